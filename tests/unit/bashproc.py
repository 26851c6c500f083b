"""A real host bash driven the way crabd drives a session (for unit tests).

Like crab-init, the harness gives bash a control channel on fd 100 (a unix
socketpair, SO_PASSCRED on our end), accepts only what bash itself sends
there, and reads the output written before a control message before that
message.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import time

from crabd.runtime import session_proto as sp
from crabd.runtime.initproto import CONTROL_FD

_UCRED = struct.Struct("iII")


class Bash:
    def __init__(self, env: dict[str, str] | None = None, *, control: bool = True) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.ctl = ours
        #: Control messages from other processes (dropped, as crab-init drops them).
        self.rejected: list[int] = []

        def give_fd() -> None:  # in the child, before exec
            if control:
                os.dup2(theirs.fileno(), CONTROL_FD)  # inheritable; `theirs` itself is CLOEXEC
            # Like crab-init's children: nothing of ours but 0-2 and the channel (pytest's own fds
            # would otherwise show up in bash's descriptor table).
            os.closerange(3, CONTROL_FD)
            os.closerange(CONTROL_FD + 1, 65536)

        self.p = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env or {"PATH": "/usr/bin:/bin", "HOME": "/root"},
            close_fds=False,
            preexec_fn=give_fd,
        )
        theirs.close()
        assert self.p.stdin and self.p.stdout and self.p.stderr
        self.p.stdin.write(sp.BOOTSTRAP)
        self.p.stdin.flush()
        for f in (self.p.stdout, self.p.stderr):
            os.set_blocking(f.fileno(), False)
        self.ctl.setblocking(False)

    def _recv_ctl(self) -> bytes | None:
        """One message bash itself sent (b"" if another process sent it); None at EOF."""
        data, anc, _, _ = self.ctl.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
        if not data:
            return None
        pid = -1
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = _UCRED.unpack(blob[: _UCRED.size])[0]
        if pid != self.p.pid:
            self.rejected.append(pid)
            return b""
        return data

    def _drain(self, sc: sp.MarkerScanner, open_: dict[str, int]) -> None:
        """Feed all output written so far; streams at EOF leave ``open_``."""
        for name, fd in list(open_.items()):
            while True:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not data:
                    del open_[name]
                    break
                sc.feed(name, data)  # type: ignore[arg-type]

    def run(
        self,
        cmd: str | bytes,
        *,
        keep: bool = False,
        limit: int = 1 << 20,
        timeout: float = 30,
        nonce: str | None = None,
    ) -> sp.MarkerScanner | None:
        """Run one command; None if bash exited before the marker."""
        assert self.p.stdin and self.p.stdout and self.p.stderr
        nonce = nonce or sp.new_nonce()
        sc = sp.MarkerScanner(nonce, max_stdout=limit, max_stderr=limit)
        self.p.stdin.write(sp.wrap_command(cmd, nonce, keep_status=keep))
        self.p.stdin.flush()
        open_ = {"stdout": self.p.stdout.fileno(), "stderr": self.p.stderr.fileno()}
        ctl_open = True
        deadline = time.monotonic() + timeout
        while not sc.done:
            assert time.monotonic() < deadline, "bash did not answer"
            if not ctl_open and self.p.poll() is not None:
                self._drain(sc, open_)
                return None
            fds = list(open_.values()) + ([self.ctl.fileno()] if ctl_open else [])
            ready, _, _ = select.select(fds, [], [], 0.2 if not ctl_open else timeout)
            assert ready or not ctl_open, "bash did not answer"
            if ctl_open and self.ctl.fileno() in ready:
                msg = self._recv_ctl()
                # What bash wrote before this message is in the pipes now.
                self._drain(sc, open_)
                if msg is None:
                    ctl_open = False
                else:
                    sc.feed_control(msg)
            else:
                self._drain(sc, open_)
        return sc

    def capture(self) -> bytes:
        """Raw state capture (the control channel's STATE record)."""
        from crabd.runtime.session_state import CAPTURE_COMMAND

        r = self.run(CAPTURE_COMMAND, keep=True)
        assert r is not None and r.exit_code == 0, r and r.stderr
        assert r.state is not None, "no STATE record on the control channel"
        assert not self.rejected, f"control messages from other processes: {self.rejected}"
        return r.state

    def close(self) -> None:
        self.p.kill()
        self.p.wait()
        self.ctl.close()
