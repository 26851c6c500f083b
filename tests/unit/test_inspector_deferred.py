"""The deferred probes: the scan decides until the probes attach, then only turns they watched whole are theirs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from crabd.backends.fsdelta import ScanLimits
from crabd.config import InspectorConfig
from crabd.errors import BpfError
from crabd.inspector import choose
from crabd.inspector.bpf import BpfEvents
from crabd.inspector.deferred import UNWATCHED, DeferredProbes
from crabd.inspector.model import Evidence
from crabd.models import InspectorMode


class GatedBpf(BpfEvents):
    """The eBPF source with the compile replaced by a gate the test opens; records what it is asked."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.fail = fail
        self.tracked: dict[str, str] = {}
        self.takes: list[str] = []
        self.quiet_for: list[str] = []
        self.closed = 0
        self.refuse: set[str] = set()

    def start(self) -> None:
        assert self.gate.wait(10)
        if self.fail:
            raise BpfError("no probes here")
        self._bpf = object()

    def close(self) -> None:
        self.closed += 1
        self._bpf = None

    def track(self, sandbox_id: str, container_id: str) -> None:
        if sandbox_id in self.refuse:
            raise BpfError(f"no cgroup for {container_id}")
        self.tracked[sandbox_id] = container_id

    def untrack(self, sandbox_id: str) -> None:
        self.tracked.pop(sandbox_id, None)

    @contextlib.contextmanager
    def quiet(self, sandbox_id: str) -> Iterator[None]:
        self.quiet_for.append(sandbox_id)
        yield

    def tasks(self, sandbox_id: str) -> tuple[int, int, int] | None:
        return (1, 5, 5) if sandbox_id in self.tracked else None

    def take(self, sandbox_id: str) -> Evidence:
        self.takes.append(sandbox_id)
        return Evidence(inspector=self.name, file_notes=[f"probe evidence {len(self.takes)}"])


def attach(bpf: GatedBpf, src: DeferredProbes) -> None:
    bpf.gate.set()
    src.wait(10)


def test_the_scan_decides_while_the_probes_compile_and_start_returns_at_once() -> None:
    bpf = GatedBpf()
    src = DeferredProbes(bpf)
    src.start()  # the gate is closed: a blocking start would hang here
    src.track("sb1", "c1")
    ev = src.take("sb1")
    assert (ev.inspector, ev.files_dirty, ev.file_notes) == ("scan", True, [UNWATCHED])
    assert src.name == "scan" and bpf.takes == []
    with src.quiet("sb1"):
        pass
    assert bpf.quiet_for == []  # nothing attached to quiet
    attach(bpf, src)
    assert src.name == "ebpf" and src.attached and src.why == "eBPF probes attached"
    src.close()
    assert bpf.closed == 1


def test_a_turn_under_way_when_the_probes_attach_is_still_the_scans() -> None:
    bpf = GatedBpf()
    src = DeferredProbes(bpf)
    src.start()
    src.track("sb1", "c1")
    attach(bpf, src)
    assert bpf.tracked == {"sb1": "c1"}  # handed over at attach
    # The epoch began before the probes watched: the scan's, and the probes' partial count is dropped.
    first = src.take("sb1")
    assert first.inspector == "scan" and first.files_dirty
    assert bpf.takes == ["sb1"]
    # The next epoch began with the probes watching: theirs.
    second = src.take("sb1")
    assert second.inspector == "ebpf" and second.file_notes == ["probe evidence 2"]
    with src.quiet("sb1"):
        pass
    assert bpf.quiet_for == ["sb1"]


def test_a_sandbox_tracked_after_attach_is_covered_from_its_start_take() -> None:
    bpf = GatedBpf()
    src = DeferredProbes(bpf)
    src.start()
    attach(bpf, src)
    src.track("sb2", "c2")  # Inspector.started: track, then a take that starts the first epoch
    assert src.take("sb2").inspector == "scan"
    assert src.take("sb2").inspector == "ebpf"
    src.untrack("sb2")
    assert "sb2" not in bpf.tracked
    # Tracked anew (a restore): not covered until its start take.
    src.track("sb2", "c3")
    assert src.take("sb2").inspector == "scan"


def test_a_sandbox_the_probes_cannot_watch_stays_with_the_scan() -> None:
    bpf = GatedBpf()
    bpf.refuse = {"bad"}
    src = DeferredProbes(bpf)
    src.start()
    src.track("bad", "c1")
    src.track("good", "c2")
    attach(bpf, src)
    for _ in range(3):
        assert src.take("bad").inspector == "scan"
    src.take("good")
    assert src.take("good").inspector == "ebpf"
    assert "bad" not in bpf.takes
    with src.quiet("bad"):
        pass
    assert bpf.quiet_for == []


def test_a_failed_compile_leaves_the_scan_deciding_and_says_why() -> None:
    bpf = GatedBpf(fail=True)
    src = DeferredProbes(bpf)
    src.start()
    src.track("sb1", "c1")
    attach(bpf, src)
    assert not src.attached and src.name == "scan"
    assert "no probes here" in src.why
    assert src.take("sb1").inspector == "scan"
    assert bpf.closed == 1  # a failed start is cleaned up


def test_closing_during_the_compile_detaches_the_probes_when_it_ends() -> None:
    bpf = GatedBpf()
    src = DeferredProbes(bpf)
    src.start()
    src.close()
    attach(bpf, src)
    assert not src.attached and bpf.closed == 1


def test_start_is_once() -> None:
    bpf = GatedBpf()
    src = DeferredProbes(bpf)
    src.start()
    with pytest.raises(BpfError, match="already being attached"):
        src.start()
    attach(bpf, src)


def test_auto_mode_serves_at_once_and_ebpf_mode_compiles_first(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[GatedBpf] = []

    def factory(**_: object) -> GatedBpf:
        made.append(GatedBpf())
        return made[-1]

    monkeypatch.setattr(choose, "BpfEvents", factory)
    inspector, why = choose.open_inspector(InspectorConfig(mode=InspectorMode.AUTO), ScanLimits())
    assert inspector.name == "scan" and "compiling in the background" in why
    made[-1].gate.set()
    assert isinstance(inspector.source, DeferredProbes) and inspector.source.wait(10)
    assert inspector.name == "ebpf"
    inspector.close()
    # mode = ebpf: the compile happens before open_inspector returns (here: the gate is open).
    monkeypatch.setattr(choose, "BpfEvents", lambda **_: _opened())
    inspector, why = choose.open_inspector(InspectorConfig(mode=InspectorMode.EBPF), ScanLimits())
    assert (inspector.name, why) == ("ebpf", "eBPF probes attached")


def _opened() -> GatedBpf:
    bpf = GatedBpf()
    bpf.gate.set()
    return bpf


def test_crabd_starts_the_compile_itself_once_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_later`` (crabd's start-up): the compile waits for ``start`` (the daemon calls it once
    serving: its Python half held the GIL while crabd got ready), and meanwhile reads pending, not settled."""
    made: list[GatedBpf] = []

    def factory(**_: object) -> GatedBpf:
        made.append(GatedBpf())
        return made[-1]

    monkeypatch.setattr(choose, "BpfEvents", factory)
    inspector, _ = choose.open_inspector(InspectorConfig(mode=InspectorMode.AUTO), ScanLimits(), compile_later=True)
    source = inspector.source
    assert isinstance(source, DeferredProbes)
    assert inspector.name == "scan" and inspector.pending  # EmbeddedDaemon.wait_inspector goes on waiting
    made[-1].gate.set()
    assert not source.wait(0.2) and inspector.name == "scan"  # nothing compiled before start
    source.start()
    assert source.wait(10) and inspector.name == "ebpf" and not inspector.pending
    inspector.close()
