"""Shared test helpers.

Capabilities (root, Docker, CRIU, BPF) are probed once per session.  When one
is missing, a test that needs it is skipped locally with the reason, but
fails under CI (``CI=true``): in CI every capability must be present.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"
REPO = Path(__file__).resolve().parents[1]
CRABCTL = str(Path(sys.executable).with_name("crabctl"))


def require(ok: bool, reason: str) -> None:
    """Skip (locally) or fail (in CI) when a capability is missing."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"missing capability in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@cache
def have_root() -> bool:
    return os.geteuid() == 0


@cache
def have_docker() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@cache
def have_criu() -> bool:
    criu = shutil.which("criu")
    if criu is None:
        return False
    try:
        return subprocess.run([criu, "check"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@cache
def have_bpf() -> bool:
    return (
        have_root()
        and Path("/sys/kernel/tracing/events/syscalls").is_dir()
        and (Path(f"/lib/modules/{os.uname().release}/build").exists())
    )


_CAPS = {
    "root": (have_root, "needs root"),
    "docker": (have_docker, "needs a reachable Docker engine (run `make setup`)"),
    "criu": (have_criu, "needs CRIU >= 4.2 passing `criu check` (run `make setup`)"),
    "bpf": (have_bpf, "needs root, tracefs and kernel headers for bcc (run `make setup`)"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _capabilities(request: pytest.FixtureRequest) -> None:
    needed = {m.name for m in request.node.iter_markers() if m.name in _CAPS}
    if request.node.get_closest_marker("integration") and not request.node.get_closest_marker("hostless"):
        needed |= {"root", "docker"}
    for name in sorted(needed):
        probe, reason = _CAPS[name]
        require(probe(), reason)


@pytest.fixture
def crab_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private directory removed after the test, whatever it holds."""
    d = tmp_path_factory.mktemp("crab")
    yield d
    shutil.rmtree(d, ignore_errors=True)
