import json
import os
import socket
import sys


def call(req: dict) -> dict:
    path = os.environ.get("KEYAGENT_SOCK")
    if not path:
        sys.exit("KEYAGENT_SOCK is not set: is the agent running in this shell?")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError as e:
        sys.exit(f"cannot reach the agent at {path}: {e}")
    s.sendall(json.dumps(req).encode() + b"\n")
    reply = json.loads(s.makefile().readline())
    s.close()
    if not reply.get("ok"):
        sys.exit(f"agent: {reply.get('error')}")
    return reply
