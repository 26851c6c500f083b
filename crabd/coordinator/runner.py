"""Running commands inside a sandbox, through crab's init (never `docker exec`).

Two ways:

* :func:`run_exec` — a one-shot process spawned by init, bound to one
  connection; killed (whole process group) on timeout or if crabd goes away.
* :class:`Session` — the sandbox's persistent bash, a *persistent* init child
  named ``crab-session`` with a control channel (``SpawnSpec.control``).
  Each command attaches, writes the framed command
  (``session_proto.wrap_command``), reads output until the done marker
  arrives on the control channel (authenticated by init: only the bash
  process itself can write it), detaches.  The bash outlives crabd
  restarts; init buffers its output meanwhile.  A bash that a restore
  brought back keeps its channel (CRIU restores the socketpair in init and
  bash); a re-created one gets a new one when init spawns it.

Output is bounded per stream; what is dropped is counted and a marker line
is appended so nobody mistakes a truncated output for a complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import logging
import signal
import time
from collections.abc import Awaitable, Callable

from crabd.coordinator.sessionkeep import CaptureCounts, IdleReading, Kept
from crabd.errors import InitSpawnError, InitUnavailable, InvalidRequest, SandboxBusy
from crabd.models import ExecOutcome
from crabd.runtime import initproto, session_proto, session_state
from crabd.runtime.initproto import Control, ControlRejected, Event, Exit, InitConnection, SpawnSpec, Stderr, Stdout

log = logging.getLogger("crabd.session")

#: Called with ("stdout" | "stderr", data) as output arrives (already bounded).
ChunkSink = Callable[[str, bytes], Awaitable[None]]
#: Opens a fresh connection to the sandbox's init.
Connector = Callable[[], Awaitable[InitConnection]]
#: Given the session bash's pid inside the sandbox: its limits, descriptors and whether it ran, or None
#: if unreadable (see ``runtime/session_os.py``, ``coordinator/sessionkeep.py``).
ProcessProbe = Callable[[int], Awaitable[IdleReading | None]]

SESSION_NAME = "crab-session"
SESSION_ARGV = ["bash", "--noprofile", "--norc"]
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


async def _next_event(conn: InitConnection, timeout_s: float) -> Event:
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
                ev = await _next_event(conn, remaining)
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


class SessionFoundDead(Exception):
    """The session's bash had already exited when a command attached to it; the command did not run.

    Not a CrabError: the caller (``Commands.session_run``) revives the session (a
    fresh bash with the last captured state) and sends the command again, since it
    was never written to any bash; other callers see :class:`InitUnavailable`.
    """


class _NoSession(Exception):
    """No bash runs, and the caller asked not to start one."""


class Session:
    """The persistent bash of one sandbox.  One command at a time."""

    def __init__(
        self, connect: Connector, env: dict[str, str], workdir: str, counts: CaptureCounts | None = None
    ) -> None:
        self._connect = connect
        self._env = env
        self._workdir = workdir
        self._lock = asyncio.Lock()
        #: Reads the idle bash's limits and descriptors from the host (set by the coordinator).
        self.probe: ProcessProbe | None = None
        #: Messages other processes wrote into the session's control channel (dropped by init).
        self.control_rejections = 0
        #: The pid init reported for the bash the last command attached to or started.
        self._bash_pid: int | None = None
        #: (monotonic time, bash pid or None: no bash) at the last state capture; None once anything else ran.
        self._captured: tuple[float, int | None] | None = None
        #: The last capture, while the bash has not run since (``coordinator/sessionkeep.py``).
        self._kept: Kept | None = None
        #: Commands sent so far: a capture keeps its result only if none was sent meanwhile.
        self._sent = 0
        self.counts = counts or CaptureCounts()

    def rebind(self, connect: Connector) -> None:
        """Reach init through ``connect`` from now on (the container was restarted under a new pid)."""
        self._connect = connect
        self._captured = self._kept = None

    def captured_pid(self, within_s: float) -> tuple[int | None] | None:
        """``(pid,)``: the bash's pid (None: no bash) as the last state capture saw it, if that
        was the session's last act and recent; None if there is no such capture.

        A turn end captures the state and then decides; the decision needs
        the same pid, and asking init again costs a connection.  Reusing it
        is as sound as asking: the bash could die between init's answer and
        the decision's /proc read either way, and a pid is only reused after
        the pid space wraps, which takes far longer than ``within_s``.
        """
        seen = self._captured
        if seen is None or time.monotonic() - seen[0] > within_s:
            return None
        return (seen[1],)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def _attach_or_spawn(self, conn: InitConnection, *, start: bool = True) -> int:
        """Bind ``conn`` to the session, starting bash if there is none (``start``; else
        :class:`_NoSession`).  Returns the bash's pid in the sandbox, as init reports it."""
        try:
            attached, listed = await conn.attach_listed(SESSION_NAME)
            if any(p.name == SESSION_NAME and p.alive for p in listed):
                return attached.pid
            # Init kept a session whose bash exited while no command ran (something in the
            # sandbox killed it): nothing was written to it yet.  A capture finds no session
            # (the next command revives it with its state); a command must not run into it.
            if not start:
                raise _NoSession
            await conn.forget(SESSION_NAME)
            raise SessionFoundDead("the session's bash had exited before the command was sent")
        except InitSpawnError as exc:
            if exc.errno == errno_mod.EBUSY:
                raise SandboxBusy("the sandbox's session is in use by another client", sandbox="") from exc
            if exc.errno != errno_mod.ENOENT:
                raise InitUnavailable(f"attaching to the session failed: {exc.message}", sandbox="") from exc
            if not start:
                raise _NoSession from exc
        hello = await conn.hello()
        if hello.version < initproto.PROTO_VERSION:
            # An older init has no control channel: the session's markers
            # would never arrive.  (A sandbox created before an upgrade.)
            raise InitUnavailable(
                f"this sandbox's init speaks protocol {hello.version}; the session needs "
                f"{initproto.PROTO_VERSION} (recreate the sandbox)",
                sandbox="",
            )
        try:
            started = await conn.spawn(
                SpawnSpec(
                    argv=list(SESSION_ARGV),
                    env=self._env,
                    cwd=self._workdir,
                    name=SESSION_NAME,
                    persistent=True,
                    control=True,
                )
            )
        except InitSpawnError as exc:
            if exc.errno == errno_mod.ENOENT and "exec" in exc.init_message:
                raise InvalidRequest(
                    "this sandbox's image has no bash; the persistent session needs bash",
                    hint="Use an env with bash (e.g. bookworm), or run programs with exec.",
                ) from exc
            raise

        await conn.write_stdin(session_proto.BOOTSTRAP)
        return started.pid

    async def run(
        self, command: str, *, timeout_s: float, max_output: int, sink: ChunkSink | None = None
    ) -> ExecOutcome:
        if self._lock.locked():
            raise SandboxBusy(
                "the session is already running a command; one session runs one command at a time", sandbox=""
            )
        async with self._lock:
            return await self._run_locked(command, timeout_s=timeout_s, max_output=max_output, sink=sink)

    async def _run_locked(
        self, command: str, *, timeout_s: float, max_output: int, sink: ChunkSink | None
    ) -> ExecOutcome:
        outcome, _ = await self._run_scanned(command, timeout_s=timeout_s, max_output=max_output, sink=sink)
        return outcome

    async def _run_scanned(
        self,
        command: str,
        *,
        timeout_s: float,
        max_output: int,
        sink: ChunkSink | None,
        keep_status: bool = False,
        start: bool = True,
    ) -> tuple[ExecOutcome, session_proto.MarkerScanner]:
        """Run one command; the scanner holds what its control channel carried (a state capture).

        ``start=False``: with no bash running, start none and raise :class:`_NoSession`.
        ``self._bash_pid`` is the pid of the bash that ran it.
        """
        self._captured = self._kept = None  # the command may end or replace the bash
        self._sent += 1
        started = time.monotonic()
        nonce = session_proto.new_nonce()
        payload = session_proto.wrap_command(command, nonce, keep_status=keep_status)
        scanner = session_proto.MarkerScanner(nonce, max_stdout=max_output, max_stderr=max_output)
        conn = await self._connect()
        async with conn:
            self._bash_pid = await self._attach_or_spawn(conn, start=start)
            await conn.write_stdin(payload)
            timed_out = False
            ended: Exit | None = None
            deadline = started + timeout_s
            while not scanner.done and ended is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                try:
                    ev = await _next_event(conn, remaining)
                except TimeoutError:
                    continue
                if isinstance(ev, Stdout):
                    kept = scanner.feed("stdout", ev.data)
                    if sink is not None and kept:
                        await sink("stdout", kept)
                elif isinstance(ev, Stderr):
                    kept = scanner.feed("stderr", ev.data)
                    if sink is not None and kept:
                        await sink("stderr", kept)
                elif isinstance(ev, Control):
                    scanner.feed_control(ev.data)
                elif isinstance(ev, ControlRejected):
                    self._rejected(ev)
                elif isinstance(ev, Exit):
                    ended = ev
            if timed_out:
                # A non-interactive bash cannot be interrupted back to a clean
                # prompt reliably (a half-run heredoc, traps, SIGINT semantics),
                # so the whole session is killed; the caller restarts it from
                # the last captured state.
                await conn.signal(signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drain_until_exit(conn), timeout=KILL_GRACE_S)
                await conn.forget(SESSION_NAME)
            elif ended is not None:
                await conn.forget(SESSION_NAME)
            else:
                await conn.detach()
        stdout, stderr = scanner.stdout, scanner.stderr
        if scanner.dropped_stdout:
            stdout += truncation_marker("stdout", scanner.dropped_stdout)
        if scanner.dropped_stderr:
            stderr += truncation_marker("stderr", scanner.dropped_stderr)
        if timed_out:
            code = 124
        elif ended is not None:
            code = ended.exit_code
        else:
            code = scanner.exit_code if scanner.exit_code is not None else 0
        outcome = ExecOutcome(
            exit_code=code,
            timed_out=timed_out,
            stdout=stdout,
            stderr=stderr,
            stdout_dropped=scanner.dropped_stdout,
            stderr_dropped=scanner.dropped_stderr,
            duration_s=time.monotonic() - started,
            session_ended=timed_out or ended is not None,
        )
        return outcome, scanner

    def _rejected(self, ev: ControlRejected) -> None:
        self.control_rejections += ev.count
        log.warning(
            "a process other than the session's bash wrote to its control channel; ignored",
            extra={"messages": ev.count, "pid_in_sandbox": ev.last_pid, "total": self.control_rejections},
        )

    @staticmethod
    async def _drain_until_exit(conn: InitConnection) -> None:
        while not isinstance(await conn.next_event(), Exit):
            pass

    async def pid(self) -> int | None:
        """The session bash's pid inside the sandbox, or None when none runs (crab's init knows it by name)."""
        conn = await self._connect()
        async with conn:
            for p in await conn.list():
                if p.name == SESSION_NAME and p.alive:
                    return p.pid
        return None

    async def capture_state(self, *, timeout_s: float = 30.0, start: bool = False) -> session_state.SessionState | None:
        """The session's semantic state, or None when no session runs (nothing to capture).

        ``start``: if no session runs, start its bash and capture that (a new
        sandbox's turn-0 checkpoint: its first turn then has a state to compare
        with, and a read-only first turn is a skip).
        """
        async with self._lock:
            seen = self._captured
            if seen is not None and seen[1] is None and not start:
                # The last capture found no bash and nothing ran through this session since: only this
                # object starts the sandbox's session (init takes requests from crabd alone, and a
                # container restarted under a new pid rebinds, which forgets this), so there is still
                # none.  Saves a connection to init at every turn end of a sandbox without bash.
                self._captured = (time.monotonic(), None)
                return None
            kept, self._kept = self._kept, None
            if kept is not None and not start and self.probe is not None:
                reused = kept.reuse(await self.probe(kept.nspid))
                if reused is not None:
                    self._kept, self._captured = kept, (time.monotonic(), kept.nspid)
                    self.counts.reused += 1
                    return reused
            self._captured = None
            # One connection: attaching to the session says whether it runs, and its pid.  Only
            # the control channel counts: what the capture (or anything else) prints is discarded.
            try:
                outcome, scanner = await self._run_scanned(
                    session_state.CAPTURE_COMMAND,
                    timeout_s=timeout_s,
                    max_output=1 << 20,
                    sink=None,
                    keep_status=True,
                    start=start,
                )
            except _NoSession:
                self._captured = (time.monotonic(), None)
                return None
            pid, sent = self._bash_pid, self._sent
            # Still under the lock: bash is idle, holding only its own descriptors.
            idle = await self.probe(pid) if self.probe and pid and outcome.exit_code == 0 else None

        if outcome.exit_code != 0 or outcome.session_ended or scanner.state is None:
            why = "too large" if scanner.control_overflow else f"exit {outcome.exit_code}"
            raise InitUnavailable(
                f"capturing the session state failed ({why}): {outcome.stderr[-500:].decode('utf-8', 'replace')}",
                sandbox="",
            )
        state = session_state.parse_state(scanner.state)
        if idle is not None:
            state.limits, state.fds = idle.limits, idle.fds
        self.counts.captured += 1
        if sent == self._sent:  # no command was sent since (the lock is released): it still stands
            self._kept = Kept.of(pid, state, idle)
            if pid is not None:
                self._captured = (time.monotonic(), pid)
        return state

    async def capture_json(self) -> str | None:
        """:meth:`capture_state` as its JSON; a reused capture's is not serialized again."""
        state = await self.capture_state()
        if state is None:
            return None
        return self._kept.to_json(state) if self._kept is not None else state.to_json()

    async def apply(self, state: session_state.SessionState, *, timeout_s: float = 60.0) -> None:
        """Make the running bash's state ``state`` without replacing it (its background jobs live on)."""
        async with self._lock:
            try:
                outcome = await self._run_locked(
                    session_state.render_restore_script(state), timeout_s=timeout_s, max_output=1 << 20, sink=None
                )
            except SessionFoundDead as exc:
                raise InitUnavailable(f"the session's state was not re-applied: {exc}", sandbox="") from exc
        if outcome.session_ended:
            raise InitUnavailable(
                "the session died while its state was re-applied: " + outcome.stderr[-500:].decode("utf-8", "replace"),
                sandbox="",
            )

    async def restart(self, state: session_state.SessionState | None, *, timeout_s: float = 60.0) -> None:
        """Replace the session's bash by a fresh one, with ``state`` applied if given."""
        if self._lock.locked():
            raise SandboxBusy("the session is running a command; cannot restart it now", sandbox="")
        async with self._lock:
            self._captured = self._kept = None
            conn = await self._connect()
            async with conn:
                for p in await conn.list():
                    if p.name != SESSION_NAME:
                        continue
                    if p.alive:
                        await conn.attach(SESSION_NAME)
                        await conn.signal(signal.SIGKILL)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._drain_until_exit(conn), timeout=KILL_GRACE_S)
                    await conn.forget(SESSION_NAME)
            if state is not None:
                outcome = await self._run_locked(
                    session_state.render_restore_script(state), timeout_s=timeout_s, max_output=1 << 20, sink=None
                )
                if outcome.session_ended:
                    raise InitUnavailable(
                        "the session died while its state was re-applied: "
                        + outcome.stderr[-500:].decode("utf-8", "replace"),
                        sandbox="",
                    )
