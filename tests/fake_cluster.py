"""An in-memory cluster for unit tests of :class:`crabd.cluster.client.Cluster` (no Ray, no crabd).

:class:`FakeHost` has the :class:`~crabd.cluster.hosts.HostAgent` methods the
cluster layer calls and keeps what a crabd would: sandboxes (state, turn,
files as a dict) and checkpoints.  All hosts share one :class:`FakeBucket`;
a host holds a checkpoint locally once it made or fetched it, and counts its
fetches, so tests can check "each host downloads the base once".  Errors are
crab's own (what a real agent's crabd raises), and :attr:`FakeHost.fail`
makes a named method fail once with a given error.
"""

from __future__ import annotations

import builtins
import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from crabd.cluster.client import Cluster
from crabd.cluster.pool import LocalPool
from crabd.cluster.registry import Registry
from crabd.errors import AlreadyExists, CheckpointNotFound, CrabError, InvalidRequest, SandboxNotFound

_ids = itertools.count(1)


@dataclass
class FakeBucket:
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)


class FakeHost:
    def __init__(self, host_id: str, bucket: FakeBucket, *, capacity: int = 4) -> None:
        self.host_id = host_id
        self.bucket = bucket
        self.capacity = capacity
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.local: dict[str, dict[str, Any]] = {}
        self.fetches: list[str] = []
        self.fail: dict[str, CrabError] = {}
        self.calls: list[str] = []

    # --- helpers for tests ---------------------------------------------------------
    def _maybe_fail(self, method: str) -> None:
        self.calls.append(method)
        err = self.fail.pop(method, None)
        if err is not None:
            raise err

    def _sb(self, ref: str) -> dict[str, Any]:
        for sb in self.sandboxes.values():
            if ref in (sb["id"], sb["name"]):
                return sb
        raise SandboxNotFound(f"no sandbox {ref!r}", sandbox=ref)

    def _out(self, sb: dict[str, Any]) -> dict[str, Any]:
        return {"host_id": self.host_id, **{k: v for k, v in sb.items() if k != "files"}}

    def _fetch(self, ckpt_id: str) -> dict[str, Any]:
        if ckpt_id in self.local:
            return self.local[ckpt_id]
        if ckpt_id not in self.bucket.checkpoints:
            raise CheckpointNotFound(f"no checkpoint {ckpt_id!r}", checkpoint=ckpt_id)
        self.fetches.append(ckpt_id)
        self.local[ckpt_id] = copy.deepcopy(self.bucket.checkpoints[ckpt_id])
        return self.local[ckpt_id]

    def new_sandbox(
        self, name: str, *, sid: str = "", files: dict[str, str] | None = None, turn: int = 0
    ) -> dict[str, Any]:
        sid = sid or f"{next(_ids):012x}"
        if sid in self.sandboxes or any(s["name"] == name for s in self.sandboxes.values()):
            raise AlreadyExists(f"a sandbox named {name!r} already exists", name=name)
        sb = {"id": sid, "name": name, "state": "running", "turn": turn, "files": dict(files or {})}
        self.sandboxes[sid] = sb
        return sb

    # --- the agent's methods ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        self._maybe_fail("info")
        n = len(self.sandboxes)
        return {"host_id": self.host_id, "capacity": self.capacity, "sandboxes": n, "free": self.capacity - n}

    def list(self) -> list[dict[str, Any]]:
        self._maybe_fail("list")
        return [self._out(sb) for sb in self.sandboxes.values()]

    def create(self, env: str, name: str = "", **options: Any) -> dict[str, Any]:
        self._maybe_fail("create")
        return self._out(self.new_sandbox(name or f"sb-{next(_ids)}"))

    def run(self, sandbox: str, command: str, *, timeout: float = 0.0) -> dict[str, Any]:
        self._maybe_fail("run")
        sb = self._sb(sandbox)
        if sb["state"] != "running":
            raise InvalidRequest(f"sandbox {sandbox} is {sb['state']}")
        sb["turn"] += 1
        key, _, value = command.partition("=")
        sb["files"][key] = value
        return {"ok": True, "stdout": ""}

    def step(self, sandbox: str, command: str, *, timeout: float = 0.0) -> dict[str, Any]:
        self.run(sandbox, command)
        return {"ok": True, "stdout": "", "turn": self._sb(sandbox)["turn"]}

    def checkpoint_full(self, sandbox: str, label: str = "") -> dict[str, Any]:
        self._maybe_fail("checkpoint_full")
        sb = self._sb(sandbox)
        ck = {
            "id": f"ck-{next(_ids):012x}",
            "sandbox_id": sb["id"],
            "sandbox_name": sb["name"],
            "turn": sb["turn"],
            "created_at": float(next(_ids)),
            "remote": False,
            "files": dict(sb["files"]),
        }
        self.local[ck["id"]] = ck
        return {"host_id": self.host_id, **ck}

    def has_checkpoint(self, checkpoint_id: str) -> bool:
        self._maybe_fail("has_checkpoint")
        return checkpoint_id in self.local

    def checkpoints(self, *, include_remote: bool = False, sync: bool = False) -> builtins.list[dict[str, Any]]:
        self._maybe_fail("checkpoints")
        out = {k: dict(v, remote=k in self.bucket.checkpoints) for k, v in self.local.items()}
        if include_remote:
            out.update({k: dict(v, remote=True) for k, v in self.bucket.checkpoints.items() if k not in out})
        return list(out.values())

    def push(self, checkpoint_id: str) -> dict[str, Any]:
        self._maybe_fail("push")
        ck = self.local.get(checkpoint_id)
        if ck is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id!r}", checkpoint=checkpoint_id)
        self.bucket.checkpoints[checkpoint_id] = copy.deepcopy(ck)
        return {"checkpoint": {"id": checkpoint_id, "remote": True}, "bytes": 100}

    def fork(self, checkpoint_id: str, n: int = 1, name_prefix: str = "") -> builtins.list[dict[str, Any]]:
        self._maybe_fail("fork")
        ck = self._fetch(checkpoint_id)
        if len(self.sandboxes) + n > self.capacity:
            raise InvalidRequest(f"host {self.host_id} is full")
        out = []
        for i in range(1, n + 1):
            name = f"{name_prefix}-{i}" if name_prefix else f"{ck['sandbox_name']}-{next(_ids)}"
            out.append(self._out(self.new_sandbox(name, files=ck["files"])))
        return out

    def import_sandbox(self, checkpoint_id: str, last_turn: int = -1) -> dict[str, Any]:
        self._maybe_fail("import_sandbox")
        ck = self._fetch(checkpoint_id)
        sb = self.new_sandbox(ck["sandbox_name"], sid=ck["sandbox_id"], files=ck["files"], turn=ck["turn"])
        return {
            "sandbox": self._out(sb),
            "checkpoint": ck["id"],
            "checkpoint_turn": ck["turn"],
            "lost_turns": list(range(ck["turn"] + 1, last_turn + 1)),
            "not_restored": [],
        }

    def stop(self, sandbox: str) -> dict[str, Any]:
        self._maybe_fail("stop")
        sb = self._sb(sandbox)
        sb["state"] = "stopped"
        return self._out(sb)

    def restore(self, sandbox: str, checkpoint_id: str) -> dict[str, Any]:
        self._maybe_fail("restore")
        sb = self._sb(sandbox)
        ck = self._fetch(checkpoint_id)
        sb.update(state="running", files=dict(ck["files"]))
        return self._out(sb)

    def remove(self, sandbox: str, keep_checkpoints: bool = False) -> None:
        self._maybe_fail("remove")
        del self.sandboxes[self._sb(sandbox)["id"]]


def fake_cluster(hosts: str = "abc", *, capacity: int = 4) -> tuple[Cluster, LocalPool, dict[str, FakeHost]]:
    """A :class:`Cluster` over fake hosts named by the letters of ``hosts``, registered with ``capacity`` each."""
    bucket = FakeBucket()
    fakes = {h: FakeHost(h, bucket, capacity=capacity) for h in hosts}
    pool = LocalPool(fakes)
    cluster = Cluster(pool, Registry())
    cluster.refresh()
    return cluster, pool, fakes
