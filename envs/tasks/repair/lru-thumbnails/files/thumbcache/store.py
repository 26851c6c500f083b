"""Thumbnails of images, rendered on demand and cached."""

from __future__ import annotations

from typing import Callable

from thumbcache.lru import ByteLRU

Renderer = Callable[[str, int], bytes]


class ThumbnailStore:
    """``store.thumbnail("cat.png", 128)`` renders once, then serves from the cache."""

    SIZES = (64, 128, 256)

    def __init__(self, render: Renderer, capacity: int) -> None:
        self._render = render
        self.cache = ByteLRU(capacity)

    def thumbnail(self, path: str, size: int) -> bytes:
        if size not in self.SIZES:
            raise ValueError(f"unsupported size {size}; choose one of {self.SIZES}")
        key = (path, size)
        data = self.cache.get(key)
        if data is None:
            data = self._render(path, size)
            self.cache.put(key, data)
        return data

    def invalidate(self, path: str) -> None:
        """Forget every size of ``path`` (the image changed)."""
        for size in self.SIZES:
            self.cache.discard((path, size))
