"""crabd on the runc+btrfs backend: checkpoints are snapshots, and restores, forks and recoveries are inode-exact.

What only this backend promises (the state matrix and everything else runs on
both backends elsewhere, e.g. tests/integration/test_processes.py): every
file's st_ino is the checkpoint's after a restore, a fork and a recovery —
including files the sandbox copied up from its image — so a SQLite
connection held across a restore keeps writing; and crabd leaves nothing of
a sandbox on the host once it is removed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

import pytest

from crabd.backends.btrfs import Pool, SubvolKind
from crabd.config import CrabConfig
from crabd.daemon.app import instance_id
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration import conftest
from tests.integration.conftest import daemon_with_config

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]

#: Files whose st_ino must survive: one the sandbox made, one it hard-linked, one copied up from the image.
PATHS = ("/work/made", "/work/linked", "/etc/issue", "/work/db.sqlite")

SETUP = (
    "mkdir -p /work && echo made > /work/made && ln /work/made /work/linked && echo more >> /etc/issue"
    " && python3 -c \"import sqlite3; c=sqlite3.connect('/work/db.sqlite'); c.execute('create table t(x)');"
    ' c.commit()"'
)

#: Holds one SQLite connection open and writes a row whenever /tmp/go appears (a restore must not break it).
WRITER = """
import os, sqlite3, time
c = sqlite3.connect('/work/db.sqlite')
n = 0
while True:
    if os.path.exists('/tmp/go'):
        os.unlink('/tmp/go')
        n += 1
        try:
            c.execute('insert into t values (?)', (n,)); c.commit(); out = 'ok %d' % n
        except Exception as e:
            out = type(e).__name__ + ': ' + str(e)
        with open('/tmp/done.tmp', 'w') as f: f.write(out)
        os.rename('/tmp/done.tmp', '/tmp/done')
    time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[EmbeddedDaemon]:
    with daemon_with_config(conftest.backend_toml("runc+btrfs", "crabrd"), "crabrd") as d:
        yield d


def inodes(sb: Sandbox) -> dict[str, str]:
    r = sb.run(["stat", "-c", "%n %i", *PATHS])
    assert r.exit_code == 0, r.stderr
    return dict(line.split() for line in r.stdout.decode().splitlines())


def ask_writer(sb: Sandbox) -> str:
    sb.run(["sh", "-c", "rm -f /tmp/done; touch /tmp/go"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = sb.run(["cat", "/tmp/done"])
        if r.exit_code == 0 and r.stdout:
            return r.stdout.decode()
        time.sleep(0.05)
    raise AssertionError("the writer did not answer")


def test_backend_is_runc(client: Client) -> None:
    assert client.status().docker_version.startswith("runc+btrfs: runc")


def test_restore_fork_and_recover_keep_every_inode(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm", checkpoints="fs")
    with sb.turn():
        assert sb.session.run(SETUP).exit_code == 0
    ck = sb.checkpoints()[-1]
    before = inodes(sb)
    with sb.turn():
        sb.session.run("rm -rf /work && echo changed > /etc/issue")
    assert sb.restore(ck).files_from == "snapshot"
    assert inodes(sb) == before
    [clone] = sb.fork(1)
    try:
        assert clone.info.files_from == "snapshot"
        assert inodes(clone) == before
    finally:
        clone.remove(force=True)
    conftest.kill_container(sb.refresh().container_id)
    deadline = time.monotonic() + 30
    while sb.refresh().state != "dead" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.recover().sandbox.files_from == "snapshot"
    assert inodes(sb) == before


def test_without_its_snapshot_a_checkpoint_restores_from_the_blobs_and_says_so(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm", checkpoints="fs")
    with sb.turn():
        assert sb.session.run(SETUP).exit_code == 0
    ck = sb.checkpoints()[-1]
    look = ["sh", "-c", f"cat /work/made /etc/issue && stat -c '%n %s %a %Y %h' {' '.join(PATHS)}"]
    want = sb.run(look).stdout
    conftest.drop_snapshot(daemon.state_dir, ck.id)  # as on another host, or after losing the pool
    with sb.turn():
        sb.session.run("rm -rf /work && echo changed > /etc/issue")
    restored = sb.restore(ck)
    assert (restored.files_from, restored.images_from) == ("blobs", None)
    # Same contents, sizes, modes, mtimes and link counts; only the inode numbers are new.
    assert sb.run(look).stdout == want


def test_an_open_sqlite_connection_writes_on_after_a_restore(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm", checkpoints="fs")
    with sb.turn():
        assert sb.session.run(SETUP).exit_code == 0
        sb.run(["sh", "-c", "cat > /tmp/writer.py"], stdin=WRITER.encode())
        sb.session.run("python3 /tmp/writer.py & sleep 0.5")
    assert ask_writer(sb) == "ok 1"
    ck = sb.checkpoint(kind="full")
    assert ask_writer(sb) == "ok 2"  # lost by the restore below
    restored = sb.restore(ck)
    assert (restored.files_from, restored.images_from) == ("snapshot", "hot")
    # The restored process still holds its connection; SQLite re-checks st_ino before writing.
    assert ask_writer(sb) == "ok 2"
    count = "import sqlite3; print(sqlite3.connect('/work/db.sqlite').execute('select count(*) from t').fetchone()[0])"
    r = sb.run(["python3", "-c", count])
    assert r.stdout == b"2\n"


def test_nothing_of_a_removed_sandbox_stays_on_the_host(daemon: EmbeddedDaemon, client: Client) -> None:
    prefix = instance_id(daemon.state_dir) + "-"
    sb = client.create("busybox", checkpoints="fs")
    with sb.turn():
        sb.run(["sh", "-c", "echo hi > /x"])
    sb.fork(2)
    for f in client.list():
        f.remove(force=True)
    with Pool.from_config(CrabConfig().btrfs) as pool:
        left = [n for kind in SubvolKind for n in pool.list(kind) if n.startswith(prefix)]
    assert left == []


#: What a sandbox sees of its /dev, /dev/shm and /sys/fs/cgroup tmpfs mounts: the roots' mode, owner, mtime and
#: type, their entries, /dev's links (owner, mtime, target), and their mounts (flags, type, source, options; the
#: uid/gid options name the sandbox's own id range, which a fork's differs from).  Sorted: a directory's read
#: order is the tmpfs's creation order, which a tar's extraction did not keep either.
TMPFS_VIEW = (
    "stat -c '%n %a %u %g %y %F' /dev /dev/shm /sys/fs/cgroup; ls -A /dev /dev/shm /sys/fs/cgroup;"
    " find /dev -maxdepth 1 -type l -exec stat -c '%n %u %g %y %N' {} + | sort;"
    ' awk \'$5=="/dev"||$5=="/dev/shm"||$5=="/sys/fs/cgroup"{for(i=7;$i!="-";i++);print $5,$6,$(i+1),$(i+2),$(i+3)}\''
    " /proc/self/mountinfo | sed -E 's/,?[ug]id=[0-9]+//g'"
)


def _copied_points(d: EmbeddedDaemon, container_id: str) -> list[str]:
    """The points (comma-joined) each dump of ``container_id`` kept out of CRIU's tar (dumps.py logs them)."""
    out = []
    for line in d.log_file.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("msg") == "tmpfs kept out of CRIU's tar" and rec.get("container") == container_id:
                out.append(rec["points"])
    return out


def test_runcs_tmpfs_mounts_come_back_exactly_as_fresh_tmpfs_of_their_own(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]
) -> None:
    """/dev, /dev/shm unused and runc's cgroup tmpfs: not tarred by CRIU (tmpfs_copies.py), yet restored exactly."""
    sb = make_sandbox("bookworm")
    cid = sb.refresh().container_id
    # Not what runc made them: a restore that made them anew from the spec alone would differ.
    prep = (
        "chmod 1770 /dev/shm && ln -s /proc/self/fd/3 /dev/mine && touch -h -d '2021-01-01 00:00:00.5' /dev/stdin"
        " && touch -d '2020-01-02 03:04:05.123456789' /dev /dev/shm /sys/fs/cgroup"
    )
    assert sb.run(["sh", "-c", prep]).exit_code == 0
    before = sb.run(["sh", "-c", TMPFS_VIEW]).stdout.decode()
    assert "/dev/shm 1770 0 0 2020-01-02 03:04:05.123456789" in before and "memory" in before
    assert "/dev/stdin 0 0 2021-01-01 00:00:00.500000000" in before and "'/dev/mine' -> '/proc/self/fd/3'" in before
    ck = sb.checkpoint(kind="full")
    assert _copied_points(daemon, cid)[-1] == "/dev,/dev/shm,/sys/fs/cgroup"
    a, b = sb.fork(2, ck)
    try:
        for clone in (a, b):
            assert clone.run(["sh", "-c", TMPFS_VIEW]).stdout.decode() == before
        # Each clone's tmpfs is its own: nothing written in one shows in another or in the source.
        assert a.run(["sh", "-c", "echo mine > /dev/shm/x && cat /dev/shm/x"]).stdout == b"mine\n"
        assert a.run(["touch", "/sys/fs/cgroup/y", "/dev/z"]).exit_code == 0
        for other in (b, sb):
            assert other.run(["ls", "-A", "/dev/shm"]).stdout == b""
            assert other.run(["sh", "-c", "test -e /sys/fs/cgroup/y || test -e /dev/z"]).exit_code == 1
        sb.restore(ck)
        assert sb.run(["sh", "-c", TMPFS_VIEW]).stdout.decode() == before
    finally:
        for clone in (a, b):
            clone.remove(force=True)
    # What the sandbox put there is CRIU's to keep (its tar), and comes back.
    mine = "echo kept > /dev/shm/keep && mkdir /sys/fs/cgroup/mine && echo also > /dev/keep"
    assert sb.run(["sh", "-c", mine]).exit_code == 0
    cid = sb.refresh().container_id  # the restore's container
    copied = len(_copied_points(daemon, cid))
    ck2 = sb.checkpoint(kind="full")
    assert len(_copied_points(daemon, cid)) == copied  # this dump copied neither
    [c] = sb.fork(1, ck2)
    try:
        assert c.run(["cat", "/dev/shm/keep"]).stdout == b"kept\n"
        assert c.run(["test", "-d", "/sys/fs/cgroup/mine"]).exit_code == 0
        assert c.run(["cat", "/dev/keep"]).stdout == b"also\n"
    finally:
        c.remove(force=True)
