"""A byte-budgeted LRU cache for rendered thumbnails."""

from thumbcache.lru import ByteLRU
from thumbcache.store import ThumbnailStore

__all__ = ["ByteLRU", "ThumbnailStore"]
