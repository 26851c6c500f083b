"""Running containers' statuses kept while their init lives (crabd/coordinator/livestatus.py), on real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from crabd.backends.sandbox import ContainerStatus
from crabd.coordinator.livestatus import RunningStatus


@pytest.fixture
def init() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for a container's init."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc
    proc.kill()
    proc.wait()


def running(pid: int) -> ContainerStatus:
    return ContainerStatus(exists=True, running=True, pid=pid, ip_address="10.0.0.2")


def test_kept_while_the_init_lives_and_asked_again_once_it_exits(init: subprocess.Popen[bytes]) -> None:
    reads: list[str] = []

    def read(cid: str) -> ContainerStatus:
        reads.append(cid)
        return running(init.pid) if init.poll() is None else ContainerStatus(exists=True, running=False)

    live = RunningStatus()
    assert live.get("c1") is None
    assert live.read("c1", read) == running(init.pid)
    assert reads == ["c1", "c1"]  # the second read confirms the pidfd is the init's
    assert live.get("c1") == running(init.pid) and live.exited() == []
    init.kill()
    init.wait()
    assert live.exited() == ["c1"]
    assert live.get("c1") is None and len(live) == 0  # the caller asks the runtime again
    assert live.exited() == []
    live.close()


def test_not_kept_when_the_second_read_disagrees(init: subprocess.Popen[bytes]) -> None:
    """The runtime's second answer names another init (a restart in between): nothing is kept."""
    live = RunningStatus()
    other = ContainerStatus(exists=True, running=True, pid=init.pid + 1)
    answers = iter([running(init.pid), other])
    assert live.read("c1", lambda cid: next(answers)) == other
    assert live.get("c1") is None and len(live) == 0


def test_a_stopped_or_gone_container_is_never_kept() -> None:
    live = RunningStatus()
    stopped = ContainerStatus(exists=True, running=False, exit_code=0)
    reads: list[str] = []

    def stopped_once(cid: str) -> ContainerStatus:
        reads.append(cid)
        return stopped

    assert live.read("c1", stopped_once) == stopped and reads == ["c1"]  # no second read
    gone = ContainerStatus(exists=False)
    answers = iter([running(2**22 + 12345), gone])  # no such pid: the runtime is asked again
    assert live.read("c2", lambda cid: next(answers)) == gone
    assert len(live) == 0


def test_drop_forgets_and_closes(init: subprocess.Popen[bytes]) -> None:
    live = RunningStatus()
    live.read("c1", lambda cid: running(init.pid))
    live.drop("c1")
    assert live.get("c1") is None and live.exited() == []
    init.kill()
    init.wait()
    assert live.exited() == []


def test_a_socket_made_after_its_caller_timed_out_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket thread may finish a connection the caller no longer waits for: it must not leak."""
    import asyncio
    import concurrent.futures
    import socket

    from crabd.runtime import initsocket
    from crabd.util import netns
    from crabd.util.netns import Netns

    made: concurrent.futures.Future[list[socket.socket]] = concurrent.futures.Future()
    made.set_running_or_notify_cancel()  # the socket thread took the job: it can no longer be cancelled
    monkeypatch.setattr(netns.sockets, "submit", lambda ns, make: made)
    with pytest.raises(TimeoutError):
        asyncio.run(initsocket.socket_in_netns(Netns(1, "c"), "crab-init", 0.05))
    late, other = socket.socketpair()
    made.set_result([late])  # one namespace entry makes a batch (netns.spares): the first was the caller's
    assert late.fileno() == -1  # closed
    other.close()
