"""Pass an open fd to another process over a unix socket (adversarial corpus helper).

    fdpass.py recv SOCK TEXT &   accept one connection, receive an fd (SCM_RIGHTS), write TEXT
                                 through it, close it, then stay alive (idle) until killed
    fdpass.py send SOCK FD       connect and send this process's FD (inherited from the shell)

The receiver never opens the file: the fd was opened by the sender's
parent (the session), possibly turns earlier.
"""

import os
import signal
import socket
import sys

op, path = sys.argv[1], sys.argv[2]
if op == "recv":
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    conn, _ = srv.accept()
    _, fds, _, _ = socket.recv_fds(conn, 16, 1)
    os.write(fds[0], sys.argv[3].encode())
    os.close(fds[0])
    conn.close()
    srv.close()
    while True:
        signal.pause()
elif op == "send":
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    socket.send_fds(c, [b"x"], [int(sys.argv[3])])
    c.close()
else:
    raise SystemExit(f"unknown operation {op}")
