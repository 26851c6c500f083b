"""Which inspector this crabd runs: the eBPF probes when they load, else the scan inspector."""

from __future__ import annotations

import logging

from crabd.backends.fsdelta import ScanLimits
from crabd.config import InspectorConfig
from crabd.errors import BpfError
from crabd.inspector.base import EventSource, ScanEvents
from crabd.inspector.bpf import BpfEvents
from crabd.inspector.decide import Inspector
from crabd.inspector.deferred import DeferredProbes
from crabd.models import InspectorMode

log = logging.getLogger("crabd.inspector")


def open_inspector(cfg: InspectorConfig, limits: ScanLimits, *, compile_later: bool = False) -> tuple[Inspector, str]:
    """The inspector to run and why it was chosen.

    ``mode = "auto"`` returns at once: the probes compile in the background
    (seconds) while the scan inspector, sound on its own, decides every turn
    they did not watch from its start (``deferred.py``); if they fail to load,
    the scan goes on.  ``"ebpf"`` compiles them here (slow: call it in a
    thread), and a failure is fatal (BpfError): every decision is the probes'.
    ``compile_later``: in mode "auto", the caller starts the compile
    (``inspector.source.start()``): crabd does once it serves, so that the
    compile's Python half (bcc's import, the BTF parse) does not hold the GIL
    while crabd gets ready to serve after a restart.
    """
    source: EventSource
    bpf = BpfEvents(ring_pages=cfg.ring_buffer_pages)
    if cfg.mode is InspectorMode.SCAN:
        source = ScanEvents("forced by [inspector] mode = scan")
        source.start()
    elif cfg.mode is InspectorMode.AUTO:
        deferred = DeferredProbes(bpf)
        # Started once: a second start would compile the probes again
        # (seconds) and leave the first set attached, every syscall traced twice.
        if not compile_later:
            deferred.start()
        source = deferred
    else:
        try:
            bpf.start()
        except BpfError:
            bpf.close()
            raise
        source = bpf
    inspector = Inspector(source, limits=limits, shadow=cfg.shadow)
    log.info("inspector chosen", extra={"inspector": inspector.name, "why": inspector.why, "shadow": inspector.shadow})
    return inspector, inspector.why
