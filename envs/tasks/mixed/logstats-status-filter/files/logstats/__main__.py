"""python3 -m logstats LOG [--method M] [--prefix P] [--top N]"""

from __future__ import annotations

import argparse
import sys

from logstats.filters import by_method, by_prefix, top_paths
from logstats.parse import parse_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="logstats", description=__doc__)
    ap.add_argument("log")
    ap.add_argument("--method", help="only this HTTP method")
    ap.add_argument("--prefix", help="only paths starting with this")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    with open(args.log, encoding="utf-8", errors="replace") as f:
        hits = parse_lines(f)
        if args.method:
            hits = by_method(hits, args.method)
        if args.prefix:
            hits = by_prefix(hits, args.prefix)
        for path, count in top_paths(hits, args.top):
            print(f"{count:6d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
