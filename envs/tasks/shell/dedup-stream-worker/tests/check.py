import json, os, subprocess, sys, time

def feed(text):
    subprocess.run(["timeout", "5", "tee", "/tmp/events.fifo"], input=text.encode(), stdout=subprocess.DEVNULL, check=True)

def stats():
    try:
        return json.load(open("/app/out/stats.json"))
    except (OSError, ValueError):
        return None

try:
    events, seen = [], set()
    total_lines = 0
    for b in (1, 2, 3):
        for line in open(f"/app/batches/batch-{b}.jsonl"):
            total_lines += 1
            ev = json.loads(line)
            if ev["id"] not in seen:
                seen.add(ev["id"])
                events.append(ev)
    assert os.path.exists("/app/out/unique.jsonl"), "/app/out/unique.jsonl is missing"
    got = [json.loads(l) for l in open("/app/out/unique.jsonl")]
    assert got == events, f"unique.jsonl has {len(got)} events, expected {len(events)} distinct ones in order"
    want = {"seen": total_lines, "unique": len(events), "duplicates": total_lines - len(events)}
    assert stats() == want, f"stats.json is {stats()}, expected {want}"
    total = sum(e["amount"] for e in events)
    assert os.path.exists("/app/out/total.txt") and open("/app/out/total.txt").read().strip() == str(total), "total.txt is wrong"
    # The live worker must still remember every id: replaying batch 1 adds no line.
    ps = subprocess.run(["pgrep", "-f", "dedup.py /tmp/events.fifo"], capture_output=True)
    assert ps.returncode == 0, "the de-duplicator is not running"
    try:
        feed(open("/app/batches/batch-1.jsonl").read() + '{"control": "flush"}\n')
    except subprocess.CalledProcessError:
        raise AssertionError("nobody reads /tmp/events.fifo")
    for _ in range(50):
        s = stats()
        if s and s["seen"] == total_lines + 120:
            break
        time.sleep(0.1)
    assert stats() == {"seen": total_lines + 120, "unique": len(events), "duplicates": total_lines + 120 - len(events)}, \
        f"after replaying batch 1 the worker reports {stats()}: it forgot the ids it had seen"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
