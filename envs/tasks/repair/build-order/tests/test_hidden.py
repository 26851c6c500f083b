import heapq
import random
import unittest

from buildgraph import CycleError, build_order, needs_rebuild


def reference_order(graph):
    nodes = set(graph) | {d for ds in graph.values() for d in ds}
    remaining = {n: set(graph.get(n, ())) for n in nodes}
    ready = [n for n, ds in remaining.items() if not ds]
    heapq.heapify(ready)
    out = []
    while ready:
        n = heapq.heappop(ready)
        out.append(n)
        for m, ds in remaining.items():
            if n in ds:
                ds.discard(n)
                if not ds:
                    heapq.heappush(ready, m)
    return out


class HiddenOrderTest(unittest.TestCase):
    def test_random_dags(self):
        rng = random.Random(1234)
        for _ in range(40):
            names = [f"n{i:02d}" for i in range(rng.randint(2, 25))]
            graph = {}
            for i, name in enumerate(names):
                if i and rng.random() < 0.8:
                    graph[name] = rng.sample(names[:i], rng.randint(1, min(i, 5)))
            order = build_order(graph)
            self.assertEqual(order, reference_order(graph))
            pos = {n: k for k, n in enumerate(order)}
            for target, deps in graph.items():
                for dep in deps:
                    self.assertLess(pos[dep], pos[target], (dep, target))

    def test_fan_in_and_fan_out(self):
        graph = {f"t{i}": ["common", f"s{i}"] for i in range(5)}
        graph["all"] = [f"t{i}" for i in range(5)]
        order = build_order(graph)
        self.assertEqual(order[-1], "all")
        self.assertEqual(len(order), 12)

    def test_cycle_behind_shared_dep(self):
        with self.assertRaises(CycleError) as cm:
            build_order({"a": ["x", "b"], "b": ["x", "a"], "c": ["x"]})
        self.assertEqual(cm.exception.stuck, ["a", "b"])

    def test_rebuild_propagates(self):
        graph = {"bin": ["a.o", "b.o"], "a.o": ["a.c", "common.h"], "b.o": ["b.c", "common.h"]}
        mtimes = {"a.c": 1, "b.c": 1, "common.h": 10, "a.o": 11, "b.o": 5, "bin": 12}
        self.assertEqual(needs_rebuild(graph, mtimes), ["b.o", "bin"])


if __name__ == "__main__":
    unittest.main()
