# A release key encrypted with a passphrase, and release artifacts to sign.
python3 - <<'PY'
import hashlib, os, random
rng = random.Random(5150)
key = bytes(rng.randrange(256) for _ in range(32))
phrase = "-".join(rng.choice(["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor"]) for _ in range(4))
stream = hashlib.sha256(b"keystream:" + phrase.encode()).digest()
os.makedirs("keys", exist_ok=True)
with open("keys/release.key.enc", "w") as f:
    f.write((bytes(a ^ b for a, b in zip(key, stream)) + hashlib.sha256(key).digest()[:8]).hex() + "\n")
with open("keys/passphrase.txt", "w") as f:
    f.write(phrase + "\n")
os.makedirs("dist", exist_ok=True)
for name in ["app-2.3.0.tar", "app-2.3.0-docs.tar", "app-cli-2.3.0.tar"]:
    with open(f"dist/{name}", "wb") as f:
        f.write(bytes(rng.randrange(256) for _ in range(rng.randrange(2000, 6000))))
PY
chmod 600 keys/*
