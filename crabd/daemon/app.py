"""The daemon's lifetime: wire the layers together, serve, shut down cleanly.

Start-up order matters for safety, and serving comes early (issue 34: with
1,000 sandboxes, adopting them all first kept crabd deaf for ~40 s).  With
``[daemon] workers`` > 1 this is each process's start-up, for its own share
of the sandboxes (daemon/workers.py); the steps that sweep what all of
crabd left run in the main process only, while no other is alive:
0. this process's shard lock; the main process waits until no process of
   an earlier crabd is left (``run/shard-*.lock``);
1. state dir (0700) and registry; the main process rehomes the sandboxes
   of processes there are no longer, and drops every process's quota
   reservations and checkpoint leases (a worker: its own);
2. install crab's init binary (content-addressed, immutable);
3. reach the container runtime; the inspector, the store and the
   coordinator over them;
4. *prepare* adoption (coordinator/adoption.py): the list of this
   instance's containers, taken before any request can make one (so one
   that no row names is an orphan, never a creation in flight), and every
   sandbox the registry knows marked unadopted.  From here on a request
   that names a sandbox waits for that sandbox's adoption (the gate in
   ``SandboxManager.get``), so none sees a half-reconciled sandbox;
5. turns whose checkpoint was still queued when crabd last stopped are
   marked lost (before any request can end or list a turn), then the host
   engine (checkpoint queue);
6. the main process starts the workers and waits until each serves; then
   the private gRPC server, then the public socket (0660 root:crab), then
   the OpenAI proxy if enabled;
7. READY=1 to systemd, watchdog pings, "crabd ready";
8. in the background: the eBPF probes' compile (mode "auto"; the scan
   inspector decides meanwhile) and CRIU's kernel-feature cache, both
   started only now (on a small host they held serving back); adoption of
   every sandbox (a few at once, one a request needs first), then recovery
   of those found dead (policy "auto"), then the full gc of blobs a crash
   orphaned (``_reconcile``, the main process only: under the store lock
   held exclusively, see there).

Shut-down runs the other way; the engine drains its queue (bounded by
``[engine] drain_timeout_s``) after the API stops taking requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
import grpc.aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crabd.api.images import ImagesServicer
from crabd.api.peercred import CallerTable, FrontDoor
from crabd.api.servicer import CrabServicer
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.api.v1 import images_pb2_grpc as images_grpc
from crabd.backends.fsdelta import FsDelta
from crabd.config import CrabConfig
from crabd.coordinator.adoption import Adoption
from crabd.coordinator.archives import Archives
from crabd.coordinator.housekeeping import Housekeeper
from crabd.coordinator.recovery import Recovery
from crabd.coordinator.replication import Replication, shard_owns
from crabd.coordinator.sandboxes import SandboxManager
from crabd.daemon import assembly, notify, shards
from crabd.daemon.provenance import attach_edges
from crabd.daemon.wiring import Wiring, open_checkpoints
from crabd.daemon.workers import ShardLock, Workers, place_of
from crabd.engine import HostEngine
from crabd.errors import CrabError
from crabd.inspector.decide import Inspector
from crabd.inspector.deferred import DeferredProbes
from crabd.models import ShardPlace
from crabd.runtime import initbin
from crabd.service.llm_gate import ServiceGate
from crabd.service.pinned_images import PinnedImages
from crabd.service.service import Service
from crabd.store.db import Database
from crabd.store.registry import Registry
from crabd.trust.provenance import Provenance
from crabd.trust.references import ReferenceChecker
from crabd.util.filelock import FileRWLock
from crabd.util.laps import Laps

if TYPE_CHECKING:
    from crabd.proxy.server import OpenAIProxy

log = logging.getLogger("crabd")

#: Largest gRPC message crabd accepts (stdin of an exec is bounded separately).
MAX_MESSAGE = 80 << 20


def instance_id(state_dir: Path) -> str:
    """Labels this daemon's containers: one per state dir, stable across restarts."""
    return hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]


def _since_exec() -> float | None:
    """Seconds since this process was started (the kernel's clock-tick resolution); None if unreadable."""
    try:
        # Field 22 of stat is the start time in ticks since boot; the name before it may hold spaces.
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - ticks / os.sysconf("SC_CLK_TCK"), 3)


class Daemon:
    """One running crabd.  ``async with Daemon(cfg) as d: await d.wait()``."""

    def __init__(
        self,
        cfg: CrabConfig,
        *,
        ephemeral: bool = False,
        place: ShardPlace | None = None,
        on_ready: Callable[[], None] | None = None,
        log_level: str = "info",
        log_file: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.ephemeral = ephemeral
        #: Which of crabd's processes this is (daemon/workers.py): 0, the main one, starts the others.
        self.place = place if place is not None else place_of(cfg, 0)
        self._on_ready = on_ready
        self._log = (log_level, log_file)
        self._workers: Workers | None = None
        self._shard_lock: ShardLock | None = None
        self._stop = asyncio.Event()
        self._db: Database | None = None
        self._registry: Registry | None = None
        self._side: assembly.SandboxSide | None = None
        self._fs: FsDelta | None = None
        self._manager: SandboxManager | None = None
        self._grpc: grpc.aio.Server | None = None
        self._front: FrontDoor | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._recovery: Recovery | None = None
        self._inspector: Inspector | None = None
        self._engine: HostEngine | None = None
        self._proxy: OpenAIProxy | None = None
        self._kdat: asyncio.Task[None] | None = None
        self._replication: Replication | None = None
        self._provenance: Provenance | None = None
        self._store_file: FileRWLock | None = None
        self._adoption: Adoption | None = None
        self._adopting: asyncio.Task[None] | None = None
        self._image_gc: asyncio.Task[None] | None = None

    @property
    def is_main(self) -> bool:
        return self.place.index == 0

    def _per_shard(self, path: Path) -> Path:
        return shards.per_shard(path, self.place)

    @property
    def private_socket(self) -> Path:
        return self._per_shard(self.cfg.paths.state_dir / "run" / "grpc.sock")

    @property
    def public_socket(self) -> Path:
        return self.cfg.paths.shard_socket(self.place.index)

    async def start(self) -> None:
        """Bring crabd up in the module doc's order; every step is one method below."""
        t0 = time.monotonic()
        steps = Laps()
        self._prepare_host()
        self._shard_lock = await shards.own_shard(self.cfg.paths.state_dir, self.place)
        docker_version = await self._open_sandboxes()
        steps.lap("sandboxes")
        wiring = await self._open_checkpoints()
        steps.lap("checkpoints")
        adoption = self._adoption = Adoption(self._manager_or_fail(), wiring.inspection.adopted)
        to_adopt = await adoption.prepare()
        prepared_s = steps.lap("prepare")
        await self._lose_pending_turns()
        engine = await self._start_engine()
        steps.lap("engine")
        # The engine reports the store lock's waits with its own metrics (util/aiolock.py).
        engine.store_lock = wiring.store_lock.stats
        # Thinning runs in the engine's background lane (coordinator/retention.py).
        wiring.retention.engine = engine
        service = Service(
            self.cfg,
            self._manager_or_fail(),
            wiring.checkpointer,
            wiring.restorer,
            wiring.recovery,
            wiring.inspection,
            engine,
            catalog=wiring.catalog,
            quotas=wiring.quotas,
            housekeeping=wiring.housekeeping,
            retention=wiring.retention,
            docker_version=docker_version,
        )
        await self._start_archives(wiring, service)
        await self._start_replication(wiring, engine, service)
        steps.lap("archives")
        # Before this process serves: once the main socket answers, every process does (a create
        # it places elsewhere finds its process there), and its sweeps above are done.
        await self._start_workers(service)
        steps.lap("workers")
        await self._serve(service)
        await self._start_proxy(service, engine)
        steps.lap("serve")
        self._ready(wiring.inspection.name, docker_version, to_adopt, prepared_s, time.monotonic() - t0, steps)
        # Once serving, neither of these competes with the steps above for the CPU and the GIL (on a
        # small host each held serving back by a few hundred ms): the eBPF probes' compile (mode
        # "auto"; bcc's import and the BTF parse are Python) and CRIU's kernel-feature cache, which
        # only saves each CRIU run its own probe (one before the cache is in place still works).
        if self._inspector is not None and isinstance(self._inspector.source, DeferredProbes):
            self._inspector.source.start()
        self._kdat = asyncio.create_task(asyncio.to_thread(assembly.ensure_criu_kdat), name="crab-criu-kdat")
        self._adopting = asyncio.create_task(self._adopt(adoption, wiring.housekeeping), name="crab-adoption")

    def _manager_or_fail(self) -> SandboxManager:
        assert self._manager is not None, "the sandbox manager is opened first"
        return self._manager

    def _prepare_host(self) -> None:
        """The state dir (0700), the fd limit, and a worker pool sized for blocking work."""
        paths = self.cfg.paths
        paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(paths.state_dir, 0o700)
        assembly.raise_nofile()
        # Blocking work (Docker calls, walks, CRIU, fsyncs) runs in worker
        # threads; the default pool (CPUs + 4) is small enough that a few
        # checkpoint jobs could delay every other sandbox's turn-end decision.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="crabd")
        )

    async def _open_sandboxes(self) -> str:
        """The registry, crab's init binary, Docker and the sandbox manager; returns Docker's version."""
        paths = self.cfg.paths
        self._db = Database(paths.state_dir / "registry.db")
        self._registry = Registry(self._db)
        init_binary = await asyncio.to_thread(initbin.install, paths.state_dir)
        instance = instance_id(paths.state_dir)
        self._side = await asyncio.to_thread(assembly.open_sandbox_side, self.cfg, instance)
        version = await asyncio.to_thread(self._side.sandbox.server_version)
        self._manager = SandboxManager(self.cfg, self._registry, self._side.sandbox, init_binary, instance)
        self._manager.place = self.place
        await asyncio.to_thread(shards.settle, self._db, self._registry, self.place)
        return f"{self._side.kind}: {version}"

    async def _open_checkpoints(self) -> Wiring:
        """The inspector, the blob store, the file and process backends, and the coordinator over them."""
        assert self._db is not None and self._side is not None, "the registry and the sandbox backend come first"
        wiring = await open_checkpoints(self.cfg, self._db, self._manager_or_fail(), self._side, self.place)
        self._inspector, self._fs, self._store_file = wiring.inspector, wiring.fs, wiring.store_file
        self._recovery, self._provenance = wiring.recovery, wiring.provenance
        return wiring

    async def _lose_pending_turns(self) -> None:
        """Turns whose checkpoint was still queued when crabd stopped: lost (the queue lived in memory)."""
        assert self._registry is not None, "the registry is opened first"
        lost = await asyncio.to_thread(
            self._registry.lose_pending_turns,
            "crabd stopped before this turn's checkpoint was taken",
            self.place.index,
        )
        if lost:
            log.warning("turn checkpoints lost in the last shutdown", extra={"turns": lost})

    async def _start_engine(self) -> HostEngine:
        """The host engine (each adopted sandbox is handed to the inspector by its adoption)."""
        self._engine = HostEngine(shards.engine_share(self.cfg, self.place))
        await self._engine.start()
        return self._engine

    async def _adopt(self, adoption: Adoption, housekeeping: Housekeeper) -> None:
        """The background half of start-up (step 8 of the module doc)."""
        try:
            await adoption.run()
        except Exception:  # a bug: each sandbox's own adoption cannot fail this way (adoption.py)
            log.exception("adoption stopped early; sandboxes not reached stay as the registry says")
        # Sandboxes that died while crabd was down were marked dead by their adoption;
        # from here on they (and any that die later) are recovered (policy "auto").
        assert self._recovery is not None, "recovery is wired before serving"
        self._recovery.start()
        # After adoption: it finishes interrupted removals, whose heads this pass drops.  The main
        # process's only: a full gc under the exclusive store lock at every worker restart would
        # stall every process's checkpoints.
        if self.is_main:
            await self._reconcile(housekeeping)
            # Pinned images nothing needs any more, every [images] gc_interval_s (coordinator/image_gc.py).
            self._image_gc = asyncio.create_task(self._manager_or_fail().images.run(), name="crab-image-gc")

    async def _reconcile(self, housekeeping: Housekeeper) -> None:
        """Orphaned blobs (and heads of removed sandboxes): a full gc, once, with crabd serving.

        Safe while requests run: it holds the store lock exclusively, and every
        writer of a blob nothing references yet holds the shared side until
        that blob is published or released (``Housekeeper.reconcile`` says why).
        """
        t0 = time.monotonic()
        try:
            swept = await housekeeping.reconcile()
        except (CrabError, OSError) as exc:
            # The next start (or `crabctl gc`) sweeps them: nothing is lost but disk space.
            log.error("orphaned blobs not reclaimed", extra={"error": str(exc)})
            return
        if swept.blobs_removed:
            log.warning("orphaned blobs reclaimed", extra={"blobs": swept.blobs_removed, "freed": swept.bytes_freed})
        # The last of start-up's background half (EmbeddedDaemon.wait_settled waits for this line).
        log.info("start-up reconciled", extra={"seconds": round(time.monotonic() - t0, 3)})

    async def _start_archives(self, wiring: Wiring, service: Service) -> None:
        """Portable archives (coordinator/archives.py); what interrupted exports and imports left is removed."""
        ck = wiring.checkpointer
        archives = Archives(
            wiring.catalog,
            ck.blobs,
            wiring.store_lock,
            self._per_shard(self.cfg.paths.state_dir / "archives"),
            ck.dumper.version,
            checker=ReferenceChecker(ck.fs, ck.images),
            limits=wiring.limits,
        )
        gone = await asyncio.to_thread(archives.clean_staging)
        if gone:
            log.warning("interrupted archive imports and exports cleaned up", extra={"entries": gone})
        assert self._provenance is not None, "provenance is opened with the checkpoints"
        attach_edges(self._provenance, archives, None, None)
        service.archives.archives = archives

    async def _start_replication(self, wiring: Wiring, engine: HostEngine, service: Service) -> None:
        """Uploads to the remote tier (when configured): what earlier runs left, then every publication."""
        if wiring.remote is None:
            return
        r = self.cfg.remote
        self._replication = Replication(
            wiring.remote,
            engine,
            wiring.store_lock,
            max_inflight=self.cfg.engine.max_uploads * 2,
            retry_initial_s=r.retry_initial_s,
            retry_max_s=r.retry_max_s,
            checker=ReferenceChecker(wiring.checkpointer.fs, wiring.checkpointer.images),
            limits=wiring.limits,
            owns=shard_owns(self.place.index, self._manager_or_fail().row),
        )
        assert self._provenance is not None, "provenance is opened with the checkpoints"
        attach_edges(self._provenance, None, None, self._replication)
        await self._replication.start()
        wiring.checkpointer.on_published.append(self._replication.published)
        service.remote.replication = self._replication
        log.info("remote tier", extra={"store": wiring.remote.describe(), "host": wiring.remote.host})

    async def _serve(self, service: Service) -> None:
        """The private gRPC server, then the public front door, then health SERVING."""
        callers = CallerTable()
        run_dir = self.private_socket.parent
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(run_dir, 0o700)
        with contextlib.suppress(FileNotFoundError):
            self.private_socket.unlink()
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
            ]
        )
        crab = CrabServicer(service, callers)
        pb_grpc.add_CrabServicer_to_server(crab, self._grpc)
        images_grpc.add_CrabImagesServicer_to_server(
            ImagesServicer(crab, PinnedImages(self._manager_or_fail().images)), self._grpc
        )
        health_servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._grpc)
        self._grpc.add_insecure_port(f"unix:{self.private_socket}")
        await self._grpc.start()
        self._front = FrontDoor(self.public_socket, self.private_socket, callers)
        await self._front.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("crab.v1.Crab", health_pb2.HealthCheckResponse.SERVING)

    async def _start_proxy(self, service: Service, engine: HostEngine) -> None:
        """The OpenAI proxy, if enabled (the main process's; crabd.config refuses it with workers)."""
        if self.cfg.proxy.enabled and self.is_main:
            # Imported only here: aiohttp is ~140 ms of a start-up that decides how soon crabd serves
            # again after a crash, and the proxy is off by default.
            from crabd.proxy.server import OpenAIProxy

            self._proxy = OpenAIProxy(self.cfg.proxy, ServiceGate(service), engine.prometheus)
            await self._proxy.start()
            service.proxy_url = self._proxy.url

    async def _start_workers(self, service: Service) -> None:
        """The main process starts the other processes and waits until each serves (daemon/workers.py)."""
        if not self.is_main or self.place.count == 1:
            return
        level, log_file = self._log
        self._workers = workers = Workers(self.cfg, ephemeral=self.ephemeral, log_level=level, log_file=log_file)
        await workers.start()
        service.process_restarts = lambda: workers.restarts

    def _ready(
        self, inspector: str, docker_version: str, to_adopt: int, prepared_s: float, took: float, steps: Laps
    ) -> None:
        """READY=1 and watchdog pings to systemd, and one log line (adoption goes on in the background).

        A worker tells the main process instead (``on_ready``), and its line says "crabd worker ready":
        "crabd ready" is the whole daemon's, once every process serves.
        """
        paths = self.cfg.paths
        if self.is_main:
            notify.notify(f"READY=1\nSTATUS=serving on {paths.socket}\nMAINPID={os.getpid()}")
            interval = notify.watchdog_interval()
            if interval is not None:
                self._watchdog = asyncio.create_task(notify.watchdog_loop(interval))
        if self._on_ready is not None:
            self._on_ready()
        log.info(
            "crabd ready" if self.is_main else "crabd worker ready",
            extra={
                "workers": self.place.count,
                "socket": str(self.public_socket),
                "state_dir": str(paths.state_dir),
                "docker": docker_version,
                "ephemeral": self.ephemeral,
                "inspector": inspector,
                "proxy": self._proxy.url if self._proxy else None,
                "to_adopt": to_adopt,
                "prepare_s": round(prepared_s, 3),  # the container list and marking (step 4)
                "start_s": round(took, 3),
                # From the process's exec (interpreter and imports included): what a restart costs.
                "since_exec_s": _since_exec(),
                "steps_s": {name: round(s, 3) for name, s in steps.took.items()},
            },
        )

    def request_stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def close(self) -> None:
        if self.is_main:
            notify.notify("STOPPING=1")
        log.info("crabd stopping")
        if self._workers is not None:
            # First, and while this process still serves: they drain their engines meanwhile.
            await self._workers.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._image_gc is not None:
            self._image_gc.cancel()  # a collection in a thread finishes; the loop stops
        if self._adopting is not None:
            # What it left half-done is done again at the next start: each step is idempotent.
            self._adopting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._adopting
        if self._adoption is not None:
            await self._adoption.close()  # each sandbox's adoption is a task of its own
        if self._recovery is not None:
            await self._recovery.close()
        if self._proxy is not None:
            await self._proxy.close()
        if self._front is not None:
            await self._front.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        if self._engine is not None:
            await self._engine.close()
        if self._replication is not None:
            await self._replication.close()
        if self._kdat is not None:
            # Bounded by the probe's own timeout; nothing to undo (the cache is installed by rename).
            await asyncio.wait({self._kdat})
        if self._manager is not None:
            await self._manager.close(remove_all=self.ephemeral)
        if self.ephemeral and self.is_main and self._fs is not None:
            # An embedded daemon's store goes with its state dir; its snapshots live in the
            # host's shared btrfs pool and would outlive it.
            await asyncio.to_thread(self._fs.retain, set())
        if self._inspector is not None:
            self._inspector.close()
        if self._side is not None:
            self._side.close()
        if self._db is not None:
            self._db.close()
        if self._store_file is not None:
            self._store_file.close()
        if self._shard_lock is not None:
            self._shard_lock.close()
        log.info("crabd stopped")

    async def __aenter__(self) -> Daemon:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


async def serve(daemon: Daemon) -> None:
    """Run ``daemon`` until SIGTERM or SIGINT."""
    async with daemon:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.request_stop)
        await daemon.wait()
