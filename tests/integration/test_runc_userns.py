"""runc sandboxes in user namespaces (issue 33, item 3), on the real daemon with `[runtime] userns = true`.

Root in a sandbox is an unprivileged host id, its range is the container's own
(a fork or restore gets another), crab-init comes from a tmpfs of its own (no
handle into the host's root file system) and runs under a keeper at PID 1, and
checkpoint -> restore, fork, and archive export -> import -> fork carry a live
process's memory across ranges, and a restored or forked sandbox takes process
checkpoints again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from crabd.backends.criu import pbimage
from crabd.backends.procdump import MASKED_DIR_KEY
from crabd.backends.runc import idmap
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from crabd.store.idranges import FIRST_BASE, RANGE_SIZE
from tests.integration.conftest import daemon_with_config, remove_sandbox_network
from tests.integration.test_processes import ASK_REPL, install, start_repl

pytestmark = pytest.mark.criu

NETWORK = "crabuserns"


@pytest.fixture(scope="module")
def daemon() -> Iterator[EmbeddedDaemon]:
    """This module's crabd: runc+btrfs with user namespaces (the default, named here all the same)."""
    toml = f'[runtime]\nbackend = "runc+btrfs"\nuserns = true\n[network]\nname = "{NETWORK}"\n'
    with daemon_with_config(toml, NETWORK) as d:
        yield d


def uid_map(sb: Sandbox) -> tuple[int, int, int]:
    """The sandbox's own uid_map, read from inside: (first inside, first on the host, count)."""
    r = sb.run(["cat", "/proc/self/uid_map"])
    assert r.exit_code == 0, r.stderr
    first, lower, count = (int(x) for x in r.stdout.split())
    return first, lower, count


def in_range(base: int) -> bool:
    return base >= FIRST_BASE and (base - FIRST_BASE) % RANGE_SIZE == 0


def _maps_in(ns_fd: int) -> list[str]:
    """uid_map and gid_map as seen by a process that joined the user namespace ``ns_fd``.

    A new program (nsenter), not an ``os.fork()`` child: in a test run that used gRPC, its at-fork
    handlers start threads in the child, and setns(CLONE_NEWUSER) refuses a threaded caller (EINVAL).
    """
    r = subprocess.run(
        ["nsenter", f"--user=/proc/self/fd/{ns_fd}", "cat", "/proc/self/uid_map", "/proc/self/gid_map"],
        pass_fds=(ns_fd,),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return [" ".join(line.split()) for line in r.stdout.splitlines()]


def _children() -> set[str]:
    return {c for t in os.listdir("/proc/self/task") for c in Path(f"/proc/self/task/{t}/children").read_text().split()}


def _left_behind(pid: str, ns: str) -> bool:
    """Whether child ``pid`` is a zombie or lives in the user namespace ``ns`` (False once it is gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" or os.readlink(f"/proc/{pid}/ns/user") == ns
    except OSError:  # gone meanwhile; a zombie's namespace links are gone too, its stat is not
        return False


def test_a_user_namespace_is_made_with_the_range_and_nothing_of_crabd_changes() -> None:
    """userns_fd clones with CLONE_VM (no copy of crabd's page tables): the mapping is the range's, the
    caller's signal mask is as before, no child is left, and parallel callers each get their own namespace."""
    ids = idmap.IdRange(FIRST_BASE + 4000 * RANGE_SIZE, RANGE_SIZE)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    before = _children()  # a full test run's earlier tests may have left children (even zombies) of their own
    fd = idmap.userns_fd(ids)
    try:
        ns = os.readlink(f"/proc/self/fd/{fd}")
        # The namespace's one process was reaped: no new child of this process, zombie or in it.
        assert not [c for c in _children() - before if _left_behind(c, ns)]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
        assert ns != os.readlink("/proc/self/ns/user")
        assert _maps_in(fd) == [f"0 {ids.base} {ids.count}"] * 2
    finally:
        os.close(fd)
    # One stack serves every clone: callers on many threads at once still each get a whole namespace.
    with ThreadPoolExecutor(8) as pool:
        fds = list(pool.map(lambda _: idmap.userns_fd(ids), range(32)))
    try:
        assert len({os.readlink(f"/proc/self/fd/{f}") for f in fds}) == 32
        assert all(_maps_in(f) == [f"0 {ids.base} {ids.count}"] * 2 for f in fds[:4])
    finally:
        for f in fds:
            os.close(f)


def test_root_in_a_sandbox_is_an_unprivileged_host_id(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    first, base, count = uid_map(sb)
    assert (first, count) == (0, RANGE_SIZE) and in_range(base)  # on today's main: "0 0 4294967295"
    assert sb.run(["id", "-u"]).stdout.strip() == b"0"  # still root inside
    other = make_sandbox("busybox")
    assert uid_map(other)[1] != base  # a range per container: no host id shared between sandboxes
    # crab-init is on a tmpfs of its own, not a bind mount from the host's root file system
    # (a handle through it could only name crab-init's own copies).
    assert sb.run(["stat", "-f", "-c", "%T", "/.crab/init"]).stdout.strip() == b"tmpfs"
    # Host root's files the sandbox may see are not its own: /proc/1/root is host root's only in the host's view.
    probe = sb.run(["sh", "-c", "cat /proc/sys/kernel/overflowuid; stat -c %u /proc/sys/kernel"])
    assert probe.stdout.split()[0] == probe.stdout.split()[1]  # host root shows as the overflow uid
    assert "user namespaces" in client.status().docker_version


def test_pid_1_is_a_keeper_that_holds_nothing(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    shape = sb.run(["sh", "-c", "cat /proc/1/comm /proc/1/task/1/children; echo; ls /proc/1/fd"])
    comm, child, *fds = shape.stdout.split()
    assert comm == b"crab-keeper" and sorted(fds) == [b"0", b"1", b"2"], shape
    links = sb.run(["sh", "-c", "for f in 0 1 2; do readlink /proc/1/fd/$f; done"]).stdout.split()
    assert links == [b"/dev/null"] * 3
    # crab-init proper is the keeper's only child and, as PID 1 elsewhere, not dumpable.
    assert sb.run(["cat", f"/proc/{child.decode()}/cmdline"]).stdout.startswith(b"/.crab/init")
    r = sb.run(["cat", f"/proc/{child.decode()}/environ"])
    assert r.exit_code != 0 and b"Permission denied" in r.stderr


@pytest.fixture
def archive_dir() -> Iterator[Path]:
    d = Path(f"/tmp/crab-userns-archives-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_restore_fork_and_archive_carry_a_live_process_across_ranges(
    client: Client, make_sandbox: Callable[..., Sandbox], archive_dir: Path
) -> None:
    sb = make_sandbox("bookworm", checkpoints="fs")
    install(sb)
    secret, n = start_repl(sb)
    sb.run(["sh", "-c", "echo mine > /root/owned && chmod 600 /root/owned"])
    full = sb.checkpoint(kind="full")
    sb.session.run(ASK_REPL)  # a question after the checkpoint: the restore forgets it
    # checkpoint -> restore: a new container, the REPL's memory as at the checkpoint.
    sb.restore(full)
    got_secret, m = sb.session.run(ASK_REPL).stdout.split()
    assert (got_secret, int(m)) == (secret, int(n) + 1)
    # A restored sandbox takes a process checkpoint again, and that one restores too (CRIU refused the dump
    # while a restored, non-dumpable crab-init was the tree's root: crab-init.c, "PID 1 keeper").
    again_full = sb.checkpoint(kind="full")
    assert again_full.kind == "full"
    sb.session.run(ASK_REPL)
    sb.restore(again_full)
    got_secret, m = sb.session.run(ASK_REPL).stdout.split()
    assert (got_secret, int(m)) == (secret, int(n) + 2)
    restored_base = uid_map(sb)[1]
    assert in_range(restored_base)  # a new container: a range of its own (the old one's went back with it)
    # fork: another range; the files stay the sandbox root's, the process its memory.
    [clone] = client.fork(full.id, 1)
    try:
        assert uid_map(clone)[1] != restored_base  # never the range of a container that runs
        assert clone.run(["stat", "-c", "%u %a", "/root/owned"]).stdout.split() == [b"0", b"600"]
        assert clone.run(["cat", "/root/owned"]).stdout == b"mine\n"
        got_secret, m = clone.session.run(ASK_REPL).stdout.split()
        assert (got_secret, int(m)) == (secret, int(n) + 1)
        assert clone.checkpoint(kind="full").kind == "full"  # a fork, too, takes process checkpoints
    finally:
        clone.remove(force=True)
    # archive: export, forget, import, fork.
    path = archive_dir / "full.crab"
    client.export_checkpoint(full, path)
    client.delete_checkpoint(full.id)
    got = client.import_checkpoint(path)
    assert got.checkpoint.id == full.id and not got.dropped
    [again] = client.fork(full.id, 1)
    try:
        assert in_range(uid_map(again)[1])
        got_secret, m = again.session.run(ASK_REPL).stdout.split()
        assert (got_secret, int(m)) == (secret, int(n) + 1)
    finally:
        again.remove(force=True)


def test_an_upgrade_keeps_process_checkpoints_taken_without_user_namespaces(kept_state: Path) -> None:
    # A crabd without user namespaces (as before they were the default) takes a process checkpoint; the
    # same state dir under a crabd with them restores and forks it as it was dumped: no range, its memory.
    net = "crabupg"
    configs = {}
    for name, on in (("off", "false"), ("on", "true")):
        configs[name] = kept_state / f"{name}.toml"
        configs[name].write_text(f'[runtime]\nbackend = "runc+btrfs"\nuserns = {on}\n[network]\nname = "{net}"\n')
    old = EmbeddedDaemon(state_dir=kept_state, ephemeral=False, extra_args=["--config", str(configs["off"])])
    old.start()
    try:
        with Client(old.socket) as c:
            sb = c.create("bookworm", checkpoints="fs")
            install(sb)
            secret, n = start_repl(sb)
            assert uid_map(sb) == (0, 0, 4294967295)
            full = sb.checkpoint(kind="full")
    finally:
        old.close()
    new = EmbeddedDaemon(state_dir=kept_state, ephemeral=False, extra_args=["--config", str(configs["on"])])
    new.start()
    try:
        with Client(new.socket) as c:
            sb = c.get(sb.id)
            sb.restore(full)
            got_secret, m = sb.session.run(ASK_REPL).stdout.split()
            assert (got_secret, int(m)) == (secret, int(n) + 1)
            assert uid_map(sb) == (0, 0, 4294967295)  # as it was taken
            [clone] = c.fork(full.id, 1)
            assert uid_map(clone) == (0, 0, 4294967295)
            assert clone.session.run(ASK_REPL).stdout.split()[0] == secret
            assert in_range(uid_map(c.create("busybox"))[1])  # a new sandbox gets a range
    finally:
        new.close()
        remove_sandbox_network(net)


def _host_mounts_of(container_id: str) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line.split()[4] for line in f if container_id in line.split()[4]]


def test_a_running_sandbox_keeps_two_host_mounts_and_still_checkpoints(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    # Each host mount makes every later runc create slower (docs/benchmarks.md): once runc has bound
    # the /etc files in, the host's idmapped view of them goes; the overlay root and the netns pin stay.
    sb = make_sandbox("busybox", network=True)
    cid = sb.info.container_id
    kept = _host_mounts_of(cid)
    assert len(kept) == 2 and not any(m.endswith("/etc") for m in kept), kept
    assert b"localhost" in sb.run(["cat", "/etc/hosts"]).stdout
    ck = sb.checkpoint(kind="full")
    (clone,) = sb.fork(1, ck)
    try:
        assert len(_host_mounts_of(clone.info.container_id)) == 2
        assert b"localhost" in clone.run(["cat", "/etc/hosts"]).stdout
        assert sb.checkpoint(kind="full").kind == "full"  # the source dumps again after the fork
    finally:
        clone.remove(force=True)


#: What a process in a sandbox sees of the masked directories: owner, mode, contents, and that writes fail.
MASKS_SEEN = (
    "stat -c '%n %u %g %a' /proc/acpi /sys/firmware; ls -A /proc/acpi /sys/firmware;"
    " touch /proc/acpi/x; mkdir /sys/firmware/y; grep -E ' /(proc/acpi|sys/firmware) ' /proc/self/mountinfo"
    " | cut -d' ' -f5,6,9,11"
)


def _masked_mount_keys(images: Path) -> dict[str, str]:
    """{mount point: CRIU external key} of the masked directories in a dump's mountpoints image."""
    dirfd = pbimage.open_dir(images)
    try:
        [name] = [n for n in os.listdir(dirfd) if n.startswith("mountpoints-")]
        entries = pbimage.messages(dirfd, name, pbimage.MNTS_MAGIC)
    finally:
        os.close(dirfd)
    points = {e.text(7) or "": e.text(18) or "" for e in entries}
    return {p.removeprefix("."): key for p, key in points.items() if p.endswith(("/proc/acpi", "/sys/firmware"))}


def test_masked_directories_come_back_as_crabs_empty_read_only_tmpfs(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]
) -> None:
    """No tar of runc's masks in a dump; a restore covers them with crab's tmpfs, seen as runc's (masks.py)."""
    sb = make_sandbox("busybox")
    seen = sb.run(["sh", "-c", MASKS_SEEN])
    assert b"/proc/acpi 0 0 1777" in seen.stdout and b"Read-only file system" in seen.stderr
    ck = sb.checkpoint(kind="full")
    hot = max((daemon.state_dir / "images-hot").iterdir(), key=lambda p: p.stat().st_mtime)
    assert _masked_mount_keys(hot) == {"/proc/acpi": MASKED_DIR_KEY, "/sys/firmware": MASKED_DIR_KEY}
    (clone,) = sb.fork(1, ck)
    try:
        again = clone.run(["sh", "-c", MASKS_SEEN])
        # Empty, read-only, the sandbox root's, mode 1777: what a fresh sandbox shows (the base id differs).
        ranged = [line.rsplit(b",uid=", 1)[0] for line in seen.stdout.splitlines()]
        assert [line.rsplit(b",uid=", 1)[0] for line in again.stdout.splitlines()] == ranged
        assert again.stderr.count(b"Read-only file system") == 2
        # The host side went once runc restore had returned: the clone's binds hold the tmpfs.
        cid = clone.info.container_id
        assert not any("/masked" in m for m in _host_mounts_of(cid))
        # The clone is dumped and restored again the same way (its bundle names its criu.conf to runc).
        (grand,) = clone.fork(1, clone.checkpoint(kind="full"))
        grand.remove(force=True)
    finally:
        clone.remove(force=True)
