"""Shared pieces of the tests that drive crab's runc layer on a private layout (test_runc_driver, test_runc_backend)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from crabd.backends.network import chain_names, host_routes
from crabd.backends.runc import cleanup, cni, named_netns
from crabd.config import NetworkConfig


def free_subnet(second_octet: int) -> ipaddress.IPv4Network:
    """A /24 in ``10.<second_octet>.x`` that no route of the host's touches, first try by this process's pid.

    A bridge left on the host (a benchmark's or an interrupted run's) keeps its
    route, and a test network on the same /24 would be unreachable from the host.
    """
    routed = [dst for dst, _ in host_routes() if dst.prefixlen > 0]
    for k in range(250):
        net = ipaddress.IPv4Network(f"10.{second_octet}.{(os.getpid() + k) % 250}.0/24")
        if not any(net.overlaps(dst) and dst.prefixlen >= net.prefixlen for dst in routed):
            return net
    raise AssertionError(f"every /24 of 10.{second_octet}.0.0/16 is routed on this host")


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
