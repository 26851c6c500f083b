"""Which inspector crabd opens: each event source is started exactly once."""

from __future__ import annotations

import pytest

from crabd.backends.fsdelta import ScanLimits
from crabd.config import InspectorConfig
from crabd.errors import BpfError
from crabd.inspector import choose
from crabd.inspector.base import ScanEvents
from crabd.inspector.bpf import BpfEvents
from crabd.inspector.deferred import DeferredProbes
from crabd.models import InspectorMode


class CountingBpf(BpfEvents):
    """The eBPF source with the compile replaced: counts starts, fails when told to."""

    fail = False
    starts = 0

    def start(self) -> None:
        type(self).starts += 1
        if self.fail:
            raise BpfError("no probes here")
        self._bpf = object()

    def close(self) -> None:
        self._bpf = None


class CountingScan(ScanEvents):
    starts = 0

    def start(self) -> None:
        type(self).starts += 1


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> None:
    CountingBpf.starts = CountingScan.starts = 0
    CountingBpf.fail = False
    monkeypatch.setattr(choose, "BpfEvents", CountingBpf)
    monkeypatch.setattr(choose, "ScanEvents", CountingScan)


def _open(mode: InspectorMode) -> str:
    inspector, why = choose.open_inspector(InspectorConfig(mode=mode), ScanLimits())
    if isinstance(inspector.source, DeferredProbes):
        inspector.source.wait(10)  # the background compile, here instant
        why = inspector.source.why
    return f"{inspector.name}: {why}"


@pytest.mark.usefixtures("counted")
def test_ebpf_probes_are_compiled_and_attached_once() -> None:
    assert _open(InspectorMode.AUTO).startswith("ebpf")
    assert (CountingBpf.starts, CountingScan.starts) == (1, 0)


@pytest.mark.usefixtures("counted")
def test_auto_falls_back_to_scan_and_compiles_once() -> None:
    CountingBpf.fail = True
    assert "eBPF probes unavailable (no probes here)" in _open(InspectorMode.AUTO)
    assert CountingBpf.starts == 1


@pytest.mark.usefixtures("counted")
def test_forced_ebpf_that_fails_is_fatal_and_forced_scan_starts_once() -> None:
    CountingBpf.fail = True
    with pytest.raises(BpfError):
        _open(InspectorMode.EBPF)
    assert _open(InspectorMode.SCAN).startswith("scan")
    assert CountingScan.starts == 1


def test_a_second_start_of_the_probes_is_refused() -> None:
    bpf = BpfEvents()
    bpf._bpf = object()  # as after a first start, without compiling anything
    with pytest.raises(BpfError, match="already attached"):
        bpf.start()
