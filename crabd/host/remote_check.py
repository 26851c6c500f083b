"""`crabctl doctor`'s look at the remote tier: is the bucket reachable, and is the upload backlog draining?"""

from __future__ import annotations

import sqlite3
import time

from crabd.config import CrabConfig
from crabd.errors import CrabError
from crabd.host import checks
from crabd.host.checks import Check
from crabd.store.remote.s3 import S3ObjectStore

#: A checkpoint not uploaded this long after it was taken means uploads are not keeping up (or failing).
STALE_S = 300.0


def check_remote(cfg: CrabConfig) -> Check:
    r = cfg.remote
    if not r.enabled:
        return checks.ok("remote", "no remote tier ([remote] enabled = false): checkpoints stay on this host")
    try:
        with S3ObjectStore(r) as objects:
            where = objects.describe()
            next(iter(objects.list("checkpoints/")), None)
    except CrabError as exc:
        return checks.fail("remote", f"the remote tier is not usable: {exc.message}", exc.hint)
    backlog, oldest = _backlog(cfg)
    if backlog and oldest is not None and time.time() - oldest > STALE_S:
        return checks.warn(
            "remote",
            f"{where} reachable, but {backlog} checkpoint(s) are not uploaded; the oldest was taken "
            f"{(time.time() - oldest) / 60:.0f} min ago",
            "see `crabctl engine --json` (remote.last_error) and the crabd log; uploads retry on their own",
        )
    return checks.ok("remote", f"{where} reachable; {backlog} checkpoint(s) waiting for upload")


def _backlog(cfg: CrabConfig) -> tuple[int, float | None]:
    """Local checkpoints not in the remote tier yet, and when the oldest was taken (read-only)."""
    db = cfg.paths.state_dir / "registry.db"
    if not db.exists():
        return 0, None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            row = conn.execute(
                "SELECT COUNT(*), MIN(created_at) FROM checkpoints"
                " WHERE id NOT IN (SELECT checkpoint_id FROM remote_index)"
            ).fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return 0, None  # crabd has not created the remote tables yet
    return int(row[0]), None if row[1] is None else float(row[1])
