"""Build graphs from Makefile-like rule files, and the order to build them in."""

from buildgraph.graph import parse_rules, sources
from buildgraph.order import CycleError, build_order, needs_rebuild

__all__ = ["CycleError", "build_order", "needs_rebuild", "parse_rules", "sources"]
