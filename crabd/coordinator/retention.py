"""Retention: thinning each sandbox's history by its policy, in the background, never losing a line.

Which checkpoints a policy keeps, and why, is ``retention_rules.py``; this
module applies it:

* **When.**  After each checkpoint is published, a *thin* job for its
  sandbox goes to the host engine's background lane (beside uploads: it
  starts only when no checkpoint job is ready, never makes the sandbox
  busy, and one per sandbox is queued at most).  ``crabctl checkpoint thin``
  runs it at once.  And before a checkpoint of a uid whose store use has
  passed ``[retention] quota_trigger`` of its quota, every sandbox of that
  uid is thinned first (:meth:`Retention.make_room`), so a quota makes room
  rather than refusing; when it still refuses, :meth:`Retention.room_hint`
  names what is holding the space.
* **How.**  Batches of at most ``[retention] batch`` checkpoints, each
  batch chosen and deleted in one catalog transaction under the store lock
  held exclusively (``Housekeeper.delete_chosen``): no checkpoint, restore
  or fork is in flight while it runs, checkpoints being restored, forked or
  exported are skipped (``leases.py``), and a crash leaves a batch whole or
  not begun.  Deletion re-parents children exactly as ``crabctl checkpoint
  rm`` does, and the blobs only the batch used are swept afterwards in
  short holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from crabd.config import QuotaConfig, RetentionConfig
from crabd.coordinator.housekeeping import Housekeeper
from crabd.coordinator.leases import Leases
from crabd.coordinator.retention_rules import Verdict, to_thin, verdict
from crabd.coordinator.sandboxes import SandboxManager
from crabd.engine.engine import HostEngine
from crabd.engine.jobs import JobControl, Outcome
from crabd.errors import CrabError, EngineStopped
from crabd.models import CheckpointRecord, KeepReason, RetentionPolicy, SandboxRecord
from crabd.store import accounting, lineage
from crabd.store.catalog import Catalog

log = logging.getLogger("crabd.retention")

#: Checkpoints a quota refusal names as holding space.
HINT_ENTRIES = 5


@dataclass
class ThinReport:
    """What one thinning of one sandbox did (or, dry, would do)."""

    sandbox_id: str
    policy: RetentionPolicy | None
    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept: int = 0
    dry_run: bool = False


class Retention:
    def __init__(
        self,
        catalog: Catalog,
        sandboxes: SandboxManager,
        housekeeping: Housekeeper,
        leases: Leases,
        cfg: RetentionConfig,
        quota: QuotaConfig,
    ) -> None:
        self.catalog = catalog
        self.sandboxes = sandboxes
        self.housekeeping = housekeeping
        self.leases = leases
        self.cfg = cfg
        self.quota = quota
        self.default = cfg.policy()
        #: Set once the host engine runs; until then nothing is scheduled.
        self.engine: HostEngine | None = None
        self._queued: set[str] = set()
        self.stats = {"thin_runs": 0, "thinned": 0, "bytes_freed": 0}

    # --- policy and explanation ------------------------------------------------------

    def policy_of(self, sandbox_id: str) -> RetentionPolicy | None:
        """A live sandbox's policy (its own, else the daemon's default); None if it is not live."""
        rec = self.sandboxes.row(sandbox_id)
        return None if rec is None else self._policy(rec)

    def _policy(self, rec: SandboxRecord) -> RetentionPolicy:
        return rec.spec.retention if rec.spec.retention is not None else self.default

    def _verdict(self, view: lineage.Lineage) -> Verdict:
        """Why each checkpoint of ``view`` is kept, its sandboxes read once each."""
        live = {r.id: r for s in {n.sandbox_id for n in view.nodes.values()} if (r := self.sandboxes.row(s))}
        policies = {sid: self._policy(r) for sid, r in live.items()}
        # A sandbox's policy governs its owner's checkpoints only: another uid's that carry the same
        # sandbox id (kept from before the id ledger, store/identity.py) are judged as kept ones.
        own, foreign = lineage.split_by_owner(view, {sid: r.owner_uid for sid, r in live.items()})
        held = self.leases.held()
        out = verdict(own, live, policies.get, now=time.time(), in_use=held)
        out.update(verdict(foreign, (), policies.get, now=time.time(), in_use=held))
        return out

    def explain(self, recs: list[CheckpointRecord]) -> dict[str, list[KeepReason]]:
        """Why each of ``recs`` is kept (an empty list: the next thinning deletes it).  Blocking."""
        sandboxes = sorted({r.sandbox_id for r in recs})
        if not sandboxes:
            return {}
        return self._verdict(lineage.read(self.catalog.db, sandbox_ids=sandboxes))

    # --- thinning --------------------------------------------------------------------

    async def thin(self, sandbox_id: str, *, dry_run: bool = False) -> ThinReport:
        """Thin one sandbox's checkpoints by its policy (steps in the module doc)."""
        report = ThinReport(sandbox_id, self.policy_of(sandbox_id), dry_run=dry_run)

        def choose() -> list[str]:
            rec = self.sandboxes.row(sandbox_id)
            view = lineage.read(self.catalog.db, sandbox_ids=[sandbox_id], owner_uid=rec.owner_uid if rec else None)
            doomed = to_thin(view, self._verdict(view))
            report.kept = len(view.nodes) - len(doomed)
            return doomed if dry_run else doomed[: self.cfg.batch]

        if dry_run:
            report.deleted = await asyncio.to_thread(choose)
            return report
        while True:
            deleted, freed = await self.housekeeping.delete_chosen(choose)
            if not deleted:
                break
            report.deleted += deleted
            report.bytes_freed += freed
        self.stats["thin_runs"] += 1
        self.stats["thinned"] += len(report.deleted)
        self.stats["bytes_freed"] += report.bytes_freed
        if report.deleted:
            log.info(
                "checkpoints thinned",
                extra={
                    "sandbox": sandbox_id,
                    "deleted": len(report.deleted),
                    "kept": report.kept,
                    "freed": report.bytes_freed,
                },
            )
        return report

    def published(self, ckpt: CheckpointRecord) -> None:
        """``Checkpointer.on_published``: a new checkpoint may leave older ones to thin."""
        self.schedule(ckpt.sandbox_id, ckpt.owner_uid)

    def schedule(self, sandbox_id: str, owner_uid: int) -> None:
        """Queue a background thinning of ``sandbox_id``, if its policy thins and none is queued yet."""
        policy = self.policy_of(sandbox_id)
        if self.engine is None or policy is None or not policy.active or sandbox_id in self._queued:
            return

        async def work(_ctl: JobControl) -> Outcome:
            self._queued.discard(sandbox_id)
            if self.sandboxes.row(sandbox_id) is None:
                return Outcome(None)
            await self.thin(sandbox_id)
            return Outcome(None)

        try:
            self.engine.submit_background(sandbox_id, work, owner_uid=owner_uid, kind="thin")
        except EngineStopped:
            return
        self._queued.add(sandbox_id)

    # --- quotas ----------------------------------------------------------------------

    def near_quota(self, uid: int, sandbox_id: str = "") -> bool:
        """Whether ``uid``'s store use, plus what ``sandbox_id``'s next checkpoint may add, passes the trigger.

        The next checkpoint is estimated by the largest of the sandbox's last
        few (a turn tends to change what the turns before it changed).
        """
        if uid == 0 and self.quota.exempt_root:
            return False
        used = accounting.store_bytes_used(self.catalog.db, uid)
        expect = accounting.recent_new_bytes(self.catalog.db, sandbox_id) if sandbox_id else 0
        return used + expect >= self.cfg.quota_trigger * self.quota.max_store_bytes

    async def make_room(self, uid: int, sandbox_id: str = "") -> list[ThinReport]:
        """Before a checkpoint of ``uid``'s ``sandbox_id``: near the quota, thin all of ``uid``'s sandboxes now."""
        if not await asyncio.to_thread(self.near_quota, uid, sandbox_id):
            return []
        out = []
        for rec in self.sandboxes.list_sandboxes(uid):
            if self._policy(rec).active:
                try:
                    out.append(await self.thin(rec.id))
                except CrabError as exc:
                    log.warning("thinning before a checkpoint failed", extra={"sandbox": rec.id, "why": exc.message})
        freed = sum(r.bytes_freed for r in out)
        log.info("store quota near: sandboxes thinned", extra={"uid": uid, "sandboxes": len(out), "freed": freed})
        return out

    def room_hint(self, uid: int) -> str:
        """What holds ``uid``'s store space that retention may not thin, for a quota refusal.  Blocking."""
        view = lineage.read(self.catalog.db, owner_uid=uid)
        result = self._verdict(view)
        held = sorted(
            (n for n in view.nodes.values() if result.get(n.id) and n.new_bytes > 0),
            key=lambda n: -n.new_bytes,
        )
        lines = []
        for n in held[:HINT_ENTRIES]:
            reasons = result[n.id]
            how = (
                f"`crabctl checkpoint unpin {n.id}`"
                if KeepReason.PINNED in reasons
                else f"`crabctl checkpoint rm {n.id}`"
            )
            why = ", ".join(r.value for r in reasons)
            lines.append(f"{n.id} (turn {n.turn}, {_mib(n.new_bytes)}, kept: {why}): {how}")
        mine = self.sandboxes.list_sandboxes(uid)
        unpoliced = sorted(r.name for r in mine if not self._policy(r).active)
        text = ""
        if lines:
            text += "Largest checkpoints retention keeps: " + "; ".join(lines) + "."
        if unpoliced:
            text += (
                f" Sandboxes with no retention policy (everything kept): {', '.join(unpoliced[:HINT_ENTRIES])}"
                f" — e.g. `crabctl retention set {unpoliced[0]} --keep-last 50`."
            )
        if mine:
            # Heads are charged too (store/charges.py): deleting checkpoints cannot free what a
            # live sandbox's current files still reference.
            names = ", ".join(sorted(r.name for r in mine)[:HINT_ENTRIES])
            text += f" Your {len(mine)} sandboxes' current files count while they exist ({names}): `crabctl rm` one."
        return text.strip()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
