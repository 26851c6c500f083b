"""python3 -m vertools sort V... | latest [--pre] CONSTRAINT V..."""

from __future__ import annotations

import argparse
import sys

from vertools.constraints import satisfies
from vertools.semver import VersionError, parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vertools", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sort", help="print the versions in ascending order")
    s.add_argument("versions", nargs="+")
    lt = sub.add_parser("latest", help="the highest version that satisfies the constraint")
    lt.add_argument("--pre", action="store_true", help="consider pre-releases too")
    lt.add_argument("constraint")
    lt.add_argument("versions", nargs="+")
    args = ap.parse_args(argv)
    try:
        versions = sorted(parse(v) for v in args.versions)
    except VersionError as exc:
        print(f"vertools: {exc}", file=sys.stderr)
        return 2
    if args.command == "sort":
        print("\n".join(str(v) for v in versions))
        return 0
    ok = [v for v in versions if satisfies(v, args.constraint) and (args.pre or not v.is_prerelease)]
    if not ok:
        print("vertools: no version satisfies the constraint", file=sys.stderr)
        return 1
    print(ok[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
