"""The doctor's vocabulary: a :class:`Check` and its status, shared by every check module.

:mod:`.doctor` runs the checks; :mod:`.backend_check`, :mod:`.inspector_check`
and :mod:`.remote_check` hold the larger ones.  They all build on this
module only, not on each other.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

SETUP_FIX = "run `crabctl host setup` as root (or `make setup` in a crab checkout)"


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    summary: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        d = asdict(self)
        d["status"] = self.status.value
        return d


def ok(name: str, summary: str) -> Check:
    return Check(name, Status.OK, summary)


def warn(name: str, summary: str, fix: str) -> Check:
    return Check(name, Status.WARN, summary, fix)


def fail(name: str, summary: str, fix: str) -> Check:
    return Check(name, Status.FAIL, summary, fix)


def read_kernel_config() -> dict[str, str] | None:
    """The running kernel's config, from /proc/config.gz or /boot, if exposed."""
    candidates = [Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")]
    for path in candidates:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except OSError:
            continue
        config: dict[str, str] = {}
        for line in raw.decode("utf-8", "replace").splitlines():
            if line.startswith("CONFIG_") and "=" in line:
                key, _, value = line.partition("=")
                config[key] = value
        return config
    return None
