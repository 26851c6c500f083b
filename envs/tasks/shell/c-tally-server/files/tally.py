"""tally.py REQUEST...: send one request to tallyd (port $TALLY_PORT, default 7411), print the reply."""

import os
import socket
import sys

s = socket.create_connection(("127.0.0.1", int(os.environ.get("TALLY_PORT", "7411"))), timeout=5)
s.sendall((" ".join(sys.argv[1:]) + "\n").encode())
data = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    data += b
s.close()
sys.stdout.write(data.decode())
