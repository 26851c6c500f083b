"""Ask logagg.py for its counters: aggctl.py [stats|reset] [FIELD]   (socket: $LOGAGG_SOCK or /tmp/logagg.sock)"""

import json
import os
import socket
import sys

cmd = sys.argv[1] if len(sys.argv) > 1 else "stats"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ.get("LOGAGG_SOCK", "/tmp/logagg.sock"))
s.sendall(cmd.encode() + b"\n")
data = json.loads(s.makefile().readline())
s.close()
if len(sys.argv) > 2:
    for key in sys.argv[2].split("."):
        data = data.get(key, 0) if isinstance(data, dict) else 0
print(json.dumps(data, sort_keys=True) if isinstance(data, dict) else data)
