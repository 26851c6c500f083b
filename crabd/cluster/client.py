"""The cluster as one driver sees it: sandboxes on any host, forks spread over hosts, migration, host loss.

:class:`Cluster` works over an :class:`~crabd.cluster.pool.AgentPool` (each
host's agent, which owns that host's crabd client) and a
:class:`~crabd.cluster.registry.Registry` (which sandbox lives where).  It
moves no checkpoint data itself: every host's crabd uploads its checkpoints
to the shared bucket and fetches, verified, what it lacks from there.  So
what crosses hosts here is only ids and small records.

The guarantees, per operation:

* **fork** is all or nothing: when one host's share fails, the children made
  on the others are removed again.  Each host downloads the base once, however
  many children it makes.
* **migrate** never leaves a sandbox twice or nowhere: the source copy is
  stopped (so the agent cannot act on a state that is about to be left
  behind), the target brings the sandbox in with its identity, and only then
  is the source copy removed.  If the target fails, the source is restored in
  place from the migration's checkpoint and runs on.
* **recover_host** brings every sandbox of a host whose Ray node died back on
  the live hosts, each from its newest checkpoint in the bucket, and reports
  the turns lost since (those that were not yet ``remote``).

``crabctl --cluster ADDR cluster ...`` and :func:`connect` build one of these
on a running Ray cluster.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import time
from collections import Counter
from typing import Any

from crabd.cluster.pool import PROBE_TIMEOUT_S, AgentPool, Call
from crabd.cluster.registry import Registry
from crabd.errors import CheckpointNotFound, CrabError, HostUnavailable, InvalidRequest, MigrationFailed

log = logging.getLogger("crabd.cluster")


class Cluster:
    """Sandboxes over the cluster's hosts."""

    def __init__(self, pool: AgentPool, registry: Registry) -> None:
        self.pool = pool
        self.registry = registry

    # --- hosts --------------------------------------------------------------------

    def refresh(self) -> dict[str, dict[str, Any]]:
        """Rebuild the registry from what the hosts say (after a driver or registry restart); the hosts.

        Each live host's agent lists its sandboxes; a host whose agent is gone
        is marked dead with the sandboxes the registry had there.
        """
        hosts = self.pool.hosts()
        infos = self.pool.gather([Call(h, "info") for h in hosts], timeout=PROBE_TIMEOUT_S)
        lists = self.pool.gather([Call(h, "list") for h in hosts], timeout=PROBE_TIMEOUT_S)
        for h, info, sandboxes in zip(hosts, infos, lists, strict=True):
            if isinstance(info, CrabError) or isinstance(sandboxes, CrabError):
                if self.registry.host_known(h):
                    self.registry.mark_dead(h)
                continue
            self.registry.add_host(h, int(info["capacity"]))
            for sb in sandboxes:
                self.registry.assign(sb["id"], h, sb["name"], int(sb["turn"]))
        return self.registry.hosts()

    def check(self) -> list[str]:
        """Probe every known host; the ones whose agent is gone (now marked dead), sorted."""
        hosts = sorted(self.registry.hosts())
        probes = self.pool.gather([Call(h, "info") for h in hosts], timeout=PROBE_TIMEOUT_S)
        dead = []
        for h, got in zip(hosts, probes, strict=True):
            if isinstance(got, HostUnavailable) and got.gone:
                self.registry.mark_dead(h)
                dead.append(h)
        return dead

    # --- sandboxes ----------------------------------------------------------------

    def where(self, sandbox: str) -> tuple[str, str]:
        """(sandbox id, host) of ``sandbox`` (id or name); InvalidRequest when no host has it."""
        sid = self.registry.find(sandbox)
        if sid is None:
            self.refresh()
            sid = self.registry.find(sandbox)
        host = None if sid is None else self.registry.host_of(sid)
        if sid is None or host is None:
            raise InvalidRequest(f"no host of the cluster has a sandbox {sandbox!r}")
        return sid, host

    def create(self, env: str, *, name: str = "", host: str = "", **options: Any) -> dict[str, Any]:
        """A new sandbox on ``host``, or on the live host with the most free capacity."""
        target = host or self.registry.place(1)[0]
        info: dict[str, Any] = self.pool.call(Call(target, "create", (env, name), options))
        self.registry.assign(info["id"], target, info["name"], int(info["turn"]))
        return info

    def call(self, sandbox: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the agent of ``sandbox``'s host, with the sandbox id first (run, checkpoint, ...)."""
        sid, host = self.where(sandbox)
        return self.pool.call(Call(host, method, (sid, *args), kwargs))

    def step(self, sandbox: str, command: str, *, timeout: float = 0.0) -> dict[str, Any]:
        """Run ``command`` in ``sandbox`` as one turn; the registry keeps its number (a host loss reports from it)."""
        sid, host = self.where(sandbox)
        got: dict[str, Any] = self.pool.call(Call(host, "step", (sid, command), {"timeout": timeout}))
        self.registry.note_turn(sid, int(got["turn"]))
        return got

    def remove(self, sandbox: str) -> None:
        sid, host = self.where(sandbox)
        self.pool.call(Call(host, "remove", (sid,)))
        self.registry.forget(sid)

    def list(self) -> builtins.list[dict[str, Any]]:
        """Every sandbox on the live hosts (each with its ``host_id``)."""
        hosts = [h for h, s in self.registry.hosts().items() if s["alive"]]
        out: list[dict[str, Any]] = []
        for got in self.pool.gather([Call(h, "list") for h in hosts], timeout=PROBE_TIMEOUT_S):
            if not isinstance(got, CrabError):
                out += got
        return out

    # --- fork ---------------------------------------------------------------------

    def fork(
        self, checkpoint: str, n: int = 1, *, name_prefix: str = "", host: str = ""
    ) -> builtins.list[dict[str, Any]]:
        """``n`` forks of ``checkpoint`` over the live hosts with free capacity (or all on ``host``).

        Steps: make sure the checkpoint is ``remote`` (a host that holds it
        pushes it, which returns at once when it is already up); place the
        children; ask every chosen host for its share at once (each fetches
        the base once); on any failure remove the children that were made and
        raise that failure.  With ``name_prefix`` a host's children are
        named ``<prefix>-<host>-<i>``, so names stay unique over the cluster.
        """
        if n < 1:
            raise InvalidRequest(f"a fork makes at least one sandbox, not {n}")
        placement = [host] * n if host else self.registry.place(n)
        self._make_remote(checkpoint)
        shares = Counter(placement)
        calls = [
            Call(h, "fork", (checkpoint, k, f"{name_prefix}-{h}" if name_prefix else "")) for h, k in shares.items()
        ]
        results = self.pool.gather(calls)
        made = [(c.host, sb) for c, got in zip(calls, results, strict=True) if isinstance(got, list) for sb in got]
        failed = [got for got in results if isinstance(got, CrabError)]
        if failed:
            self.pool.gather([Call(h, "remove", (sb["id"],)) for h, sb in made])
            raise failed[0]
        for h, sb in made:
            self.registry.assign(sb["id"], h, sb["name"], int(sb["turn"]))
        return [sb for _, sb in made]

    def _make_remote(self, checkpoint: str) -> None:
        """Push ``checkpoint`` from a live host that holds it; nothing when only the bucket has it."""
        hosts = [h for h, s in self.registry.hosts().items() if s["alive"]]
        holders = self.pool.gather([Call(h, "has_checkpoint", (checkpoint,)) for h in hosts])
        for h, has in zip(hosts, holders, strict=True):
            if has is True:
                self.pool.call(Call(h, "push", (checkpoint,)))
                return

    # --- migration ----------------------------------------------------------------

    def migrate(self, sandbox: str, to: str) -> dict[str, Any]:
        """Move ``sandbox`` to host ``to``, keeping its id, name and lineage; what happened, with timings.

        Steps: a full checkpoint on the source (its processes too); stop the
        source copy; push the checkpoint; the target imports the sandbox
        from it; the registry moves it; the source copy is removed (its
        checkpoints stay, for its lineage).  ``paused_s`` is the time the
        agent could not act: from the checkpoint to the target running.
        """
        sid, src = self.where(sandbox)
        if to == src:
            raise InvalidRequest(f"sandbox {sandbox!r} lives on {to!r} already")
        if not self.registry.hosts().get(to, {}).get("alive"):
            raise HostUnavailable(f"host {to!r} is not a live host of the cluster", host=to)
        t0 = time.monotonic()
        ck = self.pool.call(Call(src, "checkpoint_full", (sid, "migrate")))
        self.pool.call(Call(src, "stop", (sid,)))
        t_ck = time.monotonic()
        try:
            pushed = self.pool.call(Call(src, "push", (ck["id"],)))
            t_push = time.monotonic()
            done = self.pool.call(Call(to, "import_sandbox", (ck["id"], int(ck["turn"]))))
        except CrabError as exc:
            raise self._migration_undone(sid, src, to, ck["id"], exc) from exc
        t_in = time.monotonic()
        self.registry.assign(sid, to, done["sandbox"]["name"], int(done["sandbox"]["turn"]))
        try:
            self.pool.call(Call(src, "remove", (sid,), {"keep_checkpoints": True}))
        except CrabError as exc:
            # The sandbox runs on the target; a source copy left stopped is only garbage.
            log.warning("source copy of a migrated sandbox not removed", extra={"sandbox": sid, "why": str(exc)})
        return {
            "sandbox": done["sandbox"],
            "from": src,
            "to": to,
            "checkpoint": ck["id"],
            "uploaded_bytes": int(pushed.get("bytes", 0)),
            "checkpoint_s": t_ck - t0,
            "push_s": t_push - t_ck,
            "import_s": t_in - t_push,
            "paused_s": t_in - t0,
            "not_restored": done["not_restored"],
        }

    def _migration_undone(self, sid: str, src: str, to: str, ckpt: str, exc: CrabError) -> MigrationFailed:
        """After a failed push or import: the target holds no copy, the source runs again from ``ckpt``."""
        # The usual case is that the import made nothing (it is all or nothing on the target).
        with contextlib.suppress(CrabError):
            self.pool.call(Call(to, "remove", (sid,)))
        try:
            self.pool.call(Call(src, "restore", (sid, ckpt)))
        except CrabError as again:
            return MigrationFailed(
                f"migrating {sid} to {to} failed ({exc}), and restarting it on {src} failed too ({again}); "
                f"it is stopped on {src}, at checkpoint {ckpt}",
                sandbox=sid,
                target=to,
                source_kept=False,
                hint=f"Recover it: `crabctl restore {sid} {ckpt}` on {src}, or import {ckpt} on another host.",
            )
        return MigrationFailed(
            f"migrating {sid} to {to} failed ({exc}); it runs on {src} again, from checkpoint {ckpt}",
            sandbox=sid,
            target=to,
            source_kept=True,
        )

    # --- host loss ----------------------------------------------------------------

    def recover_host(self, host: str) -> dict[str, Any]:
        """Bring the sandboxes of ``host`` (its Ray node is gone) back on the live hosts.

        Steps: mark the host dead; from a live host, re-read the bucket's
        manifests and take each lost sandbox's newest remote checkpoint;
        place the sandboxes on the other hosts; import each there (its turns
        after that checkpoint, up to the last one the cluster saw, reported
        lost).  Returns ``recovered`` (one report per sandbox, as
        ``recover`` gives) and ``unrecoverable`` (sandbox id -> why).
        """
        lost = self.registry.mark_dead(host)
        live = [h for h, s in self.registry.hosts().items() if s["alive"]]
        if not live:
            raise HostUnavailable(f"no live host to recover {host!r}'s sandboxes on", host=host)
        newest = self._newest_remote(live[0], lost, host)
        unrecoverable = {sb: "no remote checkpoint of it" for sb in lost if sb not in newest}
        todo = [sb for sb in lost if sb in newest]
        placement = self.registry.place(len(todo), exclude=[host]) if todo else []
        calls = [
            Call(h, "import_sandbox", (newest[sb]["id"], self._last_turn(sb)))
            for sb, h in zip(todo, placement, strict=True)
        ]
        recovered = []
        for sb, c, got in zip(todo, calls, self.pool.gather(calls), strict=True):
            if isinstance(got, CrabError):
                unrecoverable[sb] = str(got)
                continue
            self.registry.assign(sb, c.host, got["sandbox"]["name"], int(got["sandbox"]["turn"]))
            recovered.append({**got, "host": c.host, "from_host": host})
        for sb in unrecoverable:
            log.error("sandbox of a lost host not recovered", extra={"sandbox": sb, "why": unrecoverable[sb]})
        return {"host": host, "recovered": recovered, "unrecoverable": unrecoverable}

    def _last_turn(self, sandbox_id: str) -> int:
        placed = self.registry.placed(sandbox_id)
        return -1 if placed is None else int(placed["turn"])

    def _newest_remote(self, via: str, sandboxes: builtins.list[str], lost_host: str) -> dict[str, dict[str, Any]]:
        """Per sandbox in ``sandboxes``, its newest checkpoint in the bucket (as ``via``'s crabd lists it)."""
        wanted = set(sandboxes)
        try:
            every = self.pool.call(Call(via, "checkpoints", (), {"include_remote": True, "sync": True}))
        except CheckpointNotFound:
            every = []
        mine = [ck for ck in every if ck["sandbox_id"] in wanted and ck["remote"]]
        # A sandbox's checkpoints are its owner's only: the owner of its first checkpoint in the bucket.
        # One of another uid naming the same id (a forged or squatted record) is never its newest.
        first: dict[str, dict[str, Any]] = {}
        for ck in mine:
            sb = ck["sandbox_id"]
            if sb not in first or ck["created_at"] < first[sb]["created_at"]:
                first[sb] = ck
        newest: dict[str, dict[str, Any]] = {}
        for ck in mine:
            sb = ck["sandbox_id"]
            if ck.get("owner_uid") != first[sb].get("owner_uid"):
                continue
            if sb not in newest or ck["created_at"] > newest[sb]["created_at"]:
                newest[sb] = ck
        log.info("newest remote checkpoints of a lost host", extra={"host": lost_host, "found": len(newest)})
        return newest
