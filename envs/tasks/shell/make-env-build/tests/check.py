import os, random, subprocess, sys

try:
    rng = random.Random(4096)
    build = f"rel-{rng.randrange(100, 999)}-{'%06x' % rng.getrandbits(24)}"
    binary = "/app/dist/bin/numstat"
    assert os.access(binary, os.X_OK), f"{binary} is not installed"
    v = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5).stdout.strip()
    assert v == f"numstat build {build}", f"the installed binary says {v!r}; BUILD_ID should be {build}"
    info = "/app/dist/share/numstat/BUILD_INFO"
    assert os.path.exists(info) and open(info).read().strip() == f"BUILD_ID={build} UNIT=ms", "BUILD_INFO is wrong"
    nums = [int(x) for x in open("/app/latency.txt").read().split()]
    want = f"build={build} n={len(nums)} sum={sum(nums)}ms min={min(nums)}ms max={max(nums)}ms"
    rep = "/app/dist/share/numstat/latency-report.txt"
    assert os.path.exists(rep), f"{rep} is missing"
    assert open(rep).read().strip() == want, f"the report is {open(rep).read().strip()!r}, expected {want!r}"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
