"""A benchmark stopped with SIGTERM (``timeout``, a CI runner) still runs its clean-up."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from bench.signals import terminate_as_interrupt
terminate_as_interrupt()
try:
    print("ready", flush=True)
    time.sleep(30)
finally:
    print("cleaned up", flush=True)
"""


def test_sigterm_unwinds_like_ctrl_c() -> None:
    root = str(Path(__file__).resolve().parents[2])
    p = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=root)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=10)
    finally:
        p.kill()
    assert "cleaned up" in out and p.returncode != 0


def test_the_scale_benchmark_installs_it() -> None:
    # Without it a killed scale run left hundreds of containers and their mounts behind.
    src = (Path(__file__).resolve().parents[2] / "bench" / "scale.py").read_text()
    assert "terminate_as_interrupt()" in src
