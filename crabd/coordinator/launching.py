"""Creating sandboxes: the registry row first, then the container, started once crab's init answers.

Crash safety of creation: the row is written (state ``creating``) before
the container exists (:meth:`SandboxLauncher.reserve`) and flipped to
``running`` once init answers, so adoption knows every container this
daemon may have made.  A creation that fails removes its container and its
row again (:meth:`SandboxLauncher.rollback`).  Restores and forks start
their containers here too (``coordinator/restore.py``), with a ``prepare``
step that writes the checkpoint into the container before it starts.

:class:`SandboxLauncher` is the base of ``sandboxes.SandboxManager``,
which adds lookups, sessions, stop and removal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from crabd.backends.sandbox import LABEL_INSTANCE, LABEL_OWNER, LABEL_SANDBOX, ContainerStatus, SandboxBackend
from crabd.config import MIN_MEMORY, CrabConfig
from crabd.coordinator.image_gc import ImageKeeper
from crabd.errors import AlreadyExists, CrabError, ImageError, InitUnavailable, InvalidRequest, SandboxDead
from crabd.host import images
from crabd.models import SandboxRecord, SandboxSpec, SandboxState, ShardPlace
from crabd.runtime.initproto import InitConnection
from crabd.store.image_claims import ImageClaims
from crabd.store.registry import Registry
from crabd.util import validate
from crabd.util.netns import Netns

log = logging.getLogger("crabd.sandboxes")

T = TypeVar("T")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
INIT_READY_TIMEOUT_S = 10.0


def validate_spec(spec: SandboxSpec) -> None:
    if spec.name and not NAME_RE.match(spec.name):
        raise InvalidRequest(f"invalid sandbox name {spec.name!r}: use 1-63 letters, digits, '_', '.', '-'")
    validate.fraction(spec.cpus, "cpus", maximum=os.cpu_count() or 1)
    if spec.memory_bytes < 0 or 0 < spec.memory_bytes < MIN_MEMORY:
        raise InvalidRequest(f"memory={spec.memory_bytes} bytes is too small (0 = unlimited, else >= 6 MiB)")
    if spec.pids < 0:
        raise InvalidRequest(f"pids={spec.pids} must be >= 0")
    if not spec.workdir.startswith("/") or "\0" in spec.workdir:
        raise InvalidRequest(f"workdir {spec.workdir!r} must be an absolute path")
    validate.env_vars(spec.env_vars)


class SandboxLauncher:
    def __init__(
        self, cfg: CrabConfig, registry: Registry, backend: SandboxBackend, init_binary: Path, instance: str
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.backend = backend
        self.init_binary = init_binary
        self.instance = instance
        #: Pins (and collects) the images sandboxes of any image start from (coordinator/image_gc.py).
        self.images = ImageKeeper(
            backend, registry.db, ImageClaims(cfg.images.claims_dir, instance, cfg.paths.state_dir), cfg.images
        )
        self._create_lock = asyncio.Lock()
        #: Which of crabd's processes this is: it serves only the sandboxes whose row names it.
        self.place = ShardPlace()

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(fn, *args)

    def resolve_image(self, spec: SandboxSpec) -> str:
        """What a new sandbox's record names as its image: its env's current build, or any image by digest."""
        if spec.image:
            return self.images.pin(spec.image)
        recipe = images.find_recipe(spec.env)
        if not self.backend.image_exists(recipe.image_ref):
            raise ImageError(f"env {spec.env!r} has no built image ({recipe.image_ref})", env=spec.env)
        return recipe.image_ref

    def new_id(self) -> str:
        return secrets.token_hex(6)

    async def reserve(
        self, owner_uid: int, spec: SandboxSpec, image: str, *, sandbox_id: str = "", origin: str = ""
    ) -> SandboxRecord:
        """Validate ``spec`` and write its registry row in state ``creating`` (before any container exists)."""
        validate_spec(spec)
        sandbox_id = sandbox_id or self.new_id()
        # Unnamed: "sb-" and the id's first 6 hex digits, or the whole id if another sandbox has
        # those (24 bits: with a thousand sandboxes, one unnamed create in ~17,000 meets a taken
        # name, and an RL host creates that many in hours).
        names = [spec.name] if spec.name else [f"sb-{sandbox_id[:6]}", f"sb-{sandbox_id}"]
        async with self._create_lock:
            for name in names:
                if self.registry.name_taken(name):
                    continue
                rec = SandboxRecord(
                    sandbox_id,
                    name,
                    owner_uid,
                    replace(spec, name=name),
                    image,
                    "",
                    SandboxState.CREATING,
                    time.time(),
                    origin=origin,
                    shard=self.place.index,
                )
                try:
                    self.registry.insert_sandbox(rec)
                except AlreadyExists:
                    # This lock is one process's ([daemon] workers): another may have taken the name
                    # since name_taken, and the table's UNIQUE name refused ours: as if it were taken.
                    continue
                return rec
        raise AlreadyExists(f"a sandbox named {names[-1]!r} already exists", name=names[-1])

    async def launch(
        self,
        rec: SandboxRecord,
        image: str,
        *,
        generation: str = "",
        record_id: bool = True,
        prepare: Callable[[str], Awaitable[None]] | None = None,
        checkpoint: str = "",
    ) -> tuple[str, ContainerStatus]:
        """Create a container for ``rec``, run ``prepare(container_id)`` on it, start it, wait for init.

        With ``checkpoint`` the container starts from the process images that
        ``prepare`` placed in the backend's checkpoint dir under that name.

        With ``record_id`` the container id is written to the registry before
        the container starts, so a crash leaves a trace adoption can clean up;
        a replacement container (a restore) is recorded by the caller instead.
        On any failure the container is removed again.
        """
        labels = {LABEL_SANDBOX: rec.id, LABEL_INSTANCE: self.instance, LABEL_OWNER: str(rec.owner_uid)}
        cid = await asyncio.to_thread(
            self.backend.create, rec.id, rec.spec, image, self.init_binary, labels, generation=generation
        )
        try:
            if record_id:
                rec.container_id = cid
                self.registry.update_sandbox(rec.id, container_id=cid)
            if prepare is not None:
                await prepare(cid)
            await asyncio.to_thread(self.backend.start, cid, checkpoint)
            st = await self._wait_init(cid, rec)
        except BaseException:
            await asyncio.shield(self._io(self.backend.remove, cid))
            raise
        return cid, st

    async def create(self, owner_uid: int, spec: SandboxSpec) -> SandboxRecord:
        # Pinned and recorded under the claims lock: a collection sees both or neither (image_gc.py).
        async with self.images.pinning(bool(spec.image)):
            image = await self._io(self.resolve_image, spec)
            rec = await self.reserve(owner_uid, spec, image)
        try:
            _, st = await self.launch(rec, image)
        except BaseException:
            await self._rollback(rec)
            raise
        self.registry.update_sandbox(rec.id, state=SandboxState.RUNNING)
        rec.state = SandboxState.RUNNING
        rec.ip_address = st.ip_address
        log.info(
            "sandbox created",
            extra={"sandbox": rec.id, "sandbox_name": rec.name, "image": image, "owner_uid": owner_uid},
        )
        return rec

    async def _wait_init(self, container_id: str, rec: SandboxRecord) -> ContainerStatus:
        deadline = time.monotonic() + INIT_READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            st = await self._io(self.backend.status, container_id)
            if not st.exists or not st.running:
                raise SandboxDead(
                    f"sandbox {rec.name} exited during start (code {st.exit_code}): {st.error}",
                    sandbox=rec.id,
                    container_id=container_id,
                    exit_code=st.exit_code,
                    oom_killed=st.oom_killed,
                    reason=st.error or "exited during start",
                )
            try:
                # Bounded: an init that accepted but does not answer (stuck in the kernel) must not hold the start.
                async with asyncio.timeout(max(0.05, deadline - time.monotonic())):
                    conn = await InitConnection.open(netns=Netns(st.pid, container_id))
                    async with conn:
                        await conn.hello()
                return st
            except TimeoutError:
                last = TimeoutError("no answer to HELLO")
            except CrabError as exc:
                last = exc
                await asyncio.sleep(0.01)
        raise InitUnavailable(
            f"crab's init in sandbox {rec.name} did not answer within {INIT_READY_TIMEOUT_S:g} s: {last}",
            sandbox=rec.id,
        )

    async def _rollback(self, rec: SandboxRecord) -> None:
        try:
            if rec.container_id:
                await self._io(self.backend.remove, rec.container_id)
        finally:
            self.registry.delete_sandbox(rec.id)

    async def rollback(self, rec: SandboxRecord) -> None:
        """Undo a sandbox that never reached ``running`` (its container, if any, and its row)."""
        await self._rollback(rec)
