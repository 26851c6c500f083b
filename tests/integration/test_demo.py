"""The README's main job must keep working as a new user would run it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_demo_runs_and_checks_itself() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "crabd.demo"], capture_output=True, text=True, timeout=600, cwd=str(REPO)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DEMO FAILED" not in done.stdout and "demo done" in done.stdout
