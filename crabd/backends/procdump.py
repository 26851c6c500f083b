"""The process-dump backend interface: dump a sandbox's process tree to an images directory.

Restoring goes through the sandbox backend (``SandboxBackend.start`` with a
checkpoint), because the container engine must own the restored container.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


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
