"""The sandbox backend interface: what crab needs from a container engine."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from crabd.backends.procdump import Posture
from crabd.models import SandboxSpec

#: Label keys every crab container carries.
LABEL_SANDBOX = "dev.crab.sandbox"
LABEL_INSTANCE = "dev.crab.instance"
LABEL_OWNER = "dev.crab.owner"

#: Where crab's init is bind-mounted inside every sandbox.
INIT_PATH_IN_SANDBOX = "/.crab/init"

_HOSTNAME_BAD = re.compile(r"[^a-zA-Z0-9-]")

#: The repository crab pins images in: ``crab-loaded:<digest hex>`` (docs/images.md, "Pinned images").
PIN_REPO = "crab-loaded"
#: crab's env images (``crab-env/<env>:<tag>``, crabd/host/images.py): never pinned, never collected.
ENV_REPO_PREFIX = "crab-env/"


def sandbox_hostname(spec: SandboxSpec, sandbox_id: str) -> str:
    """The sandbox's host name: its name made a valid host name label, else the head of its id."""
    return _HOSTNAME_BAD.sub("-", spec.name)[:63].strip("-") or sandbox_id[:12]


@dataclass(frozen=True)
class ContainerStatus:
    exists: bool
    running: bool = False
    pid: int = 0
    exit_code: int | None = None
    oom_killed: bool = False
    error: str = ""
    ip_address: str = ""
    paused: bool = False
    #: Where the container's filesystem changes live (overlay2's upper dir); "" if unknown.
    upper_dir: str = ""
    #: The image's layers under it, topmost first (overlay2's lower dirs).
    lower_dirs: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PinnedImage:
    """An image crab pinned (tagged ``crab-loaded:<its own id hex>``), as the engine reports it."""

    digest: str
    #: Bytes the engine reports for the image (its layers, shared ones included).
    size: int
    #: Every name it has, crab's own among them.
    tags: tuple[str, ...]
    #: When it was last tagged (each pin tags it again); 0 if the engine does not know (a load).
    pinned_at: float

    @property
    def env(self) -> bool:
        """One of crab's env images has this digest too (then only crab's tag is ever removed)."""
        return any(t.startswith(ENV_REPO_PREFIX) for t in self.tags)


@dataclass(frozen=True)
class Unpinned:
    """What :meth:`SandboxBackend.unpin_image` did."""

    #: crab's tag is gone (False: the engine refused, e.g. a container of the image exists).
    untagged: bool
    #: The image itself is gone too (no other name held it).
    deleted: bool = False
    #: The backend's own copy of it was removed (runc: its exported lower dir).
    export_removed: bool = False
    #: Why something was left ("" if nothing was).
    note: str = ""
    #: One of crab's env images has this digest too: only crab's tag went, its export stays.
    env: bool = False


class SandboxBackend(Protocol):
    """A container engine that runs sandboxes.  Blocking calls; callers offload them."""

    def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: str,
        init_binary: Path,
        labels: dict[str, str],
        *,
        generation: str = "",
    ) -> str:
        """Create (not start) the container; return its id.

        ``generation`` tells apart the containers one sandbox has had (a
        restore starts a new one before the old one is removed).
        """
        ...

    def upper_dir(self, container_id: str) -> Path:
        """Where the container's filesystem changes live on the host (exists from create on)."""
        ...

    def frozen(self, container_id: str) -> AbstractContextManager[None]:
        """Freeze every process of the container for the ``with`` body."""
        ...

    def thaw(self, container_id: str) -> None:
        """Undo a freeze that a crash left behind (no-op when not frozen, or paused through Docker)."""
        ...

    def start(self, container_id: str, checkpoint: str = "") -> None:
        """Start the container; with ``checkpoint``, restore its processes from the images placed
        in :meth:`checkpoint_dir` under that name (CriuError if that fails)."""
        ...

    def checkpoint_dir(self, container_id: str, name: str) -> Path:
        """Where process images must be for ``start(container_id, checkpoint=name)``; created empty."""
        ...

    def posture(self, container_id: str) -> Posture:
        """What the created container grants its processes, from what created it (restores are checked against it)."""
        ...

    def status(self, container_id: str) -> ContainerStatus: ...

    def stop(self, container_id: str, timeout_s: float) -> None: ...

    def remove(self, container_id: str) -> None:
        """Remove the container, running or not; a missing container is not an error."""
        ...

    def list_exited(self, instance: str) -> list[str]:
        """Ids of the containers labelled with ``instance`` that are no longer running (one cheap call)."""
        ...

    def list_instance(self, instance: str) -> dict[str, ContainerStatus]:
        """All containers labelled with ``instance``, by container id."""
        ...

    def instance_ids(self, instance: str) -> set[str]:
        """The ids :meth:`list_instance` would give, without reading any container's status.

        Cheap at any count (crabd takes it before it serves again after a restart); the ids
        of containers that are going away may be in it.
        """
        ...

    def image_exists(self, image: str) -> bool: ...

    def image_digest(self, image: str) -> str:
        """The digest crab records ``image`` by: Docker's image id, ``sha256:<hex>``; ImageError if there is none."""
        ...

    def pin_image(self, image: str) -> str:
        """The digest of ``image`` (as :meth:`image_digest`), tagged ``crab-loaded:<hex>`` unless it is an env image.

        Tagged again at every call: the engine's last-tag time says when crab last
        pinned it.  So that a user's ``docker rmi`` or re-tag of the name never
        loses an image a checkpoint needs.  ImageError if there is no such image.
        """
        ...

    def pinned_images(self) -> list[PinnedImage]:
        """Every image tagged ``crab-loaded:<hex>`` whose id is that hex (another tag there is not crab's)."""
        ...

    def unpin_image(self, digest: str) -> Unpinned:
        """Remove crab's tag of ``digest`` and what this backend derived from the image.

        Never forced: the image itself goes only if no other name and no container
        holds it; an env image's (or a mounted) export is never removed.
        """
        ...

    def server_version(self) -> str: ...

    def close(self) -> None: ...
