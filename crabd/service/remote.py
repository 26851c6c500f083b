"""The service's edge for the remote tier: who may push, sync, list and fetch remote checkpoints.

Ownership follows the local rules: a caller sees and fetches only the
checkpoints of its own uid (root sees all), judged on the manifest before any
blob moves.  Uids are assumed to mean the same users on every host of a
cluster (docs/remote.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from crabd.coordinator.replication import Replication
from crabd.errors import CheckpointNotFound, InvalidRequest, PermissionDenied
from crabd.models import Caller, CheckpointRecord
from crabd.service import refs
from crabd.store.catalog import Catalog
from crabd.store.remote.manifest import record_from_meta, valid_checkpoint_id
from crabd.store.remote.tier import SyncReport, Transfer

_NO_TIER = "this crabd has no remote tier"
_NO_TIER_HINT = "Configure [remote] in crabd.toml (endpoint_url, bucket) and restart crabd; see docs/remote.md."


def check_owner(caller: Caller, owner_uid: int, ckpt_id: str) -> None:
    """PermissionDenied unless ``caller`` may use a checkpoint of ``owner_uid`` (its own, or root)."""
    if not caller.is_root and owner_uid != caller.uid:
        raise PermissionDenied(
            f"checkpoint {ckpt_id!r} belongs to uid {owner_uid}, not to you (uid {caller.uid})",
            uid=caller.uid,
            checkpoint=ckpt_id,
        )


def readable_checkpoint(catalog: Catalog, caller: Caller, ckpt_id: str) -> CheckpointRecord:
    """The local checkpoint ``ckpt_id`` if ``caller`` may use it (else InvalidRequest, NotFound, PermissionDenied).

    ``ckpt_id`` may be a unique prefix of the id of one of the caller's checkpoints (``refs``).
    """
    if not ckpt_id:
        raise InvalidRequest("no checkpoint named in the request")
    rec = catalog.find(ckpt_id)
    if rec is None and refs.maybe_checkpoint_prefix(ckpt_id):
        mine = catalog.list_checkpoints(owner_uid=None if caller.is_root else caller.uid)
        full = refs.unique(ckpt_id, (c.id for c in mine), "checkpoint")
        rec = catalog.find(full) if full else None
    if rec is None:
        raise CheckpointNotFound(f"no checkpoint {ckpt_id!r}", checkpoint=ckpt_id)
    check_owner(caller, rec.owner_uid, ckpt_id)
    return rec


def _allowed(caller: Caller, ckpt_id: str) -> Callable[[int], None]:
    return lambda owner_uid: check_owner(caller, owner_uid, ckpt_id)


class RemoteCheckpoints:
    def __init__(self, catalog: Catalog, replication: Replication | None = None) -> None:
        self.catalog = catalog
        self.replication = replication

    @property
    def configured(self) -> bool:
        return self.replication is not None

    def describe(self) -> str:
        return self.replication.tier.describe() if self.replication is not None else ""

    def host_id(self) -> str:
        return self.replication.tier.host if self.replication is not None else ""

    def _need(self) -> Replication:
        if self.replication is None:
            raise InvalidRequest(_NO_TIER, hint=_NO_TIER_HINT)
        return self.replication

    # --- listing ----------------------------------------------------------------------

    def annotate(self, recs: list[CheckpointRecord]) -> list[CheckpointRecord]:
        """``recs`` with their ``remote`` flag (and the host that took the imported ones)."""
        if self.replication is None or not recs:
            return recs
        remote = self.replication.is_remote([r.id for r in recs])
        return [replace(r, remote=r.id in remote, host=str(r.stats.get("imported_from") or "")) for r in recs]

    def remote_only(self, caller: Caller, sandbox_id: str | None, local: set[str]) -> list[CheckpointRecord]:
        """Checkpoints the caller may see that only the remote tier holds (as of the last sync);
        ``local``: the ids of the caller's local ones (already listed)."""
        if self.replication is None:
            return []
        entries = self.replication.tier.state.entries(
            sandbox_id=sandbox_id, owner_uid=None if caller.is_root else caller.uid
        )
        return [record_from_meta(e.meta) for e in entries if e.id not in local]

    # --- fetching ----------------------------------------------------------------------

    async def find_or_fetch(self, caller: Caller, ckpt_id: str) -> CheckpointRecord | None:
        """The checkpoint from the remote tier (fetched and adopted here), or None when there is no tier."""
        if self.replication is None:
            return None
        if not valid_checkpoint_id(ckpt_id):
            raise CheckpointNotFound(f"no checkpoint {ckpt_id!r}", checkpoint=ckpt_id)
        return await self.replication.fetch(ckpt_id, _allowed(caller, ckpt_id))

    # --- pushing and syncing --------------------------------------------------------------

    async def push(self, rec: CheckpointRecord) -> Transfer:
        """Upload ``rec`` now (its owner checked by the caller) and wait until it is remote."""
        return await self._need().push(rec)

    async def sync(self, caller: Caller) -> SyncReport:
        if not caller.is_root:
            raise PermissionDenied("only root may re-read the remote store's catalog", uid=caller.uid, checkpoint="")
        return await self._need().sync()
