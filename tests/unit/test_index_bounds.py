"""Checkpoint metadata is bounded by construction: every page, root and delta written can be read back."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from crabd.backends.fsdelta import Entry, Extent, Kind
from crabd.backends.overlay import index
from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.entries import (
    decode_delta,
    decode_root,
    encode_entry,
    encoded_size,
)
from crabd.backends.overlay.index import (
    DELTA_MAX_BYTES,
    MAX_META_BLOB,
    PAGE_MAX,
    PAGE_MAX_BYTES,
    PageCache,
    build_index,
    paginate,
)
from crabd.errors import TooManyEntries
from crabd.store.fsblobs import FileBlobStore


def _entry(path: bytes, **kw: object) -> Entry:
    return Entry(path, Kind.REG, 0o644, 0, 0, 0, 0, 0, 0, 1, 1, **kw)  # type: ignore[arg-type]


def test_encoded_size_is_exact() -> None:
    for e in (
        _entry(b"a"),
        _entry(b"x" * 5000, target=b"t", link_to=b"l" * 9),
        _entry(b"f", xattrs=[(b"user.a", b"v" * 100), (b"security.capability", b"\0" * 20)]),
        _entry(b"big", extents=[Extent(i << 22, 1 << 22, "ab" * 32) for i in range(7)]),
    ):
        out = bytearray()
        encode_entry(e, out)
        assert encoded_size(e) == len(out)


def test_pages_stop_at_the_byte_bound_without_moving_ordinary_boundaries() -> None:
    # Paths that never hash to a boundary: only the caps cut.
    def no_boundary(i: int, width: int) -> bytes:
        n = 0
        while True:
            p = b"d/" + f"{i:08d}-{n}-".encode() + b"x" * width
            if zlib.crc32(p) % index.PAGE_FANOUT:
                return p
            n += 1

    long = [_entry(no_boundary(i, 200_000)) for i in range(60)]
    pages = paginate(long)
    assert len(pages) > 1 and sum(map(len, pages)) == 60
    for page in pages:
        assert len(page) == 1 or sum(map(encoded_size, page)) + 12 <= PAGE_MAX_BYTES
    # Short paths: the byte bound never binds, pages are what they always were.
    short = [_entry(no_boundary(i, 10)) for i in range(PAGE_MAX + 10)]
    assert [len(p) for p in paginate(short)] == [PAGE_MAX, 10]


def test_an_entry_no_page_can_hold_is_refused_before_anything_is_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (A real one needs ~256 MiB of xattrs; the rule is the same at any limit.)
    monkeypatch.setattr(index, "MAX_META_BLOB", 1 << 20)
    store = FileBlobStore(tmp_path)
    entries = [_entry(b"a"), _entry(b"b", xattrs=[(b"user.x", b"v" * (1 << 20))]), _entry(b"c")]
    with pytest.raises(TooManyEntries, match="more than the 1048576"):
        build_index(entries, store)
    assert list(store.iter_all()) == []


def _deep_tree(upper: Path, depth: int, files: int) -> int:
    """``depth`` nested dirs of 255-byte names, then ``files`` files: pages of ~140 KB paths.

    The names are chosen so the deepest directory ends a page and no file
    does: before the byte bound, all ``files`` files shared one page.
    Returns the length of a file's path.
    """
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    crc, plen = 0, 0
    try:
        for level in range(depth):
            n = 0
            while True:
                name = f"{level:04d}-{n:06d}-".encode().ljust(255, b"d")
                sep = b"/" if plen else b""
                c = zlib.crc32(sep + name, crc)
                # The last level must be a page boundary; the others must not matter.
                if level < depth - 1 or c % index.PAGE_FANOUT == 0:
                    break
                n += 1
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, crc, plen = nxt, c, plen + len(sep) + len(name)
        made, n = 0, 0
        while made < files:
            name = f"f{n:07d}".encode()
            n += 1
            if zlib.crc32(b"/" + name, crc) % index.PAGE_FANOUT == 0:
                continue
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            made += 1
    finally:
        os.close(fd)
    return plen + 1 + 8


def test_long_paths_make_a_checkpoint_that_loads_again(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    # 540 levels x 256 bytes = 138 KB per path; 2048 such paths in one page
    # were 283 MB, over the 256 MiB a reader accepts: the checkpoint was
    # published and could never be restored.
    plen = _deep_tree(upper, depth=540, files=PAGE_MAX)
    assert PAGE_MAX * plen > MAX_META_BLOB
    blobs = FileBlobStore(tmp_path / "blobs")
    fs = OverlayDelta(blobs, cache=PageCache(0))
    capture, stored = fs.store(fs.capture(fs.prepare(upper, None, 0)))
    total = len(capture.added)
    assert total == 540 + PAGE_MAX
    _, pages = decode_root(blobs.read_bytes(stored.index_blob, limit=MAX_META_BLOB))
    assert len(pages) > 1
    for hex_, count in pages:
        assert count == 1 or len(blobs.read_bytes(hex_, limit=MAX_META_BLOB)) <= PAGE_MAX_BYTES
    loaded = OverlayDelta(blobs, cache=PageCache(0)).load(stored.index_blob)
    assert [e.path for e in loaded] == [e.path for e in capture.tree]
    del loaded
    # The delta keeps the first changes by path within its bound; the listing knows it is short.
    raw = blobs.read_bytes(stored.delta_blob, limit=MAX_META_BLOB)
    assert len(raw) <= DELTA_MAX_BYTES
    added, changed, deleted = decode_delta(raw)
    assert 0 < len(added) < total and not changed and not deleted
    assert [e.path for e in added] == sorted(e.path for e in capture.added)[: len(added)]
    shown, truncated = fs.changes(stored.delta_blob, 10_000)
    assert len(shown) == len(added) and not truncated  # the service adds truncated from the stats


def test_a_short_delta_is_listed_as_truncated() -> None:
    import asyncio
    import dataclasses
    from types import SimpleNamespace

    from crabd.backends.fsdelta import Change
    from crabd.coordinator.housekeeping import Contents
    from crabd.models import Caller, CheckpointKind, CheckpointRecord
    from crabd.service.remote import RemoteCheckpoints
    from crabd.service.service import Service

    rec = CheckpointRecord(
        id="ck-1", sandbox_id="sb", sandbox_name="sb", owner_uid=0, parent_id=None, branch=0, turn=1,
        kind=CheckpointKind.FS, created_at=0.0, label="", image="", spec_json="{}", index_blob="", delta_blob="d",
        session_blob=None, process_blob=None, racy_ns=0, stats={"changed": 500, "deleted": 20},
    )  # fmt: skip
    kept = [Change(b"p%d" % i, "added", "file") for i in range(300)]

    async def describe(_rec: object, limit: int) -> Contents:
        return Contents(kept[:limit], len(kept) > limit, None)

    svc = Service.__new__(Service)
    svc.catalog = SimpleNamespace(find=lambda _id: rec, lineage=lambda _id: [rec])  # type: ignore[assignment]
    svc.housekeeping = SimpleNamespace(describe=describe)  # type: ignore[assignment]
    svc.remote = RemoteCheckpoints(svc.catalog)

    async def as_kept(recs: list[object]) -> list[object]:
        return recs

    svc.retention = SimpleNamespace(annotate=as_kept)  # type: ignore[assignment]
    detail = asyncio.run(svc.describe_checkpoint(Caller(uid=0, gid=0, pid=1), "ck-1"))
    assert len(detail.changes) == 300 and detail.truncated
    rec = dataclasses.replace(rec, stats={"changed": 280, "deleted": 20})
    detail = asyncio.run(svc.describe_checkpoint(Caller(uid=0, gid=0, pid=1), "ck-1"))
    assert not detail.truncated
