"""crabctl commands for sandboxes, their commands and the daemon (turns: ``turns.py``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer

from crabd.cli.common import (
    JsonOpt,
    NoTruncOpt,
    app,
    client,
    emit_json,
    err,
    escape,
    fmt_time,
    out,
    short_ids,
    show,
    sub_app,
    table,
)
from crabd.cli.core import ExecCommand
from crabd.vocabulary import TurnEnd

if TYPE_CHECKING:
    from crabd.cli.common import Columns
    from crabd.sdk.client import Client
    from crabd.sdk.models import ExecResult, OutputChunk, SandboxInfo, Turn

daemon_app = sub_app("The crabd daemon.")
app.add_typer(daemon_app, name="daemon", rich_help_panel="Host")

SANDBOXES = "Sandboxes"
#: Exit code of a command that ran out of time, from `exec` and `sh` alike (as timeout(1)'s).
TIMEOUT_EXIT = 124

SbArg = Annotated[str, typer.Argument(metavar="SB", help="A sandbox: its name, id, or a unique prefix of its id.")]
EnvOpt = Annotated[
    list[str] | None, typer.Option("--env", "-e", metavar="KEY=VAL", help="An environment variable (repeatable).")
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", metavar="SECONDS", help=f"Stop it after this long (exit {TIMEOUT_EXIT}); 0: crabd's default."
    ),
]


def _info_dict(info: SandboxInfo) -> dict[str, object]:
    return asdict(info)


def _sandbox_table(infos: list[SandboxInfo], no_trunc: bool) -> Columns:
    t = table("sandbox id", "name", "env", "state", "owner", "turn", "ip", "created")
    short = short_ids([i.id for i in infos], no_trunc)
    for i in infos:
        state = i.state if i.state != "dead" else f"dead ({i.dead_reason})" if i.dead_reason else "dead"
        t.add_row(
            short(i.id),
            i.name,
            i.env or i.image.removeprefix("sha256:")[:12],  # any image: its short id, as `docker images` shows it
            state,
            str(i.owner_uid),
            f"{i.turn}{' (open)' if i.turn_open else ''}",
            i.ip_address or "-",
            fmt_time(i.created_at),
        )
    return t


@app.command(rich_help_panel=SANDBOXES)
def ps(
    no_trunc: NoTruncOpt = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only the ids, one per line (for scripts; --no-trunc: whole ids).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """List sandboxes (yours; root sees all)."""
    with client() as c:
        infos = [s.info for s in c.list()]
    if as_json:
        emit_json([_info_dict(i) for i in infos])
    elif quiet:
        short = short_ids([i.id for i in infos], no_trunc)
        sys.stdout.write("".join(f"{short(i.id)}\n" for i in infos))
    else:
        show(_sandbox_table(infos, no_trunc))


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    """``-e KEY=VAL`` options as a mapping (a usage error names the one that is not KEY=VAL)."""
    env: dict[str, str] = {}
    for item in pairs or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(
                f"{item!r} is not KEY=VAL (-e/--env sets an environment variable; "
                "the env image is positional: `crabctl create IMAGE`)",
                param_hint="'-e' / '--env'",
            )
        env[key] = value
    return env


@app.command(rich_help_panel=SANDBOXES)
def create(
    image: Annotated[
        str | None, typer.Argument(metavar="ENV", help="The env image, e.g. bookworm (`crabctl env ls`).")
    ] = None,
    any_image: Annotated[
        str | None,
        typer.Option(
            "--image",
            metavar="IMAGE",
            help="Instead of an env: any image the host's Docker has (debian:12, sha256:<id>), or a path to"
            " a `docker save` archive or an OCI image layout dir (read with your permissions, loaded once).",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Sandbox name (default: generated).")] = None,
    env: EnvOpt = None,
    cpus: Annotated[float | None, typer.Option("--cpus", metavar="N", help="CPU limit (0 = none).")] = None,
    memory: Annotated[
        str | None, typer.Option("--memory", "-m", metavar="SIZE", help="Memory limit, e.g. 512m, 2g (0 = none).")
    ] = None,
    pids: Annotated[int | None, typer.Option("--pids", help="Process limit (0 = crab's default).")] = None,
    disk: Annotated[
        str | None,
        typer.Option("--disk", metavar="SIZE", help="Disk limit, e.g. 512m, 2g (0 = crab's default; runc+btrfs only)."),
    ] = None,
    network: Annotated[
        bool | None, typer.Option("--network/--no-network", help="Give the sandbox a network (default: no).")
    ] = None,
    workdir: Annotated[str | None, typer.Option("--workdir", "-w", metavar="DIR", help="Working directory.")] = None,
    checkpoints: Annotated[
        Literal["auto", "fs", "full", "none"] | None,
        typer.Option(
            "--checkpoints",
            help="auto (default): what the inspector finds each turn needs; fs: files every turn end; "
            "full: processes too; none: only on request.",
        ),
    ] = None,
    recovery: Annotated[
        Literal["manual", "auto"] | None,
        typer.Option(
            "--recovery", help="manual (default): `crabctl recover`; auto: crabd recovers a dead sandbox itself."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create and start a sandbox from the env ENV (or --image IMAGE); print its id and name."""
    if (image is None) == (any_image is None):
        raise typer.BadParameter("give an ENV or --image IMAGE (one of the two)", param_hint="ENV / '--image'")
    from crabd.sdk import CreateOptions  # (only now: a usage error loads no SDK)

    given: dict[str, Any] = {
        "name": name,
        "cpus": cpus,
        "memory": memory,
        "pids": pids,
        "disk": disk,
        "network": network,
        "workdir": workdir,
        "checkpoints": checkpoints,
        "recovery": recovery,
    }
    # What is not given is the SDK's default (one place for both).
    if any_image is not None and not any_image.startswith("/") and os.path.exists(any_image):
        any_image = os.path.abspath(any_image)  # a relative path, as the shell meant it (crabd's cwd is not ours)
    options = CreateOptions(
        image or "",
        image=any_image or "",
        env_vars=parse_env(env),
        **{k: v for k, v in given.items() if v is not None},
    )
    with client() as c:
        sb = c.create_from(options)
    if as_json:
        emit_json(_info_dict(sb.info))
    else:
        out.print(f"{sb.info.id} {sb.info.name}", markup=False, highlight=False)


_DECISION_STYLE = {"skip": "green", "fs": "cyan", "full": "magenta"}
#: Turn checkpoint states worth showing where the checkpoint's id would be.
_UNFINISHED = ("pending", "failed", "lost")


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


def field_text(key: str, value: object) -> str:
    """One field of an inspected object, for people: times as times, sizes and lists readable."""
    if key.endswith("_at") and isinstance(value, (int, float)):
        return fmt_time(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return "-" if value is None or value == "" else str(value)


def _show_turn(info: SandboxInfo, found: Turn, as_json: bool) -> None:
    if as_json:
        emit_json(_decision_dict(found))
        return
    turn, d = found.number, found.decision
    if d is None:
        out.print(f"turn {turn}: no decision (open, or the sandbox's policy is not auto)")
        return
    head = f"turn {turn}: [{_DECISION_STYLE.get(d.kind, 'white')}]{d.kind}[/]"
    head += f" by the {escape(d.inspector)} inspector in {d.seconds * 1000:.1f} ms"
    if found.checkpoint_id:
        head += f", checkpoint {found.checkpoint_id}"
    elif found.basis_checkpoint:
        head += f" (ended in the state of {found.basis_checkpoint})"
    else:
        head += f" ({found.checkpoint_state})"
    out.print(head, highlight=False)
    if found.checkpoint_error:
        out.print(f"  [red]checkpoint {found.checkpoint_state}:[/red] {escape(found.checkpoint_error)}")
    if d.paired_with:
        out.print(f"  processes unchanged: reuses the process image of {d.paired_with}")
    for r in d.reasons:
        out.print(f"  - {escape(r)}", highlight=False)
    if d.shadow_kind:
        out.print(f"  scan inspector (shadow): {d.shadow_kind}")


@app.command(rich_help_panel=SANDBOXES)
def inspect(
    sandbox: SbArg,
    turn: Annotated[int | None, typer.Option("--turn", "-t", help="Explain this turn's decision in full.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="Decisions of the last N turns.")] = 20,
    no_trunc: NoTruncOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Show one sandbox, and what the inspector decided at its turn ends, and why."""
    from crabd.errors import InvalidRequest

    with client() as c:
        sb = c.get(sandbox)
        info = sb.info
        turns = sb.turns(0 if turn is not None else limit)
    if turn is not None:
        found = [t for t in turns if t.number == turn]
        if not found:
            raise InvalidRequest(
                f"sandbox {info.name} has no turn {turn} (its last is {info.turn})",
                hint=f"See its turns with `crabctl log {info.name}`.",
            )
        _show_turn(info, found[0], as_json)
        return
    if as_json:
        emit_json({"sandbox": _info_dict(info), "turns": [_decision_dict(t) for t in turns]})
        return
    fields = table("field", "value", header=False)
    for key, value in _info_dict(info).items():
        if key != "turn_open":
            fields.add_row(key, _current_turn(info, turns) if key == "turn" else field_text(key, value))
    show(fields)
    decided = [t for t in turns if t.decision is not None]
    if not decided:
        return
    short = short_ids([t.checkpoint_id or t.basis_checkpoint for t in decided], no_trunc)
    dt = table("turn", "decision", "checkpoint", "ms", "why")
    for t in decided:
        d = t.decision
        assert d is not None
        why = d.reasons[0] if d.reasons else ""
        more = f" (+{len(d.reasons) - 1} more)" if len(d.reasons) > 1 else ""
        dt.add_row(
            str(t.number),
            d.kind,
            short(t.checkpoint_id)
            or (f"= {short(t.basis_checkpoint)}" if t.basis_checkpoint else "")
            or (t.checkpoint_state if t.checkpoint_state in _UNFINISHED else "-"),
            f"{d.seconds * 1000:.1f}",
            why[:100] + more,
        )
    show(dt)


def _print_result(result: ExecResult, as_json: bool, streamed: bool) -> None:
    if as_json:
        emit_json(
            {
                "exit_code": TIMEOUT_EXIT if result.timed_out else result.exit_code,
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
        sys.stdout.flush()
        err.print(f"[yellow]crab: command timed out after {result.duration_s:.1f} s[/yellow]")


def _run(items: Iterator[OutputChunk | ExecResult], as_json: bool) -> int:
    """Stream a command's output (or print its result as JSON); its exit code (124: it timed out)."""
    from crabd.sdk.models import ExecResult, OutputChunk

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
    return TIMEOUT_EXIT if result.timed_out else result.exit_code


def _run_and_exit(items: Iterator[OutputChunk | ExecResult], as_json: bool) -> NoReturn:
    raise typer.Exit(_run(items, as_json))


AsTurnOpt = Annotated[
    bool,
    typer.Option(
        "--as-turn",
        help="Run it as a whole turn of its own: begin a turn, run, end the turn (even if the command fails).",
    ),
]


@app.command(name="exec", cls=ExecCommand, rich_help_panel=SANDBOXES)
def exec_(
    sandbox: SbArg,
    command: Annotated[list[str], typer.Argument(metavar="CMD", help="Program and arguments (after --).")],
    timeout: TimeoutOpt = 0.0,
    workdir: Annotated[str, typer.Option("--workdir", "-w", metavar="DIR", help="Working directory.")] = "",
    user: Annotated[str, typer.Option("--user", "-u", metavar="UID[:GID]", help="Run as this uid inside.")] = "",
    env: EnvOpt = None,
    as_turn: AsTurnOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run one command in a sandbox: `crabctl exec SB [OPTIONS] -- CMD...`; exits with its exit code."""
    env_vars = parse_env(env)
    turn = TurnEnd.DEFERRED if as_turn else ""
    with client() as c:
        sb = c.get(sandbox)
        items = sb.stream(command, timeout=timeout, workdir=workdir, user=user, env=env_vars, turn=turn)
        _run_and_exit(items, as_json)


@app.command(name="sh", rich_help_panel=SANDBOXES)
def sh(
    sandbox: SbArg,
    script: Annotated[str, typer.Argument(metavar="SCRIPT", help="bash text to run in the sandbox's session.")],
    timeout: TimeoutOpt = 0.0,
    session: Annotated[
        str,
        typer.Option(
            "--session",
            "-s",
            metavar="NAME",
            help="A named session (its own bash; opened if new); default: the main one.",
        ),
    ] = "",
    as_turn: AsTurnOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run bash in one of the sandbox's persistent shell sessions (cd/export persist).

    Without --as-turn (and outside `crabctl turn begin|end`) the command goes
    into the sandbox's open implicit turn, with the commands before it.
    """
    with client() as c:
        # --as-turn: one call; crabd ends the turn even if the command (or crabctl) is cut short.
        shell = c.get(sandbox).session(session)
        items = shell.stream(script, timeout=timeout, turn=TurnEnd.DEFERRED if as_turn else "")
        _run_and_exit(items, as_json)


@app.command(rich_help_panel=SANDBOXES)
def stop(
    sandbox: SbArg,
    timeout: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", help="Grace before it is killed (0: crabd's default).")
    ] = 0.0,
    as_json: JsonOpt = False,
) -> None:
    """Stop a sandbox's container (it can then only be removed)."""
    with client() as c:
        info = c.get(sandbox).stop(timeout)
    if as_json:
        emit_json(_info_dict(info))
    else:
        out.print(f"{info.id} {info.state}", markup=False, highlight=False)


def forks_of(c: Client, root_id: str) -> list[str]:
    """The ids of the caller's sandboxes forked from ``root_id`` and from its forks, deepest first.

    A fork records the checkpoint it started from (its ``origin``); the
    checkpoint records its sandbox.  Only the caller's own sandboxes count
    (root's listing has everyone's: it still takes only its own).
    """
    mine = [s.info for s in c.list() if s.info.owner_uid == os.getuid()]
    taken_by = {k.id: k.sandbox_id for k in c.checkpoints()}
    family = {root_id}
    order: list[str] = []
    grew = True
    while grew:
        grew = False
        for i in mine:
            if i.id not in family and taken_by.get(i.origin) in family:
                family.add(i.id)
                order.append(i.id)
                grew = True
    return order[::-1]


@app.command(rich_help_panel=SANDBOXES)
def rm(
    sandboxes: Annotated[list[str], typer.Argument(metavar="SB", help="Sandboxes: names, ids or id prefixes.")],
    force: Annotated[bool, typer.Option("--force", "-f", help="Remove even if running.")] = False,
    with_forks: Annotated[
        bool, typer.Option("--with-forks", help="Also remove the sandboxes forked from them (and from those).")
    ] = False,
    keep_checkpoints: Annotated[
        bool, typer.Option("--keep-checkpoints", help="Keep their checkpoints, to fork them later.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove sandboxes (their containers, records, and checkpoints no other sandbox needs)."""
    removed: list[str] = []
    with client() as c:
        for ref in sandboxes:
            sb = c.get(ref)
            family = [*forks_of(c, sb.id), sb.id] if with_forks else [sb.id]
            for sid in family:
                if sid in removed:
                    continue
                c.get(sid).remove(force=force, keep_checkpoints=keep_checkpoints)
                removed.append(sid)
    if as_json:
        emit_json({"removed": removed})
    else:
        out.print("\n".join(removed), markup=False, highlight=False)


@daemon_app.command("status")
def daemon_status(as_json: JsonOpt = False) -> None:
    """Is crabd up, and what is it serving?"""
    with client() as c:
        st = c.status()
    if as_json:
        emit_json(asdict(st))
        return
    fields = table("field", "value", header=False)
    for key, value in asdict(st).items():
        fields.add_row(key, field_text(key, value))
    show(fields)
