"""CRIU's kernel-feature cache: where crabd writes it, and what doctor says (host/criu_kdat.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crabd.errors import HostError
from crabd.host import criu_kdat
from crabd.host.criu_kdat import KdatState

SHM = Path("/dev/shm")


def test_a_disk_run_dir_without_the_cache_is_absent(tmp_path: Path) -> None:
    found = criu_kdat.status(tmp_path)
    assert found.state is KdatState.ABSENT and "probes the kernel again" in found.detail


def test_install_replaces_the_cache_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "criu.kdat").write_bytes(b"old boot")
    criu_kdat.install(b"this boot", tmp_path)
    assert (tmp_path / "criu.kdat").read_bytes() == b"this boot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["criu.kdat"]
    assert criu_kdat.status(tmp_path).state is KdatState.INSTALLED


def test_install_writes_through_no_planted_link(tmp_path: Path) -> None:
    """The cache is renamed over a link at its name, never written through it."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / "criu.kdat").symlink_to(victim)
    criu_kdat.install(b"cache", run)
    assert victim.read_bytes() == b"keep"
    assert not (run / "criu.kdat").is_symlink() and (run / "criu.kdat").read_bytes() == b"cache"


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm tmpfs on this host")
def test_a_tmpfs_run_dir_is_left_to_criu(tmp_path: Path) -> None:
    assert criu_kdat.run_is_tmpfs(SHM) and not criu_kdat.run_is_tmpfs(tmp_path)
    assert criu_kdat.status(SHM).state is KdatState.CRIU_KEEPS
    # ensure() writes nothing there and never runs CRIU (no such binary is needed).
    before = set(os.listdir(SHM))
    assert criu_kdat.ensure("/nonexistent/criu", SHM).state is KdatState.CRIU_KEEPS
    assert set(os.listdir(SHM)) == before


def test_a_probe_that_cannot_run_is_a_host_error_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="kernel-feature cache") as info:
        criu_kdat.ensure(str(tmp_path / "no-criu"), tmp_path)
    assert "40 ms" in info.value.hint
    assert list(tmp_path.iterdir()) == []
