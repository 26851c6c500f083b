"""Session commands stepping aside for a process dump, and the output init drops meanwhile.

A process dump needs no crabd connection into the sandbox; a command running
in a session holds one.  :class:`DumpYield` is how a dump asks every running
command of its sandbox to let go; :func:`step_aside` is what such a command
then does (``runner.Session`` calls it), and :class:`LostOutput` counts the
output init could not keep for it meanwhile.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
from collections.abc import Awaitable, Callable

from crabd.coordinator.oneshot import ChunkSink, Connector
from crabd.coordinator.sessionkeep import CaptureCounts
from crabd.errors import InitSpawnError
from crabd.runtime import session_proto
from crabd.runtime.initproto import Event, Exit, InitConnection

#: Feeds one event of the running command to its scanner and sink; its Exit if the bash ended.
Take = Callable[[Event, session_proto.MarkerScanner, ChunkSink | None], Awaitable[Exit | None]]


class DumpYield:
    """Lets commands running in sessions step aside while a process dump runs.

    A process dump needs no crabd connection into the sandbox (CRIU would
    find a socket whose peer is outside the dumped tree).  A command in a
    session holds one for as long as it runs, and with several sessions a
    long command in one must not hold back the checkpoint a turn end in
    another needs.  The dump clears ``gate`` and calls :meth:`request`: each
    waiting command's timer fires at once, the command detaches (init keeps
    the last 1 MiB per stream of what its bash writes meanwhile, and counts
    what it drops: :func:`step_aside` reports that), closes its
    connection, waits for the gate, attaches again and reads on: its bash
    never noticed, and the dump saw it mid-command, like any background
    process.
    """

    def __init__(self, gate: asyncio.Event) -> None:
        self._gate = gate
        self._waiting: set[asyncio.Timeout] = set()

    @property
    def wanted(self) -> bool:
        return not self._gate.is_set()

    def request(self) -> None:
        """A dump wants the sandbox quiet: wake every command waiting for output."""
        now = asyncio.get_running_loop().time()
        for timer in list(self._waiting):
            timer.reschedule(now)

    async def next_event(self, conn: InitConnection, timeout_s: float) -> Event:
        """:func:`~crabd.coordinator.oneshot.next_event`, woken early (TimeoutError) when a dump asks for quiet."""
        async with asyncio.timeout(timeout_s) as timer:
            self._waiting.add(timer)
            try:
                return await conn.next_event()
            finally:
                self._waiting.discard(timer)


class LostOutput:
    """A command's output that init dropped while the command stood aside for dumps, per stream."""

    def __init__(self) -> None:
        #: Bytes whose gap a marker line shows in the kept output.
        self.marked: dict[session_proto.Stream, int] = {"stdout": 0, "stderr": 0}
        #: Bytes lost where the kept output was full already (the final truncation marker counts them).
        self.past: dict[session_proto.Stream, int] = {"stdout": 0, "stderr": 0}

    async def mark(
        self, stream: session_proto.Stream, n: int, scanner: session_proto.MarkerScanner, sink: ChunkSink | None
    ) -> None:
        marker = f"\n[crab: {n} bytes of {stream} lost while the command stood aside for a checkpoint]\n".encode()
        kept = scanner.feed(stream, marker)
        if sink is not None and kept:
            await sink(stream, kept)
        if kept == marker:
            self.marked[stream] += n
        else:  # the scanner counted the marker's bytes it did not keep as dropped output: count the gap instead
            self.past[stream] += n - (len(marker) - len(kept))


async def step_aside(
    conn: InitConnection,
    *,
    connect: Connector,
    init_name: str,
    take: Take,
    scanner: session_proto.MarkerScanner,
    sink: ChunkSink | None,
    lost: LostOutput,
    counts: CaptureCounts,
) -> tuple[InitConnection, Exit | None]:
    """A process dump wants the sandbox quiet (:class:`DumpYield`): detach, close, wait, attach again.

    Returns the new connection, attached to the same bash (init's name for
    it: ``init_name``), and its Exit if the bash ended meanwhile (its frames,
    held by init, come first; the caller then makes init forget it).  A bash
    that ended just before init read the DETACH is not waited for: init sent
    its EXIT and refuses the DETACH; the same connection is returned with
    that Exit.

    While nobody is attached, init keeps the last 1 MiB per stream and
    counts what it drops (ATTACHED's ``dropped_out``/``dropped_err``):
    a marker line takes the missing bytes' place in the command's output,
    and they count in its ``stdout_dropped``/``stderr_dropped`` (``lost``).
    """
    raced: list[Event] = []
    ended = None
    try:
        await conn.detach(keep=raced)
    except InitSpawnError as exc:
        if exc.errno != errno_mod.EINVAL or not any(isinstance(ev, Exit) for ev in raced):
            raise
        for ev in raced:
            ended = await take(ev, scanner, sink) or ended
        return conn, ended
    await conn.aclose()
    counts.stepped_aside += 1
    for ev in raced:
        ended = await take(ev, scanner, sink) or ended
    conn = await connect()  # waits until the dump is done
    try:
        attached, _ = await conn.attach_listed(init_name, keep_dead=True)
    except BaseException:
        await conn.aclose()
        raise
    gaps: tuple[tuple[session_proto.Stream, int], ...] = (
        ("stdout", attached.dropped_stdout),
        ("stderr", attached.dropped_stderr),
    )
    for stream, dropped in gaps:
        if dropped and not scanner.done:  # after its done marker: a background job's output
            await lost.mark(stream, dropped, scanner, sink)
    return conn, ended
