"""``python3 -m expenses export.csv``: print a summary of an export."""

from __future__ import annotations

import sys

from expenses.reader import read_expenses
from expenses.summary import summarize


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m expenses EXPORT.csv", file=sys.stderr)
        return 2
    with open(argv[0], newline="") as f:
        print(summarize(read_expenses(f)).render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
