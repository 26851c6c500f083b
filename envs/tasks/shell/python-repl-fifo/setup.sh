# Two batches of integer readings and per-sensor offsets, from a seeded RNG.
python3 - <<'PY'
import json, os, random
rng = random.Random(1303)
sensors = [f"s{i:02d}" for i in range(1, 9)]
os.makedirs("inbox", exist_ok=True)
for b in (1, 2):
    with open(f"inbox/batch-{b}.csv", "w") as f:
        f.write("sensor,reading\n")
        for _ in range(150):
            f.write(f"{rng.choice(sensors)},{rng.randrange(200, 900)}\n")
with open("calibration.json", "w") as f:
    json.dump({s: rng.randrange(-40, 41) for s in sensors}, f, indent=1)
PY
