"""The process-dump backend interfaces: dump a sandbox's process tree, store the images.

Restoring goes through the sandbox backend (``SandboxBackend.start`` with a
checkpoint), because the container engine must own the restored container;
:class:`ProcessImages` puts the images that start reads in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from crabd.backends.fsdelta import Outline, ReadBlob
from crabd.models import ImageSource


@dataclass(frozen=True)
class DumpResult:
    images_dir: Path
    seconds: float
    #: Processes in the dump (pids inside the sandbox).
    pids: tuple[int, ...]


class ProcessDumper(Protocol):
    def dump(self, container_id: str, images_dir: Path, work_dir: Path) -> DumpResult:
        """Dump every process of the container into ``images_dir``, leaving them running.

        A container frozen by the caller stays frozen.  Raises CriuError
        (with the log's path and an excerpt), and IncompleteDump when a
        process of the container is missing from the images.
        """
        ...

    def version(self) -> str: ...


@dataclass
class StoredImage:
    manifest: str
    children: dict[str, set[str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    new_bytes: int = 0
    image_bytes: int = 0
    pages: int = 0
    pages_new: int = 0


#: Where a restore's process images came from: a hot dump directory, or the blob store.


@dataclass(frozen=True)
class WrittenImage:
    """What ``ProcessImages.write`` put into a restore's image dir."""

    nbytes: int
    source: ImageSource


class ProcessImages(Protocol):
    """Process images in the blob store: de-duplicated by page, written back for a restore."""

    def store(self, images_dir: Path, previous: str | None) -> StoredImage:
        """Store the dump in ``images_dir``; ``previous`` (a manifest) holds the likeliest duplicate pages."""
        ...

    def outline(self, manifest: str, read: ReadBlob) -> Outline:
        """Parse the image ``manifest`` through ``read``: the blobs it names and the bytes ``write``
        would put on disk (StoreError or UnsafeEntry if malformed)."""
        ...

    def write(self, manifest: str, target: Path) -> WrittenImage:
        """Put the images of ``manifest`` into the empty dir ``target``; say how many bytes, and from where.

        The files may be hard links to a kept dump (``keep``): never write
        into one in place; replace it (write a new file, rename it over).
        """
        ...

    def keep(self, manifest: str, images_dir: Path, sandbox_id: str) -> None:
        """Hand over ``images_dir``, a dump just stored as ``manifest``, of sandbox ``sandbox_id``.

        The implementation may keep it as its hot copy for later restores,
        or delete it; either way the caller must not use ``images_dir`` again.
        """
        ...

    def close_external_connections(self, images_dir: Path) -> dict[str, int]:
        """Rewrite the images so restored processes find their outside connections closed; counts by outcome."""
        ...
