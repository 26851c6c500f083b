import json, os, socket, sys

def call(req):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect("/tmp/jobq.sock")
    s.sendall(json.dumps(req).encode() + b"\n")
    r = json.loads(s.makefile().readline())
    s.close()
    return r

try:
    shards = {n: [int(x) for x in open(f"/app/shards/shard-{n}.txt").read().split()] for n in range(1, 7)}
    for n, nums in shards.items():
        p = f"/app/sorted/shard-{n}.txt"
        assert os.path.exists(p) and [int(x) for x in open(p).read().split()] == sorted(nums), f"{p} is wrong"
    allnums = sorted(x for v in shards.values() for x in v)
    assert os.path.exists("/app/merged.txt"), "merged.txt is missing"
    assert [int(x) for x in open("/app/merged.txt").read().split()] == allnums, "merged.txt is wrong"
    want = f"{len(allnums)} {allnums[0]} {allnums[-1]}"
    assert os.path.exists("/app/stats.txt") and open("/app/stats.txt").read().strip() == want, f"stats.txt should be '{want}'"
    try:
        jobs = call({"op": "list"})["jobs"]
    except OSError as e:
        raise AssertionError(f"the job queue daemon does not answer on /tmp/jobq.sock ({e})")
    by = {j["name"]: j for j in jobs}
    names = [f"sort-shard-{n}" for n in range(1, 7)] + ["merge", "stats"]
    for name in names:
        assert name in by, f"the daemon has no job named {name} (jobs: {sorted(by)})"
        assert by[name]["state"] == "done" and by[name]["rc"] == 0, f"job {name} did not finish successfully"
    sort_ids = {by[f"sort-shard-{n}"]["id"] for n in range(1, 7)}
    assert set(by["merge"]["after"]) == sort_ids, "merge does not depend on all six sort jobs"
    assert by["stats"]["after"] == [by["merge"]["id"]], "stats does not depend on merge"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
