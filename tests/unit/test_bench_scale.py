"""bench.scale's table and timing helper (no crabd needed): what a ten-minute run prints at its end."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

import psutil

from bench.scale import CpuMeter, _median_ms, closed_loop, table


def _size(n: int, **extra: Any) -> dict[str, Any]:
    skip = {"per_s": 106.1, "p99_ms": 447.5, "crabd_cpu_ms_per_op": 9.47}
    offered = {"p50_ms": 12.0, "p99_ms": 30.0, "offered_per_s": 100.0}
    return {"sandboxes": n, "created_per_s": 13.7, "kinds": {"skip": skip}, "offered": offered,
            "crabd_rss_mb": 234.0, **extra}  # fmt: skip


def test_the_table_has_one_well_formed_row_per_size_with_the_listing_times_where_measured() -> None:
    first = {"per_s": 71.6, "crabd_cpu_ms_per_op": 17.94}
    text = table({"sizes": [_size(10, list_ms=4.2, status_ms=0.9, first_turns=first), _size(1000)]})
    lines = text.splitlines()
    assert len({line.count("|") for line in lines}) == 1  # a well-formed Markdown table
    assert lines[2] == "| 10 | 13.7 | 72 (17.9 ms) | 106 (448 ms; 9.5 ms) | 12 / 30 ms at 100/s | 234 MB | 4 / 1 ms |"
    assert lines[3].startswith("| 1000 | 13.7 | - |")  # a result file from before first turns were measured
    assert lines[3].endswith("| 234 MB | - |")  # ... and before the listing was timed


def test_median_ms_calls_the_given_number_of_times() -> None:
    calls: list[int] = []
    assert _median_ms(lambda: calls.append(1), times=3) >= 0.0
    assert len(calls) == 3


class _Box:
    """What ``operate`` calls of a sandbox, counting the turns it was given."""

    def __init__(self, name: str, turns: Counter[str], lock: threading.Lock) -> None:
        self.id, self._turns, self._lock = name, turns, lock

    def begin_turn(self) -> None:
        with self._lock:
            self._turns[self.id] += 1

    def run(self, argv: list[str]) -> SimpleNamespace:
        return SimpleNamespace(exit_code=0, stderr="")

    def end_turn(self, wait: bool) -> SimpleNamespace:
        return SimpleNamespace(decision=SimpleNamespace(kind="skip"))


def test_a_closed_loop_without_a_duration_turns_each_sandbox_exactly_once() -> None:
    turns: Counter[str] = Counter()
    lock = threading.Lock()
    boxes = [_Box(f"sb{i}", turns, lock) for i in range(37)]
    r = closed_loop(boxes, "skip", 8, None, CpuMeter(psutil.Process()))  # type: ignore[arg-type]
    assert r["ops"] == 37 and r["agents"] == 8 and r["decisions"] == {"skip": 37}
    assert turns == Counter({b.id: 1 for b in boxes})
