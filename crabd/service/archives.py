"""The service's edge for portable archives: who may export a checkpoint, and what an import may add.

* **Export**: only a checkpoint the caller may read (its own, or any for
  root: ``check_owner``, as for GetCheckpoint).  With ``ancestors``, its
  ancestors on its line go too, as far up as the caller may read them.
* **Import**: the archive's checkpoints become the caller's (owner uid =
  the caller's) and are charged to its store quota: the bytes of the blobs
  this host lacks, checked before anything is written.  Refused: a
  checkpoint id this host has for another uid, a checkpoint whose
  sandbox is a live sandbox of another uid here, and one whose sandbox spec
  (what a fork of it gets: limits, environment) a create request here could
  not ask for (a sandbox of any image: one whose digest Docker here
  lacks).  At most ``[archive] max_concurrent_imports`` imports per uid
  run at once (each holds a staging dir and a worker thread for as long as
  its client streams; with ``[daemon] workers`` each process admits its share),
  refused before anything is read; and what a restore
  of each imported checkpoint would write must fit the uid's store quota
  (``admit_expansion``: a checkpoint it could never hold the files of).

crabd never reads or writes a path the client names: both are streams
(``api/servicer.py``); ``crabctl`` and the SDK do the file I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import AsyncIterator, Iterator

from crabd.coordinator.archives import Archives, Imported, ImportPlan
from crabd.coordinator.sandboxes import SandboxManager
from crabd.errors import ArchiveRejected, CrabError, InvalidRequest, PermissionDenied, QuotaExceeded
from crabd.host.images import REPO_PREFIX
from crabd.models import Caller, CheckpointRecord
from crabd.service.limits import RequestLimits
from crabd.service.quota import Quotas
from crabd.service.remote import check_owner, readable_checkpoint
from crabd.store.archive import MANIFEST_NAME
from crabd.store.catalog import Catalog
from crabd.store.registry import spec_from_json
from crabd.trust.references import Expansion
from crabd.util import validate

#: How crab names its env images (crabd/host/images.py: content-tagged builds of a recipe).
_ENV_IMAGE = re.compile(re.escape(REPO_PREFIX) + r"/[a-z0-9][a-z0-9._-]{0,63}:[a-z0-9]{1,64}")


class ArchiveEdge:
    def __init__(
        self,
        catalog: Catalog,
        sandboxes: SandboxManager,
        quotas: Quotas,
        limits: RequestLimits,
        *,
        max_imports: int = 2,
    ) -> None:
        self.catalog = catalog
        self.sandboxes = sandboxes
        self.quotas = quotas
        self.limits = limits
        self.max_imports = max_imports
        #: Imports running now, by uid (on the event loop: no lock needed).
        self._importing: Counter[int] = Counter()
        #: The coordinator's part, attached by the daemon.
        self.archives: Archives | None = None

    def _need(self) -> Archives:
        if self.archives is None:
            raise InvalidRequest("this crabd cannot export or import archives", hint="Upgrade and restart crabd.")
        return self.archives

    def _line(self, caller: Caller, ckpt_id: str, ancestors: bool) -> list[CheckpointRecord]:
        """The checkpoints to export, parent first: it, and (``ancestors``) those above it the caller may read."""
        rec = readable_checkpoint(self.catalog, caller, ckpt_id)
        if not ancestors:
            return [rec]
        line = self.catalog.lineage(rec.id)
        out: list[CheckpointRecord] = []
        for c in reversed(line):
            if not caller.is_root and c.owner_uid != caller.uid:
                break
            out.append(c)
        return list(reversed(out))

    async def export(self, caller: Caller, ckpt_id: str, ancestors: bool) -> AsyncIterator[bytes]:
        """The archive of one checkpoint (and its ancestors), in chunks."""
        archives = self._need()
        recs = await asyncio.to_thread(self._line, caller, ckpt_id, ancestors)
        async for chunk in archives.export(recs):
            yield chunk

    def _spec_allowed(self, rec: CheckpointRecord) -> None:
        """A fork of the checkpoint gets its spec: hold it to the rules a create request meets here."""
        try:
            spec = spec_from_json(rec.spec_json)
            validate.env_vars(spec.env_vars)
            self.limits.resources(spec)
            # A fork starts the image the record names: one of crab's own env images (the sandbox's
            # env, any build of it), or for a sandbox made from any image (no env) that image's digest,
            # which this host's Docker must have (any member of crab may start any image Docker has:
            # service/images.py); never a name an archive picks to re-point at some other image.
            if not spec.env and validate.IMAGE_DIGEST_RE.match(rec.image):
                # Pinned as a create's image is, so that it stays while these checkpoints need it.
                if not self.sandboxes.images.pin_known(rec.image):
                    raise InvalidRequest(
                        f"it needs the image with digest {rec.image}, which this host's Docker lacks",
                        hint=f"Load that image here first (its id must be {rec.image}), then import again.",
                    )
            elif _ENV_IMAGE.fullmatch(rec.image) is None or rec.image.split("/", 1)[1].split(":")[0] != spec.env:
                raise InvalidRequest(
                    f"its image {rec.image[:200]!r} is not one of crab's env images for env {spec.env[:64]!r}"
                    f" ({REPO_PREFIX}/<env>:<tag>), nor the digest of an image (sha256:<id>) for a sandbox of no env"
                )
        except (CrabError, ValueError, TypeError, KeyError) as exc:
            message = exc.message if isinstance(exc, CrabError) else str(exc)[:300]
            raise ArchiveRejected(
                f"checkpoint {rec.id}'s sandbox spec is not one this host allows: {message}",
                member=MANIFEST_NAME,
                reason="manifest",
            ) from exc

    async def import_archive(self, caller: Caller, chunks: AsyncIterator[bytes]) -> Imported:
        """Import the archive ``chunks`` carry as the caller's checkpoints."""

        def admit(plan: ImportPlan) -> None:
            for rec in plan.present:
                check_owner(caller, rec.owner_uid, rec.id)
            for rec in plan.records:
                sb = self.sandboxes.row(rec.sandbox_id)  # its owner: adoption never changes it
                if sb is not None and sb.id == rec.sandbox_id and sb.owner_uid != caller.uid and not caller.is_root:
                    raise PermissionDenied(
                        f"checkpoint {rec.id} belongs to sandbox {rec.sandbox_id}, which uid {sb.owner_uid}"
                        f" runs on this host, not you (uid {caller.uid}); nothing was imported",
                        uid=caller.uid,
                        checkpoint=rec.id,
                        hint="Import it on another host, or ask that sandbox's owner to import it.",
                    )
                self._spec_allowed(rec)
            if plan.new_bytes:
                self.quotas.check_store(caller.uid, plan.new_bytes)

        def admit_expansion(expansion: dict[str, Expansion]) -> None:
            limit = self.quotas.cfg.max_store_bytes
            for ckpt_id, exp in expansion.items():
                if self.quotas.limited(caller.uid) and exp.bytes > limit:
                    raise ArchiveRejected(
                        f"restoring checkpoint {ckpt_id} would write {exp.bytes} bytes, more than uid"
                        f" {caller.uid}'s store quota of {limit} bytes could ever hold",
                        member=MANIFEST_NAME,
                        reason="bounds",
                    )

        archives = self._need()
        with self._one_import(caller):
            return await archives.import_archive(chunks, caller.uid, admit, admit_expansion)

    @property
    def process_max_imports(self) -> int:
        """This process's share of ``max_imports`` (at least 1).

        The count is per process: with ``[daemon] workers`` K each would admit the whole limit
        and a uid could run K times as many imports at once.  Read at each import: the daemon
        sets ``sandboxes.place`` after the service is made.
        """
        return max(1, self.max_imports // max(1, self.sandboxes.place.count))

    @contextlib.contextmanager
    def _one_import(self, caller: Caller) -> Iterator[None]:
        """Count one import of ``caller`` while the body runs; QuotaExceeded past this process's ``max_imports``."""
        uid = caller.uid
        limit = self.process_max_imports
        if self._importing[uid] >= limit:
            raise QuotaExceeded(
                f"uid {uid} is already importing {self._importing[uid]} archives, its limit at once;"
                " nothing was read of this one",
                uid=uid,
                quota="max_concurrent_imports",
                limit=limit,
                used=self._importing[uid],
                requested=1,
                hint="Wait for your imports in progress to finish, then import again"
                " ([archive] max_concurrent_imports).",
            )
        self._importing[uid] += 1
        try:
            yield
        finally:
            self._importing[uid] -= 1
            self._importing = +self._importing
