"""Lazy restore on the runc backend (issue 37): memory served on first touch, whole afterwards, and a page
server that dies takes its container with it instead of leaving it to run on zero pages.

Lazy pages need CRIU to make a userfaultfd in each restored task; in a user namespace the kernel refuses
that while ``vm.unprivileged_userfaultfd`` is 0 (crab's hosts keep it so), so the lazy tests run on a
crabd with ``[runtime] userns = false`` and the default crabd's restores are eager, saying why.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.lazy_restore import SERVER
from crabd.backends.criu import lazypages
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration.conftest import daemon_with_config, kill_container, remove_sandbox_network

pytestmark = [pytest.mark.integration, pytest.mark.criu]

#: A process holding ``mb`` MiB of random bytes; on port 8001 it answers "sum" with their sha256 (touching
#: every page) and anything else with "up" (the benchmark's own server).
HOLD = SERVER
ASK = (
    "python3 -c \"import socket,sys; s=socket.create_connection(('127.0.0.1',8001)); "
    's.sendall(sys.argv[1].encode()); print(s.recv(100).decode())" '
)


LAZY_NET = "crablazy"


@pytest.fixture(scope="module")
def lazy_daemon() -> Iterator[EmbeddedDaemon]:
    """A crabd whose sandboxes run without a user namespace (lazy pages allowed)."""
    with daemon_with_config(f'[runtime]\nuserns = false\n[network]\nname = "{LAZY_NET}"\n', LAZY_NET) as d:
        yield d


@pytest.fixture
def make_lazy(lazy_daemon: EmbeddedDaemon) -> Iterator[Callable[..., Sandbox]]:
    made: list[Sandbox] = []
    with Client(lazy_daemon.socket, timeout=600) as c:

        def make(env: str, **kwargs: object) -> Sandbox:
            sb = c.create(env, **kwargs)  # type: ignore[arg-type]
            made.append(sb)
            return sb

        yield make
        for sb in made:
            sb.remove(force=True)


def _holding(make_sandbox: Callable[..., Sandbox], mb: int) -> tuple[Sandbox, str]:
    sb = make_sandbox("bookworm")
    with sb.turn():
        sb.run(["sh", "-c", "cat > /tmp/hold.py"], stdin=HOLD.format(mb=mb))
        sb.session.run(
            "(setsid python3 /tmp/hold.py </dev/null >/dev/null 2>&1 &);"
            " until [ -e /tmp/hold.ready ]; do sleep 0.1; done"
        )
    return sb, _sum(sb)


def _sum(sb: Sandbox) -> str:
    out = sb.session.run(ASK + "sum")
    assert out.exit_code == 0, out.stderr
    return out.stdout.decode().strip()


def _log(d: EmbeddedDaemon, since: int) -> list[dict[str, Any]]:
    with open(d.log_file, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _logged(d: EmbeddedDaemon, since: int, msg: str, container: str, timeout_s: float = 0) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while True:
        for rec in _log(d, since):
            if rec.get("msg") == msg and rec.get("container") == container:
                return rec
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _size(d: EmbeddedDaemon) -> int:
    return d.log_file.stat().st_size


def test_restore_and_fork_serve_memory_lazily_and_bring_it_back_whole(
    lazy_daemon: EmbeddedDaemon, make_lazy: Callable[..., Sandbox]
) -> None:
    daemon = lazy_daemon
    sb, digest = _holding(make_lazy, 96)
    ck = sb.checkpoint(kind="full")
    since = _size(daemon)
    sb.restore(ck)
    cid = sb.refresh().container_id
    chosen = _logged(daemon, since, "restoring lazily", cid)
    assert chosen is not None, "the restore was not lazy"
    assert _sum(sb) == digest  # every page, read through the page server or after its push
    assert _logged(daemon, since, "lazy restore complete: every page delivered", cid, timeout_s=60)

    # A dump right after a lazy restore waits for the last pages, and brings back the same memory.
    again = sb.checkpoint(kind="full")
    sb.restore(again)
    assert _sum(sb) == digest

    since = _size(daemon)
    clones = sb.fork(3, ck)
    try:
        for clone in clones:
            assert _logged(daemon, since, "restoring lazily", clone.refresh().container_id)
            assert _sum(clone) == digest
    finally:
        for clone in clones:
            clone.remove(force=True)


def test_a_crashed_sandbox_is_recovered_lazily_with_its_memory_whole(
    lazy_daemon: EmbeddedDaemon, make_lazy: Callable[..., Sandbox]
) -> None:
    """Recovery after a sandbox crash goes through the same restore: lazily, and the memory comes back whole."""
    daemon = lazy_daemon
    sb = make_lazy("bookworm", recovery="auto")
    with sb.turn():
        sb.run(["sh", "-c", "cat > /tmp/hold.py"], stdin=HOLD.format(mb=96))
        sb.session.run(
            "(setsid python3 /tmp/hold.py </dev/null >/dev/null 2>&1 &);"
            " until [ -e /tmp/hold.ready ]; do sleep 0.1; done"
        )
    digest = _sum(sb)
    sb.checkpoint(kind="full")
    crashed = sb.refresh().container_id
    since = _size(daemon)
    kill_container(crashed)
    deadline = time.monotonic() + 60
    while not (sb.refresh().state == "running" and sb.info.container_id != crashed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.info.state == "running" and sb.info.container_id != crashed, sb.info
    assert _logged(daemon, since, "restoring lazily", sb.info.container_id), "the recovery was not lazy"
    assert _sum(sb) == digest


@pytest.mark.parametrize(
    ("fixtures", "mb", "why"),
    [
        (("lazy_daemon", "make_lazy"), 1, "lazy_min_bytes"),
        (("daemon", "make_sandbox"), 40, "unprivileged_userfaultfd"),
    ],
    ids=["small-image", "user-namespaced"],
)
def test_an_eager_restore_says_why(
    request: pytest.FixtureRequest, fixtures: tuple[str, str], mb: int, why: str
) -> None:
    """A small image (the page server would cost more than the copy), and a sandbox in a user namespace (CRIU
    cannot make userfaultfds there), restore eagerly, and crabd's log says why."""
    d: EmbeddedDaemon = request.getfixturevalue(fixtures[0])
    sb, digest = _holding(request.getfixturevalue(fixtures[1]), mb)
    ck = sb.checkpoint(kind="full")
    since = _size(d)
    sb.restore(ck)
    chosen = _logged(d, since, "restoring eagerly", sb.refresh().container_id)
    assert chosen is not None and why in chosen["reason"], chosen
    assert _sum(sb) == digest


def _daemons_of(cid: str) -> list[int]:
    """Pids of the ``criu lazy-pages`` daemon serving container ``cid``'s restore (by its work dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # CRIU itself, not the shell that waits for it (crabd/backends/criu/lazypages.py).
        if argv[0] != b"sh" and b"lazy-pages" in argv and any(a.endswith(cid.encode()) for a in argv):
            found.append(int(entry))
    return found


def test_a_page_server_killed_mid_service_takes_its_container_down(
    lazy_daemon: EmbeddedDaemon, make_lazy: Callable[..., Sandbox]
) -> None:
    """The daemon is SIGKILLed while it still pushes pages: the container is killed (its processes never run
    on zero pages) and its status says why."""
    daemon = lazy_daemon
    sb, _ = _holding(make_lazy, 640)
    ck = sb.checkpoint(kind="full")
    since = _size(daemon)
    sb.restore(ck)
    cid = sb.refresh().container_id
    pids = _daemons_of(cid)
    assert pids, "the page server had finished before the test could stop it (make the memory larger)"
    for pid in pids:  # stopped first: it cannot complete meanwhile, and is still serving when it dies
        os.kill(pid, signal.SIGSTOP)
    assert _logged(daemon, since, "lazy restore complete: every page delivered", cid) is None
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    failed = _logged(daemon, since, "lazy restore failed: container killed", cid, timeout_s=30)
    assert failed is not None and "killed by SIGKILL" in failed["error"]
    assert failed["guarded"] >= 1  # crabd held the userfaultfds: the processes waited, never read a zero page
    assert _logged(daemon, since, "lazy restore complete: every page delivered", cid) is None
    deadline = time.monotonic() + 30
    info = sb.refresh()
    while info.state != "dead" and time.monotonic() < deadline:
        time.sleep(0.2)
        info = sb.refresh()
    assert info.state == "dead" and "page server" in info.dead_reason, info


#: A stand-in for ``criu lazy-pages`` with a real userfaultfd: its child (the "restored process") registers an
#: anonymous area with one and hands it over; the stand-in, "listening", holds it until ``close`` exists, closes
#: it as CRIU does once that process's pages are all in, and tells the child to touch a page it never had.  It
#: goes on "serving" (another process, say) until killed.
STAND_IN = r"""#!{python}
import ctypes, fcntl, mmap, os, socket, struct, sys, time
work = sys.argv[5]
libc = ctypes.CDLL(None, use_errno=True)
a, b = socket.socketpair()
if os.fork() == 0:
    a.close()  # the stand-in's end: once it is gone, recv() below sees EOF and the child leaves, whatever happened
    area = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(area))
    uffd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)  # userfaultfd(2)
    assert uffd >= 0, ctypes.get_errno()
    fcntl.ioctl(uffd, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))  # UFFDIO_API
    fcntl.ioctl(uffd, 0xC020AA00, bytearray(struct.pack("QQQQ", start, 1 << 20, 1, 0)))  # UFFDIO_REGISTER, MISSING
    socket.send_fds(b, [b"u"], [uffd])
    os.close(uffd)
    if b.recv(1) != b"t":
        os._exit(1)
    area[5 * 4096] = 1  # a page the "dump" never held: waits while the range is armed and nobody reads
    open(os.path.join(work, "touched"), "w").close()
    os._exit(0)
b.close()
_, fds, _, _ = socket.recv_fds(a, 1, 1)
open(os.path.join(work, "lazy-pages.socket"), "w").close()
while not os.path.exists(os.path.join(work, "close")):
    time.sleep(0.005)
os.close(fds[0])
a.send(b"t")
while True:
    time.sleep(1)
"""


def test_crabds_copy_of_a_userfaultfd_goes_once_the_page_server_closed_its_own(tmp_path: Path) -> None:
    """CRIU closes a process's userfaultfd once all its pages are in, and counts on that close to unregister
    the ranges: the process's next fault on a page the dump never held then gets a zero page from the kernel.
    crabd's guard copy must go then too.  Held on, that fault (or a fork: its event needs a reader too) waits
    for a reader that never comes.  Seen in the benchmark: crab-init hung in ``handle_userfault``, CRIU
    spinning at 100% CPU on the closed descriptor's EBADF, a fork through crabd stuck for minutes."""
    fake = tmp_path / "criu"
    fake.write_text(STAND_IN.format(python=sys.executable))
    fake.chmod(0o755)
    work = tmp_path / "work"
    server = lazypages.PageServer(tmp_path, work, criu=str(fake))
    server.start()
    try:
        assert server.guard() == 1
        assert server.release_done() == 0  # still the daemon's: kept
        (work / "close").touch()
        deadline = time.monotonic() + 20
        while not (work / "touched").exists():
            assert time.monotonic() < deadline, "the process hung on a range crabd kept armed"
            server.release_done()  # what the watch does every RELEASE_POLL_S
            time.sleep(lazypages.RELEASE_POLL_S)
        assert server.released == 1
    finally:
        server.close()


def _kept_lazy(base: Path) -> EmbeddedDaemon:
    """A crabd on ``base`` that outlives a kill -9, its sandboxes without a user namespace."""
    cfg = base / "crabd.toml"
    cfg.write_text(f'[runtime]\nuserns = false\n[network]\nname = "{KEPT_NET}"\n')
    d = EmbeddedDaemon(state_dir=base, ephemeral=False, extra_args=["--config", str(cfg)])
    d.start()
    return d


KEPT_NET = "crablzk"


@pytest.mark.parametrize("server_dies_too", [False, True], ids=["server-completes", "server-killed"])
def test_crabd_killed_during_a_lazy_restore_vouches_for_the_memory_or_kills_the_sandbox(
    kept_state: Path, server_dies_too: bool
) -> None:
    """crabd is kill -9ed while a restore's pages are still being served.  The page server lives on (its own
    session; ``KillMode=process``): if it completes, the next crabd finds its last log line and the sandbox
    runs on with its whole memory; if it died too, nothing vouches for the memory and the next crabd kills
    the sandbox, saying why."""
    d = _kept_lazy(kept_state)
    try:
        with Client(d.socket, timeout=600) as c:
            sb, digest = _holding(c.create, 640)
            ck = sb.checkpoint(kind="full")
            sb.restore(ck)
            cid = sb.refresh().container_id
            pids = _daemons_of(cid)
            name = sb.name
        assert pids, "the page server had finished before crabd could be killed (make the memory larger)"
        for pid in pids:  # held still: crabd dies while it still serves
            os.kill(pid, signal.SIGSTOP)
        d.kill()
        for pid in pids:  # then it dies too, or goes on and completes with no crabd to watch it
            os.kill(pid, signal.SIGKILL if server_dies_too else signal.SIGCONT)
        d.start()
        d.wait_settled()
        with Client(d.socket, timeout=600) as c:
            again = c.get(name)
            if server_dies_too:
                deadline = time.monotonic() + 30
                info = again.refresh()
                while info.state != "dead" and time.monotonic() < deadline:
                    time.sleep(0.2)
                    info = again.refresh()
                assert info.state == "dead" and "in flight when crabd stopped" in info.dead_reason, info
            else:
                info = again.refresh()
                assert info.state == "running", info.dead_reason
                assert _sum(again) == digest
            again.remove(force=True)
    finally:
        d.close()
        remove_sandbox_network(KEPT_NET)
