"""Who may list and collect crab's pinned images (``coordinator/image_gc.py``; ``crabctl image ls|prune``).

Listing: any caller (any member of group crab may start any image the host's
Docker has: docs/security.md, "Images"); the counts of sandboxes and
checkpoints are the caller's own unless the caller is root, so one tenant
does not read another's activity off them.  Collecting removes images from
the host's Docker for everyone: root only, as ``crabctl gc`` is.
"""

from __future__ import annotations

import asyncio

from crabd.coordinator.image_gc import ImageKeeper, ImageRow, PruneReport
from crabd.errors import PermissionDenied
from crabd.models import Caller


class PinnedImages:
    def __init__(self, keeper: ImageKeeper) -> None:
        self.keeper = keeper

    async def listing(self, caller: Caller) -> list[ImageRow]:
        return await asyncio.to_thread(self.keeper.listing, None if caller.is_root else caller.uid)

    async def prune(self, caller: Caller, *, dry_run: bool) -> PruneReport:
        if not caller.is_root:
            raise PermissionDenied(
                "pruning removes images from the whole host's Docker; only root may run it",
                uid=caller.uid,
                hint="Run it as root (e.g. `sudo crabctl image prune`); crabd also collects by itself"
                " ([images] gc_interval_s).",
            )
        return await asyncio.to_thread(self.keeper.collect, dry_run=dry_run)
