"""A small asyncio reader/writer lock.

Checkpoints, restores and forks hold it shared; operations that delete blob
files (gc, deleting a checkpoint) hold it exclusively.  That is what makes
de-duplication safe: a writer that found a blob already stored can count on
it still being there when it publishes.  Writers are preferred, so a steady
stream of checkpoints cannot starve gc.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class RWLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()
