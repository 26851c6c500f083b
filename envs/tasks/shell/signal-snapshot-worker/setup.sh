# Nine transfer files, delivered in three drops.
python3 - <<'PY'
import os, random
rng = random.Random(2718)
accounts = ["acme", "bolt", "cask", "dune", "ember", "flint", "grove"]
for d in (1, 2, 3):
    os.makedirs(f"drops/drop-{d}", exist_ok=True)
    for k in range(3):
        with open(f"drops/drop-{d}/t{d}{k}.txn", "w") as f:
            for _ in range(rng.randrange(15, 30)):
                a, b = rng.sample(accounts, 2)
                f.write(f"{a} {b} {rng.randrange(1, 1000)}\n")
PY
mkdir -p spool
