"""The store lock between processes (util/filelock.py under util/aiolock.py).

Two opens of one lock file conflict as two processes would (flock belongs to
the open file description), so most tests play the processes with two
``RWLock``s on one path; the rest use a real child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.errors import StoreBusy
from crabd.util.aiolock import RWLock
from crabd.util.filelock import FileRWLock


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store.lock"


@pytest.fixture
def files(path: Path) -> Iterator[list[FileRWLock]]:
    made = [FileRWLock(path) for _ in range(3)]
    yield made
    for f in made:
        f.close()


def _locks(files: list[FileRWLock], prefer_s: float = 2.0) -> list[RWLock]:
    return [RWLock(prefer_s=prefer_s, file=f) for f in files]


async def _hold(cm: object, seconds: float, entered: asyncio.Event) -> None:
    async with cm:  # type: ignore[attr-defined]
        entered.set()
        await asyncio.sleep(seconds)


def test_readers_of_two_processes_share_and_a_writer_waits_for_both(files: list[FileRWLock]) -> None:
    async def go() -> None:
        a, b, c = _locks(files)
        ea, eb = asyncio.Event(), asyncio.Event()
        ha = asyncio.create_task(_hold(a.shared(), 0.2, ea))
        hb = asyncio.create_task(_hold(b.shared(), 0.4, eb))
        await asyncio.wait_for(asyncio.gather(ea.wait(), eb.wait()), 1.0)  # both in at once
        t0 = time.monotonic()
        async with c.exclusive(timeout_s=5.0):
            waited = time.monotonic() - t0
            assert ha.done() and hb.done()  # not before the longer of the two holds ended
        assert 0.3 <= waited < 1.5, waited
        await asyncio.gather(ha, hb)

    asyncio.run(go())


def test_a_writer_excludes_readers_of_other_processes(files: list[FileRWLock]) -> None:
    async def go() -> None:
        a, b, _ = _locks(files)
        entered = asyncio.Event()
        w = asyncio.create_task(_hold(a.exclusive(), 0.3, entered))
        await entered.wait()
        t0 = time.monotonic()
        async with b.shared():
            assert w.done()
            assert time.monotonic() - t0 >= 0.25
        await w

    asyncio.run(go())


def test_a_writer_elsewhere_holds_new_readers_back_only_for_prefer_s(files: list[FileRWLock]) -> None:
    """Issue 17's bound holds across processes: a waiting writer elsewhere delays a reader about prefer_s."""

    async def go() -> None:
        a, b, c = _locks(files, prefer_s=0.3)
        entered = asyncio.Event()
        long_read = asyncio.create_task(_hold(a.shared(), 3.0, entered))
        await entered.wait()
        wrote = asyncio.Event()

        async def write() -> None:
            async with b.exclusive(timeout_s=10.0):
                assert not files[2].try_shared()  # exclusive in the file, not only in b's process
                wrote.set()

        writer = asyncio.create_task(write())
        await asyncio.sleep(0.05)
        assert files[0].writer_waiting_elsewhere()  # the writer said so in the intent file
        t0 = time.monotonic()
        async with c.shared():
            waited = time.monotonic() - t0
        assert 0.2 <= waited < 1.0, waited  # held back for the writer, then overdue
        # The reader's own process: a new reader there holds back the same way.
        t0 = time.monotonic()
        async with a.shared():
            assert 0.2 <= time.monotonic() - t0 < 1.0
        long_read.cancel()
        await asyncio.gather(long_read, return_exceptions=True)
        await asyncio.wait_for(writer, 2.0)  # gets it once the long hold went
        assert wrote.is_set()
        assert not files[2].writer_waiting_elsewhere()  # it withdrew its intent when it got the lock

    asyncio.run(go())


def test_a_writer_still_goes_first_across_processes_within_the_window(files: list[FileRWLock]) -> None:
    async def go() -> None:
        a, b, c = _locks(files, prefer_s=5.0)
        entered = asyncio.Event()
        held = asyncio.create_task(_hold(a.shared(), 0.2, entered))
        await entered.wait()
        order: list[str] = []

        async def writer() -> None:
            async with b.exclusive():
                order.append("w")

        async def reader() -> None:
            async with c.shared():
                order.append("r")

        w = asyncio.create_task(writer())
        await asyncio.sleep(0.05)
        await asyncio.gather(reader(), w, held)
        assert order == ["w", "r"]

    asyncio.run(go())


def test_a_writer_timing_out_elsewhere_fails_clearly_and_leaves_nothing(files: list[FileRWLock]) -> None:
    async def go() -> None:
        a, b, c = _locks(files, prefer_s=0.1)
        entered = asyncio.Event()
        held = asyncio.create_task(_hold(a.shared(), 1.0, entered))
        await entered.wait()
        with pytest.raises(StoreBusy) as info:
            async with b.exclusive(0.3, what="deleting ck-1"):
                raise AssertionError("must not get the lock")
        assert "deleting ck-1" in str(info.value)
        assert b.stats.exclusive.timeouts == 1
        assert not files[2].writer_waiting_elsewhere()  # its intent went with it
        t0 = time.monotonic()
        async with c.shared():
            assert time.monotonic() - t0 < 0.1
        await held
        # And the writer's process holds nothing: another process writes at once.
        async with c.exclusive(timeout_s=0.5):
            pass

    asyncio.run(go())


def test_a_cancelled_writer_withdraws_its_intent(files: list[FileRWLock]) -> None:
    async def go() -> None:
        a, b, _ = _locks(files)
        entered = asyncio.Event()
        held = asyncio.create_task(_hold(a.shared(), 0.5, entered))
        await entered.wait()

        async def write() -> None:
            async with b.exclusive():
                raise AssertionError("cancelled before it got the lock")

        w = asyncio.create_task(write())
        await asyncio.sleep(0.05)
        assert files[2].writer_waiting_elsewhere()
        w.cancel()
        await asyncio.gather(w, return_exceptions=True)
        assert not files[2].writer_waiting_elsewhere()
        await held

    asyncio.run(go())


_CHILD = """
import sys, time
from pathlib import Path
from crabd.util.filelock import FileRWLock
f = FileRWLock(Path(sys.argv[1]))
assert f.try_exclusive()
print("held", flush=True)
time.sleep(60)
"""


def _child_holding(path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_process_killed_while_it_writes_holds_nothing(path: Path, files: list[FileRWLock]) -> None:
    child = _child_holding(path)
    try:

        async def go() -> float:
            lock = RWLock(file=files[0])
            with pytest.raises(StoreBusy):
                async with lock.exclusive(0.2):
                    pass
            t0 = time.monotonic()
            asyncio.get_running_loop().call_later(0.3, os.kill, child.pid, signal.SIGKILL)
            async with lock.shared():
                return time.monotonic() - t0

        waited = asyncio.run(go())
        assert 0.25 <= waited < 2.0, waited  # exactly as long as the child lived
    finally:
        child.kill()
        child.wait()


_CHILD_WITH_HELPER = """
import subprocess, sys, time
from pathlib import Path
from crabd.util.filelock import FileRWLock
f = FileRWLock(Path(sys.argv[1]))
assert f.try_exclusive()
helper = subprocess.Popen(["sleep", "30"], close_fds=False)  # as a helper crabd starts while it writes
print(helper.pid, flush=True)
time.sleep(60)
"""


def test_helpers_started_while_it_is_held_do_not_keep_it(path: Path, files: list[FileRWLock]) -> None:
    """runc, CRIU and restored sandboxes outlive a crabd killed while it held the lock: they must not hold it."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_WITH_HELPER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.stdout is not None
    helper = int(child.stdout.readline())
    try:
        assert not files[0].try_shared()
        child.kill()
        child.wait()
        os.kill(helper, 0)  # the helper lives on ...
        deadline = time.monotonic() + 2.0
        while not files[0].try_exclusive():  # ... and the lock went with crabd
            assert time.monotonic() < deadline, "a helper kept the store lock of a dead crabd"
            time.sleep(0.01)
        files[0].release()
    finally:
        child.kill()
        child.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)


def test_the_lock_file_is_never_followed_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "store.lock").symlink_to(target)
    with pytest.raises(OSError):
        FileRWLock(tmp_path / "store.lock")
