"""bench.scale's table and timing helper (no crabd needed): what a ten-minute run prints at its end."""

from __future__ import annotations

from typing import Any

from bench.scale import _median_ms, table


def _size(n: int, **extra: Any) -> dict[str, Any]:
    skip = {"per_s": 106.1, "p99_ms": 447.5, "crabd_cpu_ms_per_op": 9.47}
    offered = {"p50_ms": 12.0, "p99_ms": 30.0, "offered_per_s": 100.0}
    return {"sandboxes": n, "created_per_s": 13.7, "kinds": {"skip": skip}, "offered": offered,
            "crabd_rss_mb": 234.0, **extra}  # fmt: skip


def test_the_table_has_one_well_formed_row_per_size_with_the_listing_times_where_measured() -> None:
    text = table({"sizes": [_size(10, list_ms=4.2, status_ms=0.9), _size(1000)]})
    lines = text.splitlines()
    assert len({line.count("|") for line in lines}) == 1  # a well-formed Markdown table
    assert lines[2] == "| 10 | 13.7 | 106 (448 ms; 9.5 ms) | 12 / 30 ms at 100/s | 234 MB | 4 / 1 ms |"
    assert lines[3].endswith("| 234 MB | - |")  # a result file from before the listing was timed


def test_median_ms_calls_the_given_number_of_times() -> None:
    calls: list[int] = []
    assert _median_ms(lambda: calls.append(1), times=3) >= 0.0
    assert len(calls) == 3
