"""btrfs subvolumes and snapshots for the runc backend (layout: :mod:`.layout`; guarantees: docs/btrfs.md)."""

from __future__ import annotations

from crabd.backends.btrfs.layout import SubvolKind, SubvolRef, validate_id
from crabd.backends.btrfs.pool import POOL_FULL_HINT, Changes, Pool, PoolOp, PoolUsage

__all__ = ["POOL_FULL_HINT", "Changes", "Pool", "PoolOp", "PoolUsage", "SubvolKind", "SubvolRef", "validate_id"]
