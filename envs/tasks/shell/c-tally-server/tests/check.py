import glob, os, socket, sys

def dump():
    s = socket.create_connection(("127.0.0.1", 7411), timeout=5)
    s.sendall(b"DUMP\n")
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    s.close()
    lines = data.decode().splitlines()
    assert lines and lines[-1] == "END", f"bad DUMP reply {lines[-3:]}"
    return {n: int(v) for n, v in (l.split() for l in lines[:-1])}

try:
    want = {}
    for path in glob.glob("/app/stations/*.log"):
        for line in open(path):
            st, cand, n = line.strip().split(",")
            want[cand] = want.get(cand, 0) + int(n)
            want[f"station-{st}"] = want.get(f"station-{st}", 0) + int(n)
    assert os.access("/app/tallyd", os.X_OK), "tallyd was not built"
    try:
        got = dump()
    except OSError as e:
        raise AssertionError(f"tallyd does not answer on port 7411 ({e})")
    assert got == want, f"tallyd's counters differ from the votes: {sorted(set(got.items()) ^ set(want.items()))[:4]}"
    cands = {k: v for k, v in want.items() if not k.startswith("station-")}
    top = max(cands, key=cands.get)
    assert os.path.exists("/app/winner.txt") and open("/app/winner.txt").read().split() == [top, str(cands[top])], \
        "winner.txt is wrong"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
