"""Structured logs: one JSON object per line, on stderr (journald) and optionally a file."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool | type(None)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, sort_keys=False)


class _Shard(logging.Filter):
    """Marks a worker's lines with its shard ([daemon] workers), unless a line names one itself."""

    def __init__(self, shard: int) -> None:
        super().__init__()
        self.shard = shard

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "shard"):
            record.shard = self.shard
        return True


def setup(level: str = "info", log_file: Path | None = None, *, shard: int = 0) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level.upper())
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handlers.append(logging.FileHandler(log_file))
        # Its lines name sandboxes and uids: root only, whatever the umask or an older crabd left
        # (a regular file only: never a device such as /dev/stderr someone pointed it at).
        if log_file.is_file() and not log_file.is_symlink():
            os.chmod(log_file, 0o600)
    for h in handlers:
        h.setFormatter(JsonFormatter())
        if shard:
            h.addFilter(_Shard(shard))
        root.addHandler(h)
    # grpc and docker are chatty at debug level; keep them at warning.
    for noisy in ("urllib3", "docker", "grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
