"""ledger-report FILE.csv: totals per account of a ledger (date,account,amount_cents).

The currency label comes from $LEDGER_CURRENCY (default USD).
"""

import csv
import os
import sys

from moneyfmt import fmt

from ledgerkit import __version__


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        print(f"ledger-report {__version__}")
        return
    cur = os.environ.get("LEDGER_CURRENCY", "USD")
    totals: dict[str, int] = {}
    with open(sys.argv[1], newline="") as f:
        for row in csv.DictReader(f):
            totals[row["account"]] = totals.get(row["account"], 0) + int(row["amount_cents"])
    print(f"# {os.path.basename(sys.argv[1])} (ledger-report {__version__}, {cur})")
    for acct in sorted(totals):
        print(f"{acct:<12} {fmt(totals[acct], cur):>18}")
    print(f"{'TOTAL':<12} {fmt(sum(totals.values()), cur):>18}")
