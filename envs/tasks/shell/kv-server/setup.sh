# 40 records with values the agent cannot guess.
python3 - <<'PY'
import random
rng = random.Random(7)
with open("seed.csv", "w") as f:
    for i in range(40):
        f.write(f"item{i:02d},{rng.randrange(1000, 9999)}\n")
PY
