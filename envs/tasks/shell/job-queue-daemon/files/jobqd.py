"""A tiny job queue daemon.  Jobs are shell commands; their records live in memory.

    python3 jobqd.py --socket /tmp/jobq.sock --workers N

Requests (one JSON object per connection), normally sent with jobq.py:
    {"op": "submit", "name": NAME, "cmd": SHELL_COMMAND, "cwd": DIR, "after": [IDS]}
    {"op": "list"} | {"op": "get", "id": ID} | {"op": "pause"} | {"op": "resume"}
A job runs once every job in its `after` list finished with status 0.
"""

import argparse
import json
import os
import socket
import subprocess
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("--socket", required=True)
ap.add_argument("--workers", type=int, default=1)
args = ap.parse_args()

lock = threading.Condition()
jobs: dict[int, dict] = {}
paused = False


def ready(job: dict) -> bool:
    return job["state"] == "queued" and all(jobs[a]["state"] == "done" and jobs[a]["rc"] == 0 for a in job["after"])


def worker(n: int) -> None:
    while True:
        with lock:
            job = None
            while job is None:
                if not paused:
                    job = next((j for j in sorted(jobs.values(), key=lambda j: j["id"]) if ready(j)), None)
                if job is None:
                    lock.wait()
            job["state"], job["worker"] = "running", n
        p = subprocess.run(["bash", "-c", job["cmd"]], cwd=job["cwd"], capture_output=True, text=True)
        with lock:
            job.update(state="done", rc=p.returncode, output=(p.stdout + p.stderr)[-2000:])
            lock.notify_all()


def handle(req: dict) -> dict:
    global paused
    with lock:
        op = req.get("op")
        if op == "submit":
            after = [int(a) for a in req.get("after", [])]
            if any(a not in jobs for a in after):
                return {"ok": False, "error": "unknown dependency"}
            jid = len(jobs) + 1
            jobs[jid] = {"id": jid, "name": req["name"], "cmd": req["cmd"], "cwd": req.get("cwd", "/"),
                         "after": after, "state": "queued", "rc": None, "output": "", "worker": None}
            lock.notify_all()
            return {"ok": True, "id": jid}
        if op == "list":
            return {"ok": True, "jobs": [{k: j[k] for k in ("id", "name", "state", "rc", "after")} for j in jobs.values()]}
        if op == "get":
            j = jobs.get(int(req["id"]))
            return {"ok": True, "job": j} if j else {"ok": False, "error": "no such job"}
        if op in ("pause", "resume"):
            paused = op == "pause"
            lock.notify_all()
            return {"ok": True, "paused": paused}
        return {"ok": False, "error": f"unknown op {op}"}


for i in range(args.workers):
    threading.Thread(target=worker, args=(i,), daemon=True).start()
if os.path.exists(args.socket):
    os.unlink(args.socket)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(args.socket)
srv.listen(16)
while True:
    c, _ = srv.accept()
    with c:
        try:
            reply = handle(json.loads(c.makefile().readline()))
        except (ValueError, KeyError) as e:
            reply = {"ok": False, "error": str(e)}
        c.sendall(json.dumps(reply).encode() + b"\n")
