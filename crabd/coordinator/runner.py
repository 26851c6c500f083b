"""The sandbox's persistent shells, run through crab's init (never `docker exec`).

(One-shot commands are ``oneshot.py``'s; stepping aside for a process dump is ``stepaside.py``'s.)

* :class:`Session` — one persistent bash of the sandbox: its default
  session, or a named one (``sessions.py``); a *persistent* init child
  named ``crab-session`` (``crab-session:NAME``) with a control channel
  (``SpawnSpec.control``).
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
from collections.abc import AsyncIterator, Awaitable, Callable

from crabd.coordinator.oneshot import KILL_GRACE_S, ChunkSink, Connector, next_event, truncation_marker
from crabd.coordinator.sessionkeep import CaptureCounts, IdleReading, Kept
from crabd.coordinator.stepaside import DumpYield, LostOutput, step_aside
from crabd.errors import InitSpawnError, InitUnavailable, InvalidRequest, SandboxBusy
from crabd.models import ExecOutcome
from crabd.runtime import initproto, session_proto, session_state
from crabd.runtime.initproto import Control, ControlRejected, Event, Exit, InitConnection, SpawnSpec, Stderr, Stdout

log = logging.getLogger("crabd.session")

#: Given the session bash's pid inside the sandbox: its limits, descriptors and whether it ran, or None
#: if unreadable (see ``runtime/session_os.py``, ``coordinator/sessionkeep.py``).
ProcessProbe = Callable[[int], Awaitable[IdleReading | None]]

SESSION_NAME = "crab-session"
#: Init's name for named session NAME's bash: ``crab-session:NAME`` (the default session keeps the plain one).
NAMED_PREFIX = SESSION_NAME + ":"
SESSION_ARGV = ["bash", "--noprofile", "--norc"]


def init_name(session: str) -> str:
    """The name crab's init knows session ``session``'s bash by ("" is the default session)."""
    return NAMED_PREFIX + session if session else SESSION_NAME


class SessionFoundDead(Exception):
    """The session's bash had already exited when a command attached to it; the command did not run.

    Not a CrabError: the caller (``Commands.session_run``) revives the session (a
    fresh bash with the last captured state) and sends the command again, since it
    was never written to any bash; other callers see :class:`InitUnavailable`.
    """


class _NoSession(Exception):
    """No bash runs, and the caller asked not to start one."""


class Session:
    """One persistent bash of a sandbox: the default session (``name`` "") or a named one.

    One command at a time per session; sessions of one sandbox run at the
    same time, each its own bash (own cwd, environment, functions, options,
    limits, descriptors and jobs).
    """

    def __init__(
        self,
        connect: Connector,
        env: dict[str, str],
        workdir: str,
        counts: CaptureCounts | None = None,
        *,
        name: str = "",
        uid: int | None = None,
        gid: int | None = None,
        yielding: DumpYield | None = None,
        pty: tuple[int, int] | None = None,
        spawn_known: bool = True,
    ) -> None:
        self._connect = connect
        self._env = env
        self._workdir = workdir
        self.name = name
        self._init_name = init_name(name)
        self._uid, self._gid = uid, gid
        #: The bash's stdout and stderr are one pseudo-terminal of this size (rows, columns); None: two pipes.
        self.pty = pty
        #: Whether the running bash was started as this object says (user, terminal), so that a fresh one
        #: made from a capture is the same kind (false: a handle made for a bash found running).
        self.spawn_known = spawn_known
        #: Steps aside for process dumps while a command runs (None: holds its connection).
        self.yielding = yielding
        #: Held by whatever talks to the bash: a caller's command, or crabd's own short acts on it
        #: (a state capture at a turn end, applying a state, starting it).
        self._lock = asyncio.Lock()
        #: A caller's command (or close, or restart) runs or waits for crabd's own act to finish.  Only
        #: this makes the session busy: a command that meets a capture waits for it (a few ms) instead of
        #: being refused, as ROCK's ``arun`` would be when another session's turn end captures this one.
        self._claimed = False
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
        """Whether a caller's command (or close, or restart) runs in the session or waits to."""
        return self._claimed

    @contextlib.asynccontextmanager
    async def _claim(self, refusal: str, hint: str | None = None) -> AsyncIterator[None]:
        """Take the session for a caller: refused (``SandboxBusy``) while another caller has it, waits
        while crabd's own act holds it.  The check and the claim happen without a suspension between."""
        if self._claimed:
            raise SandboxBusy(refusal, sandbox="", hint=hint)
        self._claimed = True
        try:
            async with self._lock:
                yield
        finally:
            self._claimed = False

    @property
    def connector(self) -> Connector:
        """How this session reaches the sandbox's init (named sessions of a new container share it)."""
        return self._connect

    @property
    def user(self) -> tuple[int | None, int | None]:
        """The (uid, gid) its bash runs as (None: root, init's own)."""
        return self._uid, self._gid

    async def _attach_or_spawn(self, conn: InitConnection, *, start: bool = True) -> int:
        """Bind ``conn`` to the session, starting bash if there is none (``start``; else
        :class:`_NoSession`).  Returns the bash's pid in the sandbox, as init reports it."""
        try:
            attached, listed = await conn.attach_listed(self._init_name)
            if any(p.name == self._init_name and p.alive for p in listed):
                return attached.pid
            # Init kept a session whose bash exited while no command ran (something in the
            # sandbox killed it): nothing was written to it yet.  A capture finds no session
            # (the next command revives it with its state); a command must not run into it.
            if not start:
                raise _NoSession
            await conn.forget(self._init_name)
            raise SessionFoundDead("the session's bash had exited before the command was sent")
        except InitSpawnError as exc:
            if exc.errno == errno_mod.EBUSY:
                raise SandboxBusy(f"{self.label} is in use by another client", sandbox="") from exc
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
        if self.pty and hello.version < initproto.PTY_PROTO_VERSION:
            raise InvalidRequest(
                f"this sandbox's init speaks protocol {hello.version}; a pty session needs "
                f"{initproto.PTY_PROTO_VERSION} (the sandbox was made by an older crabd)",
                hint="Open the session without a pty, or run it in a sandbox created by this crabd.",
            )
        try:
            started = await conn.spawn(
                SpawnSpec(
                    argv=list(SESSION_ARGV),
                    env=self._env,
                    cwd=self._workdir,
                    uid=self._uid,
                    gid=self._gid,
                    name=self._init_name,
                    persistent=True,
                    control=True,
                    pty=self.pty,
                )
            )
        except InitSpawnError as exc:
            if exc.errno == errno_mod.ENOENT and "exec" in exc.init_message:
                raise InvalidRequest(
                    f"this sandbox's image has no bash; {self.label} needs bash",
                    hint="Use an image with bash (e.g. crab-env/bookworm), or run programs with exec.",
                ) from exc
            raise

        await conn.write_stdin(session_proto.BOOTSTRAP)
        return started.pid

    @property
    def label(self) -> str:
        """How messages name this session."""
        return f"session {self.name!r}" if self.name else "the session"

    async def run(
        self, command: str, *, timeout_s: float, max_output: int, sink: ChunkSink | None = None
    ) -> ExecOutcome:
        async with self._claim(
            f"{self.label} is already running a command; one session runs one command at a time",
            "Wait for it, or run the command in another session (session(name) in the SDK).",
        ):
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
        lost = LostOutput()
        conn = await self._connect()
        try:
            self._bash_pid = await self._attach_or_spawn(conn, start=start)
            await conn.write_stdin(payload)
            timed_out = False
            ended: Exit | None = None
            deadline = started + timeout_s
            while not scanner.done and ended is None:
                if self.yielding is not None and self.yielding.wanted:
                    conn, ended = await step_aside(
                        conn,
                        connect=self._connect,
                        init_name=self._init_name,
                        take=self._take,
                        scanner=scanner,
                        sink=sink,
                        lost=lost,
                        counts=self.counts,
                    )
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                try:
                    if self.yielding is not None:
                        ev = await self.yielding.next_event(conn, remaining)
                    else:
                        ev = await next_event(conn, remaining)
                except TimeoutError:
                    continue
                ended = await self._take(ev, scanner, sink)
            if timed_out:
                # A non-interactive bash cannot be interrupted back to a clean
                # prompt reliably (a half-run heredoc, traps, SIGINT semantics),
                # so the whole session is killed; the caller restarts it from
                # the last captured state.
                await conn.signal(signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drain_until_exit(conn), timeout=KILL_GRACE_S)
                await conn.forget(self._init_name)
            elif ended is not None:
                await conn.forget(self._init_name)
            else:
                await conn.detach()
        finally:
            await conn.aclose()
        stdout, stderr = scanner.stdout, scanner.stderr
        cut_out = scanner.dropped_stdout + lost.past["stdout"]
        cut_err = scanner.dropped_stderr + lost.past["stderr"]
        if cut_out:
            stdout += truncation_marker("stdout", cut_out)
        if cut_err:
            stderr += truncation_marker("stderr", cut_err)
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
            stdout_dropped=cut_out + lost.marked["stdout"],
            stderr_dropped=cut_err + lost.marked["stderr"],
            duration_s=time.monotonic() - started,
            session_ended=timed_out or ended is not None,
        )
        return outcome, scanner

    async def _take(self, ev: Event, scanner: session_proto.MarkerScanner, sink: ChunkSink | None) -> Exit | None:
        """Feed one event of the running command to ``scanner`` (and ``sink``); its Exit if the bash ended."""
        if isinstance(ev, Stdout | Stderr):
            name: session_proto.Stream = "stdout" if isinstance(ev, Stdout) else "stderr"
            kept = scanner.feed(name, ev.data)
            if sink is not None and kept:
                await sink(name, kept)
        elif isinstance(ev, Control):
            scanner.feed_control(ev.data)
        elif isinstance(ev, ControlRejected):
            self._rejected(ev)
        elif isinstance(ev, Exit):
            return ev
        return None

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

    async def start(self) -> int:
        """Start this session's bash now (not at its first command); its pid in the sandbox.

        Raises InvalidRequest if the image has no bash.
        """
        async with self._lock:
            self._captured = self._kept = None
            for _ in range(2):
                conn = await self._connect()
                async with conn:
                    try:
                        pid = await self._attach_or_spawn(conn)
                    except SessionFoundDead:
                        continue  # init still listed an exited bash of that name; it forgot it: start afresh
                    await conn.detach()
                    self._bash_pid = pid
                    return pid
        raise InitUnavailable(f"{self.label}'s bash exited as soon as it started", sandbox="")

    async def processes(self) -> list[initproto.PersistentInfo]:
        """Init's persistent processes: every session's bash (and whether it lives)."""
        conn = await self._connect()
        async with conn:
            return await conn.list()

    async def pid(self) -> int | None:
        """The session bash's pid inside the sandbox, or None when none runs (crab's init knows it by name)."""
        conn = await self._connect()
        async with conn:
            for p in await conn.list():
                if p.name == self._init_name and p.alive:
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
        async with self._claim(f"{self.label} is running a command; cannot restart it now"):
            self._captured = self._kept = None
            conn = await self._connect()
            async with conn:
                await self._kill_bash(conn)
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

    async def _kill_bash(self, conn: InitConnection) -> bool:
        """Kill this session's bash (if it lives) and make init forget it; whether init knew it."""
        for p in await conn.list():
            if p.name != self._init_name:
                continue
            if p.alive:
                await conn.attach(self._init_name)
                await conn.signal(signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drain_until_exit(conn), timeout=KILL_GRACE_S)
            await conn.forget(self._init_name)
            return True
        return False

    async def close(self) -> bool:
        """End the session: its bash and its jobs' process group are killed; whether it existed.

        Refused while it runs a command (its caller is waiting for it).
        """
        async with self._claim(f"{self.label} is running a command; close it after that"):
            self._captured = self._kept = None
            conn = await self._connect()
            async with conn:
                return await self._kill_bash(conn)
