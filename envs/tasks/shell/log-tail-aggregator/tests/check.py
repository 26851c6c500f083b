import json, os, socket, subprocess, sys

def parse(path):
    out = []
    for line in open(path):
        p = line.split()
        if len(p) == 5 and p[3].isdigit() and p[4].isdigit():
            out.append(p)
    return out

def live_stats():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect("/tmp/logagg.sock")
    s.sendall(b"stats\n")
    data = json.loads(s.makefile().readline())
    s.close()
    return data

try:
    cum, five = [], 0
    paths, status, nbytes, n = {}, {}, 0, 0
    for b in (1, 2, 3):
        for _, _, path, st, size in parse(f"/app/traffic/batch-{b}.log"):
            n += 1
            nbytes += int(size)
            paths[path] = paths.get(path, 0) + 1
            status[st] = status.get(st, 0) + 1
            five += st.startswith("5")
        cum.append(five)
    try:
        got = live_stats()
    except OSError as e:
        raise AssertionError(f"the aggregator does not answer on /tmp/logagg.sock ({e})")
    assert got["lines"] == n, f"the aggregator counted {got['lines']} lines, expected {n} (only the replayed batches)"
    assert got["paths"] == paths and got["status"] == status and got["bytes"] == nbytes, "the aggregator's counters are wrong"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    assert any(p.startswith("tail ") and "access.log" in p for p in ps), "the tail process is not running"
    lines = open("/app/checkpoints.txt").read().split() if os.path.exists("/app/checkpoints.txt") else []
    assert lines == [str(c) for c in cum], f"checkpoints.txt has {lines}, expected {cum}"
    top = max(paths, key=paths.get)
    assert open("/app/top_path.txt").read().split() == [top, str(paths[top])], "top_path.txt is wrong"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
