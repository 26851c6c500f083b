"""What a client loads: the sync SDK, as ``crabctl`` uses it, stays cheap to import.

Every ``crabctl`` call starts a new interpreter, and its imports are most of
its time (docs/benchmarks.md, "CLI start-up").  These tests pin down which
modules the sync client path must NOT load (each cost several milliseconds
and is not needed to make a call), in a fresh interpreter, without timing.
The public import paths still give every name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import crabd
import crabd.models
import crabd.sdk
import crabd.sdk.models

ROOT = Path(crabd.__file__).resolve().parent.parent

#: Loaded by none of: ``import crabd.sdk.client``, making a ``Client()``, the models of ``ps`` and
#: ``sh`` replies.  pydantic (and crabd.config, its one user here): ~90 ms; the asyncio client and
#: the embedded daemon's launcher; the daemon's records (crabd.models) and the SDK models of
#: checkpoints, reports and turns (dataclasses: ~18 ms together); importlib.metadata (pydantic's
#: plugin loader).
NOT_ON_THE_SYNC_PATH = [
    "pydantic",
    "pydantic_core",
    "importlib.metadata",
    "crabd.config",
    "crabd.sdk.aio",
    "crabd.sdk.embedded",
    "crabd.models",
    "crabd.sdk.models.checkpoint",
    "crabd.sdk.models.reports",
    "crabd.sdk.models.turns",
]


def loaded_after(code: str, **env: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code`` (this checkout's crabd)."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120, env=environ
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_sync_client_loads_none_of_the_heavy_modules(tmp_path: Path) -> None:
    config = tmp_path / "crabd.toml"
    config.write_text('[paths]\nsocket = "/srv/crab/crabd.sock"\n')
    code = (
        "from crabd.sdk.client import Client\n"
        "from crabd.sdk.models import ExecResult, OutputChunk, SandboxInfo\n"
        "c = Client()\n"
        "assert c.socket == '/srv/crab/crabd.sock', c.socket\n"
        "c.close()\n"
    )
    loaded = loaded_after(code, CRAB_CONFIG=str(config))
    assert "crabd.sdk.client" in loaded and "grpc" in loaded
    assert sorted(set(NOT_ON_THE_SYNC_PATH) & loaded) == []


def test_the_sdk_package_loads_only_the_errors_and_exports_every_name_on_use() -> None:
    loaded = loaded_after("import crabd.sdk")
    assert "crabd.errors" in loaded
    assert sorted(m for m in loaded if m.startswith("crabd.sdk.") or m == "grpc") == []
    # The lazy exports resolve to the objects of the modules that define them.
    from crabd.sdk import aio, client, embedded

    for name in crabd.sdk.__all__:
        assert getattr(crabd.sdk, name) is not None, name
    assert crabd.sdk.Client is client.Client and crabd.sdk.AsyncClient is aio.AsyncClient
    assert crabd.sdk.EmbeddedDaemon is embedded.EmbeddedDaemon
    assert crabd.sdk.RetentionPolicy is crabd.models.RetentionPolicy
    assert crabd.sdk.KeepReason is crabd.models.KeepReason
    assert crabd.sdk.CheckpointInfo is crabd.sdk.models.CheckpointInfo
    assert crabd.sdk.Turn is crabd.sdk.models.Turn
    for name in crabd.sdk.models.__all__:
        assert getattr(crabd.sdk.models, name) is not None, name
    assert set(crabd.sdk.__all__) <= set(dir(crabd.sdk))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = crabd.sdk.Nope  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = crabd.sdk.models.Nope  # type: ignore[attr-defined]
