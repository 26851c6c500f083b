"""The memory digest that proves a process unchanged: untouched anonymous pages are not read, but counted."""

from __future__ import annotations

import mmap
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from crabd.inspector import procs

#: Reserves 256 MiB of private anonymous memory, says where, and blocks reading stdin (it never runs again).
CHILD = r"""
import ctypes, mmap, sys
area = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
print(ctypes.addressof(ctypes.c_char.from_buffer(area)), flush=True)
sys.stdin.read()
"""


class Child:
    """The test changes the child's memory from outside (/proc/<pid>/mem), so nothing else in it changes."""

    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout is not None
        self.area = int(self.p.stdout.readline())

    def poke(self, page: int, data: bytes) -> None:
        with open(f"/proc/{self.p.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(self.area + page * mmap.PAGESIZE)
            mem.write(data)

    def digest(self, *, resident_only: bool = True) -> str | None:
        # Until the child waits in read(): the digest needs every thread in the kernel.
        for _ in range(500):
            if procs._stack_pointers(self.p.pid) is not None:
                break
            time.sleep(0.01)
        return procs.memory_digest(self.p.pid, 64 << 20, resident_only=resident_only)


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child()
    try:
        yield c
    finally:
        c.p.kill()
        c.p.wait()


def test_a_large_untouched_reservation_is_not_read_and_does_not_hit_the_limit(child: Child) -> None:
    assert child.digest(resident_only=False) is None  # 256 MiB of address space: over the 64 MiB limit
    assert child.digest() is not None
    assert child.digest() == child.digest()


def test_every_change_of_the_memory_changes_the_digest(child: Child) -> None:
    first = child.digest()
    child.poke(10, b"\0")  # a zero into an untouched page: same bytes, but the page is now the process's
    second = child.digest()
    assert second is not None and second != first
    child.poke(10, b"\0")  # the same byte again: nothing changed
    assert child.digest() == second
    child.poke(10, b"\7")  # a new byte in a present page
    third = child.digest()
    assert third not in (first, second)
    child.poke(60000, b"\1")  # far into the reservation
    assert child.digest() not in (first, second, third)


def test_memory_over_the_limit_is_refused_before_a_byte_of_it_is_read(
    child: Child, monkeypatch: pytest.MonkeyPatch
) -> None:
    for page in range(0, 80 << 8, 64):  # touch 80 MiB, one page per 256 KiB: ~1.3 MiB resident
        child.poke(page, b"\1")
    read: list[int] = []
    real = procs._hash_range

    def counted(h: Any, mem: Any, lo: int, hi: int) -> None:
        read.append(hi - lo)
        real(h, mem, lo, hi)

    monkeypatch.setattr(procs, "_hash_range", counted)
    assert child.digest() is not None and read  # what is resident is under the limit, and read
    read.clear()
    for page in range(0, 80 << 8):  # all 80 MiB resident: over the 64 MiB limit
        child.poke(page, b"\2")
    assert child.digest() is None
    assert read == [], f"{sum(read)} bytes read of a process known to be over the limit"
