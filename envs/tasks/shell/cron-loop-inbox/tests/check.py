import glob, os, random, subprocess, sys

def waves():
    """{name: (rows, total)} for every file setup.sh made (same seed, same draws)."""
    rng = random.Random(6060)
    out = {}
    for w in range(1, 5):
        for k in range(rng.randrange(2, 5)):
            name = f"w{w}-{rng.randrange(1000, 9999)}"
            vals = []
            for _ in range(rng.randrange(5, 40)):
                rng.randrange(100)
                vals.append(rng.randrange(1, 10000))
            out[name] = (len(vals), sum(vals))
    return out

try:
    want = waves()
    left = os.listdir("/app/inbox") if os.path.isdir("/app/inbox") else []
    assert not left, f"the inbox still holds {left}"
    for n, (rows, t) in want.items():
        assert os.path.exists(f"/app/archive/{n}.csv"), f"{n}.csv was not processed into archive/"
        p = f"/app/outbox/{n}.summary"
        assert os.path.exists(p) and open(p).read().strip() == f"{n} rows={rows} total={t}", f"{p} is wrong"
    log = [l.split()[-1] for l in open("/app/processed.log")] if os.path.exists("/app/processed.log") else []
    assert sorted(log) == sorted(want), "processed.log does not list each file exactly once"
    total = sum(t for _, t in want.values())
    assert os.path.exists("/app/grand_total.txt") and open("/app/grand_total.txt").read().strip() == str(total), \
        f"grand_total.txt should be {total}"
    ps = subprocess.run(["pgrep", "-f", "process_inbox"], capture_output=True, text=True).stdout.split()
    assert ps, "the periodic loop is not running"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
