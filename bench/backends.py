"""Running a benchmark against each sandbox backend side by side (issue 19).

``bench/processes.py`` and ``bench/checkpoints.py`` take ``--backends`` (both by
default): each backend gets a private crabd of its own with ``[runtime]
backend`` forced, one after the other in the same run, so the figures are
comparable (same host, same minute).  On the runc backend crabd's log also
holds CRIU's own time for every restore (``criu restored``, ``criu_s``: the
last timestamp of CRIU's restore log), the physical reference a restore is
measured against.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from crabd.sdk import EmbeddedDaemon

BACKENDS = ("runc+btrfs", "docker")


def parse_backends(text: str) -> list[str]:
    """``--backends``: a comma-separated subset of :data:`BACKENDS`."""
    chosen = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown or not chosen:
        raise SystemExit(f"--backends: {', '.join(unknown) or '(none)'}: choose from {', '.join(BACKENDS)}")
    return chosen


@contextlib.contextmanager
def daemon_on(backend: str) -> Iterator[EmbeddedDaemon]:
    """A private crabd whose sandboxes run on ``backend`` (its config file lives as long as it does)."""
    with tempfile.TemporaryDirectory(prefix="crab-bench-cfg-") as tmp:
        cfg = Path(tmp) / "crabd.toml"
        cfg.write_text(f'[runtime]\nbackend = "{backend}"\n')
        with EmbeddedDaemon(extra_args=["--config", str(cfg)]) as d:
            d.wait_inspector()  # the probes' compile is not measured with the work
            yield d


def log_size(d: EmbeddedDaemon) -> int:
    """Where crabd's log ends now (read what comes after with :func:`criu_restore_seconds`)."""
    return d.log_file.stat().st_size if d.log_file.exists() else 0


def criu_restore_seconds(d: EmbeddedDaemon, since: int) -> list[float]:
    """CRIU's own restore times logged by ``d`` after byte ``since`` of its log (runc backend only)."""
    with open(d.log_file, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    out = []
    for line in lines:
        if '"criu restored"' not in line:
            continue
        with contextlib.suppress(ValueError):
            value = json.loads(line).get("criu_s")
            if isinstance(value, int | float):
                out.append(float(value))
    return out
