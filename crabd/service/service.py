"""The service layer: who may do what, and request validation.

Every API call arrives here with the caller's identity (from SO_PEERCRED).
Rules:

* a sandbox belongs to the uid that created it;
* root (uid 0) sees and may act on every sandbox;
* any other caller sees only its own sandboxes; acting on someone else's
  gets PERMISSION_DENIED (its existence is not hidden from a direct lookup,
  but it never appears in that caller's listing).

Requests are validated completely before anything changes, so a bad
request gets a clear error and has no effect.  This layer is the one edge
every request crosses: each numeric field is checked here (finite, in
range, within ``[limits]``: ``limits.py``), and environment variables by
the one shared rule (``crabd.util.validate.env_vars``) wherever they come
from.  Results are bounded so a reply always fits a gRPC message.
Words of crab's vocabulary (``crabd.models``: checkpoint policies, kinds,
recovery modes) become enum members once, where they enter: a new
sandbox's spec in ``api/convert.py``, a checkpoint's kind here.

Who may act on which sandbox is ``access.py`` (:class:`Access`, which every
request's sandbox goes through; a checkpoint's reader is checked by
``remote.readable_checkpoint``), the checks of a command request's contents
``command_requests.py`` and the commands themselves ``command_edge.py``; the
edges of the remote tier, archives and retention have modules of their own
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from crabd import __version__
from crabd.config import CrabConfig
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.commands import Commands
from crabd.coordinator.housekeeping import Housekeeper
from crabd.coordinator.inspection import TurnInspection
from crabd.coordinator.recovery import Recovered, Recovery
from crabd.coordinator.restore import MAX_FORKS, Restorer
from crabd.coordinator.retention import Retention
from crabd.coordinator.sandboxes import SandboxManager
from crabd.coordinator.tree import TreeView, build_tree
from crabd.coordinator.turnflow import TurnFlow
from crabd.engine import HostEngine
from crabd.errors import CheckpointNotFound, CrabError, InvalidRequest, PermissionDenied, QuotaExceeded, SandboxBusy
from crabd.models import (
    Caller,
    CheckpointKind,
    CheckpointRecord,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    TurnRecord,
)
from crabd.service import command_requests
from crabd.service.access import Access
from crabd.service.archives import ArchiveEdge
from crabd.service.command_edge import CommandEdge
from crabd.service.images import ImageEdge
from crabd.service.limits import RequestLimits
from crabd.service.placement import place_create
from crabd.service.quota import Quotas, QuotaUse
from crabd.service.remote import RemoteCheckpoints, readable_checkpoint
from crabd.service.reports import CheckpointDetail, DaemonStatus, EngineReport
from crabd.service.retention import RetentionEdge
from crabd.store.catalog import Catalog, CheckpointFailure
from crabd.store.maintenance import GcReport, VerifyReport
from crabd.store.remote.tier import SyncReport, Transfer
from crabd.util import validate
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.service")

#: Most changed paths one `checkpoint inspect` returns.
MAX_CHANGES_SHOWN = 10_000


class Service:
    def __init__(
        self,
        cfg: CrabConfig,
        sandboxes: SandboxManager,
        checkpointer: Checkpointer,
        restorer: Restorer,
        recovery: Recovery,
        inspection: TurnInspection,
        engine: HostEngine,
        *,
        catalog: Catalog,
        quotas: Quotas,
        housekeeping: Housekeeper,
        retention: Retention,
        docker_version: str,
    ) -> None:
        self.cfg = cfg
        self.sandboxes = sandboxes
        self.commands = Commands(sandboxes)
        self.checkpoints = checkpointer
        self.restorer = restorer
        self.recovery = recovery
        self.inspection = inspection
        self.engine = engine
        self.limits = RequestLimits(cfg.limits, disk_default=cfg.btrfs.sandbox_disk_bytes)
        self.catalog = catalog
        self.quotas = quotas
        self.flow = TurnFlow(cfg.engine, engine, self.commands, inspection)
        self.images = ImageEdge(cfg, sandboxes)
        self.housekeeping = housekeeping
        self.started_at = time.time()
        #: Set by the daemon once the OpenAI proxy listens ("" = not enabled).
        self.proxy_url = ""
        #: Set by the main process when it has workers: how often one was started again after it died.
        self.process_restarts: Callable[[], int] = lambda: 0
        self.docker_version = docker_version
        #: The remote tier's edge (a tier is attached by the daemon when [remote] is configured).
        self.remote = RemoteCheckpoints(catalog)
        #: Portable archives' edge (export/import; the coordinator's part is attached by the daemon).
        self.archives = ArchiveEdge(
            catalog, sandboxes, quotas, self.limits, max_imports=cfg.archive.max_concurrent_imports
        )
        #: Who may act on which sandbox: every request's sandbox goes through it.
        self.access = Access(sandboxes)
        #: Commands' edge: exec, session commands, named sessions, session state.
        self.command_edge = CommandEdge(cfg, sandboxes, self.commands, self.flow, self.access, self.limits)
        #: Retention's edge: pins, policies, thinning, and why each checkpoint is kept.
        self.retention = RetentionEdge(retention, sandboxes.registry, self._lookup, self._checkpoint)

    # --- access -----------------------------------------------------------------

    def authorize(self, caller: Caller, ref: str) -> str:
        """The id of the sandbox ``ref`` names, if ``caller`` may act on it (``Access.authorize``)."""
        return self.access.authorize(caller, ref)

    async def _lookup(self, caller: Caller, ref: str) -> SandboxRecord:
        """The sandbox ``ref`` names, adopted, if ``caller`` may act on it (``Access.lookup``)."""
        return await self.access.lookup(caller, ref)

    def _checkpoint(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        return readable_checkpoint(self.catalog, caller, ckpt_id)

    async def _checkpoint_anywhere(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        """Like :meth:`_checkpoint`, but one only the remote tier holds is fetched here first."""
        try:
            return self._checkpoint(caller, ckpt_id)
        except CheckpointNotFound:
            fetched = await self.remote.find_or_fetch(caller, ckpt_id)
            if fetched is None:
                raise
            return fetched

    def head_of(self, sandbox_id: str) -> str:
        return self.checkpoints.head_id(sandbox_id) or ""

    def heads(self) -> dict[str, str]:  # every sandbox's non-empty head_of: the caller picks its own
        return self.checkpoints.head_ids()

    # --- daemon ---------------------------------------------------------------------

    def status(self, caller: Caller) -> DaemonStatus:
        return DaemonStatus(
            version=__version__,
            pid=os.getpid(),
            started_at=self.started_at,
            state_dir=str(self.cfg.paths.state_dir),
            socket=str(self.cfg.paths.socket),
            sandboxes=self.sandboxes.count_sandboxes(None if caller.is_root else caller.uid),
            caller_uid=caller.uid,
            docker_version=self.docker_version,
            inspector=self.inspection.name,
            proxy_url=self.proxy_url,
            inspector_why=self.inspection.why,
            inspector_pending=self.inspection.pending,
            remote_store=self.remote.describe(),
            host_id=self.remote.host_id(),
            processes=self.sandboxes.place.count,
            process_restarts=self.process_restarts(),
        )

    def engine_status(self, caller: Caller) -> EngineReport:
        """The host engine's counters (host-wide, no sandbox named), the caller's jobs, and Prometheus text."""
        now = self.engine.clock()
        jobs = [j.to_dict(now) for j in self.engine.jobs(None if caller.is_root else caller.uid)]
        counters, text = self.engine.snapshot(), self.engine.prometheus()
        counters["inspector_process_reads"] = self.inspection.process_reads()
        counters["session_captures"] = self.sandboxes.capture_counts.snapshot()
        counters["session_steps_aside"] = self.sandboxes.capture_counts.stepped_aside
        text += self.inspection.prometheus() + self.sandboxes.capture_counts.prometheus()
        if self.remote.replication is not None:
            counters["remote"] = self.remote.replication.snapshot()
            text += self.remote.replication.prometheus()
        return EngineReport(counters, jobs, text)

    # --- sandboxes ------------------------------------------------------------------

    async def create(self, caller: Caller, spec: SandboxSpec) -> SandboxRecord:
        """A new sandbox (its checkpoint and recovery policies were parsed at the edge: ``api/convert.py``)."""
        command_requests.check_env(self.cfg.limits, spec.env_vars)
        spec = self.limits.resources(spec)
        spec = await self.images.spec_for(caller, spec)  # last: a path's image is loaded only for a valid request
        place = self.sandboxes.place
        if place.count > 1:
            place_create(place, self.sandboxes.registry.shard_loads(place.count))
        with self.quotas.new_sandboxes(caller.uid, 1):
            rec = await self.sandboxes.create(caller.uid, spec)
        await self.inspection.watch(rec, None)
        try:
            await self.checkpoints.after_create(rec)
        except CrabError as exc:
            # The sandbox is usable; its history just starts at the first turn end.
            log.warning("baseline checkpoint failed", extra={"sandbox": rec.id, "error": str(exc)})
        return rec

    async def list_sandboxes(self, caller: Caller) -> list[SandboxRecord]:
        out = []
        for rec in self.sandboxes.list_sandboxes(None if caller.is_root else caller.uid):
            # Not yet adopted after a restart: listed as the registry has it (coordinator/adoption.py);
            # its container is not looked at before its adoption has decided about it.
            # Another crabd process's sandbox likewise: that process alone may decide it died.
            if rec.shard == self.sandboxes.place.index and self.sandboxes.adopted(rec.id):
                rec, _ = await self.sandboxes.refresh(rec)
            out.append(rec)
        return out

    async def get(self, caller: Caller, ref: str) -> SandboxRecord:
        rec, _ = await self.sandboxes.refresh(await self._lookup(caller, ref))
        return rec

    async def stop(self, caller: Caller, ref: str, timeout_s: float) -> SandboxRecord:
        grace = self.limits.stop_timeout(timeout_s)
        rec = await self._lookup(caller, ref)
        await self.flow.settle(rec.id, agent=False)
        return await self.sandboxes.stop(rec, grace)

    async def remove(self, caller: Caller, ref: str, force: bool, keep_checkpoints: bool = False) -> str:
        rec = await self._lookup(caller, ref)
        await self.flow.settle(rec.id, agent=False)
        if keep_checkpoints:
            await self.housekeeping.keep(rec)  # before: start-up prunes what a crash left unforgotten
        await self.sandboxes.remove(rec, force=force)
        self.inspection.forget(rec.id)
        self.flow.forget(rec.id)
        crash_point("remove.before_forget")
        await self.housekeeping.forget_sandbox(rec, keep=keep_checkpoints)
        return rec.id

    # --- turns -------------------------------------------------------------------------

    async def begin_turn(self, caller: Caller, ref: str) -> TurnRecord:
        _, turn = await self.flow.begin_turn(await self._lookup(caller, ref))
        return turn

    async def end_turn(self, caller: Caller, ref: str, *, wait: bool = False, decide: bool = True) -> TurnRecord:
        """End the open turn; its checkpoint runs in the host engine (``wait``: until it is durable).

        ``decide=False``: return before the inspector decides (it decides in the background).
        """
        turn = await self.flow.end_turn(await self._lookup(caller, ref), wait=wait, decide=decide)
        assert turn is not None  # if_open=False: no open turn raised
        return turn

    async def turns(self, caller: Caller, ref: str, limit: int) -> list[TurnRecord]:
        limit = validate.integer(limit, "limit", minimum=0)
        rec = await self._lookup(caller, ref)
        await self.flow.decided(rec.id)  # every ended turn listed with its decision (not its checkpoint)
        # 0 ("all") means all that are kept: never more rows than [quota] turns_kept.
        kept = self.cfg.quota.turns_kept
        return self.sandboxes.registry.list_turns(rec.id, min(limit, kept) if limit else kept)

    # --- checkpoints -------------------------------------------------------------------

    async def create_checkpoint(self, caller: Caller, ref: str, label: str, kind: str) -> CheckpointRecord:
        """A checkpoint now: ``kind`` "fs" or "full" ("": the sandbox's policy decides)."""
        wanted = CheckpointKind.parse(kind) if kind else None
        rec = await self._lookup(caller, ref)
        await self.flow.settle(rec.id)
        return await self.inspection.checkpoint(rec, label=label, kind=wanted)

    async def list_checkpoints(
        self, caller: Caller, ref: str, *, include_remote: bool = False
    ) -> list[CheckpointRecord]:
        """The caller's checkpoints (of one sandbox), flagged ``remote``; with those only the remote tier holds."""
        owner = None if caller.is_root else caller.uid
        sandbox_id: str | None = None
        if ref:
            rec = await self._lookup(caller, ref)
            await self.flow.settle(rec.id, agent=False)  # read-your-writes after a turn end
            sandbox_id = rec.id
            owner = rec.owner_uid  # a sandbox's checkpoints are its owner's (store/identity.py)
        recs = await asyncio.to_thread(self.checkpoints.list_checkpoints, sandbox_id, owner)
        recs = await asyncio.to_thread(self.remote.annotate, recs)
        if include_remote:
            recs += await asyncio.to_thread(self.remote.remote_only, caller, sandbox_id, {r.id for r in recs})
        return await self.retention.annotate(recs)

    async def push_checkpoint(self, caller: Caller, ckpt_id: str) -> tuple[CheckpointRecord, Transfer]:
        """Upload one of the caller's checkpoints to the remote tier now; returns it (remote) and what moved."""
        rec = await asyncio.to_thread(self._checkpoint, caller, ckpt_id)
        transfer = await self.remote.push(rec)
        return self.remote.annotate([rec])[0], transfer

    async def sync_store(self, caller: Caller) -> SyncReport:
        return await self.remote.sync(caller)

    async def describe_checkpoint(self, caller: Caller, ckpt_id: str) -> CheckpointDetail:
        rec = await asyncio.to_thread(self._checkpoint, caller, ckpt_id)
        held = await self.housekeeping.describe(rec, MAX_CHANGES_SHOWN)
        changes, session_json = held.changes, held.session_json
        # A delta blob keeps only the first changes by path when all of them
        # would not fit one metadata blob (backends/overlay/index.py); the
        # stats count all of them, so a short list is known to be short.
        counted = sum(int(v) for k, v in rec.stats.items() if k in ("changed", "deleted") and isinstance(v, int))
        truncated = held.truncated or len(changes) < min(MAX_CHANGES_SHOWN, counted)
        lineage = [c.id for c in await asyncio.to_thread(self.catalog.lineage, rec.id)]
        # Why retention keeps it, as `checkpoint ls` and `pin` say (not "not known").
        rec = (await self.retention.annotate(self.remote.annotate([rec])))[0]
        return CheckpointDetail(rec, changes, truncated, session_json, lineage)

    async def delete_checkpoint(self, caller: Caller, ckpt_id: str) -> int:
        return await self.housekeeping.delete(await asyncio.to_thread(self._checkpoint, caller, ckpt_id))

    async def restore(self, caller: Caller, ref: str, ckpt_id: str, turn: int) -> SandboxRecord:
        turn = validate.integer(turn, "turn", minimum=-1)  # -1: none (a checkpoint is named)
        rec = await self._lookup(caller, ref)
        if ckpt_id:
            ckpt = await self._checkpoint_anywhere(caller, ckpt_id)
        elif turn < 0:
            raise InvalidRequest("name a checkpoint or a turn to restore", hint="e.g. `crabctl restore SB ck-...`")
        await self.flow.before_action(rec)
        if not ckpt_id:
            # After the settle: the turn's own checkpoint, if it was still queued, is durable (or failed) now.
            ckpt = self.checkpoints.resolve_turn(rec, turn)
        if rec.turn_open and rec.state is SandboxState.RUNNING and self.checkpoints.may_restore(rec, ckpt):
            # The state being replaced ends its turn first, so it stays restorable too.
            # A session state over its quota cannot be saved; it must not keep the sandbox from going back.
            with contextlib.suppress(SandboxBusy, QuotaExceeded):
                await self.flow.end_turn(rec, wait=True)
        return await self.restorer.restore(rec, ckpt)

    async def fork(
        self, caller: Caller, ckpt_id: str, ref: str, n: int, prefix: str, turn: int | None = None
    ) -> tuple[str, list[SandboxRecord]]:
        """``n`` new sandboxes from a checkpoint, a sandbox's latest one, or (``turn``) the end of its turn."""
        if ckpt_id and ref:
            raise InvalidRequest("fork either a checkpoint or a sandbox, not both")
        if turn is not None and not ref:
            raise InvalidRequest("fork a turn of a sandbox: name the sandbox with the turn")
        if prefix and not prefix.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InvalidRequest(f"invalid name prefix {prefix!r}: use letters, digits, '_', '.', '-'")
        n = validate.integer(n, "n (sandboxes to fork)", minimum=1, maximum=MAX_FORKS)
        with self.quotas.new_sandboxes(caller.uid, n, fork=True):
            return await self._fork(caller, ckpt_id, ref, n, prefix, turn)

    async def _fork(
        self, caller: Caller, ckpt_id: str, ref: str, n: int, prefix: str, turn: int | None
    ) -> tuple[str, list[SandboxRecord]]:
        if ckpt_id:
            ckpt = await self._checkpoint_anywhere(caller, ckpt_id)
        elif ref:
            rec = await self._lookup(caller, ref)
            await self.flow.settle(rec.id)
            if turn is not None:
                return await self._fork_turn(caller, rec, turn, n, prefix)
            head = self.checkpoints.head_id(rec.id)
            if head is None:
                raise InvalidRequest(
                    f"sandbox {rec.name} has no checkpoint to fork",
                    hint=f"Take one first: `crabctl checkpoint create {rec.name}`.",
                )
            ckpt = self._checkpoint(caller, head)
        else:
            raise InvalidRequest("name a checkpoint or a sandbox to fork")
        return ckpt.id, await self.restorer.fork(caller.uid, ckpt, n, prefix)

    async def _fork_turn(
        self, caller: Caller, rec: SandboxRecord, turn: int, n: int, prefix: str
    ) -> tuple[str, list[SandboxRecord]]:
        ckpt = self.checkpoints.resolve_turn(rec, turn)
        self._checkpoint(caller, ckpt.id)  # the caller may see it (a fork's turn 0 is its origin)
        return ckpt.id, await self.restorer.fork(caller.uid, ckpt, n, prefix)

    async def tree(self, caller: Caller, ref: str, ckpt_id: str) -> TreeView:
        start: SandboxRecord | CheckpointRecord
        if ref:
            start = await self._lookup(caller, ref)
            await self.flow.settle(start.id, agent=False)
        elif ckpt_id:
            start = self._checkpoint(caller, ckpt_id)
        else:
            raise InvalidRequest("name a sandbox or a checkpoint")
        owner = None if caller.is_root else caller.uid
        sandboxes = self.sandboxes.list_sandboxes(owner)
        return await asyncio.to_thread(
            build_tree,
            self.catalog,
            sandboxes,
            start,
            lambda c: caller.is_root or c.owner_uid == caller.uid,
        )

    async def gc(self, caller: Caller) -> GcReport:
        if not caller.is_root:
            raise PermissionDenied(
                "gc sweeps the whole host's checkpoint store; only root may run it",
                uid=caller.uid,
                hint="Run it as root (e.g. `sudo crabctl gc`).",
            )
        return await self.housekeeping.gc()

    async def verify(self, caller: Caller) -> VerifyReport:
        return await self.housekeeping.verify(None if caller.is_root else caller.uid)

    async def failures(self, caller: Caller, ref: str) -> list[CheckpointFailure]:
        if ref:
            rec = await self._lookup(caller, ref)
            await self.flow.settle(rec.id, agent=False)
            # The sandbox's owner's failures only: a sandbox id is never its owner's alone by itself.
            return await asyncio.to_thread(self.catalog.failures, rec.id, owner_uid=rec.owner_uid)
        owner = None if caller.is_root else caller.uid
        visible = {r.id for r in self.sandboxes.list_sandboxes(owner)}
        every = await asyncio.to_thread(self.catalog.failures, None, limit=200, owner_uid=owner)
        return [f for f in every if caller.is_root or f.sandbox_id in visible]

    async def quota(self, caller: Caller, uid: int) -> QuotaUse:
        """``uid``'s use against its quotas (-1: the caller's own; another uid's: root only)."""
        uid = validate.integer(uid, "uid", minimum=-1, maximum=2**32 - 2)
        if uid < 0:
            uid = caller.uid
        if uid != caller.uid and not caller.is_root:
            raise PermissionDenied(f"only root may see another uid's quota (you are uid {caller.uid})", uid=caller.uid)
        return await asyncio.to_thread(self.quotas.use, uid)

    async def import_sandbox(self, caller: Caller, ckpt_id: str, last_turn: int) -> Recovered:
        """Bring a checkpoint's own sandbox to this host (from the remote tier if need be), keeping its identity."""
        last_turn = validate.integer(last_turn, "last_turn", minimum=-1)
        ckpt = await self._checkpoint_anywhere(caller, ckpt_id)
        # Counted against the sandbox's owner, who keeps it (root may move anyone's sandbox).
        with self.quotas.new_sandboxes(ckpt.owner_uid, 1):
            return await self.recovery.arrive(ckpt, last_turn)

    async def recover(self, caller: Caller, ref: str) -> Recovered:
        rec = await self._lookup(caller, ref)
        await self.flow.settle(rec.id, agent=False)
        return await self.recovery.recover(rec)
