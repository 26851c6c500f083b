"""Bucket fetches as untrusted input: no borrowing another tenant's blob, sizes from what is read, and a
fetched checkpoint's references checked before it is adopted (crabd/trust/references.py)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zstandard

from crabd.backends.fsdelta import Outline, OutlineMemo, ReadBlob
from crabd.config import EngineConfig
from crabd.coordinator.replication import Replication
from crabd.engine import HostEngine
from crabd.errors import RemoteStoreError, StoreError
from crabd.store.remote import manifest as mf
from crabd.store.remote.tier import frame_bound
from crabd.trust.references import ReferenceChecker
from crabd.util.aiolock import RWLock
from tests.fakes import MemoryObjectStore
from tests.unit.test_remote_tier import Host, make_host


@pytest.fixture
def objects() -> MemoryObjectStore:
    return MemoryObjectStore()


@pytest.fixture
def a(tmp_path: Path, objects: MemoryObjectStore) -> Iterator[Host]:
    yield from make_host(tmp_path / "a", "host-a", objects)


@pytest.fixture
def b(tmp_path: Path, objects: MemoryObjectStore) -> Iterator[Host]:
    yield from make_host(tmp_path / "b", "host-b", objects)


def _rewrite(objects: MemoryObjectStore, ckpt_id: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest in the bucket (anyone with write access to it can)."""
    key = mf.manifest_key(ckpt_id)
    doc = mf.decode(objects.objects[key], expect_id=ckpt_id).model_dump(mode="json")
    change(doc)
    objects.objects[key] = mf.encode(mf.Manifest.model_validate(doc))


def _victim(h: Host) -> str:
    """A checkpoint of uid 2000 on ``h``; the address of one of its files."""
    rec = h.publish("ck-victim", [b"uid 2000's secret file"])
    with h.db.tx() as conn:
        conn.execute("UPDATE checkpoints SET owner_uid=2000, sandbox_id='sb-victim' WHERE id='ck-victim'")
    return h.put(b"uid 2000's secret file") if rec else ""


def _borrow(objects: MemoryObjectStore, ckpt_id: str, target: str, size: int) -> None:
    def change(doc: dict[str, Any]) -> None:
        doc["blobs"][target] = size
        page = next(p for p, kids in doc["edges"].items() if kids and p != doc["checkpoint"]["index_blob"])
        doc["edges"][page].append(target)

    _rewrite(objects, ckpt_id, change)


def test_a_manifest_naming_another_tenants_blob_is_refused_alike_whether_it_exists_or_not(
    a: Host, b: Host, objects: MemoryObjectStore
) -> None:
    """Before, a fetch skipped every blob live here: a manifest could name uid 2000's blob and get it."""
    a.publish("ck-one", [b"alpha"])
    a.tier.upload("ck-one")
    theirs = _victim(b)
    assert b.catalog.is_live(theirs)
    errors: list[str] = []
    for target in (theirs, "ab" * 32):
        _borrow(objects, "ck-one", target, len(b"uid 2000's secret file"))
        with pytest.raises(StoreError) as err:
            b.tier.fetch(b.tier.manifest("ck-one"))
        assert "does not have" in err.value.message and target in err.value.message
        assert b.catalog.find("ck-one") is None
        errors.append(re.sub(r"[0-9a-f]{64}", "<blob>", err.value.message))
        a.tier.state.forget(["ck-one"])
        objects.objects.pop(mf.manifest_key("ck-one"))
        a.tier.upload("ck-one")
    assert errors[0] == errors[1]


def test_blobs_the_owner_holds_here_are_not_fetched_again_but_others_are(
    a: Host, b: Host, objects: MemoryObjectStore
) -> None:
    a.publish("ck-one", [b"alpha", b"beta"])
    a.tier.upload("ck-one")
    b.publish("ck-mine", [b"alpha"])  # uid 1000 holds "alpha" on b
    m = b.tier.manifest("ck-one")
    t = b.tier.fetch(m)
    assert b.put(b"alpha") in t.owned and b.put(b"alpha") not in t.fetched
    assert t.moved == len(m.blobs) - len(t.owned)
    with b.db.tx() as conn:
        conn.execute("UPDATE checkpoints SET owner_uid=2000 WHERE id='ck-mine'")
    t = b.tier.fetch(m)
    assert not t.owned and t.moved == len(m.blobs)  # another uid's copy does not count


def test_an_object_is_read_only_as_far_as_its_declared_size_allows(
    a: Host, b: Host, objects: MemoryObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest claiming 10 bytes for a big object must not make the fetch read the object."""
    a.publish("ck-one", [os.urandom(900 << 10)])
    a.tier.upload("ck-one")
    m = b.tier.manifest("ck-one")
    big = max(m.blobs, key=lambda x: m.blobs[x])

    def shrink(doc: dict[str, Any]) -> None:
        doc["blobs"][big] = 10

    _rewrite(objects, "ck-one", shrink)
    limits: dict[str, int] = {}
    real = objects.get

    def spy(key: str, *, limit: int) -> bytes:
        limits[key] = limit
        return real(key, limit=limit)

    monkeypatch.setattr(objects, "get", spy)
    with pytest.raises((RemoteStoreError, StoreError)):
        b.tier.fetch(b.tier.manifest("ck-one"))
    assert limits[mf.blob_key(big)] <= frame_bound(10) < (900 << 10)
    assert b.catalog.find("ck-one") is None and not b.blobs.exists(big)


def test_content_shorter_than_declared_is_refused(a: Host, b: Host, objects: MemoryObjectStore) -> None:
    """Sizes are what was read: a blob declared bigger than it is would be charged and bounded wrongly."""
    a.publish("ck-one", [b"alpha"])
    a.tier.upload("ck-one")
    m = b.tier.manifest("ck-one")
    leaf = next(
        x for x in m.blobs if zstandard.ZstdDecompressor().decompress(objects.objects[mf.blob_key(x)]) == b"alpha"
    )

    def grow(doc: dict[str, Any]) -> None:
        doc["blobs"][leaf] = 1 << 20

    _rewrite(objects, "ck-one", grow)
    with pytest.raises(StoreError, match="is not the 1048576 bytes"):
        b.tier.fetch(b.tier.manifest("ck-one"))


class _FakeIndexes:
    """The decoder of test_remote_tier's blobs ("index:<id>:<page>", "page:<leaf>,<leaf>"), as an FsDelta's
    outline and a ProcessImages' outline (a process blob names nothing)."""

    def outline(self, blob: str, read: ReadBlob, memo: OutlineMemo | None = None) -> Outline:
        text = read(blob, 1 << 20).decode()
        if text.startswith("proc:"):
            return Outline(children={blob: set()}, entries=1)
        page = text.rsplit(":", 1)[1]
        leaves = [x for x in read(page, 1 << 20).decode().removeprefix("page:").split(",") if x]
        return Outline(children={blob: {page}, page: set(leaves)}, entries=len(leaves))


def _forge_upload(a: Host) -> None:
    """Upload ck-two, whose index names a page naming uid 2000's file; its manifest declares only the page."""
    theirs = a.put(b"uid 2000's secret file")
    page = a.put(b"page:" + theirs.encode())
    index = a.put(f"index:ck-two:{page}".encode())
    rec = a.publish("ck-one", [b"alpha"])
    kids = {index: [page]}  # the page's edge to the secret is left out: the manifest will not have it
    a.catalog.adopt(
        replace(rec, id="ck-two", index_blob=index),
        lambda x: kids.get(x, []),
        lambda x: (len(a.read(x)), a.blobs.stored_size(x)),
    )
    a.tier.upload("ck-two")


def test_a_fetched_page_naming_an_undeclared_blob_is_refused_and_what_it_fetched_removed(
    tmp_path: Path, objects: MemoryObjectStore
) -> None:
    """The page's content (hashed, so honest about itself) names uid 2000's blob; the manifest hides it."""

    async def go() -> None:
        for a in make_host(tmp_path / "a", "host-a", objects):
            _forge_upload(a)
        for b in make_host(tmp_path / "b", "host-b", objects):
            _victim(b)
            before = set(b.blobs.iter_all())
            async with HostEngine(EngineConfig.model_validate({"bandwidth_mib_s": 0})) as eng:
                checker = ReferenceChecker(_FakeIndexes(), _FakeIndexes())  # type: ignore[arg-type]
                rep = Replication(
                    b.tier, eng, RWLock(), max_inflight=1, retry_initial_s=1, retry_max_s=1, checker=checker
                )
                with pytest.raises(StoreError, match="does not carry"):
                    await rep.fetch("ck-two", lambda _uid: None)
            assert b.catalog.find("ck-two") is None
            assert set(b.blobs.iter_all()) == before  # what the fetch brought was removed again

    asyncio.run(asyncio.wait_for(go(), 30))
