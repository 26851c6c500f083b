# Vote logs from three polling stations: station,candidate,votes per line.
python3 - <<'PY'
import os, random
rng = random.Random(1789)
cands = ["okafor", "lindqvist", "tanaka", "moreau", "silva"]
os.makedirs("stations", exist_ok=True)
for st in ("north", "east", "harbor"):
    with open(f"stations/{st}.log", "w") as f:
        for _ in range(rng.randrange(40, 70)):
            f.write(f"{st},{rng.choice(cands)},{rng.randrange(1, 60)}\n")
PY
