"""Per-uid quotas ([quota] in crabd.toml; docs/security.md, "Quotas").

What is counted, per uid (the owner of a sandbox or checkpoint, not whoever
acts on it: root acting on a user's sandbox charges that user):

* ``sandboxes``: sandboxes it owns, plus those its create and fork requests
  are making right now (reserved before any work starts, so two concurrent
  requests can never both pass the check and together exceed the limit);
* ``forks``: sandboxes its in-flight fork requests are making (n per call);
* ``store_bytes``: what its checkpoints and its live sandboxes hold in the
  store: every distinct blob they reference, once, in full
  (``crabd/store/charges.py``).  A checkpoint is refused up front when the
  use is already at the limit, and again after storing (before
  publication) when what it adds to the uid's charge (the blobs it
  references that the uid does not hold yet) would take the use past it;
  what it wrote is then released.  Checkpoints of one uid taken at the same
  moment are checked independently, so together they may overshoot by what
  they add; nothing more.  Forks and restores are not refused on it: their
  heads are charged as they are made, and the uid's next checkpoint is
  refused up front if that took it past the limit.

The sandbox and fork checks and their reservations are one transaction of
the shared database (``store/reservations.py``), which is what makes them
atomic, within one crabd process and across several (``[daemon] workers``).  With ``exempt_root`` (the
default) uid 0 is not limited; its use is still reported.  The session
state and turn history bounds hold for every sandbox, root's included
(``coordinator/turns.py``): they protect the daemon's database.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from crabd.config import QuotaConfig
from crabd.errors import QuotaExceeded
from crabd.store import accounting, reservations
from crabd.store.db import Database


@dataclass(frozen=True)
class QuotaUse:
    """One uid's use against its limits (``limited`` False: exempt, limits shown for information)."""

    uid: int
    limited: bool
    sandboxes: int
    max_sandboxes: int
    forks_in_flight: int
    max_concurrent_forks: int
    store_bytes: int
    max_store_bytes: int
    checkpoints: int
    max_session_state_bytes: int
    turns_kept: int


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


class Quotas:
    def __init__(self, cfg: QuotaConfig, db: Database, *, shard: int = 0) -> None:
        self.cfg = cfg
        self.db = db
        #: The crabd process this is (its reservations are dropped when it restarts).
        self.shard = shard
        #: What holds a uid's store space that retention may not thin (set by the daemon: coordinator/retention.py).
        self.room_hint: Callable[[int], str] | None = None

    def limited(self, uid: int) -> bool:
        return not (uid == 0 and self.cfg.exempt_root)

    # --- sandboxes and forks ----------------------------------------------------------

    @contextlib.contextmanager
    def new_sandboxes(self, uid: int, n: int, *, fork: bool = False) -> Iterator[None]:
        """Reserve ``n`` sandboxes (and, for a fork, ``n`` fork slots) for ``uid`` while the body runs.

        The check and the reservation are one transaction of the shared
        database (``store/reservations.py``), so they hold across crabd's
        processes as they did within one.
        """

        def admit(now: reservations.UidSandboxes) -> None:
            if self.limited(uid):
                self._admit(uid, n, fork, now)

        rid = reservations.reserve(self.db, shard=self.shard, uid=uid, sandboxes=n, forks=n if fork else 0, admit=admit)
        try:
            yield
        finally:
            reservations.release(self.db, rid)

    def _admit(self, uid: int, n: int, fork: bool, now: reservations.UidSandboxes) -> None:
        if fork and now.forking + n > self.cfg.max_concurrent_forks:
            raise QuotaExceeded(
                f"uid {uid} is already forking {now.forking} sandboxes; {n} more would exceed "
                f"its limit of {self.cfg.max_concurrent_forks} sandboxes being forked at once",
                uid=uid,
                quota="max_concurrent_forks",
                limit=self.cfg.max_concurrent_forks,
                used=now.forking,
                requested=n,
                hint="Wait for the forks in progress to finish, or fork fewer at a time.",
            )
        have = now.owned + now.making
        if have + n > self.cfg.max_sandboxes:
            raise QuotaExceeded(
                f"uid {uid} has {have} sandboxes; {n} more would exceed its limit of {self.cfg.max_sandboxes}",
                uid=uid,
                quota="max_sandboxes",
                limit=self.cfg.max_sandboxes,
                used=have,
                requested=n,
                hint="Remove sandboxes you no longer need (`crabctl rm`), or ask root to raise [quota] max_sandboxes.",
            )

    # --- store bytes ------------------------------------------------------------------

    def check_store(self, uid: int, adding: int) -> None:
        """Refuse a checkpoint of ``uid``'s adding ``adding`` bytes past its limit (0: the up-front check).

        Runs in a worker thread (it reads the database) as well as on the loop.
        """
        if not self.limited(uid):
            return
        used = accounting.store_bytes_used(self.db, uid)
        limit = self.cfg.max_store_bytes
        if used >= limit if adding == 0 else used + adding > limit:
            room = self.room_hint(uid) if self.room_hint is not None else ""
            raise QuotaExceeded(
                f"uid {uid}'s checkpoints and sandboxes hold {_size(used)} of the store"
                + (f"; this one adds {_size(adding)}" if adding else "")
                + f": past its limit of {_size(limit)} ({limit} bytes); nothing was stored for it",
                uid=uid,
                quota="max_store_bytes",
                limit=limit,
                used=used,
                requested=adding,
                hint=(room + " " if room else "")
                + "Delete checkpoints you no longer need (`crabctl checkpoint rm`) and sandboxes whose files you"
                " no longer need (`crabctl rm`: a live sandbox's files count), set a retention policy"
                " (`crabctl retention set SB --keep-last N`), or ask root to raise [quota] max_store_bytes."
                "  Earlier checkpoints are intact and the sandbox keeps running.",
            )

    # --- report -----------------------------------------------------------------------

    def use(self, uid: int) -> QuotaUse:
        now = reservations.current(self.db, uid)
        return QuotaUse(
            uid=uid,
            limited=self.limited(uid),
            sandboxes=now.owned + now.making,
            max_sandboxes=self.cfg.max_sandboxes,
            forks_in_flight=now.forking,
            max_concurrent_forks=self.cfg.max_concurrent_forks,
            store_bytes=accounting.store_bytes_used(self.db, uid),
            max_store_bytes=self.cfg.max_store_bytes,
            checkpoints=accounting.checkpoint_count(self.db, uid),
            max_session_state_bytes=self.cfg.max_session_state_bytes,
            turns_kept=self.cfg.turns_kept,
        )
