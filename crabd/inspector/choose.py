"""Which inspector this crabd runs: the eBPF probes when they load, else the scan inspector."""

from __future__ import annotations

import logging

from crabd.backends.fsdelta import ScanLimits
from crabd.config import InspectorConfig
from crabd.errors import BpfError
from crabd.inspector.base import EventSource, ScanEvents
from crabd.inspector.bpf import BpfEvents
from crabd.inspector.decide import Inspector
from crabd.models import InspectorMode

log = logging.getLogger("crabd.inspector")


def open_inspector(cfg: InspectorConfig, limits: ScanLimits) -> tuple[Inspector, str]:
    """The inspector to run and why it was chosen.  Slow (compiles the probes): call it in a thread.

    ``mode = "ebpf"`` makes a failure to load the probes fatal (BpfError);
    ``"auto"`` falls back to the scan inspector and says why.
    """
    source: EventSource
    if cfg.mode is InspectorMode.SCAN:
        source, why = ScanEvents(), "forced by [inspector] mode = scan"
        source.start()
    else:
        bpf = BpfEvents(ring_pages=cfg.ring_buffer_pages)
        try:
            # Started once, here: a second start would compile the probes again
            # (seconds) and leave the first set attached, every syscall traced twice.
            bpf.start()
            source, why = bpf, "eBPF probes attached"
        except BpfError as exc:
            bpf.close()
            if cfg.mode is InspectorMode.EBPF:
                raise
            source, why = ScanEvents(), f"eBPF probes unavailable ({exc.message})"
            source.start()
    inspector = Inspector(source, limits=limits, shadow=cfg.shadow)
    log.info("inspector chosen", extra={"inspector": inspector.name, "why": why, "shadow": inspector.shadow})
    return inspector, why
