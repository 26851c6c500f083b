"""The remote tier: copies of published checkpoints in an S3-compatible bucket.

Layout and manifest format: ``store/remote/manifest.py``.  This module moves
data; *when* it moves (uploads at low priority through the host engine,
retries, fetches before a restore) is the coordinator's (``coordinator/replication.py``).

Upload of one checkpoint, in order (a crash at any step leaves it not
``remote``, and the next attempt redoes only what is missing):

1. its closure (every blob it needs) from the catalog's reference graph;
2. the blobs the bucket is not known to hold, verified as they are read and
   put with ``If-None-Match: *`` (another host's copy of the same content
   answers "already there");
3. the manifest, last, also by conditional put;
4. a ``remote_index`` row: the checkpoint is ``remote``.

Fetch of one checkpoint onto this host:

1. its manifest, parsed as untrusted input (``manifest.decode``);
2. every blob not already charged to the checkpoint's owner here (held by
   a checkpoint of that uid), in parallel — a blob another tenant holds is
   fetched and verified all the same, so a manifest cannot borrow it and a
   fetch's outcome does not tell whether it exists here.  Each object is
   read up to the largest frame its declared size can make (a manifest
   claiming 10 bytes never reads 10 GB), its content hashed as it is stored
   and must match its address and be exactly the declared size
   (``CorruptBlob`` otherwise, and nothing is imported); a blob the bucket
   lacks is an error that names the checkpoint.  Then the coordinator checks
   the references the checkpoint's metadata makes (``crabd/trust/references.py``)
   and removes what it fetched if they are refused;
3. the fetched blobs made durable;
4. one catalog transaction adopts the checkpoint (no sandbox's head moves).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import zstandard

from crabd.errors import CheckpointNotFound, CorruptBlob, RemoteObjectMissing, StoreError
from crabd.models import CheckpointRecord
from crabd.store.blobs import BlobStore
from crabd.store.catalog import Catalog, direct_refs
from crabd.store.remote import manifest as mf
from crabd.store.remote.objects import ObjectStore
from crabd.store.remote.state import RemoteState

log = logging.getLogger("crabd.remote")

#: Blobs bigger than this move one at a time (each is held in memory, compressed, while it moves).
BIG_BLOB = 64 << 20


@dataclass
class Transfer:
    """What one upload or fetch moved."""

    checkpoint_id: str
    #: Blobs the checkpoint needs, and how many of them had to move.
    blobs: int = 0
    moved: int = 0
    #: Compressed bytes sent or received (manifest included).
    bytes: int = 0
    seconds: float = 0.0
    #: Blob puts the bucket answered with "already there" (another host or an earlier attempt).
    already_there: int = 0
    #: A fetch: the blobs it read from the bucket, those it created in the local store (not there
    #: before), and those it did not read because the owner holds them here.
    fetched: set[str] = field(default_factory=set)
    created: list[str] = field(default_factory=list)
    owned: set[str] = field(default_factory=set)


@dataclass
class SyncReport:
    """What ``crabctl store sync`` found in the bucket."""

    manifests: int = 0
    added: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


class RemoteTier:
    def __init__(
        self,
        objects: ObjectStore,
        blobs: BlobStore,
        catalog: Catalog,
        state: RemoteState,
        *,
        host: str,
        upload_concurrency: int = 4,
        fetch_concurrency: int = 8,
        max_object_bytes: int = 1 << 30,
        zstd_level: int = 3,
    ) -> None:
        self.objects = objects
        self.blobs = blobs
        self.catalog = catalog
        self.state = state
        self.host = host
        self.max_object_bytes = max_object_bytes
        self._level = zstd_level
        self._up = ThreadPoolExecutor(upload_concurrency, thread_name_prefix="crab-upload")
        self._down = ThreadPoolExecutor(fetch_concurrency, thread_name_prefix="crab-fetch")
        # Big blobs are held whole in memory while they move: one at a time.
        self._big = threading.Semaphore(1)
        #: Seals each uploaded manifest with this host's key (crabd/trust/seals.py, set by the daemon).
        self.seal: Callable[[mf.Manifest], mf.Manifest] | None = None

    def close(self) -> None:
        self._up.shutdown(wait=True, cancel_futures=True)
        self._down.shutdown(wait=True, cancel_futures=True)
        self.objects.close()

    def describe(self) -> str:
        return self.objects.describe()

    # --- upload --------------------------------------------------------------------------

    def upload(self, ckpt_id: str) -> Transfer:
        """Make ``ckpt_id`` remote (steps in the module doc); a no-op if it already is."""
        t0 = time.monotonic()
        out = Transfer(ckpt_id)
        if self.state.remote_of([ckpt_id]):
            return out
        rec = self.catalog.get(ckpt_id)
        sizes, edges = self.state.closure(direct_refs(rec))
        missing = direct_refs(rec) - sizes.keys()
        if missing:
            # Deleted between the lookup and the walk: nothing to upload.
            raise CheckpointNotFound(f"checkpoint {ckpt_id} was deleted before its upload", checkpoint=ckpt_id)
        out.blobs = len(sizes)
        todo = sorted(sizes.keys() - self.state.known_blobs(sizes))
        for moved, created in self._up.map(self._put_blob, todo, [sizes[b] for b in todo]):
            out.bytes += moved
            out.moved += 1
            out.already_there += 0 if created else 1
        self.state.add_blobs(todo)
        m = mf.build(rec, self.host, sizes, edges)
        if self.seal is not None:
            m = self.seal(m)
        data = mf.encode(m)
        self.objects.put_if_absent(mf.manifest_key(rec.id), data)
        out.bytes += len(data)
        self.state.record(mf.manifest_meta(m))
        out.seconds = time.monotonic() - t0
        return out

    def _put_blob(self, hex_: str, size: int) -> tuple[int, bool]:
        """Put one blob (read verified, compressed as the local store does); (bytes sent, whether it was new)."""
        with self._big if size > BIG_BLOB else contextlib.nullcontext():
            data = self._compress(self.blobs.iter_content(hex_), size)
            return len(data), self.objects.put_if_absent(mf.blob_key(hex_), data)

    def _compress(self, pieces: Iterator[bytes], size: int) -> bytes:
        # One call: the frame records the content size, as the local store's frames do.  A big
        # blob is held whole (twice) meanwhile; _put_blob lets only one at a time do that.
        return zstandard.ZstdCompressor(level=self._level).compress(b"".join(pieces))

    # --- fetch ---------------------------------------------------------------------------

    def manifest(self, ckpt_id: str) -> mf.Manifest:
        """The checkpoint's manifest from the bucket (CheckpointNotFound if the bucket has none)."""
        try:
            data = self.objects.get(mf.manifest_key(ckpt_id), limit=mf.MAX_MANIFEST_BYTES)
        except RemoteObjectMissing as exc:
            raise CheckpointNotFound(
                f"no checkpoint {ckpt_id!r} here or in the remote store {self.describe()}", checkpoint=ckpt_id
            ) from exc
        return mf.decode(data, expect_id=ckpt_id)

    def fetch(self, m: mf.Manifest, out: Transfer | None = None) -> Transfer:
        """Bring every blob of ``m`` the owner does not hold here into the local store, verified and durable.

        ``out`` (the caller's, so that it is readable after an exception) lists
        the blobs the fetch created: the caller removes them, under the store
        lock's exclusive side, if the checkpoint is not adopted.
        """
        t0 = time.monotonic()
        ckpt_id = m.checkpoint.id
        out = out if out is not None else Transfer(ckpt_id)
        out.blobs = len(m.blobs)
        # Only what the owner already holds here is not read again (see step 2 of the module doc).
        out.owned = self.catalog.owned_blobs(m.checkpoint.owner_uid) & m.blobs.keys()
        todo = sorted(m.blobs.keys() - out.owned)
        out.fetched = set(todo)
        futures = [self._down.submit(self._get_blob, ckpt_id, b, m.blobs[b], out.created) for b in todo]
        try:
            for f in futures:
                out.bytes += f.result()
                out.moved += 1
        except BaseException:
            # No fetch may still be writing once this returns (the caller drops the store lock).
            for f in futures:
                f.cancel()
            wait(futures)
            raise
        self.blobs.sync(todo)
        self.state.add_blobs(m.blobs)
        out.seconds = time.monotonic() - t0
        return out

    def _get_blob(self, ckpt_id: str, hex_: str, size: int, created: list[str]) -> int:
        """Fetch one blob into the local store (appended to ``created`` if it is new there); the bytes received."""
        with self._big if size > BIG_BLOB else contextlib.nullcontext():
            try:
                # No frame of ``size`` bytes is larger than zstd's compress bound: a manifest that claims
                # little for a huge object reads little of it.
                data = self.objects.get(mf.blob_key(hex_), limit=min(self.max_object_bytes, frame_bound(size)))
            except RemoteObjectMissing as exc:
                raise StoreError(
                    f"checkpoint {ckpt_id} cannot be fetched: its manifest names blob {hex_},"
                    f" which the remote store {self.describe()} does not have",
                    hint="The remote copy of this checkpoint is incomplete; restore another checkpoint.",
                ) from exc
            put = self.blobs.put_pieces(_decompressed(data, hex_, ckpt_id, size))
            if put.hex == hex_ and put.new:
                created.append(hex_)  # list.append is atomic: fetch threads share the list
            if put.hex != hex_ or put.size != size:
                if put.new and put.hex != hex_:
                    self.blobs.remove(put.hex)
                raise CorruptBlob(
                    f"the remote store's copy of blob {hex_} (checkpoint {ckpt_id}) does not match its hash"
                    f" or is not the {size} bytes its manifest says",
                    blob=hex_,
                    checkpoints=[ckpt_id],
                    hint=_FETCH_HINT,
                )
            return len(data)

    def adopt(self, m: mf.Manifest) -> CheckpointRecord:
        """Step 4: the fetched checkpoint in the local catalog (its parent kept only if this host has it)."""
        parent = m.checkpoint.parent_id
        rec = m.record(parent_id=parent if parent and self.catalog.find(parent) else None)
        self.catalog.adopt(
            rec,
            lambda b: m.edges.get(b, ()),
            lambda b: (m.blobs.get(b, 0), self.blobs.stored_size(b)),
        )
        self.state.record(mf.manifest_meta(m))
        return rec

    # --- the bucket's catalog ----------------------------------------------------------------

    def sync(self) -> SyncReport:
        """Make ``remote_index`` say what the bucket holds: add manifests it lacks, forget ones gone."""
        report = SyncReport()
        present: set[str] = set()
        for key in self.objects.list(mf.MANIFEST_PREFIX):
            name = key.removeprefix(mf.MANIFEST_PREFIX)
            if not name.endswith(mf.MANIFEST_SUFFIX):
                continue
            ckpt_id = name.removesuffix(mf.MANIFEST_SUFFIX)
            if mf.valid_checkpoint_id(ckpt_id):
                present.add(ckpt_id)
        report.manifests = len(present)
        known = self.state.known_ids()
        for ckpt_id in sorted(present - known):
            try:
                self.state.record(mf.manifest_meta(self.manifest(ckpt_id)))
                report.added.append(ckpt_id)
            except StoreError as exc:
                log.warning("damaged remote manifest", extra={"checkpoint": ckpt_id, "why": exc.message})
                report.damaged.append(ckpt_id)
        report.forgotten = sorted(known - present)
        self.state.forget(report.forgotten)
        if report.forgotten:
            # Manifests vanished: the bucket was cleaned or replaced, so what it held is not known any more.
            self.state.forget_blobs()
        return report


def frame_bound(size: int) -> int:
    """The largest zstd frame of ``size`` bytes of content (zstd's compress bound, with room for headers)."""
    return size + (size >> 7) + (64 << 10)


def _decompressed(data: bytes, hex_: str, ckpt_id: str, size: int) -> Iterator[bytes]:
    """The content of a fetched blob frame, in pieces; CorruptBlob if it is not a valid frame or
    grows past ``size`` (the manifest's word for it: a small object must not fill the disk)."""
    seen = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        while piece := reader.read(1 << 20):
            seen += len(piece)
            if seen > size:
                raise CorruptBlob(
                    f"the remote store's copy of blob {hex_} (checkpoint {ckpt_id}) is longer than"
                    f" the {size} bytes its manifest says",
                    blob=hex_,
                    checkpoints=[ckpt_id],
                    hint=_FETCH_HINT,
                )
            yield piece
    except zstandard.ZstdError as exc:
        raise CorruptBlob(
            f"the remote store's copy of blob {hex_} (checkpoint {ckpt_id}) is not valid zstd: {exc}",
            blob=hex_,
            checkpoints=[ckpt_id],
            hint=_FETCH_HINT,
        ) from exc


_FETCH_HINT = "Nothing was imported; restore another checkpoint or re-upload this one from its host."
