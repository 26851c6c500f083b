"""Named sessions captured at turn ends: which are, and the stored state they make (coordinator/named_capture.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from crabd.coordinator import named_capture
from crabd.errors import InitUnavailable
from crabd.runtime.session_state import NamedCapture, SessionState


class FakeSession:
    def __init__(
        self, name: str, *, busy: bool = False, known: bool = True, fds: list[Any] | None = None, fail: bool = False
    ) -> None:
        self.name, self.busy, self.spawn_known, self.fail = name, busy, known, fail
        self.pty: tuple[int, int] | None = (24, 80) if name == "term" else None
        self.user = (1000, 1000)
        self.fds = [] if fds is None else fds
        self.captured = 0

    async def capture_state(self, *, timeout_s: float) -> SessionState | None:
        self.captured += 1
        if self.fail:
            raise InitUnavailable("init went away", sandbox="")
        return SessionState(cwd=f"/{self.name}", fds=self.fds, limits={})

    def captured_pid(self, within_s: float) -> tuple[int | None] | None:
        return (100 + len(self.name),)


def _capture(*sessions: FakeSession) -> dict[str, NamedCapture]:
    manager: Any = SimpleNamespace(named_sessions=lambda rec: {s.name: s for s in sessions})
    return asyncio.run(named_capture.capture(manager, SimpleNamespace(id="sb")))  # type: ignore[arg-type]


def test_only_idle_known_sessions_without_descriptors_are_captured() -> None:
    web, term = FakeSession("web"), FakeSession("term")
    busy, found = FakeSession("busy", busy=True), FakeSession("found", known=False)
    holding = FakeSession("holding", fds=[{"fd": 7, "kind": "file"}])
    broken = FakeSession("broken", fail=True)
    got = _capture(web, term, busy, found, holding, broken)
    assert set(got) == {"web", "term"}
    assert got["term"] == NamedCapture(SessionState(cwd="/term", fds=[], limits={}), 104, (24, 80), 1000, 1000)
    assert busy.captured == found.captured == 0  # a busy or unknown session is not even asked
    assert _capture() == {}


def test_the_stored_state_carries_the_captures_and_drops_stale_ones() -> None:
    base = SessionState(cwd="/").to_json()
    assert named_capture.merged(None, {}) is None
    assert named_capture.merged(base, {}) is base  # nothing named: the text as it was, not parsed
    capture = NamedCapture(SessionState(cwd="/srv"), 7)
    with_web = named_capture.merged(base, {"web": capture})
    assert with_web is not None and SessionState.from_json(with_web).named_captures() == {"web": capture}
    assert named_capture.merged(with_web, {}) == base  # a session no longer captured is not carried on
