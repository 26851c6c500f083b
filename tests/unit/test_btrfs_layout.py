"""The btrfs pool's names, config, error mapping and backend choice (no root, no btrfs)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from crabd.backends.btrfs import ioctl
from crabd.backends.btrfs.layout import SubvolKind, SubvolRef, is_id, is_tmp_name, validate_id
from crabd.backends.btrfs.pool import POOL_FULL_HINT, Pool, PoolOp
from crabd.config import BtrfsConfig, CrabConfig, load_config
from crabd.errors import ConfigError, InvalidRequest, SnapshotError, StoreError, StoreFull
from crabd.host import backend_check
from crabd.host.backend_check import BackendFacts, PoolFacts, SandboxBackend, choose_backend
from crabd.host.checks import Status


@pytest.mark.parametrize("good", ["0a1b2c3d4e5f", "ck-0a1b2c3d4e5f", "A_b-9", "x" * 128])
def test_valid_ids(good: str) -> None:
    assert validate_id(good) == good
    assert is_id(good)


@pytest.mark.parametrize(
    "bad", ["", ".", "..", "a/b", "../x", "/abs", "a b", "a\0b", "tmp-123", "-x", "x" * 129, "a.b", "é"]
)
def test_invalid_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_id(bad)
    with pytest.raises(InvalidRequest):
        SubvolRef.sandbox(bad)


def test_layout_paths_and_tmp_names() -> None:
    sb, ck = SubvolRef.sandbox("abc"), SubvolRef.snapshot("ck-1")
    assert sb.relpath == "sandboxes/abc" and ck.relpath == "snapshots/ck-1"
    assert [k.value for k in SubvolKind] == ["sandboxes", "snapshots"]
    tmp = sb.tmp_name()
    assert is_tmp_name(tmp) and tmp.startswith("tmp-abc-") and not is_id(tmp)
    assert tmp != sb.tmp_name()  # fresh each time: two half-made ones never collide


def test_ioctl_numbers_match_linux_btrfs_h() -> None:
    # Values printed by a C program including <linux/btrfs.h> on the project's host.
    assert ioctl.IOC_SUBVOL_CREATE == 0x5000940E
    assert ioctl.IOC_SNAP_DESTROY == 0x5000940F
    assert ioctl.IOC_SNAP_CREATE_V2 == 0x50009417
    assert ioctl.IOC_SUBVOL_GETFLAGS == 0x80089419
    assert ioctl.IOC_SUBVOL_SETFLAGS == 0x4008941A
    assert ioctl.IOC_GET_SUBVOL_INFO == 0x81F8943C


def test_ioctl_names_are_single_entries() -> None:
    for bad in ("", ".", "..", "a/b", "a\0", "x" * 256):
        with pytest.raises(ValueError):
            ioctl._vol_args(bad)


def test_config_defaults_and_sizes(tmp_path: Path) -> None:
    b = CrabConfig().btrfs
    assert b.image == Path("/var/lib/crab/btrfs.img") and b.mount_point == Path("/var/lib/crab/pool")
    assert b.size == "16G" and b.size_bytes == 16 << 30
    assert BtrfsConfig(size="512M").size_bytes == 512 << 20
    assert BtrfsConfig(size="4096").size_bytes == 4096
    f = tmp_path / "crabd.toml"
    f.write_text('[btrfs]\nmount_point = "/srv/pool"\nsize = "2T"\nmin_free_bytes = 0\n')
    cfg = load_config(f).btrfs
    assert cfg.mount_point == Path("/srv/pool") and cfg.size_bytes == 2 << 40 and cfg.min_free_bytes == 0


@pytest.mark.parametrize("toml", ['size = "16GB"', 'size = "0G"', "min_free_bytes = -1", "typo = 1"])
def test_config_refuses_bad_values(tmp_path: Path, toml: str) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text(f"[btrfs]\n{toml}\n")
    with pytest.raises(ConfigError):
        load_config(f)


def _bare_pool(tmp_path: Path) -> Pool:
    # A Pool without __init__ (which needs a mounted btrfs): enough for the error mapping.
    pool = Pool.__new__(Pool)
    pool.mount_point = tmp_path
    pool.min_free_bytes = 0
    return pool


def test_enospc_becomes_store_full_with_hint(tmp_path: Path) -> None:
    pool, ref = _bare_pool(tmp_path), SubvolRef.snapshot("ck-1")
    with pytest.raises(StoreFull) as info, pool._translating(PoolOp.SNAPSHOT, ref.relpath):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.hint == POOL_FULL_HINT and info.value.path == str(tmp_path)
    assert isinstance(info.value.__cause__, OSError)


def test_other_errors_become_snapshot_errors(tmp_path: Path) -> None:
    pool, ref = _bare_pool(tmp_path), SubvolRef.sandbox("abc")
    with pytest.raises(SnapshotError) as info, pool._translating(PoolOp.DELETE, ref.relpath):
        raise OSError(errno.ENOTEMPTY, "Directory not empty")
    err = info.value
    assert isinstance(err, StoreError)
    assert err.attrs == {"op": "delete", "subvolume": "sandboxes/abc"}
    assert "Directory not empty" in err.message


def test_min_free_bytes_refuses_before_any_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _bare_pool(tmp_path)
    pool.min_free_bytes = 1 << 30
    monkeypatch.setattr(pool, "free_bytes", lambda: 1 << 20)
    with pytest.raises(StoreFull, match="1 MiB free"):
        pool._check_room(SubvolRef.snapshot("ck-1"))


FACTS = BackendFacts(
    runc="/usr/bin/runc", criu="/usr/local/sbin/criu", pool=PoolFacts(None, 16 << 30, 15 << 30), cni_missing=()
)


def test_backend_runc_btrfs_when_everything_is_there() -> None:
    assert choose_backend(FACTS) == (SandboxBackend.RUNC_BTRFS, [])
    auto = CrabConfig()  # "auto" is the default
    assert auto.runtime.backend == "auto"
    ready = backend_check.check_backend(auto, FACTS)
    assert ready.status is Status.OK and ready.summary.startswith("runc+btrfs (auto: runc /usr/bin/runc")
    # Docker by name: Docker it is, and doctor says runc+btrfs would be ready.
    docker = CrabConfig.model_validate({"runtime": {"backend": "docker"}})
    assert backend_check.backend_for(docker, FACTS) == (SandboxBackend.DOCKER, [])
    check = backend_check.check_backend(docker, FACTS)
    assert check.status is Status.OK and check.summary == "docker ([runtime] backend); runc+btrfs is ready too"


def test_backend_falls_back_to_docker_and_says_why() -> None:
    facts = BackendFacts(
        runc=None, criu="/c", pool=PoolFacts("no btrfs file system is mounted at /p"), cni_missing=("firewall",)
    )
    backend, why = choose_backend(facts)
    assert backend is SandboxBackend.DOCKER
    assert why == [
        "no runc on PATH",
        "btrfs pool: no btrfs file system is mounted at /p",
        f"CNI plugins missing in {backend_check.CNI_DIR}: firewall",
    ]
    auto = CrabConfig.model_validate({"runtime": {"backend": "auto"}})
    check = backend_check.check_backend(auto, facts)
    assert check.status is Status.WARN and check.summary.startswith("docker (auto); ") and "no runc" in check.summary
    # Asked for runc+btrfs by name on a host without it: doctor fails and says what is missing.
    runc = CrabConfig.model_validate({"runtime": {"backend": "runc+btrfs"}})
    assert backend_check.backend_for(runc, facts)[0] is SandboxBackend.RUNC_BTRFS
    check = backend_check.check_backend(runc, facts)
    assert check.status is Status.FAIL and "no runc on PATH" in check.summary


def test_runtime_config_subnets() -> None:
    rt = CrabConfig().runtime
    assert rt.subnet_for("crabr") != rt.subnet_for("isor") and rt.subnet_for("isor").endswith("/24")
    assert CrabConfig.model_validate({"runtime": {"subnet": "10.9.0.0/16"}}).runtime.subnet_for("x") == "10.9.0.0/16"
    for bad in ("10.9.0.0/30", "fe80::/64", "nonsense"):
        with pytest.raises(ValueError):
            CrabConfig.model_validate({"runtime": {"subnet": bad}})
    with pytest.raises(ValueError):
        CrabConfig.model_validate({"runtime": {"backend": "podman"}})


@pytest.mark.parametrize(("free", "status"), [(10 << 30, Status.OK), (2 << 30, Status.WARN), (100 << 20, Status.FAIL)])
def test_pool_free_space_thresholds(free: int, status: Status) -> None:
    check = backend_check.check_btrfs_pool(CrabConfig(), PoolFacts(None, 16 << 30, free))
    assert check.status is status
    assert "free of 16.0 GiB" in check.summary


def test_missing_pool_is_a_warning_with_the_setup_fix() -> None:
    check = backend_check.check_btrfs_pool(CrabConfig(), PoolFacts("/var/lib/crab/pool: No such file or directory"))
    assert check.status is Status.WARN and "make setup" in check.fix


def test_cni_missing(tmp_path: Path) -> None:
    (tmp_path / "bridge").write_text("")
    (tmp_path / "bridge").chmod(0o755)
    assert backend_check.cni_missing(tmp_path) == ("host-local", "firewall")


def test_pool_facts_on_a_plain_directory(tmp_path: Path) -> None:
    facts = backend_check.pool_facts(BtrfsConfig(mount_point=tmp_path))
    assert facts.problem == f"no btrfs file system is mounted at {tmp_path}"
