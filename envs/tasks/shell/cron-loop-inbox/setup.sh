# Four waves of incoming CSV files (name,amount), delivered over the task.
python3 - <<'PY'
import os, random
rng = random.Random(6060)
for w in range(1, 5):
    os.makedirs(f"incoming/wave-{w}", exist_ok=True)
    for k in range(rng.randrange(2, 5)):
        with open(f"incoming/wave-{w}/w{w}-{rng.randrange(1000, 9999)}.csv", "w") as f:
            for _ in range(rng.randrange(5, 40)):
                f.write(f"item{rng.randrange(100)},{rng.randrange(1, 10000)}\n")
PY
mkdir -p inbox
