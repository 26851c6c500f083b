# The release ticket names the build; latency samples to run the release on.
python3 - <<'PY'
import random
rng = random.Random(4096)
build = f"rel-{rng.randrange(100, 999)}-{'%06x' % rng.getrandbits(24)}"
with open("TICKET.txt", "w") as f:
    f.write(f"""Release ticket OPS-{rng.randrange(1000, 9999)}
Build the numstat tool for release with
  BUILD_ID = {build}
  UNIT     = ms
and install it under /app/dist.
""")
with open("latency.txt", "w") as f:
    f.write("\n".join(str(rng.randrange(3, 900)) for _ in range(250)) + "\n")
PY
