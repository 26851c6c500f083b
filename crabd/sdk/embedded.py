"""Embedded mode: a private crabd for one program (tests, the demo, notebooks).

The daemon runs as a child process on a temporary socket and state dir and
is stopped (SIGTERM, then SIGKILL after a grace) by :meth:`close`.  It runs
with ``--ephemeral``, so its sandboxes are removed when it stops; the state
dir is deleted too when this object created it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import grpc

from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import DaemonUnavailable

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0


class EmbeddedDaemon:
    def __init__(
        self,
        state_dir: str | Path | None = None,
        *,
        ephemeral: bool = True,
        log_level: str = "info",
        extra_args: list[str] | None = None,
    ) -> None:
        self._own_dir = state_dir is None
        # A short base path: unix socket paths are limited to 107 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="crab-", dir="/tmp")) if state_dir is None else Path(state_dir)
        self.socket = self.base / "crabd.sock"
        self.state_dir = self.base / "state"
        self.log_file = self.base / "crabd.log"
        self.ephemeral = ephemeral
        self.log_level = log_level
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        #: Where this start's lines begin in the log (it is appended to across restarts).
        self._log_from = 0

    def start(self, *, first_wait: float = 2.0) -> None:
        """Start crabd and return once it answers (``DaemonStatus``).

        ``first_wait``: how long the first try waits for an answer, doubled
        after each miss up to 2 s.  A try that connects before crabd serves
        waits that long, so a restart's timing is that coarse: bench.scale
        passes 0.25 s.  crabd finishes adoption and its store's reconciliation
        in the background after it answers; :meth:`wait_settled` waits for them.
        """
        try:
            self._log_from = self.log_file.stat().st_size
        except FileNotFoundError:
            self._log_from = 0
        argv = [
            sys.executable,
            "-m",
            "crabd.daemon.main",
            "--socket",
            str(self.socket),
            "--state-dir",
            str(self.state_dir),
            "--log-file",
            str(self.log_file),
            "--log-level",
            self.log_level,
            *(["--ephemeral"] if self.ephemeral else []),
            *self.extra_args,
        ]
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # the child is not the systemd service
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        wait = first_wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonUnavailable(
                    f"embedded crabd exited with {self.proc.returncode} during start-up; "
                    f"log: {self.log_file}\n{self._log_tail()}",
                    socket=str(self.socket),
                )
            if self.socket.exists():
                if self._answers(wait):
                    return
                # Longer on each miss: a crabd that is serving but slow (a loaded host) still gets through.
                wait = min(wait * 2, 2.0)
            time.sleep(0.05)
        self.close()
        raise DaemonUnavailable(
            f"embedded crabd did not serve within {START_TIMEOUT_S:g} s; log: {self.log_file}", socket=str(self.socket)
        )

    def kill(self) -> None:
        """kill -9 the daemon, as a crash would (fault tests, benchmarks): nothing of its clean-up runs.

        Its sandboxes live on; :meth:`start` brings crabd back on the same state dir.
        """
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(STOP_GRACE_S)
            self.proc = None

    def wait_inspector(self, timeout: float = START_TIMEOUT_S) -> str:
        """Until the inspector is settled; returns its name ("ebpf", or "scan" where the probes cannot load).

        crabd serves at once and compiles its eBPF probes in the background
        (the scan inspector decides meanwhile; see docs/inspector.md).  Tests
        and benchmarks that measure the probes' own decisions wait here first.
        """
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            while True:
                st = pb_grpc.CrabStub(ch).DaemonStatus(pb.DaemonStatusRequest(), timeout=5)
                if not st.inspector_pending:
                    return str(st.inspector)
                if time.monotonic() > deadline:
                    raise DaemonUnavailable(
                        f"crabd's eBPF probes were not attached within {timeout:g} s; log: {self.log_file}",
                        socket=str(self.socket),
                    )
                time.sleep(0.05)

    def wait_settled(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until crabd has adopted every sandbox and reconciled its store since it last started.

        crabd serves first and adopts its sandboxes in the background (coordinator/adoption.py);
        tests that judge what a restart left (the store's orphans, every sandbox's state) wait here.
        """
        deadline = time.monotonic() + timeout
        while not self._logged_since_start('"msg": "start-up reconciled"'):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise DaemonUnavailable(
                    f"crabd did not finish adopting and reconciling within {timeout:g} s; log: {self.log_file}",
                    socket=str(self.socket),
                )
            time.sleep(0.05)

    def _logged_since_start(self, needle: str) -> bool:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_from)
                return needle.encode() in f.read()
        except OSError:
            return False

    def _answers(self, wait: float = 2.0) -> bool:
        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            try:
                pb_grpc.CrabStub(ch).DaemonStatus(pb.DaemonStatusRequest(), timeout=wait)
                return True
            except grpc.RpcError:
                return False

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> EmbeddedDaemon:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
