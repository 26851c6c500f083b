"""A real S3-protocol server for tests and benchmarks: moto's server mode, as a subprocess.

moto (``moto[server]``, a dev dependency) answers S3's HTTP protocol on a
local port, so the code under test runs boto3 exactly as against AWS or
MinIO: signing, retries, timeouts, real sockets.  It keeps objects in the
server process's memory, so stopping the process empties the bucket; a
restart on the same port (:meth:`S3Server.start` after :meth:`S3Server.stop`)
then recreates the bucket.  That is enough to simulate an outage.

Usage::

    with S3Server() as s3:
        monkeypatch.setattr(os, "environ", {**os.environ, **s3.env})  # or pass s3.env to a subprocess
        cfg = RemoteConfig.model_validate(s3.remote_settings(prefix="t/"))
        toml = s3.config_toml(prefix="t/")   # the [remote] section for a crabd.toml

moto accepts any credentials; :attr:`S3Server.env` holds dummy ones, which
boto3's default chain finds, as crabd's real ones would be.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

#: moto's console script, installed beside this interpreter by the dev extra.
MOTO_SERVER = Path(sys.executable).with_name("moto_server")
#: How long a start may take before it is an error (moto imports Flask and its S3 backend: ~1-3 s).
START_TIMEOUT_S = 30.0
REGION = "us-east-1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 server on 127.0.0.1, with ``bucket`` created.  A context manager; see the module's docstring."""

    def __init__(self, bucket: str = "crab-test", *, port: int = 0) -> None:
        self.bucket = bucket
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "crab-test-key",
            "AWS_SECRET_ACCESS_KEY": "crab-test-secret",
            "AWS_DEFAULT_REGION": REGION,
        }
        self._dir = Path(tempfile.mkdtemp(prefix="crab-s3-"))
        self.log_path = self._dir / "moto.log"
        self._proc: subprocess.Popen[bytes] | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the server (on the same port as before, if it ran) and create the bucket; bounded wait."""
        if self._proc is not None:
            return
        if not MOTO_SERVER.exists():
            raise RuntimeError(f"{MOTO_SERVER} is missing: install the dev extra (pip install -e '.[dev]')")
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a test's Ctrl-C does not reach it half-way, stop() ends it.
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        try:
            self._wait_ready()
            self._create_bucket()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server: the port refuses connections until :meth:`start` (every object is lost)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the server and remove its log directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # --- what a test configures ------------------------------------------------------------

    def remote_settings(self, prefix: str = "crab/", **overrides: Any) -> dict[str, Any]:
        """``[remote]`` settings (a dict for ``RemoteConfig.model_validate``) that reach this server."""
        return {
            "enabled": True,
            "endpoint_url": self.endpoint_url,
            "bucket": self.bucket,
            "prefix": prefix,
            "region": REGION,
            **overrides,
        }

    def config_toml(self, prefix: str = "crab/", **overrides: Any) -> str:
        """The ``[remote]`` section of a crabd.toml that reaches this server."""
        lines = ["[remote]"]
        for name, value in self.remote_settings(prefix, **overrides).items():
            lines.append(f"{name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def client(self) -> Any:
        """A boto3 S3 client of this server (for tests that look behind the store's back)."""
        import boto3
        from botocore.config import Config

        session = boto3.session.Session(
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=REGION,
        )
        return session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "total_max_attempts": 2}),
        )

    # --- internals ----------------------------------------------------------------------

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self._proc.returncode} on port {self.port}; its log:\n{self.log_tail()}"
                )
            try:
                # moto's own health page; any HTTP answer means it serves.
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto_server did not answer on {self.endpoint_url} within {START_TIMEOUT_S:g} s; "
                    f"its log:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _create_bucket(self) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=self.bucket)
        finally:
            client.close()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # A TOML basic string is a JSON string for the characters a setting holds.
    return json.dumps(str(value))
