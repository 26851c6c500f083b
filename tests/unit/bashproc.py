"""A real host bash driven the way crabd drives a session (for unit tests)."""

from __future__ import annotations

import os
import select
import subprocess

from crabd.runtime import session_proto as sp


class Bash:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env or {"PATH": "/usr/bin:/bin", "HOME": "/root"},
        )
        assert self.p.stdin and self.p.stdout and self.p.stderr
        self.p.stdin.write(sp.BOOTSTRAP)
        self.p.stdin.flush()
        for f in (self.p.stdout, self.p.stderr):
            os.set_blocking(f.fileno(), False)

    def run(
        self, cmd: str | bytes, *, keep: bool = False, limit: int = 1 << 20, timeout: float = 30
    ) -> sp.MarkerScanner | None:
        """Run one command; None if bash exited before the marker."""
        assert self.p.stdin and self.p.stdout and self.p.stderr
        nonce = sp.new_nonce()
        sc = sp.MarkerScanner(nonce, max_stdout=limit, max_stderr=limit)
        self.p.stdin.write(sp.wrap_command(cmd, nonce, keep_status=keep))
        self.p.stdin.flush()
        while not sc.done:
            ready, _, _ = select.select([self.p.stdout, self.p.stderr], [], [], timeout)
            assert ready, "bash did not answer"
            for f in ready:
                data = os.read(f.fileno(), 65536)
                if not data:
                    return None
                sc.feed("stdout" if f is self.p.stdout else "stderr", data)
        return sc

    def close(self) -> None:
        self.p.kill()
        self.p.wait()
