"""Key distribution for tests of several crabds: what an operator does with the cluster's mTLS material.

Each crabd makes its host key at its first start (``<state_dir>/trust/host.pub``, crabd/trust/keys.py);
hosts that exchange checkpoints with their processes (the bucket, migration, archives) trust each other's
keys by a root-owned copy in ``<state_dir>/trust/trusted/``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from crabd.sdk import EmbeddedDaemon
from crabd.trust.keys import PUB_FILE, TRUSTED_DIR


def trust_each_other(daemons: Iterable[EmbeddedDaemon]) -> None:
    """Every one of ``daemons`` (started) trusts every other's key from now on (no restart needed)."""
    ds = list(daemons)
    for d in ds:
        for peer in ds:
            if peer is d:
                continue
            dst = d.state_dir / "trust" / TRUSTED_DIR / f"peer-{peer.state_dir.parent.name}.pub"
            shutil.copyfile(peer.state_dir / "trust" / PUB_FILE, dst)
            os.chmod(dst, 0o644)
