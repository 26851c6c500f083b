"""statx's mount-root attribute: whether a path is a mount point, without reading the mount table."""

from __future__ import annotations

import os
from pathlib import Path

from crabd.util import libc


def test_mount_roots_are_told_apart_from_plain_directories(tmp_path: Path) -> None:
    assert libc.is_mount_root("/proc") is True  # this kernel (>= 5.8) answers
    assert libc.is_mount_root(tmp_path) is False
    assert libc.is_mount_root(tmp_path / "missing") is False
    link = tmp_path / "proc-link"
    os.symlink("/proc", link)
    assert libc.is_mount_root(link) is False  # a symlink is not followed
