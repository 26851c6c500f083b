"""`crabctl doctor`'s inspector check: which inspector crabd would run here, and why.

The check loads crab's real probes (``ebpf/inspector.c``) in a child
process, exactly as crabd does at start-up, and detaches them again.
"""

from __future__ import annotations

import sys
from pathlib import Path

from crabd.config import CrabConfig
from crabd.errors import CommandError
from crabd.host.checks import Check, Status, read_kernel_config
from crabd.models import InspectorMode
from crabd.util import proc

_LOAD = """
from crabd.inspector.bpf import BpfEvents
b = BpfEvents(ring_pages={pages})
b.start()
print("attached", b.tracepoints)
b.close()
"""


def ia32_emulation(config: dict[str, str] | None = None) -> bool:
    """Can this x86 kernel run 32-bit programs (whose syscalls the syscalls:* tracepoints do not report)?"""
    config = read_kernel_config() if config is None else config
    if not config or config.get("CONFIG_IA32_EMULATION") != "y":
        return False
    try:
        cmdline = Path("/proc/cmdline").read_text()
    except OSError:
        cmdline = ""
    if "ia32_emulation=0" in cmdline or "ia32_emulation=false" in cmdline:
        return False
    return config.get("CONFIG_IA32_EMULATION_DEFAULT_DISABLED") != "y" or "ia32_emulation=1" in cmdline


def check_inspector(cfg: CrabConfig) -> Check:
    mode = cfg.inspector.mode
    if mode is InspectorMode.SCAN:
        return Check("inspector", Status.OK, "scan (forced by [inspector] mode = scan): no probes, slower turn ends")
    try:
        done = proc.run([sys.executable, "-c", _LOAD.format(pages=cfg.inspector.ring_buffer_pages)], timeout=120)
        loaded, why = "attached" in done.out, done.out.strip()
    except CommandError as exc:
        lines = (exc.stderr or exc.message).strip().splitlines()
        loaded, why = False, lines[-1] if lines else "?"
    if not loaded:
        if mode is InspectorMode.EBPF:
            return Check(
                "inspector",
                Status.FAIL,
                f"crab's eBPF probes do not load, and [inspector] mode = ebpf: {why}",
                "run `make setup` as root (bcc, kernel headers, tracefs), or set [inspector] mode = auto",
            )
        return Check(
            "inspector",
            Status.WARN,
            f"scan (the eBPF probes do not load: {why}); decisions are the same, turn ends slower",
            "run `make setup` as root to get bcc, kernel headers and tracefs",
        )
    summary = f"ebpf: {why.split()[-1]} tracepoints attached"
    if ia32_emulation():
        summary += "; 32-bit programs can run here and are handled conservatively (their syscalls are unseen)"
    return Check("inspector", Status.OK, summary)
