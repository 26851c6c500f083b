"""The remote tier over an in-memory bucket: two hosts (real store each, in tmp dirs) share it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from crabd.errors import CheckpointNotFound, CorruptBlob, RemoteStoreError, StoreError
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.store.remote import manifest as mf
from crabd.store.remote.state import RemoteState
from crabd.store.remote.tier import RemoteTier
from tests.fakes import MemoryObjectStore


@dataclass
class Host:
    name: str
    db: Database
    catalog: Catalog
    blobs: FileBlobStore
    state: RemoteState
    tier: RemoteTier

    def put(self, data: bytes) -> str:
        return self.blobs.put_bytes(data).hex

    def publish(self, cid: str, files: list[bytes], *, parent: str | None = None, turn: int = 1) -> CheckpointRecord:
        """A checkpoint whose index names a page naming ``files``, plus a delta and a process blob."""
        leaves = [self.put(f) for f in files]
        page = self.put(b"page:" + ",".join(leaves).encode())
        index = self.put(f"index:{cid}:{page}".encode())
        kids = {index: [page], page: leaves}
        rec = CheckpointRecord(
            id=cid,
            sandbox_id="sb-1",
            sandbox_name="one",
            owner_uid=1000,
            parent_id=parent,
            branch=0,
            turn=turn,
            kind=CheckpointKind.FULL,
            created_at=float(turn),
            label=f"turn {turn}",
            image="bookworm",
            spec_json="{}",
            index_blob=index,
            delta_blob=self.put(f"delta:{cid}".encode()),
            process_blob=self.put(f"proc:{cid}".encode()),
            stats={"files": len(files)},
        )
        self.catalog.publish(rec, lambda b: kids.get(b, []), lambda b: (len(self.read(b)), self.blobs.stored_size(b)))
        return rec

    def read(self, hex_: str) -> bytes:
        return self.blobs.read_bytes(hex_, limit=1 << 20)


def make_host(root: Path, name: str, objects: MemoryObjectStore) -> Iterator[Host]:
    with Database(root / "registry.db") as db:
        catalog, blobs, state = Catalog(db), FileBlobStore(root / "blobs"), RemoteState(db)
        tier = RemoteTier(objects, blobs, catalog, state, host=name, upload_concurrency=2, fetch_concurrency=2)
        yield Host(name, db, catalog, blobs, state, tier)
        tier._up.shutdown()
        tier._down.shutdown()


@pytest.fixture
def objects() -> MemoryObjectStore:
    return MemoryObjectStore()


@pytest.fixture
def a(tmp_path: Path, objects: MemoryObjectStore) -> Iterator[Host]:
    yield from make_host(tmp_path / "a", "host-a", objects)


@pytest.fixture
def b(tmp_path: Path, objects: MemoryObjectStore) -> Iterator[Host]:
    yield from make_host(tmp_path / "b", "host-b", objects)


def closure(h: Host, rec: CheckpointRecord) -> set[str]:
    return h.catalog.reachable([rec.index_blob, rec.delta_blob, rec.process_blob or ""]) - {""}


def test_upload_puts_blobs_then_the_manifest_and_only_new_blobs_next_time(a: Host, objects: MemoryObjectStore) -> None:
    one = a.publish("ck-one", [b"alpha", b"beta"])
    need = closure(a, one)
    assert len(need) == 6
    t = a.tier.upload("ck-one")
    assert t.blobs == 6 and t.moved == 6 and t.already_there == 0
    assert set(objects.created[:-1]) == {mf.blob_key(x) for x in need}
    assert objects.created[-1] == mf.manifest_key("ck-one")  # the manifest comes last
    assert a.state.remote_of(["ck-one", "ck-two"]) == {"ck-one"}
    puts = objects.puts
    assert a.tier.upload("ck-one").moved == 0 and objects.puts == puts  # already remote: no request at all
    two = a.publish("ck-two", [b"alpha", b"gamma"], parent="ck-one", turn=2)
    fresh = closure(a, two) - need
    assert len(fresh) == 5  # the new file, page, index, delta, process; "alpha" is shared
    created = len(objects.created)
    t2 = a.tier.upload("ck-two")
    assert t2.blobs == 6 and t2.moved == 5
    assert set(objects.created[created:-1]) == {mf.blob_key(x) for x in fresh}
    assert objects.created[-1] == mf.manifest_key("ck-two")


def test_fetch_and_adopt_on_another_host(a: Host, b: Host) -> None:
    a.publish("ck-one", [b"alpha", b"beta"])
    two = a.publish("ck-two", [b"alpha", b"gamma"], parent="ck-one", turn=2)
    a.tier.upload("ck-two")
    m = b.tier.manifest("ck-two")
    assert m.host == "host-a" and m.checkpoint.parent_id == "ck-one"
    t = b.tier.fetch(m)
    assert t.moved == 6 and t.bytes > 0
    rec = b.tier.adopt(m)
    got = b.catalog.get("ck-two")
    assert got == rec
    assert got.parent_id is None  # host B lacks ck-one
    assert got.stats == {"files": 2, "imported_from": "host-a", "remote_parent": "ck-one"}
    assert (got.index_blob, got.delta_blob, got.process_blob) == (two.index_blob, two.delta_blob, two.process_blob)
    assert b.catalog.heads_on("ck-two") == []  # no sandbox's head moved
    need = closure(a, two)
    assert closure(b, got) == need
    for x in need:
        assert b.read(x) == a.read(x)  # read back verified against the address
    live = b.catalog.live_blobs()
    assert set(live) == need and all(v.refcount == 1 for v in live.values())
    assert {x: live[x].size for x in need} == {x: m.blobs[x] for x in need}
    assert b.state.remote_of(["ck-two"]) == {"ck-two"}
    # Adopting again changes nothing.
    b.tier.adopt(m)
    assert b.catalog.live_blobs() == live and len(b.catalog.list_checkpoints()) == 1
    # Deleting it on B releases every blob it brought.
    assert set(b.catalog.delete("ck-two")) == need and b.catalog.live_blobs() == {}


def test_adopt_keeps_the_parent_when_this_host_has_it(a: Host, b: Host) -> None:
    a.publish("ck-one", [b"alpha"])
    a.publish("ck-two", [b"alpha", b"beta"], parent="ck-one", turn=2)
    for cid in ("ck-one", "ck-two"):
        a.tier.upload(cid)
        m = b.tier.manifest(cid)
        b.tier.fetch(m)
        b.tier.adopt(m)
    assert b.catalog.get("ck-two").parent_id == "ck-one"
    assert b.catalog.live_blobs()[b.catalog.get("ck-one").process_blob or ""].refcount == 1


def _replace_object(objects: MemoryObjectStore, key: str, content: bytes) -> None:
    objects.objects[key] = zstandard.ZstdCompressor().compress(content)


def test_corrupt_blob_object_is_refused_and_nothing_imported(a: Host, b: Host, objects: MemoryObjectStore) -> None:
    one = a.publish("ck-one", [b"alpha", b"beta"])
    a.tier.upload("ck-one")
    bad = one.delta_blob
    _replace_object(objects, mf.blob_key(bad), b"delta:ck-EVIL")  # same length as the real content
    m = b.tier.manifest("ck-one")
    with pytest.raises(CorruptBlob) as err:
        b.tier.fetch(m)
    assert err.value.checkpoints == ["ck-one"] and err.value.blob == bad and "ck-one" in err.value.message
    assert b.catalog.find("ck-one") is None and b.catalog.live_blobs() == {}
    assert not b.blobs.exists(hashlib.sha256(b"delta:ck-EVIL").hexdigest())
    assert not b.blobs.exists(bad)


def test_blob_frame_longer_than_the_manifest_says(a: Host, b: Host, objects: MemoryObjectStore) -> None:
    one = a.publish("ck-one", [b"alpha"])
    a.tier.upload("ck-one")
    _replace_object(objects, mf.blob_key(one.process_blob or ""), b"x" * (3 << 20))
    with pytest.raises(CorruptBlob, match="longer than"):
        b.tier.fetch(b.tier.manifest("ck-one"))
    assert b.catalog.find("ck-one") is None
    b.tier._down.shutdown(wait=True)  # the other blobs' fetches may still be finishing
    assert list(b.blobs.tmp.iterdir()) == []  # the partial write is not left behind


def test_missing_blob_object_and_missing_manifest(a: Host, b: Host, objects: MemoryObjectStore) -> None:
    one = a.publish("ck-one", [b"alpha"])
    a.tier.upload("ck-one")
    del objects.objects[mf.blob_key(one.index_blob)]
    with pytest.raises(StoreError, match="ck-one") as err:
        b.tier.fetch(b.tier.manifest("ck-one"))
    assert not isinstance(err.value, RemoteStoreError)  # not an outage to retry: the copy is incomplete
    with pytest.raises(CheckpointNotFound) as nf:
        b.tier.manifest("ck-nothere")
    assert nf.value.checkpoint == "ck-nothere"


def test_store_outage_during_upload_leaves_it_not_remote(a: Host, objects: MemoryObjectStore) -> None:
    a.publish("ck-one", [b"alpha"])
    objects.fail("put")
    with pytest.raises(RemoteStoreError) as err:
        a.tier.upload("ck-one")
    assert err.value.retryable
    assert a.state.remote_of(["ck-one"]) == set()
    assert mf.manifest_key("ck-one") not in objects.objects and objects.created == []
    objects.heal()
    t = a.tier.upload("ck-one")
    assert t.moved == 5 and a.state.remote_of(["ck-one"]) == {"ck-one"}
    assert objects.created[-1] == mf.manifest_key("ck-one")


class ManifestPutFails(MemoryObjectStore):
    """Every blob put succeeds; manifest puts fail while ``broken``: a crash between the two steps."""

    broken = True

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.broken and key.startswith(mf.MANIFEST_PREFIX):
            raise RemoteStoreError("injected", endpoint="memory://", bucket=self.bucket, key=key, retryable=True)
        return super().put_if_absent(key, data)


def test_crash_between_blobs_and_manifest_redoes_only_the_manifest(tmp_path: Path) -> None:
    objects = ManifestPutFails()
    for a in make_host(tmp_path, "host-a", objects):
        a.publish("ck-one", [b"alpha", b"beta"])
        with pytest.raises(RemoteStoreError):
            a.tier.upload("ck-one")
        assert a.state.remote_of(["ck-one"]) == set() and len(objects.created) == 6
        objects.broken = False
        puts = objects.puts
        t = a.tier.upload("ck-one")
        assert t.moved == 0 and objects.puts == puts + 1
        assert objects.created[-1] == mf.manifest_key("ck-one") and a.state.remote_of(["ck-one"]) == {"ck-one"}


def test_sync_learns_forgets_and_reports_damage(a: Host, b: Host, objects: MemoryObjectStore) -> None:
    a.publish("ck-one", [b"alpha"])
    a.publish("ck-two", [b"beta"], turn=2)
    a.tier.upload("ck-one")
    a.tier.upload("ck-two")
    objects.objects["checkpoints/not-a-checkpoint.json.zst"] = b"junk"  # ignored: not a checkpoint id
    report = b.tier.sync()
    assert report.manifests == 2 and report.added == ["ck-one", "ck-two"] and report.damaged == []
    assert b.state.known_ids() == {"ck-one", "ck-two"}
    entry = b.state.entry("ck-two")
    assert entry is not None and entry.host == "host-a" and entry.owner_uid == 1000
    assert b.tier.sync().added == []
    del objects.objects[mf.manifest_key("ck-one")]
    objects.objects[mf.manifest_key("ck-bad")] = b"not a manifest"
    report = b.tier.sync()
    assert report.forgotten == ["ck-one"] and report.damaged == ["ck-bad"] and report.added == []
    assert b.state.known_ids() == {"ck-two"}
