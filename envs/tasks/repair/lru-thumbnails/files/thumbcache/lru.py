"""An LRU cache whose capacity is a number of bytes, not of entries."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator


class ByteLRU:
    """Maps keys to ``bytes`` values, holding at most ``capacity`` bytes of values.

    ``get`` and ``put`` make an entry the most recently used; when room is
    needed, the least recently used entries are evicted first.  Membership
    tests and ``peek`` do not change the order.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.used = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Hashable]:
        """Keys from least to most recently used."""
        return iter(list(self._items))

    def peek(self, key: Hashable) -> bytes | None:
        return self._items.get(key)

    def get(self, key: Hashable) -> bytes | None:
        try:
            value = self._items[key]
        except KeyError:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: bytes) -> None:
        size = len(value)
        if size > self.capacity:
            raise ValueError(f"{size} bytes do not fit in a cache of {self.capacity}")
        old = self._items.pop(key, None)
        if old is not None:
            self.used -= len(old)
        while self.used + size > self.capacity:
            _, evicted = self._items.popitem()
            self.used -= len(evicted)
            self.evictions += 1
        self._items[key] = value
        self.used += size

    def discard(self, key: Hashable) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.used -= len(old)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._items), "bytes": self.used, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}
