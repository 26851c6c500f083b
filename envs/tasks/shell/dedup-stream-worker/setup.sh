# Three batches of events; retries make many of them repeat across batches.
python3 - <<'PY'
import json, os, random
rng = random.Random(31337)
os.makedirs("batches", exist_ok=True)
pool = []
for b in (1, 2, 3):
    with open(f"batches/batch-{b}.jsonl", "w") as f:
        for _ in range(120):
            if pool and rng.random() < 0.3:
                ev = rng.choice(pool)
            else:
                ev = {"id": "%012x" % rng.getrandbits(48), "user": f"u{rng.randrange(50)}",
                      "amount": rng.randrange(1, 500)}
                pool.append(ev)
            f.write(json.dumps(ev) + "\n")
PY
