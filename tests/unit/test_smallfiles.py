"""Opening host files without following a link or blocking on a fifo, and reading them bounded (util/smallfiles.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crabd.util.smallfiles import NotRegular, open_regular, read_bounded, read_small


def test_a_regular_file_opens_by_path_or_under_a_directory_fd(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    fd = open_regular(tmp_path / "f")
    try:
        assert os.read(fd, 10) == b"abc"
    finally:
        os.close(fd)
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_regular("f", dir_fd=d)
        os.close(fd)
    finally:
        os.close(d)


def test_a_link_is_refused_not_followed(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"secret")
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(OSError) as info:
        open_regular(tmp_path / "link")
    assert not isinstance(info.value, NotRegular)  # ELOOP from the kernel, before anything is opened
    assert read_small(tmp_path / "link") is None


def test_a_fifo_is_refused_without_blocking_and_a_directory_too(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would hang the test
    with pytest.raises(NotRegular):
        open_regular(tmp_path / "fifo")
    with pytest.raises(NotRegular):
        open_regular(tmp_path)
    assert read_small(tmp_path / "fifo") is None


def test_reads_stop_one_byte_past_the_bound(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 5000)
    fd = open_regular(tmp_path / "big")
    try:
        assert len(read_bounded(fd, 100)) == 101  # the caller sees "over the bound", and reads no further
    finally:
        os.close(fd)
    assert read_small(tmp_path / "big", limit=4999) is None
    assert read_small(tmp_path / "big", limit=5000) == b"x" * 5000
    assert read_small(tmp_path / "absent") is None
