"""A TCP server that sleeps in accept() between requests and logs each one (corpus helper)."""

import socket
import sys

port = int(sys.argv[1])
log = sys.argv[2] if len(sys.argv) > 2 else ""
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen()
while True:
    conn, _ = srv.accept()
    data = conn.recv(1024)
    conn.sendall(b"echo:" + data)
    conn.close()
    if log:
        with open(log, "a") as f:
            f.write(data.decode(errors="replace") + "\n")
