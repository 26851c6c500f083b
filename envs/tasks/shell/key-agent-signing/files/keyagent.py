"""A signing agent, in the manner of ssh-agent: it holds decrypted keys in memory only.

    eval "$(python3 keyagent.py)"     start it; prints the shell commands that export
                                      KEYAGENT_SOCK and KEYAGENT_PID
    keyadd.py / keysign.py            talk to it through $KEYAGENT_SOCK

Protocol (one JSON request per connection): {"op": "add", "name", "key"} |
{"op": "list"} | {"op": "sign", "name", "digest"}.
"""

import hashlib
import hmac
import json
import os
import socket
import sys

path = f"/tmp/keyagent.{os.getpid()}.sock"
if os.path.exists(path):
    os.unlink(path)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o600)
srv.listen(4)

pid = os.fork()
if pid:
    print(f"KEYAGENT_SOCK={path}; export KEYAGENT_SOCK;")
    print(f"KEYAGENT_PID={pid}; export KEYAGENT_PID;")
    print(f"echo Agent pid {pid};")
    sys.exit(0)

os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)

keys: dict[str, bytes] = {}
while True:
    conn, _ = srv.accept()
    with conn:
        try:
            req = json.loads(conn.makefile().readline())
            if req["op"] == "add":
                keys[req["name"]] = bytes.fromhex(req["key"])
                reply = {"ok": True}
            elif req["op"] == "list":
                reply = {"ok": True, "keys": {n: hashlib.sha256(k).hexdigest()[:16] for n, k in keys.items()}}
            elif req["op"] == "sign":
                key = keys[req["name"]]
                reply = {"ok": True, "sig": hmac.new(key, bytes.fromhex(req["digest"]), "sha256").hexdigest()}
            else:
                reply = {"ok": False, "error": "bad op"}
        except (KeyError, ValueError) as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        conn.sendall(json.dumps(reply).encode() + b"\n")
