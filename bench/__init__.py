"""crab's benchmarks: each is a command writing JSON results (see docs/benchmarks.md)."""
