import csv, os, subprocess, sys
from decimal import ROUND_HALF_EVEN, Decimal

try:
    rates = {"EUR": Decimal(1)}
    for line in open("/app/rates.txt"):
        if line.strip() and not line.startswith("#"):
            c, r = line.split()
            rates[c] = Decimal(r)
    totals, count = {}, 0
    for w in (1, 2):
        for row in csv.DictReader(open(f"/app/expenses-week{w}.csv")):
            eur = (Decimal(row["amount"]) / rates[row["currency"]]).quantize(Decimal("0.01"), ROUND_HALF_EVEN)
            totals[row["category"]] = totals.get(row["category"], Decimal("0.00")) + eur
            count += 1
    want = [f"{c} {totals[c]}" for c in sorted(totals)]
    want += [f"TOTAL {sum(totals.values(), Decimal('0.00'))}", f"COUNT {count}"]
    assert os.path.exists("/app/totals.txt"), "/app/totals.txt is missing"
    got = open("/app/totals.txt").read().splitlines()
    assert got == want, f"totals.txt is {got}, expected {want}"
    ps = subprocess.run(["pgrep", "-f", "python3 -u /app/fxacc.py"], capture_output=True, text=True).stdout.split()
    assert ps, "the accumulator is not running any more"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
