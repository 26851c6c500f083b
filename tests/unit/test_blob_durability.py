"""Blob files are fsync'd before they get their name, and a file at an address is adopted only if intact."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from crabd.store.fsblobs import ONE_SHOT, FileBlobStore

SMALL = b"small blob content " * 50
LARGE = os.urandom(ONE_SHOT + 12345)  # goes through put_pieces (streamed)


def _torn_variants(good: bytes) -> list[bytes]:
    # What a power cut (or a bad disk) can leave at the address: nothing, a
    # prefix of the right file, or garbage of the right length.
    return [b"", good[: len(good) // 2], b"\0" * len(good)]


@pytest.mark.parametrize("content", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("variant", range(3))
def test_a_torn_file_at_the_address_is_replaced_not_adopted(tmp_path: Path, content: bytes, variant: int) -> None:
    before = FileBlobStore(tmp_path)  # the crabd that ran before the power cut
    hex_ = before.put_bytes(content).hex
    path = before.path(hex_)
    path.write_bytes(_torn_variants(path.read_bytes())[variant])

    store = FileBlobStore(tmp_path)  # the crabd after the restart
    put = store.put_bytes(content)
    assert put.hex == hex_ and put.stored > 0  # written again, not "already stored"
    assert store.read_bytes(hex_, limit=len(content)) == content
    # put_pieces (the streaming path) repairs the same way.
    path.write_bytes(b"")
    again = FileBlobStore(tmp_path).put_pieces([content[:1000], content[1000:]])
    assert again.stored > 0 and FileBlobStore(tmp_path).read_bytes(hex_, limit=len(content)) == content


def test_an_intact_file_is_adopted_once_verified_and_then_trusted(tmp_path: Path) -> None:
    hex_ = FileBlobStore(tmp_path).put_bytes(SMALL).hex
    ino = FileBlobStore(tmp_path).path(hex_).stat().st_ino
    store = FileBlobStore(tmp_path)
    reads: list[str] = []
    real = store.iter_content

    def counting(h: str) -> Iterator[bytes]:
        reads.append(h)
        return real(h)

    store.iter_content = counting  # type: ignore[method-assign,assignment]
    assert store.put_bytes(SMALL).stored == 0
    assert store.put_pieces([SMALL]).stored == 0
    assert reads == [hex_]  # verified once, remembered after
    assert store.path(hex_).stat().st_ino == ino  # adopted, not rewritten
    # A removed blob is forgotten: storing it again writes it.
    store.remove(hex_)
    assert store.put_bytes(SMALL).stored > 0


@pytest.mark.parametrize("put", [lambda s: s.put_bytes(SMALL), lambda s: s.put_pieces([LARGE])])
def test_data_is_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, put: Callable[[FileBlobStore], Any]
) -> None:
    store = FileBlobStore(tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: Any, dst: Any) -> None:
        events.append(("rename", str(src)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    put(store)
    # (os is patched process-wide: only the store's own renames count; the
    # first rename into a new fan-out directory is tried twice.)
    [tmp] = {e[1] for e in events if e[0] == "rename" and e[1].startswith(str(store.tmp))}
    assert ("fsync", tmp) in events
    assert events.index(("fsync", tmp)) < events.index(("rename", tmp))


def test_replacement_is_a_valid_single_frame(tmp_path: Path) -> None:
    # The repaired file is a normal blob file (one zstd frame of the content).
    hex_ = FileBlobStore(tmp_path).put_bytes(SMALL).hex
    FileBlobStore(tmp_path).path(hex_).write_bytes(b"junk")
    store = FileBlobStore(tmp_path)
    store.put_bytes(SMALL)
    assert zstandard.ZstdDecompressor().decompress(store.path(hex_).read_bytes()) == SMALL
    assert not any(store.tmp.iterdir())  # no temp file left behind
