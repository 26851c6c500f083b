"""gc and verify over the blob store and the catalog.

* :func:`collect_garbage` removes every blob file the catalog does not hold
  live, and the debris of interrupted writes.  The caller must hold the
  store lock exclusively (no checkpoint may be between "found this blob
  stored" and "published it").
* :func:`verify` re-hashes live blobs and, for each one that is missing or
  damaged, names the checkpoints and sandbox heads whose state needs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from crabd.errors import CorruptBlob, StoreError
from crabd.store.blobs import BlobStore
from crabd.store.catalog import Catalog
from crabd.util.faults import crash_point


@dataclass
class GcReport:
    blobs_removed: int = 0
    bytes_freed: int = 0
    tmp_bytes_freed: int = 0
    live_blobs: int = 0
    live_bytes: int = 0
    seconds: float = 0.0


@dataclass
class BlobProblem:
    blob: str
    problem: str
    checkpoints: list[str]
    sandboxes: list[str]


@dataclass
class VerifyReport:
    blobs_checked: int = 0
    bytes_checked: int = 0
    problems: list[BlobProblem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def collect_garbage(catalog: Catalog, blobs: BlobStore, *, crash_at: str = "gc.mid") -> GcReport:
    t0 = time.monotonic()
    report = GcReport()
    live = catalog.live_blobs()
    for hex_ in list(blobs.iter_all()):
        if hex_ not in live:
            report.bytes_freed += blobs.remove(hex_)
            report.blobs_removed += 1
            crash_point(crash_at)
    report.tmp_bytes_freed = blobs.clean_tmp(0)
    report.live_blobs = len(live)
    report.live_bytes = sum(b.stored for b in live.values())
    report.seconds = time.monotonic() - t0
    return report


def verify(catalog: Catalog, blobs: BlobStore, only: Iterable[str] | None = None) -> VerifyReport:
    """Re-hash the live blobs (or the live ones among ``only``)."""
    t0 = time.monotonic()
    report = VerifyReport()
    live = catalog.live_blobs()
    todo = sorted(live if only is None else set(only) & set(live))
    for hex_ in todo:
        problem = ""
        try:
            for piece in blobs.iter_content(hex_):
                report.bytes_checked += len(piece)
        except CorruptBlob as exc:
            problem = exc.message
        except StoreError as exc:
            problem = exc.message
        report.blobs_checked += 1
        if problem:
            ckpts, heads = catalog.users_of(hex_)
            report.problems.append(BlobProblem(hex_, problem, ckpts, heads))
    report.seconds = time.monotonic() - t0
    return report


# --- the same work in short steps, for the daemon (see coordinator/housekeeping.py) -----------------

#: Most blob files one :func:`sweep_some` call looks at, and the time after which it stops early:
#: together they bound how long a sweep holds the store lock exclusively.
SWEEP_BATCH = 256
SWEEP_BUDGET_S = 0.05


def gc_candidates(catalog: Catalog, blobs: BlobStore) -> list[str]:
    """Blob files the catalog does not hold live now (listed without the store lock: re-checked by
    :func:`sweep_some` under it)."""
    live = catalog.live_blobs()
    return sorted(h for h in blobs.iter_all() if h not in live)


def sweep_some(catalog: Catalog, blobs: BlobStore, todo: list[str], report: GcReport) -> list[str]:
    """Remove the first of ``todo`` that are still not live; return the rest.

    The caller holds the store lock exclusively, so no checkpoint is between
    "found this blob stored" and "published it": a blob that is not live now
    may go, and one that a checkpoint adopted since the listing is live again
    and stays.
    """
    t0 = time.monotonic()
    done = 0
    for hex_ in todo[:SWEEP_BATCH]:
        if done and time.monotonic() - t0 >= SWEEP_BUDGET_S:
            break
        done += 1
        if not catalog.is_live(hex_):
            report.bytes_freed += blobs.remove(hex_)
            report.blobs_removed += 1
    return todo[done:]


def recheck(catalog: Catalog, blobs: BlobStore, report: VerifyReport) -> None:
    """Keep only the problems that still stand (``report`` was made without the store lock).

    A blob a delete or gc released meanwhile is no longer live and not a
    problem; one that is live now is hashed again (it may have been swept and
    stored anew by a later checkpoint).  The caller holds the store lock shared.
    """
    still = []
    for p in report.problems:
        if not catalog.is_live(p.blob):
            continue
        again = verify(catalog, blobs, [p.blob])
        still.extend(again.problems)
    report.problems = still
