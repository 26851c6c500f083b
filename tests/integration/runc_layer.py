"""Shared pieces of the tests that drive crab's runc layer on a private layout (test_runc_driver, test_runc_backend)."""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from crabd.backends.network import chain_names
from crabd.backends.runc import cleanup, cni, named_netns
from crabd.config import NetworkConfig


@contextlib.contextmanager
def private_base(d: Path) -> Iterator[Path]:
    """A fresh directory for a module's layout; afterwards no mount may be left under it."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o700)
    yield d
    named_netns.release_dir(d / "netns")
    assert not [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(d) in ln], "mounts left"
    shutil.rmtree(d, ignore_errors=True)


def private_layout(base: Path, net: NetworkConfig, subnet: ipaddress.IPv4Network) -> cleanup.Layout:
    """Every path of the runc layer under ``base``, and a CNI network of the test's own."""
    settings = cni.CniSettings(net=net, subnet=str(subnet), cache_dir=base / "cni")
    return cleanup.Layout(
        runc_root=base / "runc",
        bundles=base / "bundles",
        netns=base / "netns",
        rootfs=base / "rootfs",
        cni=settings,
        idmap=base / "idmap",
        # Not under base (0700): runc needs its ancestors searchable from inside the user namespace.
        mounts=Path("/run/crab-rootfs"),
    )


def assert_no_rules_left(net: NetworkConfig) -> str:
    """No iptables rule names ``net``'s chains any more; the whole rule set, for the caller's own checks."""
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, timeout=30).stdout
    assert not [ln for ln in rules.splitlines() if any(c in ln for c in chain_names(net))], "rules left"
    return rules
