"""What a request may ask for: every number checked against ``[limits]`` before anything happens.

All numeric request fields reach the daemon through the service, and every
one of them passes through here (or through ``crabd.util.validate``):
finite, in range, and at most the configured maximum, whose value the error
message names.  Zero means "the configured default" for timeouts, output
bounds, memory and pids; for CPUs it means no CPU quota (the sandbox shares
the host's CPUs under the kernel's fair scheduler).

Memory 0 used to mean "no limit at all"; it now means ``default_memory_bytes``,
and the sandbox's record shows the limit it really got.

:func:`fit_output` bounds what one command's result carries, so the reply
always fits the gRPC message limit even when both streams were allowed
their per-stream maximum.
"""

from __future__ import annotations

import os
from dataclasses import replace

from crabd.config import MIN_MEMORY, LimitsConfig
from crabd.coordinator.oneshot import truncation_marker
from crabd.errors import InvalidRequest
from crabd.models import ExecOutcome, SandboxSpec
from crabd.util import validate

#: Bytes kept free in a trimmed result for the two "[crab: ... truncated]" lines.
MARKER_ROOM = 256
#: Smallest disk limit a sandbox may ask for (its init, overlay work dir and shell need some room).
MIN_DISK = 16 << 20


def host_cpus() -> int:
    return os.cpu_count() or 1


def host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


class RequestLimits:
    """The ``[limits]`` section applied to requests."""

    def __init__(self, cfg: LimitsConfig, *, disk_default: int = 0) -> None:
        self.cfg = cfg
        #: ``[btrfs] sandbox_disk_bytes``: a sandbox's disk limit, and the most one may ask for (0: none).
        self.disk_default = disk_default

    # --- commands -----------------------------------------------------------

    def timeout(self, requested: float) -> float:
        """A command's timeout: finite, 0..max_timeout_s; 0 is the default."""
        t = validate.seconds(requested, "timeout", maximum=self.cfg.max_timeout_s)
        return t or self.cfg.default_timeout_s

    def stop_timeout(self, requested: float) -> float:
        """Grace before SIGKILL at a stop: finite, 0..max_stop_timeout_s; 0 is the default."""
        t = validate.seconds(requested, "stop timeout", maximum=self.cfg.max_stop_timeout_s)
        return t or self.cfg.stop_timeout_s

    # --- sandboxes ------------------------------------------------------------

    @property
    def max_cpus(self) -> float:
        # Docker refuses more CPUs than the host has whatever crabd allows.
        host = float(host_cpus())
        return min(self.cfg.max_cpus, host) if self.cfg.max_cpus is not None else host

    @property
    def max_memory(self) -> int:
        return self.cfg.max_memory_bytes if self.cfg.max_memory_bytes is not None else host_memory()

    def resources(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with its limits checked and defaults filled in (what the sandbox really gets)."""
        cpus = validate.fraction(spec.cpus, "cpus", maximum=self.max_cpus)
        memory = validate.integer(spec.memory_bytes, "memory", minimum=0)
        pids = validate.integer(spec.pids, "pids", minimum=0)
        max_memory = self.max_memory
        if memory == 0:
            memory = min(self.cfg.default_memory_bytes, max_memory)
        elif memory < MIN_MEMORY:
            raise InvalidRequest(f"memory={memory} bytes is too small (0 = the default, else >= 6 MiB)")
        elif memory > max_memory:
            raise InvalidRequest(
                f"memory={memory} bytes exceeds the maximum of {max_memory} bytes ({_gib(max_memory)})",
                hint="Ask for less, or raise [limits] max_memory_bytes in crabd.toml.",
            )
        if pids == 0:
            pids = self.cfg.default_pids
        elif pids > self.cfg.max_pids:
            raise InvalidRequest(
                f"pids={pids} exceeds the maximum of {self.cfg.max_pids}",
                hint="Ask for fewer, or raise [limits] max_pids in crabd.toml.",
            )
        return replace(spec, cpus=cpus, memory_bytes=memory, pids=pids, disk_bytes=self.disk(spec.disk_bytes))

    def disk(self, requested: int) -> int:
        """A sandbox's disk limit: 0 is the default; a tenant may ask for less than it, never more."""
        disk = validate.integer(requested, "disk", minimum=0)
        if disk == 0:
            return self.disk_default
        if disk < MIN_DISK:
            raise InvalidRequest(f"disk={disk} bytes is too small (0 = the default, else >= 16 MiB)")
        if self.disk_default and disk > self.disk_default:
            raise InvalidRequest(
                f"disk={disk} bytes exceeds the maximum of {self.disk_default} bytes ({_gib(self.disk_default)})",
                hint="Ask for less, or raise [btrfs] sandbox_disk_bytes in crabd.toml.",
            )
        return disk


def _kept(data: bytes, stream: str, dropped: int) -> bytes:
    """``data`` without the truncation line the runner appended (if it did)."""
    if dropped:
        marker = truncation_marker(stream, dropped)
        if data.endswith(marker):
            return data[: -len(marker)]
    return data


def fit_output(outcome: ExecOutcome, budget: int) -> ExecOutcome:
    """``outcome`` with stdout + stderr cut to ``budget`` bytes in all, the cut counted as dropped.

    Each stream is entitled to half; a stream that needs less leaves the rest
    to the other.  What is cut is the tail (the head is what the per-stream
    bound keeps too), and the usual truncation line says how much went.
    """
    if len(outcome.stdout) + len(outcome.stderr) <= budget:
        return outcome
    out = _kept(outcome.stdout, "stdout", outcome.stdout_dropped)
    err = _kept(outcome.stderr, "stderr", outcome.stderr_dropped)
    room = max(budget - MARKER_ROOM, 0)
    half = room // 2
    if len(out) <= half:
        keep_out, keep_err = len(out), room - len(out)
    elif len(err) <= half:
        keep_out, keep_err = room - len(err), len(err)
    else:
        keep_out, keep_err = half, room - half
    out_dropped = outcome.stdout_dropped + len(out) - keep_out
    err_dropped = outcome.stderr_dropped + len(err) - keep_err
    stdout = out[:keep_out] + (truncation_marker("stdout", out_dropped) if out_dropped else b"")
    stderr = err[:keep_err] + (truncation_marker("stderr", err_dropped) if err_dropped else b"")
    return replace(outcome, stdout=stdout, stderr=stderr, stdout_dropped=out_dropped, stderr_dropped=err_dropped)
