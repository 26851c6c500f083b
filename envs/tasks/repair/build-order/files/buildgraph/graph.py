"""Rules: ``target: dep dep ...`` lines; ``\\`` continues a line, ``#`` starts a comment."""

from __future__ import annotations

from typing import Iterable

Graph = dict[str, list[str]]


def _logical_lines(lines: Iterable[str]) -> Iterable[tuple[int, str]]:
    buf, start = "", 0
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].rstrip()
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            yield start, buf
        buf = ""
    if buf.strip():
        yield start, buf


def parse_rules(lines: Iterable[str]) -> Graph:
    """``{target: [deps in order, without duplicates]}``; a target may get deps from several lines."""
    graph: Graph = {}
    for number, line in _logical_lines(lines):
        target, sep, deps = line.partition(":")
        target = target.strip()
        if not sep or not target or " " in target:
            raise ValueError(f"line {number}: expected 'target: deps', got {line.strip()!r}")
        entry = graph.setdefault(target, [])
        for dep in deps.split():
            if dep == target:
                raise ValueError(f"line {number}: {target} depends on itself")
            if dep not in entry:
                entry.append(dep)
    return graph


def sources(graph: Graph) -> set[str]:
    """Names that are only depended on, never built (source files)."""
    return {d for deps in graph.values() for d in deps if d not in graph}
