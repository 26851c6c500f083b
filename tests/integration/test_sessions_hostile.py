"""Named sessions under a hostile sandbox, against a real crabd: a process dump while a session's command runs.

The command steps aside for the dump (``stepaside.DumpYield``: it detaches from
its bash, the dump runs, it attaches again and reads on).  Here the sandbox
kills that bash in the middle of it, or floods init with output while nobody
reads it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crabd.errors import CrabError
from crabd.sdk import AsyncClient, AsyncSandbox, Client, EmbeddedDaemon, ExecResult, Sandbox

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]

#: Bounds that a hang or a leak would break (a dump of a small sandbox takes ~1 s here).
CHECKPOINT_WITHIN_S = 60.0
RSS_GROWTH_MAX = 200 << 20

KILL_DELAYS_S = (0.0, 0.05, 0.15, 0.3, 0.5, 0.8)
#: How long a one-shot command holds a dump back (the session command stands aside meanwhile).
HOLD_S = 1.5

#: The marker a gap in a command's output carries (``stepaside.LostOutput``), and the final truncation marker.
GAP = re.compile(rb"\n\[crab: (\d+) bytes of (stdout|stderr) lost while the command stood aside for a checkpoint\]\n")
CUT = re.compile(rb"\n\[crab: (stdout|stderr) truncated, (\d+) more bytes dropped\]\n$")


def _steps_aside(c: Client) -> int:
    return int(c.engine_status().stats["session_steps_aside"])


def _rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process ``pid`` in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


async def _wait_file(asb: AsyncSandbox, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (await asb.session("watch").run(f"test -e {path}")).exit_code != 0:
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.05)


def _assert_healthy(c: Client, sb: Sandbox, session: str) -> None:
    """The sandbox answers, no session is left busy, and ``session`` can be used (reopened) again."""
    assert sb.run(["echo", "ok"]).stdout == b"ok\n"
    assert sb.session.run("echo default").stdout == b"default\n"
    again = sb.session(session).run("echo $$; echo ${MARK:-fresh}")
    assert again.exit_code == 0 and again.stdout.endswith(b"\nfresh\n"), again
    assert not [s.name for s in sb.sessions() if s.busy]
    assert not [j for j in c.engine_status().jobs if j.state in ("queued", "running")]


def test_a_bash_killed_while_its_command_stands_aside_ends_that_command_and_nothing_else(
    daemon: EmbeddedDaemon, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """Contract (docs/sessions.md): the command ends with the killed bash's status (137) and
    ``session_ended``; the checkpoint is whole or refused; the session reopens with the defaults.

    The kill lands at several moments around a dump: before, during the step-aside (before the
    freeze, while frozen, after the thaw), after the reattach.  With ``hold`` a one-shot command
    holds the dump back for HOLD_S, so the kill surely lands while the command stands aside.
    """
    sb = make_sandbox("bookworm")
    crabd_pid = daemon.pid
    assert crabd_pid is not None
    rss_before, _ = _rss(crabd_pid)
    steps_before = _steps_aside(client)
    made: list[str] = []
    refused: list[str] = []

    async def one(asb: AsyncSandbox, delay: float, hold: bool) -> None:
        victim = asb.session("victim")
        await victim.run("export MARK=set; rm -f /tmp/started")
        bash_pid = next(s.pid for s in await asb.sessions() if s.name == "victim")
        # The command runs until its bash is killed; it announces itself first.
        running = asyncio.create_task(victim.run("echo start; touch /tmp/started; while :; do sleep 0.05; done"))
        await _wait_file(asb, "/tmp/started")
        # The killer lives in the sandbox, on its own: it acts during the dump, when crabd holds no connection.
        arm = f"setsid sh -c 'sleep {delay}; kill -9 {bash_pid}' </dev/null >/dev/null 2>&1 &"
        assert (await asb.session("killer").run(arm)).exit_code == 0
        held = asyncio.create_task(asb.run(["sleep", str(HOLD_S)])) if hold else None
        await asyncio.sleep(0.1 if hold else 0)
        stepped = _steps_aside(client)
        t0 = time.monotonic()
        try:
            ck = await asyncio.wait_for(asb.checkpoint(f"kill after {delay}", kind="full"), CHECKPOINT_WITHIN_S)
        except CrabError as exc:  # refused cleanly is acceptable; a half-made checkpoint is not
            refused.append(f"{delay}: {exc}")
        else:
            assert ck.kind == "full"
            made.append(ck.id)
        took = time.monotonic() - t0
        assert took < CHECKPOINT_WITHIN_S
        r: ExecResult = await asyncio.wait_for(running, 60)
        assert (r.exit_code, r.session_ended, r.timed_out) == (137, True, False), (delay, hold, r)
        assert r.stdout.startswith(b"start\n"), r
        if held is not None:
            assert (await held).exit_code == 0
            # The command stood aside, and its bash was killed meanwhile (before the dump began).
            assert _steps_aside(client) > stepped and took > HOLD_S - 0.5, (took, delay)
            assert r.duration_s > took - 0.5, "the command returned before its reattach"

    async def go() -> None:
        async with AsyncClient(daemon.socket) as c:
            asb = await c.get(sb.id)
            for delay in KILL_DELAYS_S:
                await one(asb, delay, hold=False)
            for delay in (0.3, 0.8):
                await one(asb, delay, hold=True)

    asyncio.run(go())
    assert _steps_aside(client) - steps_before >= 2, "no command stepped aside"
    assert made, f"every checkpoint was refused: {refused}"
    _assert_healthy(client, sb, "victim")
    # Every checkpoint that was made is whole: listed with its process image, and its blobs verify.
    listed = {k.id: k for k in sb.checkpoints()}
    assert all(listed[i].kind == "full" for i in made)
    assert client.verify().problems == []
    # The last one (taken after its bash was killed while the command stood aside) forks, sessions and all.
    with sb.fork(1, made[-1]) as forks:
        assert forks[0].run(["echo", "forked"]).stdout == b"forked\n"
        assert forks[0].session("killer").run("echo $$").exit_code == 0
    rss_after, _ = _rss(crabd_pid)
    assert rss_after - rss_before < RSS_GROWTH_MAX, (rss_before, rss_after)


FLOOD = r"""
import os, sys, time
# Numbered 64 KiB records at RATE bytes/s for SECONDS; then how many, to OUT.
rate, seconds, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
CH = 1 << 16
def record(k):
    return b"%010d" % k + b"." * (CH - 11) + b"\n"
open("/tmp/flood.started", "w").close()
t0 = time.monotonic()
k = 0
while time.monotonic() - t0 < seconds:
    os.write(1, record(k)) == CH or sys.exit("short write")
    k += 1
    time.sleep(max(0.0, t0 + k * CH / rate - time.monotonic()))
with open(out, "w") as f:
    f.write("%d\n" % k)
"""
RECORD = 1 << 16


def _expected(records: int) -> bytes:
    return b"".join(b"%010d" % k + b"." * (RECORD - 11) + b"\n" for k in range(records))


def _check_tiling(stdout: bytes, produced: bytes, dropped: int) -> int:
    """The kept output, its gap markers and its final truncation marker account for ``produced`` exactly.

    Returns the bytes the gap markers report.
    """
    cut = CUT.search(stdout)
    body, tail_cut = (stdout[: cut.start()], int(cut.group(2))) if cut else (stdout, 0)
    at, gaps = 0, 0
    pieces = GAP.split(body)
    # GAP.split gives: text, n, stream, text, n, stream, ..., text
    for k in range(0, len(pieces), 3):
        piece = pieces[k]
        assert produced[at : at + len(piece)] == piece, f"output differs from what was written at byte {at}"
        at += len(piece)
        if k + 1 < len(pieces):
            assert pieces[k + 2] == b"stdout"
            gap = int(pieces[k + 1])
            gaps += gap
            at += gap
    assert at + tail_cut == len(produced), (at, tail_cut, len(produced))
    assert gaps + tail_cut == dropped, (gaps, tail_cut, dropped)
    return gaps


@pytest.mark.parametrize(
    ("rate", "max_output"),
    [
        # Paced (6 MiB/s) below the kept limit: init's 1 MiB ring drops most of what the bash writes
        # while the command stands aside, and the gap shows where it is, in order with the rest.
        pytest.param(6 << 20, 64 << 20, id="paced"),
        # As fast as it goes, with the default 1 MiB kept: crabd's memory stays bounded.
        pytest.param(1 << 40, 0, id="unbounded"),
    ],
)
def test_a_bash_flooding_output_while_its_command_stands_aside(
    daemon: EmbeddedDaemon,
    client: Client,
    make_sandbox: Callable[..., Sandbox],
    rate: int,
    max_output: int,
) -> None:
    """No deadlock; the checkpoint completes in bounded time; what init dropped while nobody read is
    reported (a marker where it went missing, counted in ``stdout_dropped``), never silently lost."""
    sb = make_sandbox("bookworm")
    sb.run(["sh", "-c", "cat > /tmp/flood.py"], stdin=FLOOD.encode())
    crabd_pid = daemon.pid
    assert crabd_pid is not None
    rss_before, _ = _rss(crabd_pid)
    steps_before = _steps_aside(client)

    async def go() -> tuple[ExecResult, float]:
        async with AsyncClient(daemon.socket) as c:
            asb = await c.get(sb.id)
            flood = asyncio.create_task(
                asb.session("flood").run(
                    f"python3 /tmp/flood.py {rate} 4 /tmp/flood.count; echo done >&2",
                    max_output=max_output,
                    timeout=120,
                )
            )
            await _wait_file(asb, "/tmp/flood.started")
            await asyncio.sleep(0.3)
            # A one-shot command holds its connection (it does not step aside): the dump waits for it,
            # while the flooding command stands aside for HOLD_S, its bash writing on.
            held = asyncio.create_task(asb.run(["sleep", str(HOLD_S)]))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            ck = await asyncio.wait_for(asb.checkpoint("mid-flood", kind="full"), CHECKPOINT_WITHIN_S)
            took = time.monotonic() - t0
            assert ck.kind == "full" and (await held).exit_code == 0
            return await asyncio.wait_for(flood, 120), took

    r, took = asyncio.run(go())
    assert took < CHECKPOINT_WITHIN_S
    assert (r.exit_code, r.timed_out, r.session_ended) == (0, False, False), (r.exit_code, r.stderr[-300:])
    assert r.stderr == b"done\n"
    assert _steps_aside(client) - steps_before >= 1
    records = int(sb.run(["cat", "/tmp/flood.count"]).stdout)
    produced = _expected(records)
    if max_output:
        gaps = _check_tiling(r.stdout, produced, r.stdout_dropped)
        # Most of what the bash wrote while nobody read was dropped by init, and said so.
        assert gaps > 4 << 20, gaps
        print(f"flood: {len(produced)} bytes written, {gaps} lost while stepped aside, checkpoint {took:.2f} s")
    else:
        # Only the first 1 MiB is kept; the rest, dropped by init or by crabd, is counted all the same.
        kept = GAP.sub(b"", CUT.sub(b"", r.stdout))
        assert len(kept) == 1 << 20 and kept == produced[: len(kept)]
        assert len(kept) + r.stdout_dropped == len(produced), (len(kept), r.stdout_dropped, len(produced))
        print(f"flood: {len(produced)} bytes written, {r.stdout_dropped} dropped, checkpoint {took:.2f} s")
    rss_after, _ = _rss(crabd_pid)
    assert rss_after - rss_before < RSS_GROWTH_MAX + 2 * max_output, (rss_before, rss_after)
    assert sb.session("flood").run("echo fine").stdout == b"fine\n"
    assert not [j for j in client.engine_status().jobs if j.state in ("queued", "running")]
