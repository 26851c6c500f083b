"""Per-sandbox disk limits on the runc+btrfs backend (issue 33: btrfs quota groups, ``[btrfs] sandbox_disk_bytes``).

Before them a sandbox could fill the shared pool: every other sandbox's
writes and crab's own (checkpoint snapshots) then failed.  Now a write past
the limit fails inside the sandbox with EDQUOT, while another sandbox writes
on and checkpoints of both still publish; restores and forks get the limit
too, and removing a sandbox leaves no quota group behind.  The pool's quotas
are btrfs simple quotas (``crabd/backends/btrfs/qgroups.py``): what a
sandbox wrote is charged to it while anything (it, a checkpoint, a fork)
holds it.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crabd.backends.btrfs import SubvolRef
from crabd.config import CrabConfig
from crabd.errors import InvalidRequest
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration import conftest
from tests.integration.conftest import daemon_with_config

pytestmark = [pytest.mark.integration, pytest.mark.docker]

LIMIT = 48 << 20


@pytest.fixture(scope="module")
def daemon() -> Iterator[EmbeddedDaemon]:
    toml = conftest.backend_toml("runc+btrfs", "crabdq") + f"[btrfs]\nsandbox_disk_bytes = {LIMIT}\n"
    with daemon_with_config(toml, "crabdq") as d:
        yield d


def _subvol(sb: Sandbox) -> Path:
    return CrabConfig().btrfs.mount_point / SubvolRef.sandbox(sb.refresh().container_id).relpath


def _subvol_id(path: Path) -> int:
    out = subprocess.run(["btrfs", "subvolume", "show", str(path)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Subvolume ID:\s+(\d+)", out)
    assert m, out
    return int(m.group(1))


def _qgroups() -> dict[int, str]:
    """Level-0 qgroups of the pool: subvolume id -> max referenced ("none" or bytes)."""
    pool = str(CrabConfig().btrfs.mount_point)
    out = subprocess.run(["btrfs", "qgroup", "show", "-re", "--raw", pool], capture_output=True, text=True, check=True)
    got = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts and parts[0].startswith("0/"):
            got[int(parts[0][2:])] = parts[3]
    return got


def _dd(sb: Sandbox, path: str, mib: int) -> tuple[int, str]:
    r = sb.run(["sh", "-c", f"dd if=/dev/urandom of={path} bs=1M count={mib} conv=fsync 2>&1"], timeout=120)
    return r.exit_code, r.stdout.decode(errors="replace")


def _sync_pool() -> None:
    """Commit the pool's transaction, so the cleaner can drop deleted subvolumes (charges come back then)."""
    # Not `btrfs subvolume sync POOL`: on a shared pool that waits for everyone's deletions.
    pool = str(CrabConfig().btrfs.mount_point)
    subprocess.run(["btrfs", "filesystem", "sync", pool], capture_output=True, timeout=120)


def test_a_sandbox_cannot_write_past_its_disk_limit_and_others_go_on(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    a = make_sandbox("busybox", checkpoints="none")
    b = make_sandbox("busybox", checkpoints="none")
    assert _qgroups()[_subvol_id(_subvol(a))] == str(LIMIT)

    code, text = _dd(a, "/big", 2 * (LIMIT >> 20))
    assert code != 0, text
    assert "Disk quota exceeded" in text or "No space left" in text, text
    # Another sandbox on the same pool writes on, and checkpoints of both publish (crab's own writes).
    code, text = _dd(b, "/some", 8)
    assert code == 0, text
    ck_a = a.checkpoint("full-disk")
    assert b.checkpoint("other").id
    # What a sandbox wrote stays charged to it while a checkpoint holds it (simple quotas bound what
    # a sandbox makes the pool keep); deleting the checkpoint gives it back.
    assert a.run(["rm", "-f", "/big"]).exit_code == 0
    code, text = _dd(a, "/again", 16)
    assert code != 0, text
    client.delete_checkpoint(ck_a.id)
    deadline = time.monotonic() + 60
    while True:
        _sync_pool()
        code, text = _dd(a, "/again", 16)
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert code == 0, text
    ck2 = a.checkpoint("after")

    # A fork (a writable snapshot of the checkpoint) gets the limit of its own, and is held to it.
    [clone] = client.fork(ck2.id, 1)
    try:
        sub = _subvol_id(_subvol(clone))
        assert _qgroups()[sub] == str(LIMIT)
        code, text = _dd(clone, "/big2", 2 * (LIMIT >> 20))
        assert code != 0 and ("Disk quota exceeded" in text or "No space left" in text), text
    finally:
        clone.remove(force=True)
    # Removed: its subvolume and, once the cleaner dropped it, its quota group are gone.
    deadline = time.monotonic() + 60
    while sub in _qgroups() and time.monotonic() < deadline:
        _sync_pool()
        time.sleep(0.5)
    assert sub not in _qgroups()


def test_a_sandbox_may_ask_for_less_disk_never_more(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    small = make_sandbox("busybox", checkpoints="none", disk="24m")
    assert small.refresh().disk_bytes == 24 << 20
    assert _qgroups()[_subvol_id(_subvol(small))] == str(24 << 20)
    code, text = _dd(small, "/big", 40)
    assert code != 0 and ("Disk quota exceeded" in text or "No space left" in text), text
    assert make_sandbox("busybox", checkpoints="none").refresh().disk_bytes == LIMIT
    with pytest.raises(InvalidRequest) as info:
        client.create("busybox", disk=2 * LIMIT)
    assert "sandbox_disk_bytes" in (info.value.hint or "")
