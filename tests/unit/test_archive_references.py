"""Declared references and bounded expansion of imported archives (crabd/trust/references.py).

Each attack is a consistently re-packed archive (tests/archive_forge.py): every hash and size in its
manifest is right, only what its metadata *names* is hostile.  Every one of these imports succeeded
before the references were parsed.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from crabd.backends.criu.imagestore import PACK_PAGES, PAGE, _decode, _encode, _File
from crabd.backends.fsdelta import Entry, Kind
from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.entries import encode_page, encode_root
from crabd.errors import ArchiveRejected, QuotaExceeded
from crabd.trust.references import ReferenceChecker
from tests.archive_forge import Opened, open_archive
from tests.fakes import ALICE, BOB, Stack, run, spec
from tests.unit.test_archive_import import _engines, _export, _import, _stack, _staging_empty, _world


@pytest.fixture
def two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stack, Stack]:
    return _stack(tmp_path / "a", monkeypatch), _stack(tmp_path / "b", monkeypatch)


async def _full_export(st: Stack) -> tuple[bytes, str]:
    """Alice's full checkpoint (a process image in the real image store), exported."""
    rec = await st.service.create(ALICE, spec("srv", checkpoints="fs"))
    full = await st.service.create_checkpoint(ALICE, rec.id, "", "full")
    assert full.process_blob
    return await _export(st, ALICE, full.id), full.id


def _forge_image(o: Opened, change: list[_File], edges: set[str]) -> None:
    """Replace the archive's process image manifest by ``change``, declaring ``edges`` as its children."""
    ck = o.checkpoint()
    old = ck["process_blob"]
    new = o.put(_encode(change))
    ck["process_blob"] = new
    del o.doc["blobs"][old]
    o.doc["edges"].pop(old, None)
    o.doc["blobs"][new] = 0
    o.doc["edges"][new] = sorted(edges)
    kids = {k for kids in o.doc["edges"].values() for k in kids}
    roots = {ck[k] for k in ("index_blob", "delta_blob", "session_blob", "process_blob") if ck.get(k)}
    for b in list(o.doc["blobs"]):  # what no checkpoint needs any more leaves the blob list
        if b not in kids and b not in roots:
            del o.doc["blobs"][b]
            o.doc["edges"].pop(b, None)


async def _victim_blob(st: Stack) -> str:
    """Bob's checkpoint on ``st``, with a secret in its files: the address of its index (the file list)."""
    rec = await st.service.create(BOB, spec("bob", checkpoints="fs"))
    st.write(rec.id, "secret.txt", "bob's password: hunter2")
    ck = await st.service.create_checkpoint(BOB, rec.id, "", "fs")
    return ck.index_blob


def _unaddressed(message: str) -> str:
    return re.sub(r"[0-9a-f]{64}", "<blob>", message)


def test_a_blob_the_archive_does_not_carry_is_refused_alike_whether_another_tenant_has_it_or_not(
    two: tuple[Stack, Stack],
) -> None:
    """The image names Bob's blob by its address (it exists here) or an address nothing has: one answer."""
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            data, _ = await _full_export(a)
            bobs = await _victim_blob(b)
            assert b.blobs.exists(bobs)
            errors: list[ArchiveRejected] = []
            for target in (bobs, secrets.token_hex(32)):
                o = open_archive(data)
                files = _decode(o.blobs[o.checkpoint()["process_blob"]])
                files.append(_File("core-2.img", 0, 23, target))
                honest = {f.blob for f in files} - {target}  # it cannot carry what it does not have
                _forge_image(o, files, honest)
                before = _world(b)
                t0 = time.monotonic()
                with pytest.raises(ArchiveRejected) as err:
                    await _import(b, ALICE, o.pack(b.provenance))
                assert time.monotonic() - t0 < 5
                assert err.value.reason == "references" and target in err.value.message
                assert _world(b) == before and _staging_empty(b)
                errors.append(err.value)
            assert _unaddressed(errors[0].message) == _unaddressed(errors[1].message)
            assert errors[0].attrs == errors[1].attrs

    run(body())


def test_declared_edges_must_be_the_parsed_references_exactly(two: tuple[Stack, Stack]) -> None:
    """An edge the image does not make (here: to the delta, which the archive carries anyway) is refused."""
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            data, _ = await _full_export(a)
            o = open_archive(data)
            ck = o.checkpoint()
            files = _decode(o.blobs[ck["process_blob"]])
            _forge_image(o, files, {f.blob for f in files} | {ck["delta_blob"]})
            before = _world(b)
            with pytest.raises(ArchiveRejected, match="declared to name") as err:
                await _import(b, ALICE, o.pack(b.provenance))
            assert err.value.reason == "references" and _world(b) == before and _staging_empty(b)
            # The honest edges of the same forged image import.
            o = open_archive(data)
            files = _decode(o.blobs[o.checkpoint()["process_blob"]])
            _forge_image(o, files, {f.blob for f in files})
            got = await _import(b, ALICE, o.pack(b.provenance))
            assert len(got.checkpoints) == 1

    run(body())


def test_page_runs_all_naming_one_pack_are_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 4 MiB pack named by 256 runs: a few KB of manifest that a fork would write out as 1 GiB."""
    a = _stack(tmp_path / "a", monkeypatch)
    b = _stack(tmp_path / "b", monkeypatch, checkpoint={"max_restore_bytes": 256 << 20})

    async def body() -> None:
        async with _engines(a, b):
            data, _ = await _full_export(a)
            o = open_archive(data)
            files = _decode(o.blobs[o.checkpoint()["process_blob"]])
            pack = o.put(bytes(PACK_PAGES * PAGE))
            index = o.put(b"CRABPX01" + bytes(8))
            files.append(_File("pages-1.img", 1, 256 * PACK_PAGES * PAGE, index, [(pack, 0, PACK_PAGES)] * 256))
            _forge_image(o, files, {f.blob for f in files} | {pack})
            o.doc["blobs"].update({pack: 0, index: 0})
            forged = o.pack(b.provenance)
            assert len(forged) < 200_000
            before = _world(b)
            with pytest.raises(ArchiveRejected) as err:
                await _import(b, ALICE, forged)
            written = re.search(r"write (\d+) bytes", err.value.message)
            assert err.value.reason == "bounds" and written is not None and int(written.group(1)) >= 1 << 30
            assert _world(b) == before and _staging_empty(b)

    run(body())


def test_the_image_store_refuses_to_write_past_its_bound_before_the_first_file(tmp_path: Path) -> None:
    """Defence in depth at restore: the same image, already in a store, writes nothing."""
    from crabd.backends.criu.imagestore import ImageStore
    from crabd.errors import StoreFull
    from crabd.store.fsblobs import FileBlobStore

    blobs = FileBlobStore(tmp_path / "blobs")
    pack = blobs.put_bytes(bytes(PACK_PAGES * PAGE)).hex
    index = blobs.put_bytes(b"CRABPX01" + bytes(8)).hex
    manifest = blobs.put_bytes(
        _encode([_File("pages-1.img", 1, 256 * PACK_PAGES * PAGE, index, [(pack, 0, PACK_PAGES)] * 256)])
    ).hex
    target = tmp_path / "img"
    target.mkdir()
    with pytest.raises(StoreFull):
        ImageStore(blobs, max_bytes=256 << 20).write_from_blobs(manifest, target)
    assert not any(target.iterdir())


def _repeating_archive(o: Opened, repeats: int, per_page: int) -> str:
    """Make the archive's checkpoint an overlay index whose root names one page ``repeats`` times."""
    page = encode_page([Entry(b"f%06d" % i, Kind.REG, 0o644, 0, 0, 0, 0, 0, 0, 0, 1) for i in range(per_page)])
    page_hex = o.put(page)
    root_hex = o.put(encode_root(repeats * per_page, [(page_hex, per_page)] * repeats))
    ck = o.checkpoint()
    del o.doc["blobs"][ck["index_blob"]]
    ck["index_blob"] = root_hex
    o.doc["blobs"].update({root_hex: 0, page_hex: 0})
    o.doc["edges"][root_hex] = [page_hex]
    return root_hex


@pytest.mark.parametrize(("repeats", "per_page"), [(200_000, 100), (200_000, 1)])
def test_an_index_root_naming_one_page_200000_times_is_refused_quickly_in_bounded_memory(
    two: tuple[Stack, Stack], repeats: int, per_page: int
) -> None:
    """30 KB of archive took crabd from 81 MB to 2.8 GB before MemoryError; now: refused at the root."""
    a, b = two
    importer = b.service.archives.archives
    assert importer is not None
    # The overlay backend's decoders (the fakes' file system stores its trees as JSON).
    importer.checker = ReferenceChecker(OverlayDelta(b.blobs), b.images)

    async def body() -> None:
        async with _engines(a, b):
            rec = await a.service.create(ALICE, spec("web", checkpoints="fs"))
            ck = await a.service.create_checkpoint(ALICE, rec.id, "", "fs")
            o = open_archive(await _export(a, ALICE, ck.id))
            _repeating_archive(o, repeats, per_page)
            forged = o.pack()
            assert len(forged) < 200_000
            before = _world(b)
            tracemalloc.start()
            t0 = time.monotonic()
            try:
                with pytest.raises(ArchiveRejected) as err:
                    await _import(b, ALICE, forged)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert time.monotonic() - t0 < 10 and peak < 50 << 20, peak
            assert err.value.reason in ("bounds", "references")
            assert _world(b) == before and _staging_empty(b)

    run(body())


async def _blocked(gate: asyncio.Event, data: bytes) -> AsyncIterator[bytes]:
    yield data[:1024]
    await gate.wait()
    yield data[1024:]


def test_concurrent_imports_per_uid_are_capped(two: tuple[Stack, Stack]) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            rec = await a.service.create(ALICE, spec("web", checkpoints="fs"))
            ck = await a.service.create_checkpoint(ALICE, rec.id, "", "fs")
            data = await _export(a, ALICE, ck.id)
            bobs = await a.service.create(BOB, spec("bob", checkpoints="fs"))
            bob_data = await _export(a, BOB, (await a.service.create_checkpoint(BOB, bobs.id, "", "fs")).id)
            gate = asyncio.Event()
            slow = [
                asyncio.create_task(b.service.archives.import_archive(ALICE, _blocked(gate, data))) for _ in range(2)
            ]
            await asyncio.sleep(0.2)
            with pytest.raises(QuotaExceeded) as err:
                await asyncio.wait_for(b.service.archives.import_archive(ALICE, _blocked(gate, data)), 5)
            assert err.value.attrs["quota"] == "max_concurrent_imports"
            # Another uid is not held up by Alice's imports.
            other = asyncio.create_task(b.service.archives.import_archive(BOB, _blocked(gate, bob_data)))
            gate.set()
            results = await asyncio.gather(*slow, other, return_exceptions=True)
            assert not isinstance(results[-1], BaseException)  # Bob's went through
            assert sum(not isinstance(r, BaseException) for r in results[:-1]) >= 1
            # The slots are given back.
            again = await _import(b, ALICE, data)
            assert again.checkpoints

    run(body())


def test_what_an_import_reports_and_charges_does_not_tell_whether_another_tenant_holds_its_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bob holds the archive's files on b, nobody does on c: Alice's import of it reads the same on both."""
    a = _stack(tmp_path / "a", monkeypatch)
    b = _stack(tmp_path / "b", monkeypatch)
    c = _stack(tmp_path / "c", monkeypatch)

    async def body() -> None:
        async with _engines(a, b, c):
            content = secrets.token_hex(20_000)
            rec = await a.service.create(ALICE, spec("web", checkpoints="fs"))
            a.write(rec.id, "doc.txt", content)
            ck = await a.service.create_checkpoint(ALICE, rec.id, "", "fs")
            data = await _export(a, ALICE, ck.id)
            bobs = await b.service.create(BOB, spec("bob", checkpoints="fs"))
            b.write(bobs.id, "doc.txt", content)
            theirs = await b.service.create_checkpoint(BOB, bobs.id, "", "fs")
            assert theirs.index_blob == ck.index_blob  # the same files: the same index blob
            on_b, on_c = await _import(b, ALICE, data), await _import(c, ALICE, data)
            assert (on_b.stored_blobs, on_b.blobs) == (on_c.stored_blobs, on_c.blobs)
            got_b, got_c = b.catalog.get(ck.id), c.catalog.get(ck.id)
            assert got_b.stats["new_bytes"] == got_c.stats["new_bytes"] > 0
            # Bob's checkpoint is intact, and Alice's restores hers.
            assert b.stored_files(b.catalog.get(theirs.id))["doc.txt"] == content
            assert b.stored_files(got_b)["doc.txt"] == content

    run(body())
