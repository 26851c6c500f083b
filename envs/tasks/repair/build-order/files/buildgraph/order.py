"""Build order: every target after all of its dependencies (Kahn's algorithm)."""

from __future__ import annotations

import heapq
from typing import Mapping

from buildgraph.graph import Graph, sources


class CycleError(ValueError):
    def __init__(self, stuck: list[str]) -> None:
        super().__init__(f"dependency cycle among: {', '.join(stuck)}")
        self.stuck = stuck


def build_order(graph: Graph) -> list[str]:
    """Targets and sources in an order that respects every dependency.

    Among the names that are ready at the same time, the alphabetically
    first comes first, so the order is deterministic.
    """
    nodes = set(graph) | sources(graph)
    waiting_on = {node: 0 for node in nodes}
    dependents: dict[str, list[str]] = {}
    for target, deps in graph.items():
        for dep in deps:
            waiting_on[target] += 1
            dependents.setdefault(dep, [target])
    ready = [node for node, count in waiting_on.items() if count == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for target in dependents.get(node, []):
            waiting_on[target] -= 1
            if waiting_on[target] == 0:
                heapq.heappush(ready, target)
    if len(order) != len(nodes):
        raise CycleError(sorted(n for n, count in waiting_on.items() if count > 0))
    return order


def needs_rebuild(graph: Graph, mtimes: Mapping[str, float]) -> list[str]:
    """Targets to rebuild, in build order: missing, older than a dependency, or
    depending on something that is itself rebuilt."""
    stale: set[str] = set()
    for node in build_order(graph):
        if node not in graph:
            continue
        mine = mtimes.get(node)
        if mine is None or any(d in stale or mtimes.get(d, float("inf")) > mine for d in graph[node]):
            stale.add(node)
    return [n for n in build_order(graph) if n in stale]
