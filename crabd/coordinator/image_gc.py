"""Pinned images: crabd pins each image a sandbox of any image starts from, and collects it once unneeded.

**Pin.**  A create from ``image=...`` (a name, an id, an archive or OCI layout
once loaded) records the image by digest; crabd also tags it
``crab-loaded:<hex>`` (the backend's ``pin_image``), so a user's ``docker rmi``
or re-tag of the name never loses an image a sandbox or checkpoint needs, and
records this instance's claim of it (``store/image_claims.py``: host-wide,
since Docker and the runc exports are shared by every crabd on the host).
Env images (``crab-env/...``) are crab's own builds: never pinned.

**Collect** (:meth:`ImageKeeper.collect`: every ``[images] gc_interval_s`` in
the main process, and ``crabctl image prune``).  A pinned image goes, with the
runc backend's export of it, once

* nothing in this crabd's database names its digest: no sandbox in any state,
  no checkpoint (kept ones of removed sandboxes too), no checkpoint the remote
  tier holds;
* this instance last pinned it more than ``[images] gc_grace_s`` ago (a pin
  without a claim, from before claims existed, counts from Docker's last tag
  time, which a ``docker load`` leaves unset);
* no other live crabd instance claims it (each drops its own claim by the
  same two rules; a claim whose state dir is gone is stale).

**Races.**  A create holds the claims lock shared from its pin to its
registry row (an archive's load: from the load to its pin); a collection
holds it exclusively while it reads the references, decides and removes.  So
a create either comes first and the collection sees its row (or its fresh
pin), or comes after and pins (or loads, or exports) the image again.  A
collection never waits for the lock: while creates hold it, it tries again
next time.  An import of an archive pins the image it names the same way
(its checkpoints are written shortly after, well inside the grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from crabd.backends.sandbox import PinnedImage, SandboxBackend
from crabd.config import ImagesConfig
from crabd.errors import CrabError, ImageError
from crabd.store.db import Database
from crabd.store.image_claims import Claim, ImageClaims, Refs, references
from crabd.vocabulary import PinState

log = logging.getLogger("crabd.images")


@dataclass(frozen=True)
class ImageRow:
    """One pinned image, as ``crabctl image ls`` shows it."""

    digest: str
    size: int
    tags: tuple[str, ...]
    #: When crab last pinned it (this instance's claim, else Docker's last tag time); 0 unknown.
    pinned_at: float
    sandboxes: int
    checkpoints: int
    remote_checkpoints: int
    #: crabd instances that claim it (this one included).
    claims: int
    #: "in use", "grace" (removable from ``removable_at``), "claimed" (by another instance) or "removable".
    state: PinState
    removable_at: float = 0.0


@dataclass
class PruneReport:
    """What one collection did (or, dry, would do)."""

    removed: list[str] = field(default_factory=list)
    #: digest -> why it stays (only those a collection looked at and left: in use ones are not listed).
    left: dict[str, str] = field(default_factory=dict)
    exports_removed: int = 0
    bytes_freed: int = 0
    #: Creates held the claims lock: nothing was looked at; the next collection tries again.
    busy: bool = False
    dry_run: bool = False


def _release_taken(claims: ImageClaims) -> Callable[[asyncio.Future[int]], None]:
    def release(done: asyncio.Future[int]) -> None:
        if not done.cancelled() and done.exception() is None:
            claims.release(done.result())

    return release


class ImageKeeper:
    def __init__(
        self,
        backend: SandboxBackend,
        db: Database,
        claims: ImageClaims,
        cfg: ImagesConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.db = db
        self.claims = claims
        self.cfg = cfg
        self.clock = clock

    # --- pins ---------------------------------------------------------------------------

    def pin(self, image: str) -> str:
        """The digest of ``image``, pinned and claimed (hold :meth:`pinning` around it and the record)."""
        digest = self.backend.pin_image(image)
        self.claims.claim(digest)
        return digest

    def pin_known(self, digest: str) -> bool:
        """Pin an image an archive names by digest, if Docker has it (blocking; takes the lock itself)."""
        try:
            with self.claims.shared():
                self.pin(digest)
        except ImageError:
            return False
        return True

    @contextlib.asynccontextmanager
    async def pinning(self, needed: bool = True) -> AsyncIterator[None]:
        """The claims lock held shared for the body (a create's pin and its record); nothing if not ``needed``."""
        if not needed:
            yield
            return
        taking = asyncio.ensure_future(asyncio.to_thread(self.claims.acquire_shared))
        try:
            fd = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The thread still takes the lock: let it go then, or no collection could ever run again.
            taking.add_done_callback(_release_taken(self.claims))
            raise
        try:
            yield
        finally:
            self.claims.release(fd)

    # --- what stays and what goes -------------------------------------------------------------

    def _judge(
        self, digest: str, pin: PinnedImage | None, claims: list[Claim], refs: Refs | None, now: float
    ) -> tuple[PinState, float]:
        """(state, removable from) of one image, by the module doc's rules."""
        if refs is not None and refs.any:
            return "in use", 0.0
        mine = [c.at for c in claims if c.instance == self.claims.instance]
        last = max(mine) if mine else (pin.pinned_at if pin is not None else 0.0)
        if now < last + self.cfg.gc_grace_s:
            return "grace", last + self.cfg.gc_grace_s
        if any(c.instance != self.claims.instance and not c.stale() for c in claims):
            return "claimed", 0.0
        return "removable", now

    def listing(self, owner_uid: int | None = None) -> list[ImageRow]:
        """Every image crab pinned or claims; counts of ``owner_uid``'s records only if given (blocking)."""
        now = self.clock()
        pins = {p.digest: p for p in self.backend.pinned_images()}
        claims = self.claims.read()
        mine = references(self.db, owner_uid)
        every = mine if owner_uid is None else references(self.db)
        rows = []
        for digest in sorted(set(pins) | set(claims)):
            pin, refs = pins.get(digest), mine.get(digest, Refs())
            state, when = self._judge(digest, pin, claims.get(digest, []), every.get(digest), now)
            own = [c.at for c in claims.get(digest, []) if c.instance == self.claims.instance]
            rows.append(
                ImageRow(
                    digest,
                    pin.size if pin else 0,
                    pin.tags if pin else (),
                    max(own) if own else (pin.pinned_at if pin else 0.0),
                    refs.sandboxes,
                    refs.checkpoints,
                    refs.remote,
                    len(claims.get(digest, [])),
                    state,
                    when,
                )
            )
        return rows

    def adopt(self) -> int:
        """Claim every pinned image this instance's database names (pins from before claims existed)."""
        refs = references(self.db)
        claims = self.claims.read()
        adopted = 0
        for p in self.backend.pinned_images():
            r = refs.get(p.digest)
            if r is not None and r.any and not self._mine(claims.get(p.digest, [])):
                self.claims.claim(p.digest)
                adopted += 1
        return adopted

    def _mine(self, claims: list[Claim]) -> bool:
        return any(c.instance == self.claims.instance for c in claims)

    def collect(self, *, dry_run: bool = False) -> PruneReport:
        """One collection (blocking): every pinned image nothing needs goes (module doc)."""
        report = PruneReport(dry_run=dry_run)
        with self.claims.exclusive() as held:
            if not held:
                report.busy = True
                return report
            now = self.clock()
            # Under the lock: a create's pin and row are either both visible here or neither began.
            refs = references(self.db)
            pins = {p.digest: p for p in self.backend.pinned_images()}
            claims = self.claims.read()
            for digest in sorted(set(pins) | set(claims)):
                pin, held_by = pins.get(digest), claims.get(digest, [])
                state, _ = self._judge(digest, pin, held_by, refs.get(digest), now)
                if state == "in use":
                    if pin is not None and not dry_run and not self._mine(held_by):
                        self.claims.claim(digest)  # named here, pinned, not yet claimed: adopt it
                    continue
                if state == "grace":
                    continue
                if not dry_run:
                    # This instance no longer needs it; neither do instances that are gone.
                    for c in held_by:
                        if c.instance == self.claims.instance or c.stale():
                            self.claims.drop(digest, c.instance)
                if state == "claimed":
                    report.left[digest] = "another crabd instance on this host still claims it"
                    continue
                if dry_run:
                    if pin is not None:
                        report.removed.append(digest)
                    continue
                if pin is None:
                    continue  # a claim of an image Docker no longer pins: the claim was all there was
                self._unpin(pin, report)
        return report

    def _unpin(self, pin: PinnedImage, report: PruneReport) -> None:
        try:
            done = self.backend.unpin_image(pin.digest)
        except CrabError as exc:
            report.left[pin.digest] = exc.message
            log.warning("pinned image not removed", extra={"image": pin.digest, "error": exc.message})
            return
        if not done.untagged:
            report.left[pin.digest] = done.note or "the engine kept it"
            return
        report.removed.append(pin.digest)
        report.exports_removed += int(done.export_removed)
        report.bytes_freed += pin.size if done.deleted else 0
        if done.note:
            report.left[pin.digest] = done.note
        log.info(
            "pinned image removed",
            extra={"image": pin.digest, "deleted": done.deleted, "export_removed": done.export_removed},
        )

    async def run(self) -> None:
        """Collect every ``[images] gc_interval_s`` until cancelled (0: never)."""
        if self.cfg.gc_interval_s <= 0:
            return
        with contextlib.suppress(CrabError, OSError):
            await asyncio.to_thread(self.adopt)
        while True:
            await asyncio.sleep(self.cfg.gc_interval_s)
            try:
                report = await asyncio.to_thread(self.collect)
            except (CrabError, OSError) as exc:  # the next one tries again: nothing is lost but disk
                log.warning("image collection failed", extra={"error": str(exc)})
                continue
            if report.removed:
                log.info("pinned images collected", extra={"images": report.removed, "freed": report.bytes_freed})
