"""Crash recovery: recreate a sandbox whose container died, from its latest checkpoint.

"Latest" is the sandbox's head — the checkpoint its files descend from on
its current branch.  A full checkpoint brings its processes back, an fs one
its files and session state.  Turns recorded after that checkpoint had
effects that are gone; recovery reports them (``turnmap.lost_turns``), so an
agent can redo them, and it reports what of the checkpoint's own state the
new container could not be given (``not_restored``: e.g. the session bash's
open descriptors after a files-only checkpoint).

With ``recovery="auto"`` crabd does this by itself: a watcher lists the
containers of this daemon that exited (one Docker call every
:data:`WATCH_INTERVAL_S`), marks their sandboxes dead, and recovers those
whose policy asks for it (each of crabd's processes only its own sandboxes:
``SandboxRecord.shard``); adoption at start-up does the same for sandboxes
that died while crabd was down (a host reboot).  A sandbox stopped on
request is never recovered behind its owner's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from crabd.coordinator.restore import Restorer
from crabd.coordinator.sandboxes import SandboxManager
from crabd.coordinator.turnmap import lost_turns
from crabd.errors import AlreadyExists, CrabError, InvalidRequest
from crabd.models import CheckpointRecord, RecoveryMode, SandboxRecord, SandboxState
from crabd.store.catalog import Catalog
from crabd.store.identity import SandboxIds
from crabd.trust import identity
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.recovery")

WATCH_INTERVAL_S = 2.0
#: Every this many watch intervals (and whenever a sandbox was found dead elsewhere, or a
#: recovery waits for its retry) the watch lists the runtime's stopped containers and reads
#: every sandbox; in between it only polls the pidfds of the running containers' inits
#: (``livestatus.py``), which costs nothing per sandbox that did not stop.
FULL_SWEEP_EVERY = 15
#: Turns an import may report lost after its checkpoint (``last_turn`` comes from the caller).
MAX_LOST_TURNS = 100_000
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Recovered:
    sandbox: SandboxRecord
    checkpoint: CheckpointRecord
    lost_turns: list[int]
    #: What of the checkpoint's state the new container could not be given (see ``SandboxRecord.not_restored``).
    not_restored: list[str] = field(default_factory=list)


class Recovery:
    def __init__(self, restorer: Restorer, sandboxes: SandboxManager, catalog: Catalog) -> None:
        self.restorer = restorer
        self.sandboxes = sandboxes
        self.catalog = catalog
        self._task: asyncio.Task[None] | None = None
        self._busy: set[str] = set()
        #: sandbox id -> (failed attempts, monotonic time of the last); automatic
        #: recovery backs off (1, 2, 4 minutes) and gives up after MAX_ATTEMPTS.
        self._failed: dict[str, tuple[int, float]] = {}
        self._ticks = 0
        #: ``SandboxManager.deaths`` as of the last full pass.
        self._deaths_seen = -1

    def _latest(self, rec: SandboxRecord) -> CheckpointRecord:
        # Only the sandbox's owner's checkpoints: another uid's that carry the same sandbox id
        # (kept from before the id ledger, store/identity.py) are not this sandbox's past.
        head = self.catalog.head(rec.id)
        if head is not None and head.checkpoint is not None and head.checkpoint.owner_uid == rec.owner_uid:
            return head.checkpoint
        own = self.catalog.list_checkpoints(rec.id, rec.owner_uid)
        if not own:
            raise InvalidRequest(
                f"sandbox {rec.name} has no checkpoint to recover from",
                hint="Create sandboxes with checkpoints (the default policy), or remove this one.",
            )
        return own[-1]

    async def recover(self, rec: SandboxRecord) -> Recovered:
        rec, _ = await self.sandboxes.refresh(rec)
        if rec.state is SandboxState.RUNNING:
            raise InvalidRequest(
                f"sandbox {rec.name} is running; recovery is for sandboxes whose container died",
                hint=f"To go back to a checkpoint, use `crabctl restore {rec.name} CKPT`.",
            )
        if rec.state is SandboxState.CREATING:
            raise InvalidRequest(f"sandbox {rec.name} is still being created")
        ckpt = self._latest(rec)
        turns = self.sandboxes.registry.list_turns(rec.id)
        lost = lost_turns(turns, ckpt, rec)
        crash_point("recover.before_restore")
        out = await self.restorer.restore(rec, ckpt)
        log.warning(
            "sandbox recovered",
            extra={
                "sandbox": rec.id,
                "checkpoint": ckpt.id,
                "kind": ckpt.kind,
                "lost_turns": lost,
                "not_restored": out.not_restored,
            },
        )
        return Recovered(out, ckpt, lost, list(out.not_restored))

    async def arrive(self, ckpt: CheckpointRecord, last_turn: int) -> Recovered:
        """Bring ``ckpt``'s sandbox here from another host (migrated, or its host was lost).

        ``last_turn``: the last turn the caller knows the sandbox ended on its
        old host (-1: unknown).  The turns after ``ckpt``'s are reported lost:
        their effects stayed on the old host.
        """
        if last_turn - ckpt.turn > MAX_LOST_TURNS:
            # The caller's number sizes the report: bound it before any list is made from it.
            raise InvalidRequest(
                f"last_turn {last_turn} is {last_turn - ckpt.turn} turns after checkpoint {ckpt.id}'s "
                f"(turn {ckpt.turn}); at most {MAX_LOST_TURNS} can be reported lost",
                hint="Pass the last turn the sandbox really ended, or -1 if it is not known.",
            )
        if await self.sandboxes.get(ckpt.sandbox_id) is not None:
            raise AlreadyExists(
                f"sandbox {ckpt.sandbox_name} ({ckpt.sandbox_id}) already lives on this host",
                name=ckpt.sandbox_name,
                hint=f"To go back to that checkpoint, use `crabctl restore {ckpt.sandbox_name} {ckpt.id}`.",
            )
        # The checkpoint's sandbox id must be its owner's here too (crabd/trust/identity.py).
        identity.check_arrival(SandboxIds(self.catalog.db), ckpt.sandbox_id, ckpt.owner_uid, ckpt.id)
        lost = list(range(ckpt.turn + 1, last_turn + 1))
        out = await self.restorer.arrive(ckpt)
        log.warning(
            "sandbox brought in from another host",
            extra={"sandbox": out.id, "checkpoint": ckpt.id, "lost_turns": lost, "not_restored": out.not_restored},
        )
        return Recovered(out, ckpt, lost, list(out.not_restored))

    # --- automatic recovery ---------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="crab-recovery-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            try:
                await self._tick()
            except CrabError as exc:
                log.warning("recovery watch failed", extra={"error": str(exc)})
            except Exception:  # never let the watcher die silently
                log.exception("recovery watch crashed; continuing")
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _tick(self) -> list[str]:
        """One watch interval: a full :meth:`sweep` when due, else only the containers whose init exited."""
        retrying = any(attempts < MAX_ATTEMPTS for attempts, _ in self._failed.values())
        full = self._ticks % FULL_SWEEP_EVERY == 0 or self.sandboxes.deaths != self._deaths_seen or retrying
        self._ticks += 1
        if full:
            return await self.sweep()
        exited = set(self.sandboxes.live_status.exited())
        return await self._sweep(exited) if exited else []

    async def sweep(self) -> list[str]:
        """Mark sandboxes whose container exited dead; recover those that ask for it.  Returns their ids."""
        exited = set(await asyncio.to_thread(self.sandboxes.backend.list_exited, self.sandboxes.instance))
        return await self._sweep(exited | set(self.sandboxes.live_status.exited()))

    async def _sweep(self, exited: set[str]) -> list[str]:
        # Read before the pass: a sandbox found dead while it runs is seen by the next full one.
        self._deaths_seen = self.sandboxes.deaths
        done = []
        for rec in self.sandboxes.list_sandboxes(None):
            # ``exited`` is the whole runtime instance's, the rows every process's ([daemon] workers):
            # another process's sandbox is that process's to mark dead and recover (else both restore it).
            if rec.shard != self.sandboxes.place.index:
                continue
            if rec.state is SandboxState.RUNNING and rec.container_id in exited:
                rec, _ = await self.sandboxes.refresh(rec)
            if rec.state is not SandboxState.DEAD or rec.spec.recovery is not RecoveryMode.AUTO or rec.id in self._busy:
                continue
            attempts, last = self._failed.get(rec.id, (0, 0.0))
            if attempts >= MAX_ATTEMPTS or (attempts and time.monotonic() - last < 60.0 * 2 ** (attempts - 1)):
                continue
            self._busy.add(rec.id)
            try:
                await self.recover(rec)
                self._failed.pop(rec.id, None)
                done.append(rec.id)
            except CrabError as exc:
                self._failed[rec.id] = (attempts + 1, time.monotonic())
                log.error(
                    "automatic recovery failed",
                    extra={"sandbox": rec.id, "attempt": attempts + 1, "error": str(exc)},
                )
            finally:
                self._busy.discard(rec.id)
        return done
