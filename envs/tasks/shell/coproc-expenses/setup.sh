# Exchange rates and two weeks of travel expenses in several currencies.
python3 - <<'PY'
import os, random
rng = random.Random(2025)
rates = {"USD": "1.0%03d" % rng.randrange(500, 999), "GBP": "0.8%03d" % rng.randrange(100, 700),
         "JPY": "1%02d.%02d" % (rng.randrange(50, 80), rng.randrange(100)), "CHF": "0.9%03d" % rng.randrange(100, 900)}
with open("rates.txt", "w") as f:
    f.write("# units of currency per 1 EUR\n")
    for c, r in rates.items():
        f.write(f"{c} {r}\n")
cats = ["hotel", "meals", "transport", "conference"]
for w in (1, 2):
    with open(f"expenses-week{w}.csv", "w") as f:
        f.write("category,amount,currency\n")
        for _ in range(rng.randrange(12, 20)):
            cur = rng.choice(["EUR", "USD", "GBP", "JPY", "CHF"])
            amt = rng.randrange(500, 40000) if cur == "JPY" else rng.randrange(300, 50000) / 100
            f.write(f"{rng.choice(cats)},{amt:.2f},{cur}\n" if cur != "JPY" else f"{rng.choice(cats)},{amt},{cur}\n")
PY
