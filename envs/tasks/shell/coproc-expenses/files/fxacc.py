"""fxacc: an expense accumulator that converts currencies.  Line protocol on stdin/stdout,
one reply line per command (meant to run as a coprocess):

    rate CUR UNITS_PER_EUR   set an exchange rate           -> "ok"
    add CATEGORY AMOUNT CUR  book an expense (e.g. 12.50)   -> the amount in EUR
    total [CATEGORY]         the sum in EUR                 -> e.g. "1234.56"
    count                    expenses booked                -> e.g. "17"
    categories               -> "cat1 cat2 ..." (sorted)

Every expense is converted to EUR when it is booked and rounded to the cent;
state lives in memory only.
"""

import sys
from decimal import ROUND_HALF_EVEN, Decimal

rates: dict[str, Decimal] = {"EUR": Decimal(1)}
booked: list[tuple[str, Decimal]] = []
CENT = Decimal("0.01")

for line in sys.stdin:
    p = line.split()
    try:
        if p[0] == "rate":
            rates[p[1]] = Decimal(p[2])
            out = "ok"
        elif p[0] == "add":
            eur = (Decimal(p[2]) / rates[p[3]]).quantize(CENT, ROUND_HALF_EVEN)
            booked.append((p[1], eur))
            out = str(eur)
        elif p[0] == "total":
            out = str(sum((e for c, e in booked if len(p) < 2 or c == p[1]), Decimal("0.00")))
        elif p[0] == "count":
            out = str(len(booked))
        elif p[0] == "categories":
            out = " ".join(sorted({c for c, _ in booked}))
        else:
            out = "error unknown command"
    except (IndexError, KeyError, ArithmeticError) as e:
        out = f"error {type(e).__name__} {e}"
    print(out, flush=True)
