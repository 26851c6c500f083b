import os, random, stat, sys

try:
    rng = random.Random(4711)
    services = ["billing", "search", "mailer", "metrics", "auth", "storage", "queue", "cache", "ledger", "gateway",
                "audit", "reports", "backup", "cdn", "dns", "vpn", "ci", "registry", "sso", "pager"]
    def secret():
        return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789") for _ in range(24))
    fresh = {s: secret() for s in services}
    kept = {s: secret() for s in rng.sample(services, 5)}
    created = sorted(s for s in services if s not in kept)
    for s in services:
        p = f"/app/vault/{s}.secret"
        assert os.path.exists(p), f"{p} is missing"
        want = f"{kept[s]}  # rotated by hand, keep\n" if s in kept else fresh[s] + "\n"
        assert open(p).read() == want, f"{p} has the wrong content" + (" (a kept entry was overwritten)" if s in kept else "")
        mode = stat.S_IMODE(os.stat(p).st_mode)
        if s not in kept:
            assert mode == 0o600, f"{p} has mode {oct(mode)}, expected 0o600"
    idx = "/app/vault/INDEX"
    assert os.path.exists(idx), f"{idx} is missing"
    assert open(idx).read().split() == created, "INDEX does not list exactly the created entries"
    assert stat.S_IMODE(os.stat(idx).st_mode) == 0o600, "INDEX is not owner-only"
    stray = [f for f in os.listdir("/app") if f.endswith(".secret")]
    assert not stray, f"secret files outside the vault: {stray}"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
