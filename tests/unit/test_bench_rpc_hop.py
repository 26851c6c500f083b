"""bench.rpc_hop measures both sides of a real gRPC call between two processes (few calls here)."""

from __future__ import annotations

from bench import rpc_hop


def test_both_sides_of_a_call_are_measured_per_call() -> None:
    got = rpc_hop.measure(calls=60, reps=2)
    assert got["calls_per_rep"] == 60 and len(got["reps"]) == 2
    m = got["median"]
    assert set(m) == {"server_cpu_ms", "client_cpu_ms", "wall_ms"}
    # Both processes did work for each call; the whole call took at least as long as neither's CPU alone.
    assert m["wall_ms"] > 0 and m["server_cpu_ms"] >= 0 and m["client_cpu_ms"] > 0
    assert m["server_cpu_ms"] + m["client_cpu_ms"] > 0
