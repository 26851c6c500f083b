"""Doctor's decision logic, fed with fake host facts."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.config import CrabConfig
from crabd.host import doctor
from crabd.host.checks import Status

FULL = {k: "y" for k in doctor.KERNEL_NEEDS}


def test_parse_criu_version() -> None:
    assert doctor.parse_criu_version("Version: 4.2.1\n") == (4, 2, 1)
    assert doctor.parse_criu_version("Version: 3.17\nGitID: x") == (3, 17)
    assert doctor.parse_criu_version("garbage") is None


def test_kernel_all_present() -> None:
    assert doctor.check_kernel(dict(FULL)).status is Status.OK


def test_kernel_missing_feature_is_named() -> None:
    cfg = dict(FULL)
    del cfg["CONFIG_CHECKPOINT_RESTORE"]
    check = doctor.check_kernel(cfg)
    assert check.status is Status.FAIL
    assert "CONFIG_CHECKPOINT_RESTORE" in check.summary
    assert check.fix


def test_cgroup_layouts(tmp_path: Path) -> None:
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.procs").write_text("")
    (tmp_path / "freezer").mkdir()
    assert doctor.cgroup_layout(tmp_path) == "hybrid"
    assert doctor.check_cgroups(tmp_path).status is Status.OK
    (tmp_path / "cgroup.controllers").write_text("")
    assert doctor.cgroup_layout(tmp_path) == "unified"


def test_cgroup_v1_without_freezer_fails(tmp_path: Path) -> None:
    check = doctor.check_cgroups(tmp_path)
    assert check.status is Status.FAIL
    assert "freezer" in check.fix


@pytest.mark.parametrize(
    ("min_free", "warn_free", "expected"),
    [(0.0, 0.0, Status.OK), (1e9, 1e9, Status.FAIL), (0.0, 1e9, Status.WARN)],
)
def test_disk_thresholds(tmp_path: Path, min_free: float, warn_free: float, expected: Status) -> None:
    cfg = CrabConfig.model_validate(
        {
            "paths": {"state_dir": str(tmp_path / "not" / "yet")},
            "doctor": {"min_free_gib": min_free, "warn_free_gib": warn_free},
        }
    )
    check = doctor.check_disk(cfg)
    assert check.status is expected
    assert "not created yet" in check.summary


def test_criu_missing_from_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    check = doctor.check_criu()
    assert check.status is Status.FAIL
    assert "not on PATH" in check.summary
    assert "make setup" in check.fix


def test_criu_too_old(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    check = doctor.check_criu()
    assert check.status is Status.FAIL
    assert "3.17.1" in check.summary and ">= 4.2" in check.summary


def test_criu_config_check(tmp_path: Path) -> None:
    conf = tmp_path / "runc.conf"
    assert doctor.check_criu_config(conf).status is Status.FAIL
    conf.write_text("# crab\ntcp-established\n")
    assert doctor.check_criu_config(conf).status is Status.WARN
    conf.write_text("# crab\ntcp-established\nnetwork-lock skip\n")
    assert doctor.check_criu_config(conf).status is Status.OK


def test_conntrack_check(tmp_path: Path) -> None:
    table = tmp_path / "nf_conntrack_buckets"
    assert doctor.check_conntrack(table).status is Status.OK  # no table: nothing to walk
    table.write_text("262144\n")
    check = doctor.check_conntrack(table)
    assert check.status is Status.WARN and "~20 ms" in check.summary
    table.write_text("32768\n")
    assert doctor.check_conntrack(table).status is Status.OK
    table.write_text("many\n")
    assert doctor.check_conntrack(table).status is Status.WARN


def test_failed_checkpoints_are_reported_with_their_log(tmp_path: Path) -> None:
    from crabd.config import CrabConfig, PathsConfig
    from crabd.models import CheckpointKind
    from crabd.store.catalog import Catalog
    from crabd.store.db import Database

    cfg = CrabConfig(paths=PathsConfig(state_dir=tmp_path))
    assert doctor.check_checkpoint_failures(cfg).status is Status.OK
    with Database(tmp_path / "registry.db") as db:
        full = CheckpointKind.FULL
        Catalog(db).record_failure("sb1", 3, full, "CRIU could not dump: bad socket", "/var/log/x-dump.log")
    check = doctor.check_checkpoint_failures(cfg)
    assert check.status is Status.WARN
    assert "/var/log/x-dump.log" in check.summary and "bad socket" in check.summary
