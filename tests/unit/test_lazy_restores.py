"""Lazy restores without CRIU: the choice and its reasons, the daemon's log read, and the watch's order
(a failed page server kills the container before its userfaultfd copies go; a clean end kills nothing; a copy
goes once the running daemon closed its own)."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.criu import lazypages
from crabd.backends.runc.lazy_restores import LazyRestores
from crabd.errors import CriuError
from crabd.util import libc

MIB = 1 << 20


def test_the_choice_says_why() -> None:
    lazy = lazypages.choose(enabled=True, page_bytes=200 * MIB, min_bytes=32 * MIB, unsupported="")
    assert lazy.lazy and str(200 * MIB) in lazy.reason
    off = lazypages.choose(enabled=False, page_bytes=200 * MIB, min_bytes=32 * MIB, unsupported="")
    assert not off.lazy and "lazy_restore" in off.reason
    small = lazypages.choose(enabled=True, page_bytes=MIB, min_bytes=32 * MIB, unsupported="")
    assert not small.lazy and "lazy_min_bytes" in small.reason
    host = lazypages.choose(enabled=True, page_bytes=200 * MIB, min_bytes=0, unsupported="no uffd")
    assert not host.lazy and "no uffd" in host.reason


def test_page_bytes_count_pages_images_only(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(b"x" * 4096)
    (tmp_path / "pages-2.img").write_bytes(b"x" * 8192)
    (tmp_path / "pagemap-1.img").write_bytes(b"x" * 100)
    (tmp_path / "pages-3.img.tmp").write_bytes(b"x" * 100)
    (tmp_path / "pages-9.img").symlink_to("/etc/hostname")  # a link is no page file
    assert lazypages.page_bytes(tmp_path) == 12288


def test_completed_means_the_daemon_exited_0(tmp_path: Path) -> None:
    assert not lazypages.completed(tmp_path)  # no status yet: still serving, or gone without one
    (tmp_path / lazypages.STATUS).write_text("137\n")
    assert not lazypages.completed(tmp_path)
    (tmp_path / lazypages.STATUS).write_text("0\n")
    assert lazypages.completed(tmp_path)
    (tmp_path / lazypages.PIDFILE).write_text("1234\n")
    assert lazypages.daemon_pid(tmp_path) == 1234
    (tmp_path / lazypages.PIDFILE).write_text("12; rm -rf /\n")
    assert lazypages.daemon_pid(tmp_path) is None


def test_the_supervisor_records_the_daemons_exit_status(tmp_path: Path) -> None:
    """The one-line shell around the daemon, run on stand-ins for it (argv passed as data, never as text)."""
    import subprocess

    for argv, status in ((["true"], "0"), (["sh", "-c", "exit 3"], "3"), (["echo", "$(touch pwned)"], "0")):
        subprocess.run(["sh", "-c", lazypages._SUPERVISOR, "sh", *argv], cwd=tmp_path, check=False, capture_output=True)
        assert (tmp_path / lazypages.STATUS).read_text().strip() == status
    assert not (tmp_path / "pwned").exists()


def test_a_failure_quotes_the_daemons_errors(tmp_path: Path) -> None:
    server = lazypages.PageServer(tmp_path, tmp_path)
    (tmp_path / lazypages.LOG).write_text("(00.1) fine\n(00.2) Error (criu/uffd.c:1): can't read pages\n(00.3) bye\n")
    assert "can't read pages" in server.failure()
    (tmp_path / lazypages.LOG).unlink()
    assert "no log" in server.failure()


class _Server:
    """Stands in for a PageServer: ends with ``code`` when told to."""

    def __init__(self, events: list[str], code: int, *, guard_fails: bool = False) -> None:
        self.events, self.code, self.guard_fails = events, code, guard_fails
        self.started_at = 0.0
        self.guarded = 1
        self.released = 0
        self.ended = threading.Event()

    def guard(self) -> int:
        if self.guard_fails:
            raise CriuError("holds no userfaultfd", log_path=None, log_excerpt="")
        self.events.append("guard")
        return 1

    def wait(self, timeout_s: float | None = None) -> int:
        self.ended.wait(10)
        return self.code

    def failure(self) -> str:
        return "Error: page read failed"

    def close(self) -> None:
        self.events.append("close")
        self.ended.set()


def _restores(events: list[str]) -> LazyRestores:
    def remove_dirs(cid: str) -> list[str]:
        events.append(f"remove {cid}")
        return []

    return LazyRestores(lambda cid: events.append(f"kill {cid}"), remove_dirs)


def _watched(code: int, **kw: Any) -> tuple[LazyRestores, list[str], _Server]:
    events: list[str] = []
    lazy = _restores(events)
    server = _Server(events, code, **kw)
    lazy.watch("c1", server)  # type: ignore[arg-type]
    return lazy, events, server


def test_every_page_delivered_ends_the_watch_without_a_kill() -> None:
    lazy, events, server = _watched(0)
    assert lazy.serving("c1")
    server.ended.set()
    lazy.settled("c1", timeout_s=10)
    assert events == ["guard", "close", "remove c1"]
    assert not lazy.serving("c1") and lazy.failure("c1") == ""


def test_a_failed_page_server_kills_the_container_before_its_copies_close() -> None:
    lazy, events, server = _watched(1)
    server.ended.set()
    lazy.settled("c1", timeout_s=10)
    assert events == ["guard", "kill c1", "close", "remove c1"]
    assert "page read failed" in lazy.failure("c1")


def test_an_unguardable_restore_is_killed_at_once() -> None:
    lazy, events, _ = _watched(0, guard_fails=True)
    assert events == ["kill c1", "close", "remove c1"]
    assert "could not be guarded" in lazy.failure("c1")


def test_removing_the_container_is_no_failure() -> None:
    lazy, events, _ = _watched(-9)
    lazy.stop("c1")
    assert events[:3] == ["guard", "kill c1", "close"] and events[-1] == "remove c1"
    assert events.count("kill c1") == 1 and lazy.failure("c1") == ""


@pytest.mark.parametrize(
    ("status", "running", "expected"),
    [
        ("0", True, ["remove c1"]),
        ("137", True, ["kill c1", "remove c1"]),
        (None, True, ["kill c1", "remove c1"]),
        ("137", False, ["remove c1"]),
    ],
)
def test_a_restore_left_in_flight_by_a_dead_crabd_is_vouched_for_by_its_exit_status_alone(
    tmp_path: Path, status: str | None, running: bool, expected: list[str]
) -> None:
    (tmp_path / lazypages.LOG).write_text("(00.1) some log\n")
    if status is not None:
        (tmp_path / lazypages.STATUS).write_text(status + "\n")
    (tmp_path / lazypages.PIDFILE).write_text("999999999\n")  # no such process
    events: list[str] = []
    lazy = _restores(events)
    lazy.adopt("c1", tmp_path, running=running)
    assert events == expected
    assert bool(lazy.failure("c1")) == ("kill c1" in expected)


def test_a_failed_lazy_launch_runs_again_eagerly_and_a_good_one_is_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crabd.backends.runc.launch import Restore
    from crabd.errors import ContainerRuntimeError

    events: list[str] = []
    servers: list[_Server] = []

    def new_server(images: Path, work: Path) -> _Server:
        server = _Server(events, 0)
        server.start = lambda: events.append("listen")  # type: ignore[attr-defined]
        servers.append(server)
        return server

    monkeypatch.setattr(lazypages, "unsupported", lambda criu: "")
    monkeypatch.setattr(lazypages, "page_bytes", lambda d: 200 * MIB)
    monkeypatch.setattr(lazypages, "PageServer", new_server)
    lazy = LazyRestores(lambda cid: events.append(f"kill {cid}"), lambda cid: [], enabled=True)
    restore = Restore(tmp_path, tmp_path)

    done: Any = "launched"

    def failing_when_lazy(*, restore: Restore) -> Any:
        lazy_pages = restore.options is not None and restore.options.lazy_pages
        events.append("run lazy" if lazy_pages else "run eager")
        if lazy_pages:
            raise ContainerRuntimeError("criu said no", container="c1")
        return "launched"

    assert lazy.launch("c1", restore, failing_when_lazy, userns=False) is done
    assert events == ["listen", "run lazy", "close", "run eager"] and not lazy.serving("c1")

    events.clear()
    assert lazy.launch("c2", restore, lambda *, restore: done, userns=False) is done
    assert events == ["listen", "guard"] and lazy.serving("c2")
    servers[-1].ended.set()
    lazy.settled("c2", timeout_s=10)
    assert not lazy.serving("c2")

    events.clear()
    monkeypatch.setattr(lazypages, "userns_unsupported", lambda: "no uffd in a userns")
    assert lazy.launch("c3", restore, lambda *, restore: restore.options, userns=True) is None  # eager as given
    assert events == []


def test_exit_statuses_in_words() -> None:
    assert lazypages.describe_exit(1) == "exit 1"
    assert lazypages.describe_exit(137) == "killed by SIGKILL"  # the supervising shell's way
    assert lazypages.describe_exit(-9) == "killed by SIGKILL"  # the shell itself killed
    assert lazypages.describe_exit(128 + 99) == "killed by signal 99"


def _fake_criu(tmp_path: Path, then: str) -> str:
    """A stand-in for ``criu lazy-pages``: listens (makes the socket file), logs an error line, then ``then``."""
    path = tmp_path / "fake-criu"
    path.write_text(
        "#!/bin/sh\n# argv: lazy-pages --images-dir I --work-dir W -o LOG -v2\n"
        f'touch "$5/{lazypages.SOCKET}"; echo "(00.1) Error (fake): page read failed" > "$5/{lazypages.LOG}"\n'
        f"{then}\n"
    )
    path.chmod(0o755)
    return str(path)


def test_a_page_server_is_supervised_and_closing_it_leaves_no_zombie(tmp_path: Path) -> None:
    """Real processes, no CRIU: the server listens, holds no userfaultfd (refused as unguardable), and
    close() kills it, lets the shell reap it and record its status."""
    work = tmp_path / "work"
    server = lazypages.PageServer(tmp_path, work, criu=_fake_criu(tmp_path, "exec sleep 60"))
    server.start()
    daemon = server._daemon_pid
    assert daemon is not None and lazypages.daemon_pid(work) == server.pid
    with pytest.raises(CriuError, match="holds no userfaultfd"):
        server.guard()
    server.close()
    assert not Path(f"/proc/{daemon}").exists()  # reaped, not a zombie
    assert (work / lazypages.STATUS).read_text().strip() == "137" and not lazypages.completed(work)
    assert "page read failed" in server.failure()


def test_a_page_server_that_delivered_everything_exits_0(tmp_path: Path) -> None:
    work = tmp_path / "work"
    server = lazypages.PageServer(tmp_path, work, criu=_fake_criu(tmp_path, "exit 0"))
    server.start()
    assert server.wait(10) == 0 and server.guard() == 0
    server.close()
    assert lazypages.completed(work)


def test_a_restore_left_in_flight_is_adopted_once_though_it_has_two_dirs(tmp_path: Path) -> None:
    from crabd.backends.runc.cli import RuncStatus
    from crabd.backends.runc.restore_dirs import RestoreDirs

    dirs = RestoreDirs(tmp_path)
    images, work = dirs.of("c1")
    images.mkdir(parents=True)
    work.mkdir(parents=True)
    (work / lazypages.LOG).write_text("(00.1) some log\n")  # no status: never completed, no daemon left

    class _Runc:
        def state(self, cid: str) -> Any:
            return type("St", (), {"status": RuncStatus.RUNNING})()

    events: list[str] = []
    lazy = _restores(events)
    lazy.adopt_all(dirs, lambda cid: True, _Runc())  # type: ignore[arg-type]
    assert events == ["kill c1", "remove c1"]


def _wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _holding(tmp_path: Path) -> lazypages.PageServer:
    """A stand-in daemon holding descriptors 7 and 8, which closes 8 once ``close8`` exists; crabd's copies of both
    taken as :meth:`guard` takes them of userfaultfds."""
    then = 'exec 7</dev/null 8</dev/null; while [ ! -e "$5/close8" ]; do sleep 0.01; done; exec 8<&-; exec sleep 60'
    server = lazypages.PageServer(tmp_path, tmp_path / "work", criu=_fake_criu(tmp_path, then))
    server.start()
    assert server._daemon_fd is not None and server._daemon_pid is not None
    _wait_for(lambda: Path(f"/proc/{server._daemon_pid}/fd/8").exists(), "the stand-in did not open its fds")
    server._guards = [(n, libc.pidfd_getfd(server._daemon_fd, n)) for n in (7, 8)]
    return server


def test_a_copy_goes_once_the_running_daemon_closed_its_own_and_not_before(tmp_path: Path) -> None:
    server = _holding(tmp_path)
    try:
        copy8 = server._guards[1][1]
        assert server.release_done() == 0 and server.release_done() == 0  # both still held
        (tmp_path / "work" / "close8").touch()
        _wait_for(lambda: not Path(f"/proc/{server._daemon_pid}/fd/8").exists(), "fd 8 still open")
        assert server.release_done() == 0  # missing once: not yet (a failing daemon closes them just before it exits)
        assert server.release_done() == 1 and server.released == 1
        assert [orig for orig, _ in server._guards] == [7]
        with pytest.raises(OSError):
            os.fstat(copy8)  # closed: CRIU's close now unregisters that process's ranges
    finally:
        server.close()


def test_the_copies_of_a_daemon_that_died_stay_until_the_container_is_killed(tmp_path: Path) -> None:
    server = _holding(tmp_path)
    try:
        assert server._daemon_fd is not None
        signal.pidfd_send_signal(server._daemon_fd, signal.SIGKILL)
        assert server.wait(10) == 137
        assert server.release_done() == 0 and server.release_done() == 0
        assert len(server._guards) == 2  # a fault now waits: never a zero page
    finally:
        server.close()


def test_a_kcmp_that_fails_otherwise_than_ebadf_proves_nothing_and_the_copies_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSYS (a machine whose syscall number crab does not know), EPERM: the originals may still be held, and
    a copy let go while the daemon serves could hand the process a zero page."""
    server = _holding(tmp_path)
    try:

        def refused(*args: int) -> bool:
            raise OSError(errno.ENOSYS, "kcmp")

        monkeypatch.setattr(libc, "kcmp_file", refused)
        assert server.release_done() == 0 and server.release_done() == 0
        assert len(server._guards) == 2
    finally:
        server.close()
