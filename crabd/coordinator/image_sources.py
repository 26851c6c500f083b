"""Images a create names by path: loaded into the host's Docker once, then named by digest.

The checks and the load are ``backends/image_archive.py``; here they run
off the event loop, at most :data:`MAX_LOADS` at once per crabd process (each
holds up to two copies of an archive in the staging dir while it runs).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from crabd.backends import image_archive
from crabd.backends.sandbox import SandboxBackend

#: Loads one crabd process runs at once; more wait their turn.
MAX_LOADS = 2


class ImageLoader:
    def __init__(self, root: Path, max_bytes: int, backend: SandboxBackend) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.backend = backend
        self._slots = asyncio.Semaphore(MAX_LOADS)
        image_archive.remove_stale(root)

    async def load(self, path: str, uid: int, gid: int) -> str:
        """The digest of the image at ``path`` as ``uid``/``gid`` may read it (loaded if Docker lacks it)."""
        async with self._slots:
            return await asyncio.to_thread(
                image_archive.load_as, path, uid, gid, self.root, self.max_bytes, self.backend.image_exists
            )
