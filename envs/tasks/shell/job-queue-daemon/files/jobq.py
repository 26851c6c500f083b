"""Client for jobqd.py (socket: $JOBQ_SOCK, default /tmp/jobq.sock).

    jobq.py submit NAME [--after ID,ID] -- COMMAND...   prints the new job's id
    jobq.py list                                         id, name, state, rc
    jobq.py show ID                                      the job's record, with its output
    jobq.py wait ID... [--timeout S]                     until they are done; exit 1 if any failed
    jobq.py pause | resume
Jobs run in the directory jobq.py was called from.
"""

import json
import os
import socket
import sys
import time


def call(req: dict) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.environ.get("JOBQ_SOCK", "/tmp/jobq.sock"))
    s.sendall(json.dumps(req).encode() + b"\n")
    r = json.loads(s.makefile().readline())
    s.close()
    if not r["ok"]:
        sys.exit(f"jobq: {r['error']}")
    return r


a = sys.argv[1:]
if a[0] == "submit":
    name, rest = a[1], a[2:]
    after = []
    if rest[:1] == ["--after"]:
        after, rest = [int(x) for x in rest[1].split(",") if x], rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    print(call({"op": "submit", "name": name, "cmd": " ".join(rest), "cwd": os.getcwd(), "after": after})["id"])
elif a[0] == "list":
    for j in call({"op": "list"})["jobs"]:
        print(j["id"], j["name"], j["state"], "" if j["rc"] is None else j["rc"], sep="\t")
elif a[0] == "show":
    print(json.dumps(call({"op": "get", "id": a[1]})["job"], indent=1))
elif a[0] == "wait":
    timeout = 30.0
    if "--timeout" in a:
        i = a.index("--timeout")
        timeout = float(a[i + 1])
        a = a[:i] + a[i + 2:]
    end = time.time() + timeout
    ids = a[1:]
    while True:
        js = [call({"op": "get", "id": i})["job"] for i in ids]
        if all(j["state"] == "done" for j in js):
            sys.exit(1 if any(j["rc"] != 0 for j in js) else 0)
        if time.time() > end:
            sys.exit("jobq: timed out waiting")
        time.sleep(0.1)
elif a[0] in ("pause", "resume"):
    print(call({"op": a[0]}))
else:
    sys.exit(__doc__)
