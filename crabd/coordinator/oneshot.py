"""One-shot commands in a sandbox (``exec``), and what session commands share with them.

:func:`run_exec` runs a process spawned by crab's init, bound to one
connection: killed (its whole process group) on timeout or if crabd goes
away.  Output is bounded per stream; what is dropped is counted and a
marker line is appended so nobody mistakes a truncated output for a
complete one.  The persistent sessions are ``runner.py``'s.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import signal
import time
from collections.abc import Awaitable, Callable

from crabd.errors import InitSpawnError, InitUnavailable, InvalidRequest
from crabd.models import ExecOutcome
from crabd.runtime.initproto import Event, Exit, InitConnection, SpawnSpec, Stderr, Stdout

#: Called with ("stdout" | "stderr", data) as output arrives (already bounded).
ChunkSink = Callable[[str, bytes], Awaitable[None]]
#: Opens a fresh connection to the sandbox's init.
Connector = Callable[[], Awaitable[InitConnection]]
#: After a kill, how long to wait for the process to be reported gone.
KILL_GRACE_S = 5.0


def truncation_marker(stream: str, dropped: int) -> bytes:
    return f"\n[crab: {stream} truncated, {dropped} more bytes dropped]\n".encode()


class BoundedOutput:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self.kept = 0
        self.dropped = 0

    def add(self, data: bytes) -> bytes:
        """Store ``data`` within the bound; return the part that was kept."""
        room = self.limit - self.kept
        keep = data[: max(room, 0)]
        if keep:
            self._parts.append(keep)
            self.kept += len(keep)
        self.dropped += len(data) - len(keep)
        return keep

    def value(self, stream: str) -> bytes:
        out = b"".join(self._parts)
        return out + truncation_marker(stream, self.dropped) if self.dropped else out


def _spawn_failure_outcome(exc: InitSpawnError, argv0: str, started: float) -> ExecOutcome:
    # Like a shell: 127 when the program does not exist, 126 when it cannot run.
    code = 127 if exc.errno == errno_mod.ENOENT else 126
    msg = f"crab: cannot execute {argv0!r}: {exc.message}\n".encode()
    return ExecOutcome(code, False, b"", msg, 0, 0, time.monotonic() - started)


async def next_event(conn: InitConnection, timeout_s: float) -> Event:
    """The connection's next event, TimeoutError after ``timeout_s``.

    A timer on the calling task: ``asyncio.wait_for`` would make a task per
    event (most events are already read and decoded: the wait costs nothing).
    """
    async with asyncio.timeout(timeout_s):
        return await conn.next_event()


async def run_exec(
    connect: Connector,
    spec: SpawnSpec,
    *,
    stdin: bytes,
    timeout_s: float,
    max_output: int,
    sink: ChunkSink | None = None,
) -> ExecOutcome:
    started = time.monotonic()
    out, err = BoundedOutput(max_output), BoundedOutput(max_output)
    conn = await connect()
    async with conn:
        try:
            await conn.spawn(spec)
        except InitSpawnError as exc:
            if "chdir" in exc.message or exc.errno in (errno_mod.ENOTDIR,):
                raise InvalidRequest(
                    f"cannot use workdir {spec.cwd!r} in the sandbox: {exc.message}",
                    hint="Pass an existing directory as workdir.",
                ) from exc
            return _spawn_failure_outcome(exc, str(spec.argv[0]), started)
        if stdin:
            await conn.write_stdin(stdin)
            await conn.close_stdin()
        timed_out = False
        deadline = started + timeout_s
        exit_event: Exit | None = None
        while exit_event is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not timed_out:
                timed_out = True
                await conn.signal(signal.SIGKILL)
                deadline = time.monotonic() + KILL_GRACE_S
                continue
            if remaining <= 0:
                raise InitUnavailable("init did not report the killed command's exit", sandbox="")
            try:
                ev = await next_event(conn, remaining)
            except TimeoutError:
                continue
            if isinstance(ev, Stdout | Stderr):
                name = "stdout" if isinstance(ev, Stdout) else "stderr"
                kept = (out if name == "stdout" else err).add(ev.data)
                if kept and sink is not None:
                    await sink(name, kept)
            elif isinstance(ev, Exit):
                exit_event = ev
            # (Control frames: a one-shot process has no control channel.)
    return ExecOutcome(
        exit_code=exit_event.exit_code,
        timed_out=timed_out,
        stdout=out.value("stdout"),
        stderr=err.value("stderr"),
        stdout_dropped=out.dropped,
        stderr_dropped=err.dropped,
        duration_s=time.monotonic() - started,
    )
