"""CRIU images in the blob store: page-level de-duplication and exact write-back."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from crabd.backends.criu.images import COMMON_MAGIC, PSTREE_MAGIC, dumped_tasks
from crabd.backends.criu.imagestore import PAGE, ImageStore
from crabd.errors import CorruptBlob
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
