# Six shards of numbers to sort, merge and summarise.
python3 - <<'PY'
import os, random
rng = random.Random(77)
os.makedirs("shards", exist_ok=True)
for i in range(1, 7):
    with open(f"shards/shard-{i}.txt", "w") as f:
        f.write("\n".join(str(rng.randrange(10**6)) for _ in range(rng.randrange(300, 500))) + "\n")
PY
