"""In-memory fakes of crab's backends, and one factory that builds the coordinator on them.

The coordinator and the service are tested against the REAL store (SQLite
database, catalog, registry, file blob store, all in a tmp dir: none needs
root) and FAKE backends:

* :class:`FakeSandboxBackend` — containers are dicts; each has a real upper
  dir (a tmp dir) whose regular files are the sandbox's files;
* :class:`FakeDumper` — a "process dump" is one file in the images dir;
* :class:`FakeFsDelta` — a tree is a snapshot ``{path: content}`` of the upper
  dir, stored as a JSON index blob in the real blob store (so blob accounting,
  durability and release of unpublished blobs run for real);
* :class:`MemoryObjectStore` — the remote tier's bucket is a dict
  (``ObjectStore``; the real one is moto's server, ``tests/s3server.py``);
* crab's init is faked by :class:`FakeInit` (it says hello and runs no session),
  patched in for the duration of a test: reaching the real one needs root.

Every fake fails on demand (:class:`Faults`), with the error its real
counterpart raises.  Everything that constructs coordinator or service
objects is in :func:`build_stack`, so a changed constructor is one edit here.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from crabd.backends.criu.hotimages import HotImages
from crabd.backends.criu.imagestore import ImageStore
from crabd.backends.fsdelta import (
    Change,
    FsCapture,
    MaterializeStats,
    Outline,
    OutlineMemo,
    ReadBlob,
    ScanLimits,
    StoredTree,
    Tree,
)

# The one overlay type the tests name (it may move beside the FsDelta protocol).
from crabd.backends.procdump import DumpResult, Posture
from crabd.backends.sandbox import ENV_REPO_PREFIX, PIN_REPO, ContainerStatus, PinnedImage, Unpinned
from crabd.config import CrabConfig
from crabd.coordinator.archives import Archives
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.housekeeping import Housekeeper
from crabd.coordinator.inspection import TurnInspection
from crabd.coordinator.recovery import Recovery
from crabd.coordinator.restore import Restorer
from crabd.coordinator.retention import Retention
from crabd.coordinator.sandboxes import SandboxManager
from crabd.engine import HostEngine
from crabd.errors import (
    CrabError,
    CriuError,
    DockerError,
    ImageError,
    InitSpawnError,
    RemoteObjectMissing,
    RemoteStoreError,
    StoreError,
)
from crabd.inspector.base import ScanEvents
from crabd.inspector.decide import Inspector
from crabd.models import Caller, CheckpointPolicy, CheckpointRecord, RecoveryMode, SandboxSpec, TurnRecord
from crabd.runtime.initproto import PROTO_VERSION, Hello, InitConnection
from crabd.service.quota import Quotas
from crabd.service.service import Service
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.store.registry import Registry
from crabd.store.remote.objects import check_key, check_list_prefix
from crabd.trust.keys import open_keyring
from crabd.trust.provenance import Provenance
from crabd.trust.references import ReferenceChecker
from crabd.util.aiolock import RWLock
from crabd.util.validate import IMAGE_DIGEST_RE
from tests.criu_forge import NORMAL_POSTURE, write_images

T = TypeVar("T")

#: An env with a recipe in envs/images (the fake backend says every image exists).
ENV = "bookworm"
#: Every fake container's init "runs" as this host pid, above any pid_max: what crabd reads of it
#: (/proc/PID/..., by the inspector) is then absent, never some real process's, whoever runs the tests.
NO_SUCH_PID = (1 << 22) + 7
ROOT = Caller(0, 0, 1)
ALICE = Caller(1000, 1000, 2)
BOB = Caller(1001, 1001, 3)


# --- failures on demand -------------------------------------------------------------


class Faults:
    """Named failure points: ``arm("backend.start", after=2)`` lets two calls pass, then every one fails."""

    def __init__(self) -> None:
        self._armed: dict[str, int] = {}
        #: Calls seen per point (armed or not), to assert what was attempted.
        self.calls: dict[str, int] = {}

    def arm(self, point: str, *, after: int = 0) -> None:
        self._armed[point] = after

    def disarm(self, point: str) -> None:
        self._armed.pop(point, None)

    def hit(self, point: str, error: type[CrabError]) -> None:
        self.calls[point] = self.calls.get(point, 0) + 1
        left = self._armed.get(point)
        if left is None:
            return
        if left > 0:
            self._armed[point] = left - 1
            return
        message = f"injected failure at {point}"
        if error is CriuError:
            # What runc reports when CRIU refuses: the log it left and its tail.
            raise CriuError(message, log_path="/nonexistent/dump.log", log_excerpt="Error (criu): injected")
        raise error(message)


# --- crab's init --------------------------------------------------------------------


class FakeInit:
    """A connection to a sandbox's init that answers ``hello`` and runs no processes.

    So no session either: as in an image without bash, attaching finds none
    and spawning one fails the way the real init does.
    """

    def __init__(self) -> None:
        self.on_close: Any = None

    async def hello(self) -> Hello:
        return Hello(PROTO_VERSION, 1, 0)

    async def attach(self, name: str) -> None:
        raise InitSpawnError(f"no process named {name}", errno=errno.ENOENT)

    async def attach_listed(self, name: str) -> None:
        raise InitSpawnError(f"no process named {name}", errno=errno.ENOENT)

    async def spawn(self, spec: object) -> None:
        raise InitSpawnError(
            "spawn failed", errno=errno.ENOENT, init_message="exec /bin/bash: No such file or directory"
        )

    async def list(self) -> list[Any]:
        return []

    async def aclose(self, *, until_init_closed: bool = False) -> None:
        callback, self.on_close = self.on_close, None
        if callback is not None:
            callback()

    async def __aenter__(self) -> FakeInit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _open_fake_init(*_: object, **__: object) -> FakeInit:
    return FakeInit()


# --- the sandbox backend ------------------------------------------------------------


@dataclass
class FakeContainer:
    id: str
    sandbox_id: str
    labels: dict[str, str]
    upper: Path
    running: bool = False
    exit_code: int | None = None
    #: The checkpoint name it was started from ("" = from its image).
    restored_from: str = ""


class FakeSandboxBackend:
    """Containers in a dict; each has a real (tmp) upper dir.  Implements ``SandboxBackend``."""

    def __init__(self, root: Path, faults: Faults) -> None:
        self.root = root
        self.faults = faults
        self.containers: dict[str, FakeContainer] = {}
        self.removed: list[str] = []
        self.frozen_now: set[str] = set()
        #: Images this fake host lacks (every other one "exists").
        self.missing_images: set[str] = set()
        #: Images pinned (crab-loaded:<hex>), by digest; what unpin_image removed, in order.
        self.pins: dict[str, PinnedImage] = {}
        self.unpinned: list[str] = []
        #: Digests whose unpin the "engine" refuses (a container of the image exists).
        self.refuse_unpin: set[str] = set()

    def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: str,
        init_binary: Path,
        labels: dict[str, str],
        *,
        generation: str = "",
    ) -> str:
        self.faults.hit("backend.create", DockerError)
        cid = secrets.token_hex(8)
        upper = self.root / cid / "upper"
        upper.mkdir(parents=True)
        self.containers[cid] = FakeContainer(cid, sandbox_id, dict(labels), upper)
        return cid

    def _get(self, container_id: str) -> FakeContainer:
        c = self.containers.get(container_id)
        if c is None:
            raise DockerError(f"no container {container_id}")
        return c

    def upper_dir(self, container_id: str) -> Path:
        return self._get(container_id).upper

    @contextmanager
    def _frozen(self, container_id: str) -> Iterator[None]:
        self.frozen_now.add(container_id)
        try:
            yield
        finally:
            self.frozen_now.discard(container_id)

    def frozen(self, container_id: str) -> AbstractContextManager[None]:
        self._get(container_id)
        return self._frozen(container_id)

    def thaw(self, container_id: str) -> None:
        self.faults.hit("backend.thaw", DockerError)
        self.frozen_now.discard(container_id)

    def start(self, container_id: str, checkpoint: str = "") -> None:
        self.faults.hit("backend.start", CriuError if checkpoint else DockerError)
        c = self._get(container_id)
        c.running, c.restored_from = True, checkpoint

    def posture(self, container_id: str) -> Posture:
        self._get(container_id)
        return NORMAL_POSTURE

    def checkpoint_dir(self, container_id: str, name: str) -> Path:
        d = self.root / container_id / "checkpoints" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def status(self, container_id: str) -> ContainerStatus:
        c = self.containers.get(container_id)
        if c is None:
            return ContainerStatus(exists=False)
        return ContainerStatus(
            exists=True,
            running=c.running,
            pid=NO_SUCH_PID,
            exit_code=c.exit_code,
            upper_dir=str(c.upper),
            labels=dict(c.labels),
        )

    def kill(self, container_id: str, exit_code: int = 137) -> None:
        """Test helper: the container dies on its own."""
        c = self._get(container_id)
        c.running, c.exit_code = False, exit_code

    def stop(self, container_id: str, timeout_s: float) -> None:
        self.kill(container_id, 0)

    def remove(self, container_id: str) -> None:
        if self.containers.pop(container_id, None) is not None:
            self.removed.append(container_id)

    def list_exited(self, instance: str) -> list[str]:
        return [c.id for c in self.containers.values() if not c.running]

    def list_instance(self, instance: str) -> dict[str, ContainerStatus]:
        return {cid: self.status(cid) for cid in self.containers}

    def instance_ids(self, instance: str) -> set[str]:
        return set(self.containers)

    def image_exists(self, image: str) -> bool:
        return image not in self.missing_images

    def image_digest(self, image: str) -> str:
        if image in self.missing_images:
            raise ImageError(f"no Docker image {image!r} on this host", env=image)
        return image if IMAGE_DIGEST_RE.match(image) else "sha256:" + hashlib.sha256(image.encode()).hexdigest()

    def pin_image(self, image: str) -> str:
        digest = self.image_digest(image)
        if not image.startswith(ENV_REPO_PREFIX):
            tag = f"{PIN_REPO}:{digest.removeprefix('sha256:')}"
            self.pins[digest] = PinnedImage(digest, 1000, (tag,), time.time())
        return digest

    def pinned_images(self) -> list[PinnedImage]:
        return sorted(self.pins.values(), key=lambda p: p.digest)

    def unpin_image(self, digest: str) -> Unpinned:
        if digest in self.refuse_unpin:
            return Unpinned(untagged=False, note="a container of the image exists")
        if self.pins.pop(digest, None) is None:
            return Unpinned(untagged=True, note="not pinned")
        self.unpinned.append(digest)
        self.missing_images.add(digest)
        return Unpinned(untagged=True, deleted=True, export_removed=True)

    def server_version(self) -> str:
        return "fake"

    def close(self) -> None:
        return None


# --- the process dumper ---------------------------------------------------------------


class FakeDumper:
    """A "dump" is one file naming the container.  Implements ``ProcessDumper``."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def dump(self, container_id: str, images_dir: Path, work_dir: Path) -> DumpResult:
        self.faults.hit("dump", CriuError)
        # A normal sandbox's images, so a restore's posture check (backends/criu/posture.py) runs on them.
        write_images(images_dir)
        (images_dir / "fake.txt").write_bytes(f"processes of {container_id}\n".encode())
        return DumpResult(images_dir, 0.001, (1,))

    def version(self) -> str:
        return "fake"


# --- the filesystem delta ----------------------------------------------------------------


class FakeTree(Tree):
    """A snapshot of an upper dir's regular files; an (empty) ``Tree`` to the coordinator."""

    def __init__(self, files: dict[str, str]) -> None:
        super().__init__()
        self.files = files


def _snapshot(upper: Path) -> dict[str, str]:
    return {str(p.relative_to(upper)): p.read_text() for p in sorted(upper.rglob("*")) if p.is_file()}


@dataclass
class _FakeCut:
    files: dict[str, str]
    base: dict[str, str]


class FakeFsDelta:
    """Trees are ``{path: text}`` snapshots stored as JSON blobs in the real store.  Implements ``FsDelta``."""

    def __init__(self, blobs: FileBlobStore, faults: Faults, *, snapshots: bool = False) -> None:
        self.blobs = blobs
        self.faults = faults
        #: Like the btrfs backend: ``capture`` keeps a snapshot per checkpoint, restores copy it back.
        self.snapshots_enabled = snapshots
        self.snapshots: dict[str, dict[str, str]] = {}

    def load(self, index_blob: str) -> Tree:
        doc = json.loads(self.blobs.read_bytes(index_blob, limit=1 << 20))
        return FakeTree(dict(doc["files"]))

    def prepare(self, upper: Path, base: Tree | None, racy_ns: int, *, checkpoint_id: str = "") -> Any:
        self.faults.hit("fs.prepare", StoreError)
        return (upper, base.files if isinstance(base, FakeTree) else {}, checkpoint_id)

    def capture(self, prepared: Any) -> Any:
        self.faults.hit("fs.capture", StoreError)
        upper, base, checkpoint_id = prepared
        files = _snapshot(upper)
        if self.snapshots_enabled:
            self.snapshots[checkpoint_id] = dict(files)
        return _FakeCut(files, base)

    def restore_snapshot(self, checkpoint_id: str, into: Path) -> bool:
        files = self.snapshots.get(checkpoint_id)
        if files is None:
            return False
        self.faults.hit("fs.restore_snapshot", StoreError)
        for path, text in files.items():
            (into / path).parent.mkdir(parents=True, exist_ok=True)
            (into / path).write_text(text)
        return True

    def drop(self, checkpoint_id: str) -> None:
        self.snapshots.pop(checkpoint_id, None)

    def retain(self, live: set[str]) -> list[str]:
        gone = sorted(set(self.snapshots) - live)
        for c in gone:
            del self.snapshots[c]
        return gone

    def _put_tree(self, files: dict[str, str], delta: dict[str, Any]) -> StoredTree:
        index = self.blobs.put_bytes(json.dumps({"files": files}, sort_keys=True).encode())
        # The delta names the exact change, so that two checkpoints of one state still differ.
        delta_put = self.blobs.put_bytes(json.dumps(delta, sort_keys=True).encode())
        return StoredTree(
            index.hex,
            delta_put.hex,
            {},
            {index.hex: index.size, delta_put.hex: delta_put.size},
            index.stored + delta_put.stored,
        )

    def store(self, cut: Any) -> tuple[FsCapture, StoredTree]:
        self.faults.hit("fs.store", StoreError)
        files, base = cut.files, cut.base
        added = sorted(set(files) - set(base))
        changed = sorted(p for p in files if p in base and files[p] != base[p])
        deleted = sorted(set(base) - set(files))
        # The base by digest, not content: a delta stays small, as a real one is (store charges count it).
        base_id = hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest()
        stored = self._put_tree(files, {"added": added, "changed": changed, "deleted": deleted, "base": base_id})
        return FsCapture(FakeTree(files), [], [], [p.encode() for p in deleted]), stored

    def store_tree(self, tree: Tree) -> StoredTree:
        files = tree.files if isinstance(tree, FakeTree) else {}
        return self._put_tree(files, {"stat": secrets.token_hex(4)})

    def materialize(self, tree: Tree, into: Path) -> tuple[Tree, MaterializeStats]:
        self.faults.hit("fs.materialize", StoreError)
        files = tree.files if isinstance(tree, FakeTree) else {}
        for path, text in files.items():
            (into / path).parent.mkdir(parents=True, exist_ok=True)
            (into / path).write_text(text)
        written = sum(len(text.encode()) for text in files.values())
        return FakeTree(dict(files)), MaterializeStats(
            entries=len(files), bytes_written=written, materialize_s=0.0, stat_s=0.0
        )

    def outline(self, index_blob: str, read: ReadBlob, memo: OutlineMemo) -> Outline:
        try:
            files = dict(json.loads(read(index_blob, 1 << 20))["files"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"not a fake index: {exc}") from exc
        size = sum(len(str(text).encode()) for text in files.values())
        return Outline(children={index_blob: set()}, entries=len(files), bytes=size)

    def changes(self, delta_blob: str, limit: int) -> tuple[list[Change], bool]:
        doc = json.loads(self.blobs.read_bytes(delta_blob, limit=1 << 20))
        out = [Change(p.encode(), what, "file") for what in ("added", "changed", "deleted") for p in doc.get(what, [])]
        return out[:limit], len(out) > limit


# --- the remote tier's object store --------------------------------------------------------


#: Every operation of the ``ObjectStore`` protocol, as :attr:`MemoryObjectStore.calls` counts them.
OBJECT_OPS = frozenset({"put", "get", "exists", "list", "delete"})


class MemoryObjectStore:
    """A bucket in a dict.  Implements ``ObjectStore`` (crabd/store/remote/objects.py); thread-safe.

    Keys are checked as the S3 store checks them, and ``get`` honours its
    ``limit``.  For tests of the upload and fetch logic:

    * ``fail()`` makes every operation (or only the named ones: ``fail("put")``)
      raise a retryable :class:`RemoteStoreError`, as an unreachable store does,
      until ``heal()``; failed calls are counted too;
    * ``calls`` counts calls per operation (``puts``/``gets`` for short), and
      ``created`` lists the keys ``put_if_absent`` created, in order.
    """

    def __init__(self, *, bucket: str = "fake-bucket", prefix: str = "crab/") -> None:
        self.bucket = bucket
        self.prefix = prefix
        #: The bucket's contents, by relative key.
        self.objects: dict[str, bytes] = {}
        self.calls: dict[str, int] = dict.fromkeys(sorted(OBJECT_OPS), 0)
        self.created: list[str] = []
        self.failing: frozenset[str] = frozenset()
        self.closed = False
        self._lock = threading.Lock()

    def fail(self, *ops: str) -> None:
        """From now on, ``ops`` (default: every operation) raise a retryable ``RemoteStoreError``."""
        assert set(ops) <= OBJECT_OPS, f"unknown operations {set(ops) - OBJECT_OPS}"
        self.failing = frozenset(ops or OBJECT_OPS)

    def heal(self) -> None:
        self.failing = frozenset()

    @property
    def puts(self) -> int:
        return self.calls["put"]

    @property
    def gets(self) -> int:
        return self.calls["get"]

    def _enter(self, op: str, key: str) -> None:
        """Count the call, then fail it if armed (the lock is held)."""
        assert not self.closed, "MemoryObjectStore used after close()"
        self.calls[op] += 1
        if op in self.failing:
            raise RemoteStoreError(
                f"{op} {key!r}: injected outage of the fake store",
                endpoint="memory://",
                bucket=self.bucket,
                key=self.prefix + key,
                retryable=True,
            )

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        with self._lock:
            self._enter("put", key)
            if key in self.objects:
                return False
            self.objects[key] = bytes(data)
            self.created.append(key)
            return True

    def get(self, key: str, *, limit: int) -> bytes:
        check_key(key)
        with self._lock:
            self._enter("get", key)
            data = self.objects.get(key)
        if data is None:
            raise RemoteObjectMissing(
                f"get {key!r}: no such object", endpoint="memory://", bucket=self.bucket, key=self.prefix + key
            )
        if len(data) > limit:
            raise RemoteStoreError(
                f"get {key!r}: {len(data)} bytes, over the limit of {limit}",
                endpoint="memory://",
                bucket=self.bucket,
                key=self.prefix + key,
            )
        return data

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            self._enter("exists", key)
            return key in self.objects

    def list(self, prefix: str) -> Iterator[str]:
        check_list_prefix(prefix)
        with self._lock:
            self._enter("list", prefix)
            keys = sorted(k for k in self.objects if k.startswith(prefix))
        yield from keys

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._enter("delete", key)
            self.objects.pop(key, None)

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} in memory"

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> MemoryObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the stack ------------------------------------------------------------------------------


@dataclass
class Stack:
    cfg: CrabConfig
    faults: Faults
    backend: FakeSandboxBackend
    fs: FakeFsDelta
    db: Database
    registry: Registry
    catalog: Catalog
    blobs: FileBlobStore
    sandboxes: SandboxManager
    checkpointer: Checkpointer
    restorer: Restorer
    recovery: Recovery
    service: Service
    engine: HostEngine
    housekeeping: Housekeeper
    images: ImageStore
    #: This stack's provenance (its own host key under state/trust), as daemon/provenance.py wires it.
    provenance: Provenance

    def blob_files(self) -> set[str]:
        """Every blob in the store."""
        return set(self.blobs.iter_all())

    def write(self, sandbox_id: str, path: str, text: str) -> None:
        """Test helper: the sandbox writes a file (into its current container's upper dir)."""
        rec = self.registry.get_sandbox(sandbox_id)
        assert rec is not None
        target = self.backend.upper_dir(rec.container_id) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    async def turn(self, caller: Caller, sandbox_id: str, content: str) -> TurnRecord:
        """One whole turn of ``caller``'s agent: writes ``content`` into state.txt, ends waiting for its checkpoint."""
        await self.service.begin_turn(caller, sandbox_id)
        self.write(sandbox_id, "state.txt", content)
        return await self.service.end_turn(caller, sandbox_id, wait=True)

    def stored_files(self, ckpt: CheckpointRecord) -> dict[str, str]:
        """The files a checkpoint holds."""
        tree = self.fs.load(ckpt.index_blob)
        assert isinstance(tree, FakeTree)
        return tree.files

    def files(self, sandbox_id: str) -> dict[str, str]:
        rec = self.registry.get_sandbox(sandbox_id)
        assert rec is not None
        return _snapshot(self.backend.upper_dir(rec.container_id))


def build_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, snapshots: bool = False, **config: dict[str, Any]
) -> Stack:
    """The daemon's wiring (crabd/daemon/app.py) on fake backends and a real store under ``tmp_path``.

    ``snapshots``: the filesystem backend keeps a snapshot per checkpoint, as the btrfs one does.
    ``config``: sections merged into the configuration, e.g. ``quota={"max_sandboxes": 2}``.
    The engine is not started: call ``await stack.engine.start()`` where turn ends are tested.
    """
    monkeypatch.setattr(InitConnection, "open", _open_fake_init)
    state = tmp_path / "state"
    state.mkdir()
    # Image claims are host-wide on a real host; a stack's are its own.
    config = {"images": {"claims_dir": str(tmp_path / "image-claims"), **config.pop("images", {})}, **config}
    cfg = CrabConfig.model_validate({"paths": {"state_dir": str(state), "socket": str(tmp_path / "s.sock")}, **config})
    faults = Faults()
    backend = FakeSandboxBackend(tmp_path / "containers", faults)
    db = Database(state / "registry.db")
    registry = Registry(db)
    blobs = FileBlobStore(state / "blobs")
    fs = FakeFsDelta(blobs, faults, snapshots=snapshots)
    catalog = Catalog(db)
    sandboxes = SandboxManager(cfg, registry, backend, tmp_path / "init", "test-instance")
    dump_root = state / "dumps"
    dump_root.mkdir()
    # The real page-deduplicating image store: FakeDumper's images are plain files in a dir.
    # And its hot copies, as daemon/app.py wires them.
    budget = cfg.criu.hot_images_bytes
    images = ImageStore(blobs, hot=HotImages(state / "images-hot", budget) if budget else None)
    store_lock = RWLock()
    checkpointer = Checkpointer(
        db, sandboxes, catalog, blobs, fs, FakeDumper(faults), images=images, dump_root=dump_root, store_lock=store_lock
    )
    inspector = Inspector(ScanEvents(), limits=ScanLimits())
    inspection = TurnInspection(inspector, checkpointer, sandboxes, catalog, fs)
    restorer = Restorer(checkpointer, sandboxes, db, catalog, fs, images, store_lock)
    restorer.inspection = inspection
    # Each stack is a host of its own: its own key, trusting only itself.
    provenance = Provenance(open_keyring(state / "trust", "test-host"))
    checkpointer.provenance = restorer.provenance = provenance
    recovery = Recovery(restorer, sandboxes, catalog)
    housekeeping = Housekeeper(checkpointer, sandboxes, catalog, blobs, fs, store_lock)
    engine = HostEngine(cfg.engine)
    engine.store_lock = store_lock.stats
    quotas = Quotas(cfg.quota, db)
    checkpointer.store_quota = quotas.check_store
    retention = Retention(catalog, sandboxes, housekeeping, restorer.leases, cfg.retention, cfg.quota)
    checkpointer.make_room = retention.make_room
    checkpointer.on_published.append(retention.published)
    quotas.room_hint = retention.room_hint
    retention.engine = engine
    service = Service(
        cfg,
        sandboxes,
        checkpointer,
        restorer,
        recovery,
        inspection,
        engine,
        catalog=catalog,
        quotas=quotas,
        housekeeping=housekeeping,
        retention=retention,
        docker_version="fake",
    )
    # Portable archives, as daemon/app.py attaches them (a CRIU version any host accepts images from).
    service.archives.archives = Archives(
        catalog,
        blobs,
        store_lock,
        state / "archives",
        lambda: "4.2.1",
        checker=ReferenceChecker(fs, images),
        limits=ScanLimits(max_entries=cfg.checkpoint.max_entries, max_restore_bytes=cfg.checkpoint.max_restore_bytes),
    )
    service.archives.archives.ring = provenance.ring
    return Stack(
        cfg=cfg,
        faults=faults,
        backend=backend,
        fs=fs,
        db=db,
        registry=registry,
        catalog=catalog,
        blobs=blobs,
        sandboxes=sandboxes,
        checkpointer=checkpointer,
        restorer=restorer,
        recovery=recovery,
        service=service,
        engine=engine,
        housekeeping=housekeeping,
        images=images,
        provenance=provenance,
    )


def spec(name: str = "", *, checkpoints: str = "auto", recovery: str = "manual", **kw: Any) -> SandboxSpec:
    """A sandbox spec as the gRPC edge hands it to the service (policy words already parsed)."""
    return SandboxSpec(
        env=ENV,
        name=name,
        checkpoints=CheckpointPolicy.parse(checkpoints),
        recovery=RecoveryMode.parse(recovery),
        **kw,
    )


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test body (every test is one event loop: the coordinator's locks bind to it)."""
    return asyncio.run(asyncio.wait_for(coro, 30))


@asynccontextmanager
async def engine_running(stack: Stack) -> AsyncIterator[None]:
    """The host engine runs turn-end checkpoints: started for the ``async with`` body."""
    await stack.engine.start()
    try:
        yield
    finally:
        await stack.engine.close()
