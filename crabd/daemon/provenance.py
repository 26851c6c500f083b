"""Wiring provenance into the daemon: one key ring, handed to every edge that signs or checks.

At start (``daemon/app.py``), in order:

1. open this host's key ring under ``<state_dir>/trust`` (``crabd/trust/keys.py``; the key is
   made on the first start);
2. hand it to the checkpointer (signs at publication) and the restorer (checks before a
   process image is restored), then sign the checkpoints this host produced before
   provenance existed (``Provenance.backfill``; never what came from an archive or the bucket);
3. hand it to the archives (seal exports, check imports), the remote tier (seal uploads) and
   replication (check fetches) as each is started.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from crabd.coordinator.archives import Archives
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.replication import Replication
from crabd.coordinator.restore import Restorer
from crabd.store.catalog import Catalog
from crabd.store.remote.manifest import Manifest
from crabd.store.remote.tier import RemoteTier
from crabd.trust.keys import KeyRing, open_keyring
from crabd.trust.provenance import Provenance
from crabd.trust.seals import seal_bucket


def open_provenance(state_dir: Path) -> Provenance:
    """Step 1: this host's provenance rules over its key ring."""
    return Provenance(open_keyring(state_dir / "trust", socket.gethostname()[:63]))


async def attach_checkpoints(p: Provenance, checkpointer: Checkpointer, restorer: Restorer, catalog: Catalog) -> int:
    """Step 2; the checkpoints signed now."""
    checkpointer.provenance = p
    restorer.provenance = p
    return await asyncio.to_thread(p.backfill, catalog)


def attach_edges(
    p: Provenance, archives: Archives | None, tier: RemoteTier | None, replication: Replication | None
) -> None:
    """Step 3 (each one that exists)."""
    ring: KeyRing = p.ring
    if archives is not None:
        archives.ring = ring
    if tier is not None:

        def seal(m: Manifest) -> Manifest:
            return seal_bucket(ring, m)

        tier.seal = seal
    if replication is not None:
        replication.ring = ring
