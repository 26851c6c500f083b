# Two quarters of ledger entries.
python3 - <<'PY'
import os, random
rng = random.Random(9393)
accounts = ["rent", "payroll", "cloud", "travel", "sales", "refunds"]
os.makedirs("data", exist_ok=True)
for q in (1, 2):
    with open(f"data/2024-q{q}.csv", "w") as f:
        f.write("date,account,amount_cents\n")
        for _ in range(rng.randrange(60, 90)):
            a = rng.choice(accounts)
            amt = rng.randrange(100, 500000) * (1 if a in ("sales",) else -1)
            f.write(f"2024-{3 * q - rng.randrange(3):02d}-{rng.randrange(1, 29):02d},{a},{amt}\n")
PY
