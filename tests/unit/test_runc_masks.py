"""A restore's CRIU configuration for the masked directories (backends/runc/masks.py) and its bundle annotation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from crabd.backends.runc import bundle, masks
from crabd.errors import ContainerRuntimeError

SOURCE = Path("/run/crab-rootfs/c1/masked")


def test_the_config_is_the_hosts_runc_conf_then_the_mapping(tmp_path: Path) -> None:
    host = tmp_path / "runc.conf"
    host.write_text("tcp-established\nnetwork-lock skip")  # no final newline: the mapping still gets its own line
    assert masks.criu_conf(SOURCE, host) == (
        b"tcp-established\nnetwork-lock skip\nexternal mnt[crab-masked-dir]:/run/crab-rootfs/c1/masked\n"
    )


def test_without_a_host_conf_only_the_mapping(tmp_path: Path) -> None:
    assert (
        masks.criu_conf(SOURCE, tmp_path / "absent.conf")
        == b"external mnt[crab-masked-dir]:/run/crab-rootfs/c1/masked\n"
    )


@pytest.mark.parametrize("kind", ["link", "fifo", "huge"])
def test_a_host_conf_that_is_not_a_small_regular_file_is_an_error_not_skipped(tmp_path: Path, kind: str) -> None:
    """runc would have applied its options: dropping them silently would change the restore."""
    host = tmp_path / "runc.conf"
    if kind == "link":
        (tmp_path / "real").write_text("tcp-established\n")
        os.symlink(tmp_path / "real", host)
    elif kind == "fifo":
        os.mkfifo(host)  # opened without blocking
    else:
        host.write_bytes(b"#" * (65 << 10))
    with pytest.raises(ContainerRuntimeError, match="not a readable regular file"):
        masks.criu_conf(SOURCE, host)


def test_the_bundle_names_its_criu_conf_to_runc(tmp_path: Path) -> None:
    spec = bundle.ContainerSpec(id="c1", netns=Path("/run/netns/x"), init_binary=Path("/opt/crab-init"))
    b = bundle.write(spec, tmp_path, criu_conf=b"external mnt[crab-masked-dir]:/x\n")
    cfg = json.loads(b.config_path.read_text())
    assert cfg["annotations"][bundle.CRIU_CONFIG_ANNOTATION] == str(tmp_path / "c1" / bundle.CRIU_CONF)
    assert (tmp_path / "c1" / bundle.CRIU_CONF).read_bytes() == b"external mnt[crab-masked-dir]:/x\n"
    # A fresh container's bundle names none: runc reads the host's runc.conf, as before.
    fresh = bundle.write(bundle.ContainerSpec(id="c2", netns=Path("/run/netns/y"), init_binary=Path("/i")), tmp_path)
    cfg = json.loads(fresh.config_path.read_text())
    assert bundle.CRIU_CONFIG_ANNOTATION not in cfg["annotations"]
    assert not (tmp_path / "c2" / bundle.CRIU_CONF).exists()
