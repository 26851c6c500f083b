"""CRIU images in the blob store: page-level de-duplication and exact write-back."""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.backends.criu import imagestore, sockets
from crabd.backends.criu.hotimages import HotImages
from crabd.backends.criu.images import COMMON_MAGIC, PSTREE_MAGIC, dumped_tasks
from crabd.backends.criu.imagestore import PAGE, ImageStore
from crabd.errors import CorruptBlob
from crabd.store.blobs import PutResult
from crabd.store.fsblobs import FileBlobStore


def _dump(d: Path, pages: list[bytes], extra: bytes = b"core") -> Path:
    d.mkdir()
    (d / "pages-1.img").write_bytes(b"".join(pages))
    (d / "core-1.img").write_bytes(extra)
    (d / "descriptors.json").write_text('["/dev/null"]')
    return d


def _same_dirs(a: Path, b: Path) -> None:
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_pages_are_stored_once_and_written_back_exactly(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    store = ImageStore(blobs)
    pages = [os.urandom(PAGE) for _ in range(3000)]
    pages += pages[:500]  # a forked child shares its parent's pages
    first_dir = _dump(tmp_path / "d1", pages)
    first = store.store(first_dir, None)
    assert first.pages == 3500 and first.pages_new == 3000
    assert first.new_bytes > 3000 * PAGE  # random pages do not compress

    pages2 = list(pages)
    pages2[10] = os.urandom(PAGE)  # one page changed
    pages2.insert(100, os.urandom(PAGE))  # one page added: later pages shift, still de-duplicated
    second_dir = _dump(tmp_path / "d2", pages2, extra=b"core v2")
    second = ImageStore(blobs).store(second_dir, first.manifest)  # a fresh store: reads the page index
    assert second.pages_new == 2
    assert second.new_bytes < 0.05 * first.new_bytes

    out = tmp_path / "out"
    out.mkdir()
    store.write(second.manifest, out)
    _same_dirs(second_dir, out)
    assert second.children[second.manifest] >= {blobs.put_bytes(b"core v2").hex}


def test_an_unchanged_metadata_file_is_hashed_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most of a dump's small files are the previous dump's: stored again, they write no temporary
    blob file.  A file larger than one read still streams through ``put_pieces``; both come back exact."""
    blobs = FileBlobStore(tmp_path / "blobs")
    store = ImageStore(blobs)
    d1 = _dump(tmp_path / "d1", [os.urandom(PAGE)])
    (d1 / "pipes-data.img").write_bytes(os.urandom(3 * 4096))
    store.store(d1, None)
    streamed: list[int] = []
    put_pieces = blobs.put_pieces

    def counted(pieces: Iterator[bytes]) -> PutResult:
        streamed.append(1)
        return put_pieces(pieces)

    monkeypatch.setattr(blobs, "put_pieces", counted)
    again = store.store(d1, None)
    assert streamed == [] and again.new_bytes == 0

    monkeypatch.setattr(imagestore, "_READ", 4096)  # pipes-data.img is now larger than one read
    big = store.store(d1, None)
    assert streamed == [1] and big.manifest == again.manifest
    out = tmp_path / "out"
    out.mkdir()
    store.write(big.manifest, out)
    _same_dirs(d1, out)


def test_corrupt_pack_is_detected(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    store = ImageStore(blobs)
    image = store.store(_dump(tmp_path / "d", [os.urandom(PAGE) for _ in range(8)]), None)
    pack = next(c for c in image.children[image.manifest] if image.sizes.get(c) == 8 * PAGE)
    path = blobs.path(pack)
    path.write_bytes(blobs.path(blobs.put_bytes(b"other").hex).read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptBlob):
        store.write(image.manifest, out)


def test_pstree_is_read_without_criu_tools(tmp_path: Path) -> None:
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            b = n & 0x7F
            n >>= 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)

    def entry(pid: int, ppid: int, threads: list[int]) -> bytes:
        msg = b"\x08" + varint(pid) + b"\x10" + varint(ppid) + b"\x18" + varint(pid) + b"\x20" + varint(1)
        msg += b"".join(b"\x28" + varint(t) for t in threads)
        return struct.pack("<I", len(msg)) + msg

    (tmp_path / "pstree.img").write_bytes(
        struct.pack("<II", COMMON_MAGIC, PSTREE_MAGIC) + entry(1, 0, [1]) + entry(300, 1, [300, 301])
    )
    tasks = dumped_tasks(tmp_path)
    assert [(t.pid, t.ppid, t.threads) for t in tasks] == [(1, 0, (1,)), (300, 1, (300, 301))]


# --- the hot copy (backends/criu/hotimages.py) -----------------------------------------------


def _files_img_with_an_outside_connection() -> bytes:
    """A files.img holding one established TCP socket from 10.0.0.2 to 10.0.0.9 (sockets.py rewrites it)."""

    def word(a: str) -> int:
        return int.from_bytes(bytes(int(x) for x in a.split(".")), "little")

    isk = sockets._encode(
        [(5, 0, 6), (6, 0, 1), (7, 0, 40000), (8, 0, 80), (11, 0, word("10.0.0.2")), (12, 0, word("10.0.0.9"))]
    )
    rec = sockets._encode([(1, 0, 5), (4, 2, isk)])
    return struct.pack("<II", COMMON_MAGIC, 0x56505244) + struct.pack("<I", len(rec)) + rec


def test_a_kept_dump_is_linked_and_never_written_through(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    hot = HotImages(tmp_path / "hot", 1 << 30, boot_id="b")
    store = ImageStore(blobs, hot=hot)
    (tmp_path / "work").mkdir()
    d = _dump(tmp_path / "work" / "images", [os.urandom(PAGE) for _ in range(64)])
    (d / "files.img").write_bytes(_files_img_with_an_outside_connection())
    want = {p.name: p.read_bytes() for p in d.iterdir()}
    image = store.store(d, None)
    store.keep(image.manifest, d, "sb1")
    assert not d.exists() and image.manifest in hot

    out = tmp_path / "out"
    out.mkdir()
    written = store.write(image.manifest, out)
    assert written.source == "hot" and written.nbytes == sum(len(v) for v in want.values())
    # The restore's rewrite of files.img replaces the link: the kept copy keeps the stored bytes.
    assert store.close_external_connections(out) == {"closed": 1, "unbound": 0}
    entry = tmp_path / "hot" / image.manifest
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == want
    assert (out / "files.img").read_bytes() != want["files.img"]
    assert (out / "files.img").stat().st_ino != (entry / "files.img").stat().st_ino
    assert (out / "pages-1.img").stat().st_ino == (entry / "pages-1.img").stat().st_ino

    # Exactly what the blob store writes back.
    from_blobs = tmp_path / "from-blobs"
    from_blobs.mkdir()
    assert ImageStore(blobs).write(image.manifest, from_blobs).source == "blobs"
    _same_dirs(entry, from_blobs)


def test_without_a_hot_copy_the_store_writes_and_keep_deletes(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    plain = ImageStore(blobs)
    d = _dump(tmp_path / "d", [os.urandom(PAGE) for _ in range(4)])
    image = plain.store(d, None)
    plain.keep(image.manifest, d, "sb")
    assert not d.exists()  # no cache: handed over means deleted

    hot = HotImages(tmp_path / "hot", 100, boot_id="b")  # too small for this dump
    store = ImageStore(blobs, hot=hot)
    d = _dump(tmp_path / "d", [os.urandom(PAGE) for _ in range(4)])
    image = store.store(d, None)
    want = {p.name: p.read_bytes() for p in d.iterdir()}
    store.keep(image.manifest, d, "sb")
    assert not d.exists() and hot.usage() == (0, 0)
    out = tmp_path / "out"
    out.mkdir()
    assert store.write(image.manifest, out).source == "blobs"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == want


def test_a_vanished_hot_copy_falls_back_to_the_blobs(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    hot = HotImages(tmp_path / "hot", 1 << 30, boot_id="b")
    store = ImageStore(blobs, hot=hot)
    d = _dump(tmp_path / "d", [os.urandom(PAGE) for _ in range(4)])
    image = store.store(d, None)
    want = {p.name: p.read_bytes() for p in d.iterdir()}
    store.keep(image.manifest, d, "sb")
    shutil.rmtree(tmp_path / "hot" / image.manifest)
    out = tmp_path / "out"
    out.mkdir()
    written = store.write(image.manifest, out)
    assert written.source == "blobs"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == want
