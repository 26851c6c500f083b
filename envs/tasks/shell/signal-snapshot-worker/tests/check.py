import glob, json, os, subprocess, sys, time

try:
    balances, transfers = {}, 0
    files = sorted(glob.glob("/app/drops/drop-*/*.txn"))
    for path in files:
        for line in open(path):
            a, b, n = line.split()
            balances[a] = balances.get(a, 0) - int(n)
            balances[b] = balances.get(b, 0) + int(n)
            transfers += 1
    want = {"files": len(files), "transfers": transfers, "balances": balances}
    assert os.path.exists("/app/snapshot.json"), "snapshot.json is missing"
    got = json.load(open("/app/snapshot.json"))
    assert got == want, f"snapshot.json covers {got.get('files')} files / {got.get('transfers')} transfers, expected {len(files)} / {transfers} (or balances differ)"
    top = max(balances, key=balances.get)
    assert os.path.exists("/app/richest.txt") and open("/app/richest.txt").read().split() == [top, str(balances[top])], "richest.txt is wrong"
    pids = subprocess.run(["pgrep", "-f", "ledgerd.py /app/spool"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, f"expected one running worker, found {len(pids)}"
    os.rename("/app/snapshot.json", "/app/snapshot.prev.json")
    os.kill(int(pids[0]), 10)
    for _ in range(50):
        if os.path.exists("/app/snapshot.json"):
            break
        time.sleep(0.1)
    assert os.path.exists("/app/snapshot.json"), "the worker did not answer SIGUSR1"
    assert json.load(open("/app/snapshot.json")) == want, "the running worker's balances are not the ledger's"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
