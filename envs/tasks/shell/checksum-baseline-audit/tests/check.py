import hashlib, os, random, subprocess, sys, tempfile

def baseline():
    """The tree setup.sh made, rebuilt with the same seed in a scratch directory."""
    rng = random.Random(1999)
    words = "alpha beta gamma delta omega sigma kappa lambda theta zeta".split()
    out, files = {}, []
    for sub in ["", "css", "js", "img", "docs", "docs/api"]:
        for _ in range(rng.randrange(3, 7)):
            name = os.path.join(sub, f"{rng.choice(words)}-{rng.randrange(100, 999)}.{rng.choice(['html', 'txt', 'json'])}")
            if name in files:
                continue
            files.append(name)
            out[name] = hashlib.sha256((" ".join(rng.choice(words) for _ in range(rng.randrange(10, 80))) + "\n").encode()).hexdigest()
    return out

def now():
    out = {}
    for root, _, names in os.walk("/app/site"):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, "/app/site")] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out

try:
    assert not os.path.exists("/app/.deploy-plan.sh"), "the deployment was not run"
    base, cur = baseline(), now()
    want = []
    for p in cur:
        if p not in base:
            want.append(("A", p))
        elif base[p] != cur[p]:
            want.append(("M", p))
    want += [("D", p) for p in base if p not in cur]
    want = [f"{k} {p}" for k, p in sorted(want, key=lambda x: x[1])]
    assert os.path.exists("/app/audit.txt"), "/app/audit.txt is missing"
    got = open("/app/audit.txt").read().splitlines()
    assert got == want, f"audit.txt has {len(got)} lines, expected {len(want)}: {sorted(set(got) ^ set(want))[:4]} differ"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
