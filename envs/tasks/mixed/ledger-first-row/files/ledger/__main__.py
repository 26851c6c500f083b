"""python3 -m ledger EXPORT.csv [--month YYYY-MM]"""

from __future__ import annotations

import argparse
import sys

from ledger.io import LedgerError, read_entries
from ledger.report import format_table, totals_by_category


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ledger", description=__doc__)
    ap.add_argument("export")
    ap.add_argument("--month", default="")
    args = ap.parse_args(argv)
    try:
        with open(args.export, newline="", encoding="utf-8") as f:
            totals = totals_by_category(read_entries(f), args.month)
    except (OSError, LedgerError) as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return 1
    print(format_table(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
