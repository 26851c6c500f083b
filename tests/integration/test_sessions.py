"""Named sessions against a real crabd: each its own bash, running at the same time, checkpointed and brought back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crabd.sdk import AsyncClient, Client, EmbeddedDaemon, InvalidRequest, Sandbox, SandboxBusy

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]


def _jobs_alive(sb: Sandbox, session: str) -> bytes:
    return sb.session(session).run("echo $NAME; kill -0 $JOB && echo alive").stdout


def test_three_sessions_with_jobs_come_back_from_checkpoint_restore_and_fork(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox("bookworm")
    for name in ("srv", "tests", "edit"):
        sb.session(name).run(f"cd /tmp && export NAME={name}; sleep 1000 & JOB=$!; f() {{ echo fn-{name}; }}")
    listed = {s.name: s for s in sb.sessions()}
    assert set(listed) >= {"srv", "tests", "edit"} and len({s.pid for s in listed.values()}) == len(listed)
    # Each session is its own bash: its own variables, cwd, functions and jobs.
    assert sb.session("srv").run("echo $NAME $PWD; f").stdout == b"srv /tmp\nfn-srv\n"
    assert sb.session.run("echo ${NAME:-none}").stdout == b"none\n"

    ck = sb.checkpoint("three sessions")
    assert ck.kind == "full"  # live sessions' bashes are processes: a process image holds them exactly
    for name in ("srv", "tests", "edit"):
        sb.session(name).run("export NAME=changed; kill $JOB")
    sb.restore(ck.id)
    for name in ("srv", "tests", "edit"):
        assert _jobs_alive(sb, name) == f"{name}\nalive\n".encode()
    with sb.fork(1, ck.id) as forks:
        assert {s.name for s in forks[0].sessions()} >= {"srv", "tests", "edit"}
        for name in ("srv", "tests", "edit"):
            assert _jobs_alive(forks[0], name) == f"{name}\nalive\n".encode()

    sb.session("edit").close()
    assert "edit" not in {s.name for s in sb.sessions()}


def test_sessions_run_at_once_and_one_kills_anothers_command(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm")

    async def go() -> None:
        async with AsyncClient(daemon.socket) as c:
            asb = await c.get(sb.id)
            long = asyncio.create_task(asb.session("server").run("sleep 600 && echo never"))
            t0 = time.monotonic()
            # Meanwhile other sessions answer at once, gathered concurrently.
            outs = await asyncio.gather(*(asb.session(f"w{i}").run(f"echo {i}") for i in range(4)))
            assert [o.stdout for o in outs] == [f"{i}\n".encode() for i in range(4)]
            assert time.monotonic() - t0 < 30 and not long.done()
            # The same session twice at once is refused (one command per session).
            with pytest.raises(SandboxBusy):
                await asb.session("server").run("true")
            # A kill from another session ends the long command.
            await asb.session("killer").run("pkill -f 'sleep 600'")
            r = await asyncio.wait_for(long, 60)
            assert r.stdout == b"" and r.exit_code == 143  # SIGTERM

    asyncio.run(go())


def test_a_turn_ends_while_another_session_runs_and_that_command_completes(
    daemon: EmbeddedDaemon, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm")

    async def go() -> None:
        async with AsyncClient(daemon.socket) as c:
            asb = await c.get(sb.id)
            long = asyncio.create_task(
                asb.session("slow").run("echo start; sleep 4; echo end > /tmp/slow; echo end", turn="durable")
            )
            await asyncio.sleep(1.0)
            quick = await asb.session("quick").run("echo q > /tmp/q", turn="durable")
            assert quick.ended_turn is not None and quick.ended_turn.checkpoint_state == "done"
            assert not long.done()  # the turn ended (and checkpointed the slow command mid-way)
            slow = await asyncio.wait_for(long, 60)
            # The slow command stepped aside for the dump and read on: its whole output, in order.
            assert slow.stdout == b"start\nend\n" and slow.exit_code == 0
            assert slow.ended_turn is not None and slow.ended_turn.number > quick.ended_turn.number

    asyncio.run(go())
    assert client.engine_status().stats["session_steps_aside"] >= 1
    # The quick turn's checkpoint holds the slow command mid-run: restored, it runs to its end again.
    turns = {t.number: t for t in sb.turns()}
    quick_turn = max(n for n, t in turns.items() if any(cmd.command.startswith("echo q") for cmd in t.commands))
    sb.restore(turn=quick_turn)
    deadline = time.monotonic() + 30
    while sb.run(["cat", "/tmp/slow"]).exit_code != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sb.run(["cat", "/tmp/slow", "/tmp/q"]).stdout == b"end\nq\n"
    # The restored bash runs the next command once the one it was running ended; what that one
    # printed after the checkpoint has no reader but the next command (docs/sessions.md).
    assert sb.session("slow").run("echo mine").stdout.endswith(b"mine\n")


def test_open_options_bad_names_and_the_quota(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    info = sb.session("clean").open(env={"ONLY": "1"}, empty_env=True, workdir="/tmp", user="65534:65534")
    assert info.name == "clean" and info.pid > 1
    r = sb.session("clean").run("echo $ONLY ${HOME:-unset} $PWD; id -u")
    assert r.stdout == b"1 unset /tmp\n65534\n"
    with pytest.raises(InvalidRequest, match="already has a session"):
        sb.session("clean").open()
    with pytest.raises(InvalidRequest, match="not valid"):
        sb.session("../x").run("true")
    with pytest.raises(InvalidRequest, match="not valid"):
        sb.session("-rf").open()
    with pytest.raises(InvalidRequest):
        sb.session("clean").state()
    # A named session whose command times out is closed; the next command opens a fresh one.
    sb.session("t").run("export X=1")
    assert sb.session("t").run("sleep 30", timeout=1).timed_out
    assert sb.session("t").run("echo ${X:-fresh}").stdout == b"fresh\n"
    assert "t" in {s.name for s in sb.sessions()}


def test_an_image_without_bash_says_why_sessions_cannot_start(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    with pytest.raises(InvalidRequest, match="no bash"):
        sb.session("x").run("true")
    assert sb.run(["echo", "exec works"]).stdout == b"exec works\n"


def test_named_sessions_travel_in_an_archive(
    client: Client, make_sandbox: Callable[..., Sandbox], tmp_path: Path
) -> None:
    """Export a checkpoint with named sessions, forget it, import it, fork it: the sessions run in the fork."""
    sb = make_sandbox("bookworm")
    for name in ("build", "serve"):
        sb.session(name).run(f"cd /tmp && export NAME={name}; sleep 1000 & JOB=$!")
    ck = sb.checkpoint("archived")
    path = tmp_path / "sessions.crab"
    client.export_checkpoint(ck, path)
    client.delete_checkpoint(ck.id)
    assert client.import_checkpoint(path).checkpoint.id == ck.id
    clone = client.fork(ck.id, 1)[0]
    try:
        assert {s.name for s in clone.sessions()} >= {"build", "serve"}
        for name in ("build", "serve"):
            assert _jobs_alive(clone, name) == f"{name}\nalive\n".encode()
            assert clone.session(name).run("echo $PWD").stdout == b"/tmp\n"
    finally:
        clone.remove(force=True)
