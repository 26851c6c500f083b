"""What `make setup` runs (a dry run of the Makefile: nothing is executed).

Issue 35: `make setup` built Harbor's Python 3.12 venv, which only Harbor's tests need, and installed
crabctl nowhere a member of group crab could run it.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import REPO


def dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    # A venv that does not exist: every step of the target is listed, none is run.
    done = subprocess.run(
        ["make", "-n", target, "VENV=/nonexistent/venv", "HARBOR_VENV=/nonexistent/harbor"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_setup_installs_crab_for_the_host_and_builds_no_harbor_venv() -> None:
    steps = dry_run("setup")
    assert "scripts/install-crab.sh" in steps
    assert "/nonexistent/harbor" not in steps and "harbor" not in steps


def test_demo_builds_no_harbor_venv() -> None:
    assert "/nonexistent/harbor" not in dry_run("demo")


@pytest.mark.parametrize("target", ["test", "integration"])
def test_the_test_targets_build_the_harbor_venv(target: str) -> None:
    assert "/nonexistent/harbor/bin/python -m pip install" in dry_run(target)
