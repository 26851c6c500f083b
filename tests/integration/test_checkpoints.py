"""Filesystem checkpoints, restore and fork of real sandboxes (issue 4)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crabd.errors import InvalidRequest
from crabd.sdk import Client, EmbeddedDaemon, Sandbox, Turn
from tests.fstree import diff, snapshot
from tests.integration.conftest import upper_dir

#: Run inside a bookworm sandbox: every kind of file a hostile agent can leave behind.
HOSTILE_TREE = r"""
import os, socket
os.makedirs("/work/app", exist_ok=True)
os.chdir("/work")
open("app/main.py", "w").write("print('hi')\n")
os.chmod("app/main.py", 0o751)
os.symlink("/etc/shadow", "shadow-link")
os.symlink("/proc/self/root/etc", "proc-escape")
os.mkfifo("fifo")
s = socket.socket(socket.AF_UNIX); s.bind("/work/sock"); s.close()
try:  # a sandbox in a user namespace (runc's default) may not make device nodes: the kernel refuses mknod
    os.mknod("null-dev", 0o600 | 0o020000, os.makedev(1, 3))
    os.mknod("disk-dev", 0o600 | 0o060000, os.makedev(8, 0))
except PermissionError:
    pass
open(b"bad-\xff\xfe-name", "w").write("not utf-8\n")
open("new\nline name", "w").write("newline\n")
open("x" * 255, "w").write("long\n")
os.link("app/main.py", "app/hard")
os.setxattr("app/main.py", "user.crab", b"\x00\x01attr")
with open("sparse", "wb") as f:
    f.truncate(1 << 40); f.seek(1 << 30); f.write(b"island")
os.chown("app", 1234, 5678)
os.utime("app/main.py", ns=(1, 1_234_567_891_000))
os.remove("/etc/issue")                      # a whiteout over the image
import shutil; shutil.rmtree("/usr/share/doc/bash")
os.makedirs("/usr/share/doc/bash"); open("/usr/share/doc/bash/only", "w").write("opaque\n")
"""


def upper_of(container_id: str) -> Path:
    return upper_dir(container_id)


def _blob_path(daemon: EmbeddedDaemon, content: bytes) -> Path:
    h = hashlib.sha256(content).hexdigest()
    return daemon.state_dir / "blobs" / "sha256" / h[:2] / h


def test_restore_is_exact_and_brings_back_the_session(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    with sb.turn():
        r = sb.run(["python3", "-c", HOSTILE_TREE])
        assert r.exit_code == 0, r.stderr
        sb.session.run("cd /work/app && export CRAB_MARK='a b' && alias ll='ls -l' && f() { echo fn; }")
    ck = sb.checkpoints()[-1]
    assert ck.turn == 1 and ck.has_session_state
    # Stored as its holes: a 1 TB sparse file costs kilobytes, not a terabyte.
    assert ck.new_bytes < 1 << 20 and ck.logical_bytes < 1 << 20
    old_cid = sb.info.container_id
    before = snapshot(upper_of(old_cid))
    assert b"work/bad-\xff\xfe-name" in before and b"etc/issue" in before

    with sb.turn():
        sb.session.run("cd / && rm -rf /work && unset CRAB_MARK && unalias ll && unset -f f")
        sb.run(["sh", "-c", "echo gone > /etc/motd"])
    info = sb.restore(ck)
    assert info.head == ck.id and info.branch == 1 and info.container_id != old_cid

    after = snapshot(upper_of(info.container_id))
    # /.crab is crab's own (crab-init's mount point, made by the engine): never checkpointed, made anew.
    assert [d for d in diff(before, after) if not d.split(": ", 1)[-1].startswith("b'.crab")] == []
    r = sb.session.run('echo "$CRAB_MARK|$PWD"; ll >/dev/null && f')
    assert r.stdout == b"a b|/work/app\nfn\n"
    # Seen from inside: the link is the sandbox's own, the host's shadow never left the host.
    r = sb.run(["sh", "-c", "readlink /work/shadow-link; cat /work/app/main.py; test -e /etc/issue || echo no-issue"])
    assert r.stdout == b"/etc/shadow\nprint('hi')\nno-issue\n"
    r = sb.run(["ls", "/usr/share/doc/bash"])
    assert r.stdout == b"only\n"  # the opaque dir hides the image's files


def test_host_files_never_enter_the_store(daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    secret = Path("/etc/shadow").read_bytes()
    with sb.turn():
        sb.run(["sh", "-c", "mkdir -p /work && ln -s /etc/shadow /work/x && ln -s / /work/root"])
    assert not _blob_path(daemon, secret).exists()
    blobs = daemon.state_dir / "blobs" / "sha256"
    digest = hashlib.sha256(secret).hexdigest()
    assert not any(p.name == digest for p in blobs.rglob("*"))
    sb.restore(sb.checkpoints()[-1])
    assert sb.run(["readlink", "/work/x"]).stdout == b"/etc/shadow\n"


def test_rollback_keeps_later_turns_restorable(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    for i in range(1, 8):
        with sb.turn():
            sb.run(["sh", "-c", f"echo {i} > /t{i}"])
    sb.restore(turn=3)
    assert sb.run(["sh", "-c", "cat /t*"]).stdout == b"1\n2\n3\n"  # (an implicit turn)
    with sb.turn() as t:
        sb.run(["sh", "-c", "echo eight > /t8"])
    eight = t.number
    # Turns 4-7 stay restorable after the rollback, and the new turn branched off turn 3.
    sb.restore(turn=6)
    assert sb.run(["sh", "-c", "cat /t*"]).stdout == b"1\n2\n3\n4\n5\n6\n"
    cks = {c.turn: c for c in sb.checkpoints()}
    lineage = client.checkpoint(cks[eight].id).lineage
    assert cks[3].id in lineage and cks[4].id not in lineage and cks[eight].branch == 1
    tree = sb.tree()
    assert cks[4].id in {c.id for c in tree.children(cks[3].id)}
    assert len(tree.children(cks[3].id)) == 2  # turn 4, and the new branch
    sb.restore(turn=eight)
    assert sb.run(["sh", "-c", "cat /t*"]).stdout == b"1\n2\n3\neight\n"


def _turn(sb: Sandbox, command: str) -> Turn:
    """One turn running ``command`` in the session, ended and settled."""
    sb.begin_turn()
    sb.session.run(command)
    return sb.end_turn(wait=True)


def test_a_turn_number_names_the_state_that_turn_ended_in(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")  # "auto": a turn that changed nothing takes no checkpoint
    t1 = _turn(sb, "echo one > /work.txt")
    t2 = _turn(sb, "echo two > /work.txt")
    t3 = _turn(sb, "cat /work.txt")
    assert [t.checkpoint_state for t in (t1, t2, t3)] == ["done", "done", "skipped"]
    assert t3.basis_checkpoint == t2.checkpoint_id
    sb.restore(turn=t1.number)
    assert sb.session.run("cat /work.txt").stdout == b"one\n"
    # Turn 3 ended in turn 2's state; the head is turn 1's now, and that must not change what "turn 3" means.
    info = sb.restore(turn=t3.number)
    assert info.head == t2.checkpoint_id
    assert sb.session.run("cat /work.txt").stdout == b"two\n"
    [clone] = sb.fork(1, turn=t3.number)
    try:
        assert clone.info.origin == t2.checkpoint_id
        assert clone.session.run("cat /work.txt").stdout == b"two\n"
        # The clone numbers its own turns from 1 (the command above was its implicit turn 1): its
        # turn numbers name its own turns, never its parent's of the same number.
        c2 = _turn(clone, "echo three > /work.txt")
        c3 = _turn(clone, "cat /work.txt")
        assert (c2.number, c3.number, c3.checkpoint_state) == (t2.number, t3.number, "skipped")
        clone.restore(turn=0)  # where it started
        assert clone.session.run("cat /work.txt").stdout == b"two\n"
        clone.restore(turn=c3.number)
        assert clone.session.run("cat /work.txt").stdout == b"three\n"
    finally:
        clone.remove()
    # A turn that is still open has no end state: refused, and nothing changes.
    sb.begin_turn()
    sb.session.run("echo four > /work.txt")
    open_turn = sb.refresh().turn
    with pytest.raises(InvalidRequest, match="still open"):
        sb.restore(turn=open_turn)
    with pytest.raises(InvalidRequest, match="no turn 99"):
        sb.fork(1, turn=99)
    assert sb.session.run("cat /work.txt").stdout == b"four\n"
    sb.end_turn(wait=True)


def test_unchanged_recheckpoint_stores_nothing(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm", checkpoints="none")
    sb.run(["sh", "-c", "mkdir /w && for i in $(seq 100); do echo $i > /w/f$i; done"])
    sb.session.run("cd /w")
    first = sb.checkpoint()
    time.sleep(0.1)
    again = sb.checkpoint()
    assert first.new_bytes > 0 and again.new_bytes == 0
    assert again.changed == 0 and again.deleted == 0 and again.parent_id == first.id


def test_fork_gives_independent_sandboxes(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm", network=True)
    with sb.turn():
        sb.session.run("mkdir -p /work && cd /work && echo base > f && export ROLE=parent")
    forks = sb.fork(3, name_prefix=f"{sb.name}-br")
    try:
        infos = [f.info for f in forks]
        assert [i.name for i in infos] == [f"{sb.name}-br-{k}" for k in (1, 2, 3)]
        assert len({i.container_id for i in infos} | {sb.info.container_id}) == 4
        ips = {i.ip_address for i in infos} | {sb.refresh().ip_address}
        assert len(ips) == 4 and all(ips)
        assert all(i.origin == sb.checkpoints()[-1].id for i in infos)
        for k, f in enumerate(forks):
            r = f.session.run(f"cat f; echo $ROLE $PWD; echo branch{k} > f")
            assert r.stdout == b"base\nparent /work\n"
            assert f.run(["hostname"]).stdout.strip().decode() == f.name
        outs = [f.run(["cat", "/work/f"]).stdout for f in forks]
        assert outs == [b"branch0\n", b"branch1\n", b"branch2\n"]
        assert sb.run(["cat", "/work/f"]).stdout == b"base\n"
        forks[0].remove()
        assert forks[1].run(["cat", "/work/f"]).stdout == b"branch1\n"
        tree = sb.tree()
        assert {s.name for s in tree.sandboxes} >= {sb.name, forks[1].name, forks[2].name}
    finally:
        for f in forks:
            f.remove() if any(s.id == f.id for s in client.list()) else None


def test_fork_a_checkpoint_of_a_removed_sandbox(client: Client) -> None:
    sb = client.create("busybox")
    with sb.turn():
        sb.run(["sh", "-c", "echo kept > /k"])
    ck = sb.checkpoints()[-1]
    sb.remove(keep_checkpoints=True)
    [clone] = client.fork(ck.id, 1)
    try:
        assert clone.run(["cat", "/k"]).stdout == b"kept\n"
    finally:
        clone.remove()
        client.delete_checkpoint(ck.id)


def test_removing_a_sandbox_drops_its_checkpoints(client: Client) -> None:
    sb = client.create("busybox")
    with sb.turn():
        sb.run(["sh", "-c", "echo x > /x"])
    ids = {c.id for c in sb.checkpoints()}
    sb.remove()
    assert not ids & {c.id for c in client.checkpoints()}


@pytest.mark.parametrize("n", [0, 65])
def test_fork_bounds(make_sandbox: Callable[..., Sandbox], n: int) -> None:
    from crabd.sdk import InvalidRequest

    sb = make_sandbox("busybox")
    with pytest.raises(InvalidRequest):
        sb.fork(n)


def test_checkpoint_inspect_lists_changes(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    with sb.turn():
        sb.run(["sh", "-c", "echo a > /a && rm /etc/group"])
    detail = client.checkpoint(sb.checkpoints()[-1])
    changes = {c.path: (c.change, c.kind) for c in detail.changes}
    assert changes[b"a"] == ("added", "file")
    assert changes[b"etc/group"] == ("whiteout", "chardev")
    assert detail.lineage[-1] == detail.checkpoint.id and len(detail.lineage) == 2


def test_identical_content_is_stored_once_across_sandboxes(make_sandbox: Callable[..., Sandbox]) -> None:
    payload = os.urandom(3 << 20)
    first, second = make_sandbox("busybox", checkpoints="none"), make_sandbox("busybox", checkpoints="none")
    stored = []
    for sb, where in ((first, "/a/data"), (second, "/b/elsewhere/copy")):
        sb.run(["sh", "-c", f"mkdir -p $(dirname {where}) && cat > {where}"], stdin=payload)
        stored.append(sb.checkpoint().new_bytes)
    assert stored[0] > len(payload) // 2  # random data does not compress
    assert stored[1] < 64 << 10  # only its index: the 3 MiB are the first sandbox's blobs
