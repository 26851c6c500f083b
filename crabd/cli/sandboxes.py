"""crabctl commands for sandboxes, their commands and the daemon (turns: ``turns.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import asdict
from typing import Annotated, NoReturn

import typer
from rich.table import Table

from crabd.cli.common import JsonOpt, app, client, emit_json, err, fmt_time, out
from crabd.errors import InvalidRequest
from crabd.models import CheckpointPolicy, DecisionKind, RecoveryMode, TurnCheckpointState
from crabd.sdk import CreateOptions
from crabd.sdk.models import ExecResult, OutputChunk, SandboxInfo, Turn

daemon_app = typer.Typer(no_args_is_help=True, help="The crabd daemon.")
app.add_typer(daemon_app, name="daemon")


def _info_dict(info: SandboxInfo) -> dict[str, object]:
    return asdict(info)


def _sandbox_table(infos: list[SandboxInfo]) -> Table:
    table = Table("id", "name", "env", "state", "owner", "turn", "ip", "created")
    for i in infos:
        state = i.state if i.state != "dead" else f"dead ({i.dead_reason})" if i.dead_reason else "dead"
        table.add_row(
            i.id,
            i.name,
            i.env,
            state,
            str(i.owner_uid),
            f"{i.turn}{' (open)' if i.turn_open else ''}",
            i.ip_address or "-",
            fmt_time(i.created_at),
        )
    return table


@app.command()
def ps(as_json: JsonOpt = False) -> None:
    """List sandboxes (yours; root sees all)."""
    with client() as c:
        infos = [s.info for s in c.list()]
    if as_json:
        emit_json([_info_dict(i) for i in infos])
    else:
        out.print(_sandbox_table(infos))


def _parse_env(pairs: list[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in pairs or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"--env-var {item!r} must look like KEY=VALUE")
        env[key] = value
    return env


#: crabctl create's defaults are the SDK's (one place for both).
_CREATE = CreateOptions(env="")
_CREATE_POLICY = CheckpointPolicy(_CREATE.checkpoints)
_CREATE_RECOVERY = RecoveryMode(_CREATE.recovery)


@app.command()
def create(
    env: Annotated[str, typer.Option("--env", help="Env image name (see `crabctl env ls`).")],
    name: Annotated[str, typer.Option("--name", help="Sandbox name (default: generated).")] = _CREATE.name,
    cpus: Annotated[float, typer.Option("--cpus", help="CPU limit (0 = none).")] = _CREATE.cpus,
    memory: Annotated[str, typer.Option("--memory", help="Memory limit, e.g. 512m, 2g (0 = none).")] = "0",
    pids: Annotated[int, typer.Option("--pids", help="Process limit (0 = crab's default).")] = _CREATE.pids,
    disk: Annotated[
        str, typer.Option("--disk", help="Disk limit, e.g. 512m, 2g (0 = crab's default; runc+btrfs only).")
    ] = "0",
    network: Annotated[
        bool, typer.Option("--network/--no-network", help="Give the sandbox a network.")
    ] = _CREATE.network,
    env_var: Annotated[list[str] | None, typer.Option("--env-var", "-e", help="KEY=VALUE (repeatable).")] = None,
    workdir: Annotated[str, typer.Option("--workdir", "-w", help="Working directory.")] = _CREATE.workdir,
    checkpoints: Annotated[
        CheckpointPolicy,
        typer.Option(
            "--checkpoints",
            help="auto: what the inspector finds each turn needs; fs: files every turn end; "
            "full: processes too; none: only on request.",
        ),
    ] = _CREATE_POLICY,
    recovery: Annotated[
        RecoveryMode,
        typer.Option("--recovery", help="manual: `crabctl recover`; auto: crabd recovers a dead sandbox itself."),
    ] = _CREATE_RECOVERY,
    as_json: JsonOpt = False,
) -> None:
    """Create and start a sandbox."""
    options = CreateOptions(
        env,
        name=name,
        cpus=cpus,
        memory=memory,
        pids=pids,
        disk=disk,
        network=network,
        env_vars=_parse_env(env_var),
        workdir=workdir,
        checkpoints=checkpoints,
        recovery=recovery,
    )
    with client() as c:
        sb = c.create_from(options)
    if as_json:
        emit_json(_info_dict(sb.info))
    else:
        out.print(f"{sb.info.id} {sb.info.name}")


_DECISION_STYLE = {DecisionKind.SKIP: "green", DecisionKind.FS: "cyan", DecisionKind.FULL: "magenta"}
#: Turn checkpoint states worth showing where the checkpoint's id would be.
_UNFINISHED = (TurnCheckpointState.PENDING, TurnCheckpointState.FAILED, TurnCheckpointState.LOST)


def _decision_dict(t: Turn) -> dict[str, object]:
    d = t.decision
    return {
        "turn": t.number,
        "decision": d.kind if d else None,
        "checkpoint": t.checkpoint_id or None,
        "checkpoint_state": t.checkpoint_state or None,
        "checkpoint_error": t.checkpoint_error or None,
        "basis_checkpoint": t.basis_checkpoint or None,
        "inspector": d.inspector if d else None,
        "seconds": d.seconds if d else None,
        "paired_with": (d.paired_with or None) if d else None,
        "reasons": d.reasons if d else [],
        "shadow": {"kind": d.shadow_kind, "reasons": d.shadow_reasons} if d and d.shadow_kind else None,
    }


def _current_turn(info: SandboxInfo, turns: list[Turn]) -> str:
    """The sandbox's turn number, and whether it is open (explicit or implicit), for humans."""
    if not info.turn_open:
        return f"{info.turn} (ended, none open)" if info.turn else "0 (none yet)"
    last = turns[-1] if turns else None
    kind = "" if last is None or last.number != info.turn else ", implicit" if last.implicit else ", explicit"
    return f"{info.turn} (open{kind})"


@app.command()
def inspect(
    sandbox: str,
    turn: Annotated[int | None, typer.Option("--turn", "-t", help="Explain this turn's decision in full.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="Decisions of the last N turns.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Show one sandbox, and what the inspector decided at its turn ends, and why."""
    with client() as c:
        sb = c.get(sandbox)
        info = sb.info
        turns = sb.turns(0 if turn is not None else limit)
    if turn is not None:
        found = [t for t in turns if t.number == turn]
        if not found:
            err.print(f"sandbox {info.name} has no turn {turn} (its last is {info.turn})")
            raise typer.Exit(1)
        one = _decision_dict(found[0])
        if as_json:
            emit_json(one)
            return
        d = found[0].decision
        if d is None:
            out.print(f"turn {turn}: no decision (open, or the sandbox's policy is not auto)")
            return
        head = f"turn {turn}: [{_DECISION_STYLE.get(d.kind, 'white')}]{d.kind}[/]"
        head += f" by the {d.inspector} inspector in {d.seconds * 1000:.1f} ms"
        t0 = found[0]
        if t0.checkpoint_id:
            head += f", checkpoint {t0.checkpoint_id}"
        elif t0.basis_checkpoint:
            head += f" (ended in the state of {t0.basis_checkpoint})"
        else:
            head += f" ({t0.checkpoint_state})"
        out.print(head)
        if t0.checkpoint_error:
            out.print(f"  [red]checkpoint {t0.checkpoint_state}:[/red] {t0.checkpoint_error}")
        if d.paired_with:
            out.print(f"  processes unchanged: reuses the process image of {d.paired_with}")
        for r in d.reasons:
            out.print(f"  - {r}")
        if d.shadow_kind:
            out.print(f"  scan inspector (shadow): {d.shadow_kind}")
        return
    if as_json:
        emit_json({"sandbox": _info_dict(info), "turns": [_decision_dict(t) for t in turns]})
        return
    table = Table("field", "value", show_header=False)
    for key, value in _info_dict(info).items():
        if key == "turn":
            value = _current_turn(info, turns)
        if key != "turn_open":
            table.add_row(key, str(value))
    out.print(table)
    decided = [t for t in turns if t.decision is not None]
    if decided:
        dt = Table("turn", "decision", "checkpoint", "ms", "why")
        for t in decided:
            d = t.decision
            assert d is not None
            why = d.reasons[0] if d.reasons else ""
            more = f" (+{len(d.reasons) - 1} more)" if len(d.reasons) > 1 else ""
            dt.add_row(
                str(t.number),
                f"[{_DECISION_STYLE.get(d.kind, 'white')}]{d.kind}[/]",
                t.checkpoint_id
                or (f"= {t.basis_checkpoint}" if t.basis_checkpoint else "")
                or (t.checkpoint_state if t.checkpoint_state in _UNFINISHED else "-"),
                f"{d.seconds * 1000:.1f}",
                why[:100] + more,
            )
        out.print(dt)


def _print_result(result: ExecResult, as_json: bool, streamed: bool) -> None:
    if as_json:
        emit_json(
            {
                "exit_code": result.exit_code,
                "timed_out": result.timed_out,
                "stdout": result.stdout.decode("utf-8", "replace"),
                "stderr": result.stderr.decode("utf-8", "replace"),
                "stdout_dropped": result.stdout_dropped,
                "stderr_dropped": result.stderr_dropped,
                "duration_s": result.duration_s,
                "turn": result.turn,
                "seq": result.seq,
                "session_ended": result.session_ended,
            }
        )
        return
    if not streamed:
        sys.stdout.buffer.write(result.stdout)
        sys.stderr.buffer.write(result.stderr)
    if result.timed_out:
        err.print(f"[yellow]crab: command timed out after {result.duration_s:.1f} s[/yellow]")


def _run(items: Iterator[OutputChunk | ExecResult], as_json: bool) -> int:
    """Stream a command's output (or print its result as JSON); its exit code."""
    result: ExecResult | None = None
    streamed = False
    for item in items:
        if isinstance(item, OutputChunk) and not as_json:
            stream = sys.stdout if item.stream == "stdout" else sys.stderr
            stream.buffer.write(item.data)
            stream.flush()
            streamed = True
        elif isinstance(item, ExecResult):
            result = item
    assert result is not None
    # Output that never streamed (e.g. "cannot execute") is in the result only.
    _print_result(result, as_json, streamed=streamed)
    return result.exit_code


def _run_and_exit(items: Iterator[OutputChunk | ExecResult], as_json: bool) -> NoReturn:
    raise typer.Exit(_run(items, as_json))


@app.command(name="exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox: str,
    command: Annotated[list[str], typer.Argument(help="Program and arguments (after --).")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds (0 = daemon default).")] = 0.0,
    workdir: Annotated[str, typer.Option("--workdir", "-w")] = "",
    user: Annotated[str, typer.Option("--user", "-u", help="uid or uid:gid inside the sandbox.")] = "",
    env_var: Annotated[list[str] | None, typer.Option("--env-var", "-e", help="KEY=VALUE (repeatable).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run one command in a sandbox; exits with the command's exit code."""
    if command and command[0] == "--":
        command = command[1:]
    with client() as c:
        sb = c.get(sandbox)
        items = sb.stream(command, timeout=timeout, workdir=workdir, user=user, env=_parse_env(env_var))
        _run_and_exit(items, as_json)


@app.command(name="sh")
def sh(
    sandbox: str,
    command: Annotated[str, typer.Argument(help="bash text to run in the sandbox's persistent session.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds (0 = daemon default).")] = 0.0,
    turn: Annotated[
        bool,
        typer.Option(
            "--turn", help="Run it as one whole turn: begin a turn, run, end the turn (even if the command fails)."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a command in the sandbox's persistent shell session (cd/export persist).

    Without --turn (and outside `crabctl turn begin|end`) the command goes into
    the sandbox's open implicit turn, with the commands before it.
    """
    with client() as c:
        sb = c.get(sandbox)
        if not turn:
            _run_and_exit(sb.session.stream(command, timeout=timeout), as_json)
        # As the SDK's Sandbox.turn(): the turn ends even if the command (or crabctl) is cut short.
        with sb.turn():
            code = _run(sb.session.stream(command, timeout=timeout), as_json)
    raise typer.Exit(code)


@app.command()
def stop(sandbox: str, timeout: Annotated[float, typer.Option("--timeout")] = 0.0, as_json: JsonOpt = False) -> None:
    """Stop a sandbox's container (it can then only be removed)."""
    with client() as c:
        info = c.get(sandbox).stop(timeout)
    emit_json(_info_dict(info)) if as_json else out.print(f"{info.id} {info.state}")


@app.command()
def rm(
    sandboxes: Annotated[list[str], typer.Argument(help="Sandbox ids or names.")],
    force: Annotated[bool, typer.Option("--force", "-f", help="Remove even if running.")] = False,
    keep_checkpoints: Annotated[
        bool, typer.Option("--keep-checkpoints", help="Keep their checkpoints, to fork them later.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove sandboxes (their containers, records, and checkpoints no other sandbox needs)."""
    removed = []
    with client() as c:
        for ref in sandboxes:
            sb = c.get(ref)
            sb.remove(force=force, keep_checkpoints=keep_checkpoints)
            removed.append(sb.id)
    emit_json({"removed": removed}) if as_json else out.print("\n".join(removed))


@daemon_app.command("status")
def daemon_status(as_json: JsonOpt = False) -> None:
    """Is crabd up, and what is it serving?"""
    with client() as c:
        st = c.status()
    if as_json:
        emit_json(asdict(st))
        return
    table = Table("field", "value", show_header=False)
    for key, value in asdict(st).items():
        table.add_row(key, fmt_time(value) if key == "started_at" else str(value))
    out.print(table)
