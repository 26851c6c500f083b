# An access log with old traffic, and three batches of new traffic to replay.
python3 - <<'PY'
import os, random
rng = random.Random(4242)
paths = ["/", "/login", "/api/items", "/api/cart", "/static/app.js", "/health", "/api/checkout"]
statuses = ["200"] * 12 + ["201", "204", "301", "304", "400", "403", "404", "404", "500", "502", "503"]
def line():
    ip = f"10.0.{rng.randrange(256)}.{rng.randrange(1, 255)}"
    return f"{ip} {rng.choice(['GET', 'GET', 'POST'])} {rng.choice(paths)} {rng.choice(statuses)} {rng.randrange(80, 20000)}\n"
os.makedirs("logs", exist_ok=True)
os.makedirs("traffic", exist_ok=True)
with open("logs/access.log", "w") as f:
    f.writelines(line() for _ in range(500))
for b in (1, 2, 3):
    with open(f"traffic/batch-{b}.log", "w") as f:
        for _ in range(rng.randrange(120, 200)):
            f.write(line() if rng.random() > 0.03 else "garbled line\n")
PY
