# Credentials to export into a vault directory that already holds hand-edited entries.
python3 - <<'PY'
import os, random
rng = random.Random(4711)
services = ["billing", "search", "mailer", "metrics", "auth", "storage", "queue", "cache", "ledger", "gateway",
            "audit", "reports", "backup", "cdn", "dns", "vpn", "ci", "registry", "sso", "pager"]
def secret():
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789") for _ in range(24))
with open("secrets.csv", "w") as f:
    for s in services:
        f.write(f"{s},{secret()}\n")
os.makedirs("vault", exist_ok=True)
for s in rng.sample(services, 5):
    with open(f"vault/{s}.secret", "w") as f:
        f.write(f"{secret()}  # rotated by hand, keep\n")
PY
chmod 644 vault/*.secret
