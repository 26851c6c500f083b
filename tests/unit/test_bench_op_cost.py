"""bench.op_cost's arithmetic: medians over rounds, and the side-by-side table (no crabd needed)."""

from __future__ import annotations

from bench.op_cost import _medians, table


def _arm(label: str, crabd: list[float]) -> dict[str, object]:
    cells = [{"crabd_cpu_ms": c, "helpers_cpu_ms": 0.5, "sandbox_cpu_ms": 1.5, "wall_ms": 10.0} for c in crabd]
    return {"label": label, "kinds": {"skip": _medians(cells)}}


def test_medians_are_per_figure_over_the_rounds() -> None:
    got = _medians(
        [
            {"crabd_cpu_ms": 9.0, "wall_ms": 1.0},
            {"crabd_cpu_ms": 3.0, "wall_ms": 5.0},
            {"crabd_cpu_ms": 4.0, "wall_ms": 2.0},
        ]
    )
    assert got == {"crabd_cpu_ms": 4.0, "wall_ms": 2.0, "rounds": 3}


def test_table_gives_this_over_baseline_for_crabds_cpu() -> None:
    text = table([_arm("this", [6.0, 6.2, 5.8]), _arm("baseline", [8.0, 7.9, 8.1])])
    lines = text.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")  # a well-formed Markdown table
    assert lines[2] == "| skip | 6.0 / 0.5 / 1.5 / 10.0 | 8.0 / 0.5 / 1.5 / 10.0 | 0.75 |"


def test_table_of_one_arm_has_no_ratio() -> None:
    lines = table([_arm("this", [6.0])]).splitlines()
    assert lines[2] == "| skip | 6.0 / 0.5 / 1.5 / 10.0 |" and "baseline" not in lines[0]
