"""A session command stepping aside for a process dump (``stepaside.step_aside``), on a scripted init.

Each connection is a stand-in for crab-init's: it hands out the frames a
test scripts for it and records the requests.  The dump is simulated the
way ``SandboxManager.quiesced`` does it: clear the gate, ask the waiting
commands for quiet (:meth:`DumpYield.request`), set the gate again later.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any

import pytest

from crabd.coordinator.runner import Session, init_name
from crabd.coordinator.sessionkeep import CaptureCounts
from crabd.coordinator.stepaside import DumpYield
from crabd.errors import InitSpawnError, SandboxBusy
from crabd.models import ExecOutcome
from crabd.runtime import session_proto
from crabd.runtime.initproto import Attached, Control, Event, Exit, PersistentInfo, Stderr, Stdout

NONCE = "0123abcd"
NAME = "work"
BASH_PID = 42
KILLED = 9  # the wait status of a process killed by SIGKILL


def _done(status: int = 0) -> Control:
    return Control(f"DONE:{NONCE}:{status}\0".encode())


class _Conn:
    """One scripted connection to init."""

    def __init__(
        self,
        events: list[Event],
        *,
        alive: bool = True,
        dropped: tuple[int, int] = (0, 0),
        then: Callable[[], None] | None = None,
        raced: list[Event] | None = None,
        detach_refused: bool = False,
    ) -> None:
        #: What init sends after ATTACHED (held output, then live frames), in order.
        self.events = list(events)
        self.alive, self.dropped = alive, dropped
        #: Called once the scripted frames are used up (a dump starts), then the read blocks.
        self.then = then
        #: Frames that arrive between the DETACH request and its answer.
        self.raced = raced or []
        #: Init answers the DETACH with an ERROR: the process ended (its EXIT went out) first.
        self.detach_refused = detach_refused
        self.requests: list[str] = []
        self.closed = False

    async def attach_listed(self, name: str, *, keep_dead: bool = False) -> tuple[Attached, list[PersistentInfo]]:
        self.requests.append("attach")
        listed = [PersistentInfo(name, BASH_PID, 1, self.alive, None if self.alive else KILLED, True, 0)]
        return Attached(BASH_PID, 1, *self.dropped), listed

    async def write_stdin(self, data: bytes) -> None:
        self.requests.append("stdin")

    async def next_event(self) -> Event:
        if self.events:
            return self.events.pop(0)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        await asyncio.Event().wait()  # nothing more comes on this connection
        raise AssertionError("unreachable")

    async def detach(self, *, keep: list[Event] | None = None) -> None:
        self.requests.append("detach")
        if keep is not None:
            keep.extend(self.raced)
        if self.detach_refused:
            raise InitSpawnError(
                "init refused the request: not attached to a persistent process",
                errno=errno.EINVAL,
                init_message="not attached to a persistent process",
            )

    async def forget(self, name: str) -> None:
        assert name == init_name(NAME)
        self.requests.append("forget")

    async def signal(self, signo: int) -> None:
        self.requests.append(f"signal {signo}")

    async def aclose(self, *, until_init_closed: bool = False) -> None:
        self.closed = True

    async def __aenter__(self) -> _Conn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(session_proto, "new_nonce", lambda: NONCE)
        self.gate = asyncio.Event()
        self.gate.set()
        self.yielding = DumpYield(self.gate)
        self.conns: list[_Conn] = []
        self.opened: list[_Conn] = []
        self.counts = CaptureCounts()
        connect: Any = self._connect  # a stand-in for InitConnection: only what the session calls
        self.session = Session(connect, {}, "/", self.counts, name=NAME, yielding=self.yielding)
        self.streamed: list[tuple[str, bytes]] = []

    async def _connect(self) -> _Conn:
        await self.gate.wait()  # as the real connector: no connection while a dump runs
        conn = self.conns.pop(0)
        self.opened.append(conn)
        return conn

    def dump(self, lasting_s: float = 0.05) -> Callable[[], None]:
        """What a process dump does to the running commands: quiet asked, then the gate opens again."""

        def start() -> None:
            self.gate.clear()
            self.yielding.request()
            asyncio.get_running_loop().call_later(lasting_s, self.gate.set)

        return start

    async def sink(self, stream: str, data: bytes) -> None:
        self.streamed.append((stream, data))

    def run(self, max_output: int = 1 << 20) -> ExecOutcome:
        async def go() -> ExecOutcome:
            return await asyncio.wait_for(
                self.session.run("cmd", timeout_s=30, max_output=max_output, sink=self.sink), 10
            )

        return asyncio.run(go())


def test_a_command_steps_aside_and_reads_on_with_its_output_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    h = _Harness(monkeypatch)
    h.conns = [
        _Conn([Stdout(b"one\n")], then=h.dump(), raced=[Stdout(b"two\n")]),
        _Conn([Stdout(b"three\n"), Stderr(b"err\n"), _done(3)]),
    ]
    out = h.run()
    assert (out.exit_code, out.stdout, out.stderr) == (3, b"one\ntwo\nthree\n", b"err\n")
    assert (out.stdout_dropped, out.stderr_dropped, out.session_ended) == (0, 0, False)
    assert h.counts.stepped_aside == 1
    first, second = h.opened
    assert first.requests == ["attach", "stdin", "detach"] and first.closed
    assert second.requests == ["attach", "detach"] and second.closed


def test_output_init_dropped_while_the_command_stood_aside_is_reported_where_it_went_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Init's ring (1 MiB per stream) drops the oldest bytes while nobody is attached: never silently."""
    h = _Harness(monkeypatch)
    h.conns = [
        _Conn([Stdout(b"before\n")], then=h.dump()),
        _Conn([Stdout(b"after\n"), Stderr(b"e\n"), _done()], dropped=(5000, 7)),
    ]
    out = h.run()
    assert (out.stdout_dropped, out.stderr_dropped) == (5000, 7)
    # The gap is marked where it is, in the output and in what was streamed.
    before, marker, after = out.stdout.partition(b"\n[crab: 5000 bytes of stdout lost")
    assert before == b"before\n" and marker and after.endswith(b"]\nafter\n"), out.stdout
    assert out.stderr.startswith(b"\n[crab: 7 bytes of stderr lost") and out.stderr.endswith(b"]\ne\n")
    assert b"".join(d for s, d in h.streamed if s == "stdout") == out.stdout
    assert out.exit_code == 0 and not out.session_ended


def test_a_lost_gap_past_the_output_limit_is_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kept output full, the gap's marker is not kept either: the count is the bytes lost, no more."""
    h = _Harness(monkeypatch)
    h.conns = [
        _Conn([Stdout(b"x" * 10)], then=h.dump()),
        _Conn([Stdout(b"y" * 4), _done()], dropped=(1000, 0)),
    ]
    out = h.run(max_output=10)
    assert out.stdout_dropped == 1000 + 4
    assert out.stdout.startswith(b"x" * 10) and b"1004 more bytes dropped" in out.stdout


def test_a_bash_killed_while_its_command_stood_aside_ends_the_command_with_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = _Harness(monkeypatch)
    h.conns = [
        _Conn([Stdout(b"running\n")], then=h.dump()),
        # Init held the bash's last output and its EXIT: the reattach finds it dead.
        _Conn([Stdout(b"last words\n"), Exit(KILLED)], alive=False),
    ]
    out = h.run()
    assert (out.exit_code, out.session_ended, out.timed_out) == (128 + 9, True, False)
    assert out.stdout == b"running\nlast words\n"
    second = h.opened[1]
    assert second.requests == ["attach", "forget"] and second.closed  # init forgets the dead session


def test_a_bash_that_dies_as_its_command_detaches_ends_the_command_with_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The EXIT went out just before init read the DETACH, which it then refuses: not an error of the command."""
    h = _Harness(monkeypatch)
    h.conns = [
        _Conn([Stdout(b"running\n")], then=h.dump(), raced=[Stdout(b"bye\n"), Exit(KILLED)], detach_refused=True),
    ]
    out = h.run()
    assert (out.exit_code, out.session_ended) == (128 + 9, True)
    assert out.stdout == b"running\nbye\n"
    (only,) = h.opened
    assert only.requests == ["attach", "stdin", "detach", "forget"] and only.closed
    assert h.counts.stepped_aside == 0  # it never stood aside: there was nothing left to wait for


def test_a_command_done_before_it_stood_aside_ignores_what_init_dropped_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The done marker raced the detach: what init dropped afterwards is a background job's, not the command's."""
    h = _Harness(monkeypatch)
    h.conns = [
        _Conn([Stdout(b"out\n")], then=h.dump(), raced=[_done(0)]),
        _Conn([Stdout(b"job output\n")], dropped=(123, 0)),
    ]
    out = h.run()
    assert (out.exit_code, out.stdout, out.stdout_dropped) == (0, b"out\n", 0)


def test_a_command_waits_for_crabds_own_act_on_the_session_and_a_second_caller_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capture (here: starting the bash) holds the session a moment: a caller's command meeting it waits
    instead of being refused (ROCK's ``arun`` met another session's turn end that way); a second caller
    while the first one's command waits or runs is refused, and so is closing the session."""

    async def go() -> tuple[ExecOutcome, list[str]]:
        h = _Harness(monkeypatch)
        h.conns = [_Conn([]), _Conn([Stdout(b"hi\n"), _done()])]
        h.gate.clear()  # crabd's own act is under way: it holds the session while it waits for init
        own = asyncio.create_task(h.session.start())
        await asyncio.sleep(0.01)
        assert not h.session.busy  # crabd's own act does not make the session busy
        command = asyncio.create_task(h.session.run("cmd", timeout_s=30, max_output=1 << 20))
        await asyncio.sleep(0.01)
        assert h.session.busy and not command.done()
        refused: list[str] = []
        for second in (h.session.run("cmd", timeout_s=30, max_output=1 << 20), h.session.close()):
            with pytest.raises(SandboxBusy) as caught:
                await second
            refused.append(caught.value.message)
        h.gate.set()
        assert await asyncio.wait_for(own, 5) == BASH_PID
        out = await asyncio.wait_for(command, 5)
        assert not h.session.busy
        return out, refused

    out, refused = asyncio.run(go())
    assert (out.exit_code, out.stdout) == (0, b"hi\n")
    assert "already running a command" in refused[0] and "close it after that" in refused[1]
