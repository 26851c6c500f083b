"""Send one request to a corpus server and print the answer."""

import socket
import sys

s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
s.sendall(sys.argv[2].encode() if len(sys.argv) > 2 else b"ping")
print(s.recv(1024).decode())
s.close()
