"""Restores never expand past a bound computed before the first write (defence in depth behind imports).

The stored metadata here is hostile but already in the store (say, imported before the import checks
existed): loading an index is capped while it decodes, and materialize / image writes refuse before
creating anything.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from crabd.backends.fsdelta import Entry, Extent, Kind, ScanLimits
from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.entries import encode_page, encode_root
from crabd.backends.overlay.index import load_index, outline_index
from crabd.backends.overlay.materialize import materialize
from crabd.errors import StoreError, StoreFull, TooManyEntries
from crabd.store.fsblobs import FileBlobStore


def _file(path: bytes, *extents: Extent, size: int = 0) -> Entry:
    return Entry(path, Kind.REG, 0o644, 0, 0, size, 0, 0, 0, 0, 1, extents=list(extents))


def _repeating_root(blobs: FileBlobStore, repeats: int, per_page: int) -> str:
    page = blobs.put_bytes(encode_page([_file(b"f%06d" % i) for i in range(per_page)])).hex
    return blobs.put_bytes(encode_root(repeats * per_page, [(page, per_page)] * repeats)).hex


@pytest.mark.parametrize(("repeats", "per_page"), [(200_000, 100), (200_000, 1)])
def test_loading_an_index_that_repeats_one_page_is_refused_at_its_root(
    tmp_path: Path, repeats: int, per_page: int
) -> None:
    """Before: 200,000 x 100 references to one page's entries (and more per step after); now the root's total
    or its repeated page stops the load before any page is decoded."""
    blobs = FileBlobStore(tmp_path / "blobs")
    root = _repeating_root(blobs, repeats, per_page)
    fs = OverlayDelta(blobs)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises((TooManyEntries, StoreError)):
            fs.load(root)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 5 and peak < 50 << 20, peak


def test_a_page_holding_more_entries_than_its_root_says_is_refused_before_decoding_them(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    page = blobs.put_bytes(encode_page([_file(b"f%06d" % i) for i in range(50_000)])).hex
    root = blobs.put_bytes(encode_root(1, [(page, 1)])).hex
    tracemalloc.start()
    try:
        with pytest.raises(StoreError, match="its index says 1"):
            load_index(root, blobs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The page's bytes are read (a few MB), none of its 50,000 entries is built (that took ~20 MB more).
    assert peak < 3 * len(blobs.read_bytes(page, limit=1 << 30)), peak


def test_an_index_repeating_a_path_is_refused(tmp_path: Path) -> None:
    blobs = FileBlobStore(tmp_path / "blobs")
    page = blobs.put_bytes(encode_page([_file(b"a"), _file(b"a")])).hex
    root = blobs.put_bytes(encode_root(2, [(page, 2)])).hex
    with pytest.raises(StoreError, match="repeats"):
        load_index(root, blobs)


def test_the_outline_counts_every_repeated_reference(tmp_path: Path) -> None:
    """Many entries naming one 4 MiB blob write it out each time: the outline's bytes say so."""
    blobs = FileBlobStore(tmp_path / "blobs")
    big = blobs.put_bytes(bytes(4 << 20)).hex
    entries = [_file(b"f%04d" % i, Extent(0, 4 << 20, big), size=4 << 20) for i in range(256)]
    page = blobs.put_bytes(encode_page(entries)).hex
    root = blobs.put_bytes(encode_root(256, [(page, 256)])).hex

    def read(hex_: str, limit: int) -> bytes:
        return blobs.read_bytes(hex_, limit=limit)

    out = outline_index(root, read, ScanLimits())
    assert out.entries == 256 and out.bytes == 256 << 22 and out.children == {root: {page}, page: {big}}
    with pytest.raises(TooManyEntries):
        outline_index(root, read, ScanLimits(max_restore_bytes=64 << 20))
    # And materialize refuses the same tree before its first write.
    target = tmp_path / "upper"
    target.mkdir()
    with pytest.raises(StoreFull):
        materialize(entries, blobs, target, max_bytes=64 << 20)
    assert not any(target.iterdir())


def test_materialize_never_writes_past_an_extent(tmp_path: Path) -> None:
    """An extent that says 10 bytes of a 4 MiB blob writes at most 10 (the bound computed before holds)."""
    blobs = FileBlobStore(tmp_path / "blobs")
    big = blobs.put_bytes(bytes(4 << 20)).hex
    target = tmp_path / "upper"
    target.mkdir()
    with pytest.raises(StoreError, match="more than the 10 bytes"):
        materialize([_file(b"f", Extent(0, 10, big), size=10)], blobs, target)
    assert (target / "f").stat().st_size <= 10
