"""The main-job demo: a real sandbox driven like an agent would, through a private crabd.

    make demo          # or: .venv/bin/python -m crabd.demo

Each step prints what it does and what came back, and the demo fails loudly
(non-zero exit) if any result is not what crab promises.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from crabd.cli.checkpoints import render_tree
from crabd.models import CheckpointKind, DecisionKind
from crabd.sdk import CheckpointInfo, Client, ExecResult, Sandbox
from crabd.util import cgroups

con = Console()


def step(title: str) -> None:
    con.rule(f"[bold]{title}")


def show(cmd: str, r: ExecResult) -> None:
    con.print(f"[cyan]$ {cmd}[/cyan]  [dim](exit {r.exit_code}, {r.duration_s * 1000:.1f} ms)[/dim]")
    if r.stdout:
        con.print(r.stdout.decode("utf-8", "replace").rstrip(), highlight=False, markup=False)
    if r.stderr:
        con.print(r.stderr.decode("utf-8", "replace").rstrip(), style="yellow", highlight=False, markup=False)


def check(ok: bool, what: str) -> None:
    if not ok:
        con.print(f"[red]DEMO FAILED: {what}[/red]")
        sys.exit(1)
    con.print(f"[green]✓[/green] {what}")


def crash(sb: Sandbox) -> None:
    """Kill the sandbox's container behind crabd's back, as a host failure would."""
    if not cgroups.kill_init(sb.refresh().container_id):
        check(False, "the sandbox's container has a live init to kill")
    deadline = time.monotonic() + 30
    while sb.refresh().state != "dead" and time.monotonic() < deadline:
        time.sleep(0.2)


def agent_turn(sb: Sandbox, *commands: str) -> list[ExecResult]:
    results = []
    with sb.turn() as t:
        con.print(f"[bold]turn {t.number}[/bold]")
        for cmd in commands:
            r = sb.session.run(cmd)
            show(cmd, r)
            results.append(r)
    ended = sb.turns(1)[-1]
    if ended.decision is not None:
        d = ended.decision
        took = f"checkpoint {ended.checkpoint_id}" if ended.checkpoint_id else "no checkpoint"
        con.print(f"  [cyan]inspector[/cyan]: {d.kind} ({took}, decided in {d.seconds * 1000:.1f} ms): {d.reasons[0]}")
    return results


def main() -> None:
    """The demo's steps, each one function below, on one sandbox of a private crabd."""
    t0 = time.monotonic()
    step("start a private crabd (embedded mode) and a Debian sandbox")
    with Client.embedded() as client, client.create("bookworm", name="demo", memory="512m") as sb:
        st = client.status()
        con.print(f"crabd {st.version} pid {st.pid}, state {st.state_dir}; sandbox {sb.name} ({sb.id})")
        persistent_session(sb)
        background_server(sb)
        good = turn_checkpoints(sb)
        rollback(sb, good)
        branches = fork_branches(sb)
        crash_and_recover(sb)
        show_history(sb)
        for br in branches:
            br.remove()
    con.rule(f"[bold green]demo done in {time.monotonic() - t0:.1f} s")


def persistent_session(sb: Sandbox) -> None:
    step("agent turns in a persistent shell session")
    agent_turn(
        sb,
        "mkdir -p /work/app && cd /work/app",
        "printf 'def add(a, b):\\n    return a + b\\n' > calc.py && export APP_ENV=dev",
    )
    r = agent_turn(sb, "python3 -c 'import calc; print(calc.add(2, 3))'", "echo $APP_ENV $PWD")
    check(r[0].stdout == b"5\n", "the session kept its working directory between turns")
    check(r[1].stdout == b"dev /work/app\n", "exported variables persisted")


def background_server(sb: Sandbox) -> None:
    step("a background server keeps running across turns")
    agent_turn(sb, "python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/http.log 2>&1 & echo started $!")
    r = agent_turn(
        sb,
        'sleep 0.5; python3 -c "import urllib.request as u; '
        "print(u.urlopen('http://127.0.0.1:8000/calc.py').status)\"",
    )
    check(r[0].stdout == b"200\n", "the server started in an earlier turn answers")

    step("every process descends from crab's init (PID 1), so CRIU will see it")
    ps = sb.run(["ps", "-eo", "pid,ppid,args"])
    show("ps -eo pid,ppid,args", ps)
    check(b"/.crab/init" in ps.stdout.splitlines()[1], "PID 1 is crab-init")


def turn_checkpoints(sb: Sandbox) -> CheckpointInfo:
    """Check the turn ends' decisions and checkpoints; return the latest checkpoint (the rollback target)."""
    step("each turn end took the checkpoint the inspector called for")
    turns = [t for t in sb.turns() if not t.open]
    check(
        all(
            t.decision is not None and bool(t.checkpoint_id) == (t.decision.kind is not DecisionKind.SKIP)
            for t in turns
        ),
        "every turn has a decision, and a checkpoint unless it was skip",
    )
    check(
        any(t.decision and t.decision.kind is DecisionKind.FULL for t in turns),
        "the server's turn took a full checkpoint",
    )
    cks = sb.checkpoints()
    for ck in cks:
        con.print(
            f"{ck.id} turn {ck.turn}: +{ck.changed} -{ck.deleted} entries, {ck.new_bytes} new bytes, "
            f"froze the sandbox {ck.freeze_s * 1000:.2f} ms, took {ck.total_s * 1000:.0f} ms"
        )
    check(len(cks) >= 3 and all(k.freeze_s < 0.5 for k in cks), "each checkpoint a short freeze")
    return cks[-1]


def rollback(sb: Sandbox, good: CheckpointInfo) -> None:
    step("a destructive action: the agent wipes its work")
    agent_turn(sb, "cd / && rm -rf /work && unset APP_ENV")
    gone = sb.run(["ls", "/work"])
    check(gone.exit_code != 0, "the work dir is gone")

    step(f"rollback to turn {good.turn}")
    t_restore = time.monotonic()
    sb.restore(good)
    con.print(f"restored in {(time.monotonic() - t_restore) * 1000:.0f} ms")
    back = sb.session.run("cat calc.py && echo $APP_ENV $PWD")
    show("cat calc.py && echo $APP_ENV $PWD", back)
    check(back.stdout.endswith(b"dev /work/app\n") and b"def add" in back.stdout, "files and session state are back")


def fork_branches(sb: Sandbox) -> list[Sandbox]:
    step("fork the rolled-back state into 3 branches that diverge")
    t_fork = time.monotonic()
    branches = sb.fork(3, name_prefix="demo-branch")
    con.print(f"forked 3 sandboxes in {(time.monotonic() - t_fork) * 1000:.0f} ms")
    ops = ["a + b", "a * b", "a - b"]
    for br, op in zip(branches, ops, strict=True):
        agent_turn(br, f"sed -i 's/a + b/{op}/' calc.py", "python3 -c 'import calc; print(calc.add(6, 3))'")
    outs = [br.session.run("python3 -c 'import calc; print(calc.add(6, 3))'").stdout for br in branches]
    check(outs == [b"9\n", b"18\n", b"3\n"], "each branch runs its own copy, independently")
    check(
        sb.session.run("python3 -c 'import calc; print(calc.add(6, 3))'").stdout == b"9\n",
        "the parent is untouched",
    )
    return branches


def crash_and_recover(sb: Sandbox) -> None:
    step("a process checkpoint (CRIU), a crash, and recovery")
    agent_turn(sb, "(setsid python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 </dev/null &); sleep 0.7")
    full = sb.checkpoint("server up", kind=CheckpointKind.FULL)
    con.print(
        f"{full.id}: every process and the files at one instant; the sandbox froze "
        f"{full.freeze_s * 1000:.0f} ms, {full.new_bytes / 1e6:.1f} MB stored"
    )
    # The agent's next action is under way when the host loses the container.
    sb.run(["sh", "-c", "echo 'written after the checkpoint' > /work/app/late.txt"])
    crash(sb)
    check(sb.refresh().state == "dead", "the sandbox's container was killed (a simulated crash)")
    t_recover = time.monotonic()
    done = sb.recover()
    con.print(
        f"recovered from {done.checkpoint} in {(time.monotonic() - t_recover) * 1000:.0f} ms; "
        f"lost turns: {done.lost_turns}"
    )
    ask = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').status)\""
    check(sb.session.run(ask).stdout == b"200\n", "the server started before the checkpoint answers again")
    check(
        sb.run(["ls", "/work/app/late.txt"]).exit_code != 0 and len(done.lost_turns) == 1,
        "the unfinished turn's work is gone, and reported lost",
    )


def show_history(sb: Sandbox) -> None:
    step("the checkpoint tree: history, the rollback branch and the forks")
    con.print(render_tree(sb.tree()))

    step("the turn log crabd recorded")
    table = Table("turn", "kind", "exit", "command")
    for t in sb.turns():
        for c in t.commands:
            table.add_row(str(t.number), c.kind, str(c.exit_code), c.command[:70])
    con.print(table)
    state = sb.session.state()
    check(
        state["cwd"] == "/work/app" and state["env"].get("APP_ENV") == "dev",
        "the session's semantic state was captured at turn end",
    )


if __name__ == "__main__":
    main()
