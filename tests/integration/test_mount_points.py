"""rootfs.is_mounted and rootfs.umount on real mounts: one system call each, no read of the mount table."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.backends.runc import rootfs
from tests.conftest import have_root, require


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Path]:
    require(have_root(), "needs root")
    at = tmp_path / "m"
    at.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "crab-test", str(at)], check=True)
    yield at
    subprocess.run(["umount", "-l", str(at)], check=False, capture_output=True)


def test_mounted_unmounted_and_a_symlink_to_a_mount(mounted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_table(*args: object, **kwargs: object) -> None:
        raise AssertionError("the mount table was read")

    (mounted / "inner").mkdir()
    link = mounted.parent / "link"
    os.symlink(mounted, link)
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda f, *a, **k: no_table() if str(f) == "/proc/self/mountinfo" else real_open(f, *a, **k)
    )
    assert rootfs.is_mounted(mounted) and not rootfs.is_mounted(mounted / "inner")
    assert not rootfs.is_mounted(link) and not rootfs.umount(link)  # never followed
    assert rootfs.umount(mounted) and not rootfs.is_mounted(mounted)
    assert not rootfs.umount(mounted) and not rootfs.umount(mounted.parent / "missing")


def test_a_busy_mount_is_detached(mounted: Path) -> None:
    fd = os.open(mounted, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(mounted / "f", "w") as f:  # an open file inside: umount(2) says EBUSY
            assert rootfs.umount(mounted) and not rootfs.is_mounted(mounted)
            f.write("still writable through the open file")
    finally:
        os.close(fd)
