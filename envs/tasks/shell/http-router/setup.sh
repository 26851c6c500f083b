# Two static sites for the backends, with contents nobody could guess.
python3 - <<'PY'
import json, os, random
rng = random.Random(9001)
words = "quartz lumen parcel orbit velvet cinder maple tundra signal harbor copper prism".split()
os.makedirs("sites/docs", exist_ok=True)
os.makedirs("sites/api/v1", exist_ok=True)
pages = []
for i in range(6):
    name = f"{rng.choice(words)}-{rng.randrange(100, 999)}.txt"
    pages.append(name)
    with open(f"sites/docs/{name}", "w") as f:
        f.write(" ".join(rng.choice(words) for _ in range(40)) + "\n")
with open("sites/docs/INDEX", "w") as f:
    f.write("\n".join(pages) + "\n")
with open("sites/api/v1/version.json", "w") as f:
    json.dump({"version": f"4.{rng.randrange(10)}.{rng.randrange(100)}", "build": "%08x" % rng.getrandbits(32)}, f)
with open("sites/api/v1/health.json", "w") as f:
    json.dump({"status": "ok", "node": rng.choice(words)}, f)
PY
