"""When a session capture may be kept and reused (coordinator/sessionkeep.py)."""

from __future__ import annotations

import pytest

from crabd.coordinator.sessionkeep import CaptureCounts, IdleReading, Kept
from crabd.runtime.session_state import SessionState

RAN = (4242, 1000, 5_000_000)
WRITES = (1, 0)


def idle(witness: tuple[object, ...] | None = (WRITES, RAN), *, nofile: int = 1024) -> IdleReading:
    return IdleReading({"nofile": [nofile, nofile]}, [{"fd": 3, "kind": "file"}], witness)


def state(traps: str = "") -> SessionState:
    return SessionState(cwd="/tmp", variables={"A": 'declare -- A="1"'}, traps=traps)


def test_a_capture_is_kept_with_the_witness_read_once_bash_went_idle() -> None:
    kept = Kept.of(7, state(), idle())
    assert kept is not None and (kept.nspid, kept.witness) == (7, (WRITES, RAN))


def test_nothing_is_kept_with_a_trap_set_without_probes_or_without_a_bash() -> None:
    assert Kept.of(7, state("trap -- 'X=1' SIGUSR1"), idle()) is None
    assert Kept.of(7, state(), idle(None)) is None  # the scan inspector: nothing counts memory writes
    assert Kept.of(7, state(), None) is None  # the bash could not be read
    assert Kept.of(None, state(), idle()) is None


def test_reuse_needs_the_same_witness_and_takes_the_limits_and_descriptors_read_now() -> None:
    kept = Kept.of(7, state(), idle())
    assert kept is not None
    again = kept.reuse(idle(nofile=100))
    assert again is not None and again.limits == {"nofile": [100, 100]} and again.variables == kept.state.variables
    assert kept.state.limits is None  # the kept state itself is not changed
    ran_since = (RAN[0], RAN[1], RAN[2] + 1)
    for other in [(WRITES, ran_since), ((1, 1), RAN), ((2, 0), RAN), (WRITES, (4243, 1000, RAN[2]))]:
        assert kept.reuse(idle(other)) is None, other
    assert kept.reuse(idle(None)) is None
    assert kept.reuse(None) is None


def test_counts_render_as_prometheus_text() -> None:
    c = CaptureCounts(captured=3, reused=5)
    assert c.snapshot() == {"captured": 3, "reused": 5}
    assert 'crab_session_captures_total{how="reused"} 5\n' in c.prometheus()


def test_an_unchanged_reuse_is_the_kept_state_and_its_json_is_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    s = state()
    s.limits, s.fds = idle().limits, idle().fds
    kept = Kept.of(7, s, idle())
    assert kept is not None
    again = kept.reuse(idle())
    assert again is s
    made: list[int] = []
    real = SessionState.to_json

    def counted(self: SessionState) -> str:
        made.append(1)
        return real(self)

    monkeypatch.setattr(SessionState, "to_json", counted)
    assert kept.to_json(again) == kept.to_json(again) == real(s)
    assert len(made) == 1
    other = kept.reuse(idle(nofile=5))
    assert other is not None and other is not s and '"nofile": [5, 5]' in kept.to_json(other)
