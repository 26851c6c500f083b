"""Sandbox lifecycle: lookups and status, session binding, stop, remove.

Creation (and the containers of restores and forks) is in ``launching.py``,
the base class; commands and turns in ``commands.py``; checkpoints in
``checkpoints.py`` and ``restore.py``; taking sandboxes over after a restart
in ``adoption.py``.

A removal marks its row ``being removed`` before the container goes, so
adoption finishes it rather than taking the sandbox for one whose container
vanished.

How a request gets a sandbox: :meth:`SandboxManager.get`, the one lookup
that waits for a sandbox's adoption after a restart (the gate,
``adoption.py``).  :meth:`SandboxManager.row` and
:meth:`SandboxManager.list_sandboxes` are the registry's rows as they
stand, for the coordinator's re-reads of a sandbox already in hand and for
what adoption never changes (owner, spec, counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TypeVar

from crabd.backends.sandbox import ContainerStatus, SandboxBackend
from crabd.config import CrabConfig
from crabd.coordinator.launching import SandboxLauncher
from crabd.coordinator.livestatus import RunningStatus
from crabd.coordinator.quiesce import until_init_alone
from crabd.coordinator.runner import ProcessProbe, Session
from crabd.coordinator.sessionkeep import CaptureCounts, IdleReading
from crabd.coordinator.stepaside import DumpYield
from crabd.coordinator.turns import TurnKeeper
from crabd.errors import (
    CrabError,
    InitUnavailable,
    InvalidRequest,
    SandboxBusy,
    SandboxDead,
)
from crabd.inspector.model import MemoryWrites
from crabd.models import SandboxRecord, SandboxState
from crabd.runtime import session_os, session_state
from crabd.runtime.initproto import InitConnection
from crabd.runtime.session_state import SessionState
from crabd.store.registry import Registry
from crabd.util.faults import crash_point
from crabd.util.netns import Netns

log = logging.getLogger("crabd.sandboxes")

T = TypeVar("T")

#: ``dead_reason`` of a sandbox whose removal began: adoption finishes it (see :meth:`SandboxManager.remove`).
REMOVING = "being removed"


#: How long a failed connection into a sandbox waits for a dying init to finish exiting.
INIT_EXIT_WAIT_S = 1.0


def env_dict(env: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    out.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    out.setdefault("HOME", "/root")
    return out


class _Live:
    """Per-sandbox runtime state held in memory (the registry holds the rest)."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.session: Session | None = None
        #: Named sessions met so far, by name (``coordinator/sessions.py``); init's table is the truth.
        self.named: dict[str, Session] = {}
        #: (container id, init pid) the session's connector reaches.
        self.bound: tuple[str, int] | None = None
        self.op_lock = asyncio.Lock()
        # A process dump must not see a connection from crabd into the sandbox
        # (CRIU would find a unix socket whose peer is outside the dumped
        # tree).  ``gate`` is cleared while a dump runs; ``conns`` counts open
        # connections and ``idle`` is set when there are none.
        self.gate = asyncio.Event()
        self.gate.set()
        #: Session commands in flight step aside for a dump (``stepaside.DumpYield``).
        self.yielding = DumpYield(self.gate)
        self.conns = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def opened(self) -> None:
        self.conns += 1
        self.idle.clear()

    def closed(self) -> None:
        self.conns -= 1
        if self.conns <= 0:
            self.conns = 0
            self.idle.set()


class AdoptionGate(Protocol):
    """Start-up adoption as the manager's lookups see it (``coordinator/adoption.py``)."""

    def settled(self, sandbox_id: str) -> bool:
        """True unless the sandbox is still to be adopted (or being adopted)."""
        ...

    async def wait(self, sandbox_id: str) -> None:
        """Until the sandbox is adopted (adopting it now if it is still queued)."""
        ...


class SandboxManager(SandboxLauncher):
    def __init__(
        self, cfg: CrabConfig, registry: Registry, backend: SandboxBackend, init_binary: Path, instance: str
    ) -> None:
        super().__init__(cfg, registry, backend, init_binary, instance)
        self.turns = TurnKeeper(registry, keep=cfg.quota.turns_kept)
        self._live: dict[str, _Live] = {}
        self._background: set[asyncio.Task[None]] = set()
        #: Running containers' statuses, kept while their init lives.
        self.live_status = RunningStatus()
        #: Sandboxes found dead so far (the recovery watch reads all sandboxes when it moved).
        self.deaths = 0
        #: Set before serving by start-up adoption; None: every sandbox is adopted.
        self.gate: AdoptionGate | None = None
        #: The probes' memory-writes count of a sandbox (set by the daemon's assembly; None: unwatched).
        self.memory_writes: Callable[[str], MemoryWrites | None] = lambda _sandbox_id: None
        #: Session states stored by turn ends and checkpoints: captured in bash, or reused.
        self.capture_counts = CaptureCounts()

    # --- lookup and status ----------------------------------------------------

    async def get(self, ref: str) -> SandboxRecord | None:
        """The sandbox ``ref`` (id or name) names, once adopted: a request's only way to a sandbox.

        After a restart it waits for that sandbox's adoption (adopting it first
        if no worker has yet), then reads the row again: a rolled-back creation
        or a finished removal is gone, a failed adoption reads ``dead``.
        """
        rec = self.registry.get_sandbox(ref)
        # Another process's sandbox is that process's to adopt: the row as it stands (Access refuses it).
        if rec is None or self.gate is None or rec.shard != self.place.index or self.gate.settled(rec.id):
            return rec
        await self.gate.wait(rec.id)
        return self.registry.get_sandbox(rec.id)

    def row(self, ref: str) -> SandboxRecord | None:
        """The registry's row as it stands, adopted or not (see the module doc: not for a request's lookup)."""
        return self.registry.get_sandbox(ref)

    def adopted(self, sandbox_id: str) -> bool:
        """False while start-up adoption has yet to take the sandbox over (its row may not be the truth)."""
        return self.gate is None or self.gate.settled(sandbox_id)

    def list_sandboxes(self, owner_uid: int | None) -> list[SandboxRecord]:
        return self.registry.list_sandboxes(owner_uid)

    def count_sandboxes(self, owner_uid: int | None) -> int:
        return self.registry.count_sandboxes(owner_uid)

    def sandbox_names(self, owner_uid: int | None) -> dict[str, str]:
        return self.registry.sandbox_names(owner_uid)

    def _mark_dead(self, rec: SandboxRecord, st: ContainerStatus) -> SandboxRecord:
        self.live_status.drop(rec.container_id)
        self.deaths += 1
        if not st.exists:
            reason = "container vanished (removed outside crab, or the host lost it)"
        elif st.oom_killed:
            reason = (
                f"container exited with code {st.exit_code} after the kernel's OOM killer acted in it "
                "(memory limit reached)"
            )
        else:
            reason = f"container exited with code {st.exit_code}" + (f": {st.error}" if st.error else "")
        self.registry.update_sandbox(
            rec.id, state=SandboxState.DEAD, exit_code=st.exit_code, oom_killed=st.oom_killed, dead_reason=reason
        )
        log.warning("sandbox dead", extra={"sandbox": rec.id, "reason": reason})
        self._drop_session(rec.id)
        return replace(
            rec, state=SandboxState.DEAD, exit_code=st.exit_code, oom_killed=st.oom_killed, dead_reason=reason
        )

    def mark_unadoptable(self, sandbox_id: str, reason: str) -> None:
        """Adoption failed: the sandbox is dead to crabd (requests get SandboxDead, recovery may restore it)."""
        self.registry.update_sandbox(sandbox_id, state=SandboxState.DEAD, dead_reason=reason)
        self._drop_session(sandbox_id)

    async def refresh(self, rec: SandboxRecord) -> tuple[SandboxRecord, ContainerStatus | None]:
        """Re-read the container; a running sandbox whose container stopped becomes dead."""
        if rec.state is not SandboxState.RUNNING or not rec.container_id:
            return rec, None
        # Kept while the init lives (livestatus.py): most lookups cost a poll, not a runtime call.
        st = self.live_status.get(rec.container_id)
        if st is None:
            st = await self._io(self.live_status.read, rec.container_id, self.backend.status)
        if not st.exists or not st.running:
            return self._mark_dead(rec, st), st
        rec.ip_address = st.ip_address
        return rec, st

    async def running(self, rec: SandboxRecord) -> ContainerStatus:
        """The container's status; SandboxDead unless the sandbox is running."""
        return await self._running(rec)

    async def _running(self, rec: SandboxRecord) -> ContainerStatus:
        rec, st = await self.refresh(rec)
        if rec.state is not SandboxState.RUNNING or st is None:
            what = {SandboxState.STOPPED: "is stopped", SandboxState.CREATING: "is still being created"}.get(
                rec.state, "is dead"
            )
            raise SandboxDead(
                f"sandbox {rec.name} ({rec.id}) {what}" + (f": {rec.dead_reason}" if rec.dead_reason else ""),
                sandbox=rec.id,
                container_id=rec.container_id,
                exit_code=rec.exit_code,
                oom_killed=rec.oom_killed,
                reason=rec.dead_reason or what,
            )
        return st

    def connector(self, rec: SandboxRecord, pid: int) -> Callable[[], Awaitable[InitConnection]]:
        live = self._live_for(rec)

        async def connect() -> InitConnection:
            await live.gate.wait()  # a process dump is running: wait for it
            live.opened()
            try:
                conn = await InitConnection.open(netns=Netns(pid, rec.container_id))
            except InitUnavailable as exc:
                live.closed()
                await self._dead_after_init_lost(rec)
                raise InitUnavailable(f"sandbox {rec.name}: {exc.message}", sandbox=rec.id) from exc
            except BaseException:
                live.closed()
                raise
            conn.on_close = live.closed
            return conn

        return connect

    @contextlib.asynccontextmanager
    async def init_lost_means_dead(self, rec: SandboxRecord) -> AsyncIterator[None]:
        """Init went away in the middle of a call: SandboxDead if that is because the sandbox died.

        A sandbox killed while (or just before) a command runs closes init's
        connection before its init counts as exited (:meth:`_init_exit`).
        """
        try:
            yield
        except InitUnavailable:
            await self._dead_after_init_lost(rec)
            raise

    async def _dead_after_init_lost(self, rec: SandboxRecord) -> None:
        """SandboxDead if init went away because the sandbox died; returns if it still runs."""
        await self._init_exit(rec.container_id)
        await self._running(rec)

    async def _init_exit(self, container_id: str) -> None:
        """After init went away: give a dying init a moment to finish exiting, then forget its status.

        A killed init loses its namespaces early in its exit (setns then fails
        with ESRCH) but counts as exited, for its pidfd and for /proc, a moment
        later.  Asked in between, the kept status would still say running and
        the caller would report init unavailable instead of the sandbox dead.
        """
        deadline = time.monotonic() + INIT_EXIT_WAIT_S
        while self.live_status.get(container_id) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.live_status.drop(container_id)  # the next lookup asks the runtime

    @contextlib.asynccontextmanager
    async def quiesced(self, rec: SandboxRecord, wait_s: float) -> AsyncIterator[None]:
        """No crabd connection into the sandbox for the ``with`` body; new ones wait.

        Waits up to ``wait_s`` for commands in flight to finish, then raises
        SandboxBusy (a long-running exec holds its connection open); then
        until init itself holds none of them (``coordinator/quiesce.py``).
        """
        live = self._live_for(rec)
        live.gate.clear()
        live.yielding.request()
        try:
            try:
                await asyncio.wait_for(live.idle.wait(), wait_s)
            except TimeoutError:
                raise SandboxBusy(
                    f"sandbox {rec.name} has {live.conns} command(s) running; a process checkpoint needs it idle",
                    sandbox=rec.id,
                    hint="Checkpoint between commands (at turn end), or wait for the running command.",
                ) from None
            st = await self._running(rec)
            async with self.init_lost_means_dead(rec):
                await until_init_alone(
                    lambda: InitConnection.open(netns=Netns(st.pid, rec.container_id)), rec.name, rec.id
                )
            yield
        finally:
            live.gate.set()

    def _drop_session(self, sandbox_id: str) -> None:
        live = self._live.get(sandbox_id)
        if live is not None:
            live.session = None
            live.named.clear()

    def _live_for(self, rec: SandboxRecord) -> _Live:
        return self._live_for_id(rec.id)

    def _live_for_id(self, sandbox_id: str) -> _Live:
        live = self._live.get(sandbox_id)
        if live is None:
            live = self._live[sandbox_id] = _Live(sandbox_id)
        return live

    async def session_for(self, rec: SandboxRecord) -> Session:
        """The sandbox's session object, bound to its current container (bash starts on first use)."""
        return self._session_on(rec, await self._running(rec))

    def _session_on(self, rec: SandboxRecord, st: ContainerStatus) -> Session:
        """:meth:`session_for` with the container's status already in hand."""
        live = self._live_for(rec)
        # The container's pid changes only if it was restarted; rebind then.
        target = (rec.container_id, st.pid)
        if live.session is None:
            live.session = Session(
                self.connector(rec, st.pid),
                env_dict(st.env),
                rec.spec.workdir,
                self.capture_counts,
                yielding=live.yielding,
            )
        elif live.bound != target:
            live.session.rebind(self.connector(rec, st.pid))
            for named in live.named.values():
                named.rebind(self.connector(rec, st.pid))
        live.bound = target
        live.session.probe = self.session_probe(rec.container_id, rec.id)
        return live.session

    def session_probe(self, container_id: str, sandbox_id: str) -> ProcessProbe:
        """Reads the idle session bash's limits and descriptors from /proc (``runtime/session_os.py``),
        and what says whether it has run since: the probes' memory-writes count, read first, then
        its CPU time (``coordinator/sessionkeep.py``).

        A failure is logged and leaves them unrecorded: the capture itself
        stands, and a restore reports nothing it cannot know about.
        """

        async def probe(nspid: int) -> IdleReading | None:
            writes = self.memory_writes(sandbox_id)
            try:
                limits, fds, ran = await asyncio.to_thread(session_os.capture, container_id, nspid)
                return IdleReading(limits, fds, None if writes is None else (writes, ran))
            except CrabError as exc:
                log.warning("session process state not read", extra={"sandbox": sandbox_id, "error": str(exc)})
                return None

        return probe

    def bind_session(self, sandbox_id: str, session: Session | None, named: dict[str, Session] | None = None) -> None:
        """Make ``session`` the sandbox's session (after its container was replaced), and ``named`` the named
        sessions known of the new container (the others are found in its init again)."""
        live = self._live_for_id(sandbox_id)
        live.session, live.bound = session, None
        live.named = dict(named or {})
        for s in [session, *live.named.values()]:
            if s is not None:
                s.yielding = live.yielding

    def op_lock(self, sandbox_id: str) -> asyncio.Lock:
        """Serialises checkpoint, restore and fork of one sandbox."""
        return self._live_for_id(sandbox_id).op_lock

    def session_busy(self, sandbox_id: str) -> bool:
        """Whether the default session runs a command."""
        live = self._live.get(sandbox_id)
        return live is not None and live.session is not None and live.session.busy

    def busy_sessions(self, sandbox_id: str) -> list[str]:
        """The sessions running a command now ("" is the default session)."""
        live = self._live.get(sandbox_id)
        if live is None:
            return []
        named = [name for name, s in live.named.items() if s.busy]
        return ([""] if live.session is not None and live.session.busy else []) + named

    def named_sessions(self, rec: SandboxRecord) -> dict[str, Session]:
        """The sandbox's named session objects met so far (``coordinator/sessions.py`` manages them)."""
        return self._live_for(rec).named

    def dump_yield(self, rec: SandboxRecord) -> DumpYield:
        return self._live_for(rec).yielding

    def remove_in_background(self, container_id: str, sandbox_id: str) -> None:
        """Remove a container no registry row names any more (a replaced one) without waiting for it.

        If crabd stops first, adoption at the next start removes it.
        """

        self.live_status.drop(container_id)

        async def go() -> None:
            try:
                await self._io(self.backend.remove, container_id)
            except CrabError as exc:
                log.warning("old container not removed", extra={"sandbox": sandbox_id, "error": str(exc)})

        task = asyncio.create_task(go())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self, rec: SandboxRecord, timeout_s: float | None) -> SandboxRecord:
        await self._running(rec)
        grace = self.cfg.limits.stop_timeout_s if timeout_s is None or timeout_s <= 0 else timeout_s
        self.live_status.drop(rec.container_id)
        await self._io(self.backend.stop, rec.container_id, grace)
        st = await self._io(self.backend.status, rec.container_id)
        self.registry.update_sandbox(
            rec.id,
            state=SandboxState.STOPPED,
            exit_code=st.exit_code,
            oom_killed=st.oom_killed,
            dead_reason="stopped by request",
        )
        self._drop_session(rec.id)
        return self.registry.get_sandbox(rec.id) or rec

    async def remove(self, rec: SandboxRecord, *, force: bool) -> None:
        if rec.state is SandboxState.RUNNING and not force:
            rec, _ = await self.refresh(rec)
            if rec.state is SandboxState.RUNNING:
                raise InvalidRequest(
                    f"sandbox {rec.name} is running; stop it first or remove with force",
                    hint="Use `crabctl rm --force` (or remove(force=True)).",
                )
        if rec.container_id:
            # Recorded first: a crash after the container is gone must not leave a
            # sandbox that adoption takes for one whose container vanished (dead).
            self.registry.update_sandbox(rec.id, dead_reason=REMOVING)
            self.live_status.drop(rec.container_id)
            await self._io(self.backend.remove, rec.container_id)
        crash_point("remove.after_container")
        self.registry.delete_sandbox(rec.id)
        self._live.pop(rec.id, None)
        log.info("sandbox removed", extra={"sandbox": rec.id})

    # --- commands ---------------------------------------------------------------

    async def session_pid(
        self, rec: SandboxRecord, st: ContainerStatus | None = None, *, captured_within_s: float = 0.0
    ) -> int | None:
        """The pid (inside the sandbox) of its session's bash, or None if none runs.

        ``st``: the container's status, if the caller just read it (saves a docker inspect).
        ``captured_within_s``: the pid a state capture saw that long ago at most will do
        (``Session.captured_pid``: a turn end's decision right after its capture).
        """
        session = self._session_on(rec, st) if st is not None else await self.session_for(rec)
        seen = session.captured_pid(captured_within_s) if captured_within_s > 0 else None
        if seen is not None:
            return seen[0]
        return await session.pid()

    async def session_pids(
        self,
        rec: SandboxRecord,
        st: ContainerStatus | None = None,
        *,
        captured_within_s: float = 0.0,
        session_json: str | None = None,
        named: frozenset[int] | None = None,
    ) -> frozenset[int]:
        """The sessions' bashes the inspector leaves out of the processes, their state being captured: the
        default session's (:meth:`session_pid`) and the named ones ``session_json`` holds (or ``named``)."""
        pid = await self.session_pid(rec, st, captured_within_s=captured_within_s)
        others = named if named is not None else session_state.named_pids(session_json)
        return others | {pid} if pid else others

    async def session_state(self, rec: SandboxRecord, *, start: bool = False) -> SessionState | None:
        """The session's state (``start``: starting its bash if none runs; see ``Session.capture_state``)."""
        session = await self.session_for(rec)
        return await session.capture_state(start=start)

    async def close(self, *, remove_all: bool) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=60)
        if remove_all:
            # Only this process's sandboxes: the others' processes remove theirs ([daemon] workers).
            for rec in self.list_sandboxes(None):
                if rec.shard != self.place.index:
                    continue
                try:
                    await self.remove(rec, force=True)
                except CrabError as exc:
                    log.warning("remove at shutdown failed", extra={"sandbox": rec.id, "error": str(exc)})
        self.live_status.close()
