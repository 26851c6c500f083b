"""Client for kvserver.py: kvctl.py get KEY | put KEY VALUE | keys  (port from $KV_PORT, default 7070)."""

import os
import sys
import urllib.request

base = f"http://127.0.0.1:{os.environ.get('KV_PORT', '7070')}/"
cmd = sys.argv[1]
if cmd == "get":
    print(urllib.request.urlopen(base + sys.argv[2]).read().decode())
elif cmd == "put":
    req = urllib.request.Request(base + sys.argv[2], data=sys.argv[3].encode(), method="PUT")
    urllib.request.urlopen(req).read()
elif cmd == "keys":
    print(urllib.request.urlopen(base).read().decode())
else:
    sys.exit(f"unknown command {cmd}")
