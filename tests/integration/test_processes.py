"""Process checkpoints (issue 5): the state matrix, each case checked from inside the sandbox.

Every case takes a full checkpoint (CRIU dump + filesystem delta, one cut),
then changes, kills or crashes the sandbox, then restores, recovers or
forks it, and checks that the live state came back.  Helper programs poll a
trigger file, so the test can ask a restored process to act.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from crabd.backends.criu import hotimages
from crabd.sdk import Client, CriuError, EmbeddedDaemon, IncompleteDump, Sandbox
from tests.integration import conftest
from tests.integration.conftest import daemon_with_config

pytestmark = pytest.mark.criu

PROGRAMS = {
    "repl": r"""
import os, socket, time
secret = os.urandom(16).hex()            # lives only in this process's memory
asked = 0
srv = socket.socket(socket.AF_UNIX); srv.bind("/tmp/repl.sock"); srv.listen()
while True:
    c, _ = srv.accept()
    asked += 1
    c.sendall(f"{secret} {asked}".encode()); c.close()
""",
    "sqlite": r"""
import os, sqlite3, time
db = sqlite3.connect("/tmp/t.db", isolation_level=None)
db.execute("PRAGMA journal_mode=WAL"); db.execute("CREATE TABLE t(n INTEGER)")
for i in range(100): db.execute("INSERT INTO t VALUES(?)", (i,))
open("/tmp/sqlite.ready", "w").write("1")
while True:
    if os.path.exists("/tmp/sqlite.go"):
        n = int(open("/tmp/sqlite.go").read()); os.unlink("/tmp/sqlite.go")
        for i in range(n): db.execute("INSERT INTO t VALUES(?)", (1000 + i,))
        open("/tmp/sqlite.done", "w").write(str(db.execute("SELECT count(*) FROM t").fetchone()[0]))
    time.sleep(0.05)
""",
    "producer": r"""
import sys, time
i = 0
while True:
    i += 1; sys.stdout.write(f"{i}\n"); sys.stdout.flush(); time.sleep(0.02)
""",
    "consumer": r"""
import sys
for line in sys.stdin:
    open("/tmp/pipe.last.tmp", "w").write(line); __import__("os").replace("/tmp/pipe.last.tmp", "/tmp/pipe.last")
""",
    "fiforeader": r"""
import os
os.mkfifo("/tmp/ff")
keep = os.open("/tmp/ff", os.O_RDWR)      # holds the fifo open, like a long-lived writer
with open("/tmp/ff") as f:
    open("/tmp/fifo.ready", "w").write("1")
    for line in f:
        open("/tmp/fifo.out", "a").write(line)
""",
    "ghost": r"""
import os, time
fd = os.open("/tmp/ghost", os.O_RDWR | os.O_CREAT)
os.write(fd, b"content of a deleted file"); os.unlink("/tmp/ghost")
open("/tmp/ghost.ready", "w").write("1")
while not os.path.exists("/tmp/ghost.go"): time.sleep(0.05)
open("/tmp/ghost.out", "wb").write(os.pread(fd, 100, 0))
time.sleep(10**6)
""",
    "mmapped": r"""
import mmap, os, time
with open("/tmp/mm", "wb") as f: f.write(b"." * 4096)
f = open("/tmp/mm", "r+b"); m = mmap.mmap(f.fileno(), 4096)
m[:6] = b"before"; m.flush()
open("/tmp/mm.ready", "w").write("1")
while not os.path.exists("/tmp/mm.go"): time.sleep(0.05)
m[6:11] = b"after"; m.flush()
open("/tmp/mm.done", "w").write("1")
time.sleep(10**6)
""",
    "threads": r"""
import threading, time, os
counts = [0, 0, 0, 0]
def work(i):
    while True: counts[i] += 1; time.sleep(0.01)
for i in range(4): threading.Thread(target=work, args=(i,), daemon=True).start()
while True:
    open("/tmp/threads.tmp", "w").write(" ".join(map(str, counts))); os.replace("/tmp/threads.tmp", "/tmp/threads")
    time.sleep(0.05)
""",
    "zombie": r"""
import os, time
pid = os.fork()
if pid == 0: os._exit(7)
open("/tmp/zombie.pid", "w").write(str(pid))
while not os.path.exists("/tmp/zombie.go"): time.sleep(0.05)
got, status = os.waitpid(pid, 0)
open("/tmp/zombie.out", "w").write(f"{got} {os.WEXITSTATUS(status)}")
time.sleep(10**6)
""",
    "echoserver": r"""
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 9000)); s.listen()
def serve(c):
    while (d := c.recv(100)): c.sendall(b"echo:" + d)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
""",
    "tcpclient": r"""
import os, socket, sys, time
loop = socket.create_connection(("127.0.0.1", 9000))
outside = socket.create_connection((sys.argv[1], int(sys.argv[2])))
open("/tmp/tcp.ready", "w").write("1")
n = 0
while True:
    n += 1; loop.sendall(b"ping"); r = loop.recv(100)
    open("/tmp/loop.tmp", "w").write(f"{n} {r.decode()}"); os.replace("/tmp/loop.tmp", "/tmp/loop")
    try:
        outside.sendall(b"x"); state = "open"
    except OSError as e:
        state = f"closed:{e.errno}"
    # Replaced, never rewritten in place: a reader must never see it empty.
    open("/tmp/outside.tmp", "w").write(state); os.replace("/tmp/outside.tmp", "/tmp/outside")
    time.sleep(0.1)
""",
}


def install(sb: Sandbox) -> None:
    sb.run(["mkdir", "-p", "/opt/t"])
    for name, src in PROGRAMS.items():
        sb.run(["sh", "-c", f"cat > /opt/t/{name}.py"], stdin=src)


def wait_file(sb: Sandbox, path: str, timeout: float = 20.0) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = sb.run(["cat", path])
        if r.exit_code == 0 and r.stdout:
            return r.stdout
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear in {sb.name}")


def wait_advanced(
    sb: Sandbox, path: str, before: bytes, advanced: Callable[[bytes, bytes], bool], timeout: float = 20.0
) -> bytes:
    """``path``'s content once ``advanced(before, now)`` holds: a job shown to run on, however loaded the host."""
    deadline = time.monotonic() + timeout
    now = b""
    while time.monotonic() < deadline:
        now = sb.run(["cat", path]).stdout
        if now and advanced(before, now):
            return now
        time.sleep(0.1)
    raise AssertionError(f"{path} in {sb.name} did not move on from {before!r} (last: {now!r})")


def _first_grew(before: bytes, now: bytes) -> bool:
    return int(now.split()[0]) > int(before.split()[0])


def kill_container(sb: Sandbox) -> None:
    conftest.kill_container(sb.refresh().container_id)
    deadline = time.monotonic() + 30
    while sb.refresh().state != "dead" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.info.state == "dead"


@pytest.fixture
def sbx(make_sandbox: Callable[..., Sandbox]) -> Callable[..., Sandbox]:
    def make(**kw: Any) -> Sandbox:
        # These tests take their checkpoints explicitly; turn ends take files only
        # (the inspector's own tests cover the "auto" policy).
        kw.setdefault("checkpoints", "fs")
        sb = make_sandbox("bookworm", **kw)
        install(sb)
        return sb

    return make


def test_background_job_in_the_session(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        # Written aside and renamed: a reader never sees the file truncated and empty.
        sb.session.run(
            "cd /tmp; export MARK=kept; "
            "(while true; do date +%s%N > /tmp/tick.new; mv /tmp/tick.new /tmp/tick; sleep 0.05; done) &"
        )
    ck = sb.checkpoint(kind="full")
    assert ck.kind == "full"
    sb.session.run("kill %1; wait; cd / && unset MARK")
    sb.restore(ck)
    r = sb.session.run("echo $MARK $PWD; jobs -p | wc -l")
    assert r.stdout == b"kept /tmp\n1\n"
    first = wait_file(sb, "/tmp/tick")
    wait_advanced(sb, "/tmp/tick", first, _first_grew)  # the job runs on


def test_daemonized_http_server_in_every_fork(client: Client, sbx: Callable[..., Sandbox]) -> None:
    sb = sbx(network=True)
    with sb.turn():
        sb.session.run("(setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null &)")
        # Listening once it answers (a fixed sleep was too short for Python's start on a loaded host).
        probe = "for i in $(seq 300); do (: >/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; sleep 0.05; done; exit 1"
        r = sb.run(["bash", "-c", probe])
        assert r.exit_code == 0, "the server never listened"
    parent_ip = sb.refresh().ip_address
    assert urllib.request.urlopen(f"http://{parent_ip}:8000/", timeout=10).status == 200
    ck = sb.checkpoint(kind="full")
    clones = sb.fork(2, ck)
    try:
        ips = {c.info.ip_address for c in clones}
        assert len(ips) == 2 and parent_ip not in ips
        for c in clones:  # the server the parent had listens in each clone, on the clone's own IP
            assert urllib.request.urlopen(f"http://{c.info.ip_address}:8000/", timeout=10).status == 200
        assert urllib.request.urlopen(f"http://{parent_ip}:8000/", timeout=10).status == 200
    finally:
        for c in clones:
            c.remove()


#: Asks the REPL (/opt/t/repl.py) for its secret and how many questions it has answered.
ASK_REPL = (
    "python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.connect('/tmp/repl.sock'); "
    'print(s.recv(99).decode())"'
)


def start_repl(sb: Sandbox) -> tuple[bytes, bytes]:
    """Start the REPL in the session (one turn); its secret and answer count."""
    with sb.turn():
        sb.session.run("python3 /opt/t/repl.py & sleep 0.5")
    secret, n = sb.session.run(ASK_REPL).stdout.split()
    return secret, n


def test_interpreter_memory_survives_a_crash(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    ask = ASK_REPL
    secret, n = start_repl(sb)
    ck = sb.checkpoint(kind="full")
    sb.session.run(ask)  # one more question after the checkpoint: lost with the crash
    kill_container(sb)
    done = sb.recover()
    assert done.checkpoint == ck.id and done.kind == "full"
    again, m = sb.session.run(ask).stdout.split()
    assert again == secret and int(m) == int(n) + 1  # same memory, as of the checkpoint


def test_sqlite_wal_with_an_open_connection(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/sqlite.py &")
    wait_file(sb, "/tmp/sqlite.ready")
    ck = sb.checkpoint(kind="full")
    sb.run(["sh", "-c", "echo 50 > /tmp/sqlite.go"])
    assert wait_file(sb, "/tmp/sqlite.done") == b"150"
    sb.restore(ck)
    count = (
        "python3 -c \"import sqlite3; d=sqlite3.connect('/tmp/t.db'); "
        "print(d.execute('select count(*) from t').fetchone()[0], d.execute('pragma integrity_check').fetchone()[0])\""
    )
    assert sb.run(["sh", "-c", count]).stdout == b"100 ok\n"
    sb.run(["sh", "-c", "echo 7 > /tmp/sqlite.go"])  # the restored process's connection still works
    assert wait_file(sb, "/tmp/sqlite.done", timeout=60) == b"107"  # a loaded host: the restored process is slow


def test_processes_joined_by_a_pipe_in_a_fork(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/producer.py | python3 /opt/t/consumer.py &")
    wait_file(sb, "/tmp/pipe.last")
    ck = sb.checkpoint(kind="full")
    [clone] = sb.fork(1, ck)
    try:
        first = wait_file(clone, "/tmp/pipe.last")
        wait_advanced(clone, "/tmp/pipe.last", first, _first_grew)
    finally:
        clone.remove()


def test_a_fifo_with_its_reader(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/fiforeader.py &")
    wait_file(sb, "/tmp/fifo.ready")
    ck = sb.checkpoint(kind="full")
    sb.session.run("kill %1")
    sb.restore(ck)
    sb.run(["sh", "-c", "echo through the fifo > /tmp/ff"])
    assert wait_file(sb, "/tmp/fifo.out") == b"through the fifo\n"


def test_a_deleted_but_open_file(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/ghost.py &")
    wait_file(sb, "/tmp/ghost.ready")
    ck = sb.checkpoint(kind="full")
    kill_container(sb)
    assert sb.recover().checkpoint == ck.id
    sb.run(["touch", "/tmp/ghost.go"])
    assert wait_file(sb, "/tmp/ghost.out") == b"content of a deleted file"


def test_an_mmapped_file(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/mmapped.py &")
    wait_file(sb, "/tmp/mm.ready")
    ck = sb.checkpoint(kind="full")
    sb.session.run("kill %1; rm /tmp/mm")
    sb.restore(ck)
    sb.run(["touch", "/tmp/mm.go"])
    wait_file(sb, "/tmp/mm.done")
    assert sb.run(["head", "-c", "11", "/tmp/mm"]).stdout == b"beforeafter"


def test_a_multithreaded_process_in_a_fork(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/threads.py &")
    wait_file(sb, "/tmp/threads")
    ck = sb.checkpoint(kind="full")
    [clone] = sb.fork(1, ck)
    try:
        before = wait_file(clone, "/tmp/threads")

        def all_grew(was: bytes, now: bytes) -> bool:
            return all(int(a) > int(b) for a, b in zip(now.split(), was.split(), strict=True))

        wait_advanced(clone, "/tmp/threads", before, all_grew)  # all four threads run
        assert clone.run(["ps", "-o", "nlwp=", "-C", "python3"]).stdout.strip() == b"5"
    finally:
        clone.remove()


def test_a_zombie_child(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("python3 /opt/t/zombie.py &")
    child = wait_file(sb, "/tmp/zombie.pid").decode()
    assert sb.run(["ps", "-o", "stat=", "-p", child]).stdout.strip().startswith(b"Z")
    ck = sb.checkpoint(kind="full")
    sb.session.run("kill %1")
    sb.restore(ck)
    assert sb.run(["ps", "-o", "stat=", "-p", child]).stdout.strip().startswith(b"Z")
    sb.run(["touch", "/tmp/zombie.go"])
    assert wait_file(sb, "/tmp/zombie.out") == f"{child} 7".encode()


def test_a_sleep_midway(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        pid = sb.session.run("sleep 4 & echo $!").stdout.strip().decode()
    time.sleep(1.0)
    ck = sb.checkpoint(kind="full")
    sb.session.run("kill %1")
    sb.restore(ck)
    assert sb.run(["kill", "-0", pid]).exit_code == 0  # still sleeping
    r = sb.session.run(f"wait {pid}; echo $?", timeout=20)
    assert r.stdout == b"0\n"  # and it finishes normally


def _docker0_address() -> str:
    return (
        subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True, text=True, timeout=60)
        .stdout.split()[3]
        .split("/")[0]
    )


@pytest.fixture(scope="module", params=conftest.BACKENDS)
def daemon(request: pytest.FixtureRequest) -> Iterator[EmbeddedDaemon]:
    """This module's crabd, once per backend: sandboxes may reach the host's docker0 address (``outside_listener``).

    Sandboxes are kept from the host's services by default; the "outside"
    connection below needs a peer outside the sandbox, so that one address is
    allowed (on a network of this module's own, so no other daemon's rules change).
    """
    toml = conftest.backend_toml(request.param, "crabproc") + f'allow = ["{_docker0_address()}/32"]\n'
    with daemon_with_config(toml, "crabproc") as d:
        yield d


@pytest.fixture
def outside_listener() -> Iterator[tuple[str, int]]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            conns.append(c)

    threading.Thread(target=accept, daemon=True).start()
    # A host address the module's daemon lets sandboxes reach.
    yield _docker0_address(), srv.getsockname()[1]
    srv.close()
    for c in conns:
        c.close()


def test_loopback_connections_survive_and_outside_ones_close(
    sbx: Callable[..., Sandbox], outside_listener: tuple[str, int]
) -> None:
    host, port = outside_listener
    sb = sbx(network=True)
    with sb.turn():
        sb.session.run(f"python3 /opt/t/echoserver.py & sleep 0.5; python3 /opt/t/tcpclient.py {host} {port} &")
    wait_file(sb, "/tmp/tcp.ready")
    assert wait_file(sb, "/tmp/outside") == b"open"
    ck = sb.checkpoint(kind="full")
    [clone] = sb.fork(1, ck)  # a new IP: the outside connection cannot follow
    try:
        first = wait_file(clone, "/tmp/loop")
        later = wait_advanced(clone, "/tmp/loop", first, _first_grew).split()
        assert later[1] == b"echo:ping"  # the loopback connection lives on
        assert wait_file(clone, "/tmp/outside").startswith(b"closed:")
        assert sb.run(["cat", "/tmp/outside"]).stdout == b"open"  # the parent keeps its connection
    finally:
        clone.remove()


def test_every_process_must_be_in_the_dump(client: Client, sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    cid = sb.refresh().container_id
    outsider = conftest.exec_outside_init(cid, ["sleep", "300"])
    try:
        time.sleep(1.0)
        with pytest.raises(IncompleteDump) as info:
            sb.checkpoint(kind="full")
        assert "sleep" in info.value.message and info.value.pids
        assert sb.run(["true"]).exit_code == 0  # the sandbox keeps running, thawed
        assert all(c.kind != "full" for c in sb.checkpoints())
        [failure] = [f for f in client.checkpoint_failures(sb.id) if f.kind == "full"]
        assert "outside its init's process tree" in failure.error
    finally:
        outsider.kill()


def test_what_criu_cannot_dump_fails_clearly(client: Client, sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    uring = (
        "import ctypes, time; p = (ctypes.c_uint8 * 120)(); "
        "assert ctypes.CDLL(None).syscall(425, 8, p) >= 0; time.sleep(10**6)"
    )
    sb.run(["sh", "-c", "cat > /opt/t/uring.py"], stdin=uring)
    with sb.turn():
        sb.session.run("python3 /opt/t/uring.py & sleep 0.5")
    before = [c.id for c in sb.checkpoints()]
    with pytest.raises(CriuError) as info:
        sb.checkpoint(kind="full")
    err = info.value
    assert err.log_path and "uring.py" in err.message and "Error" in err.log_excerpt
    from pathlib import Path

    assert Path(err.log_path).exists()
    assert [c.id for c in sb.checkpoints()] == before  # no checkpoint is claimed
    assert sb.run(["true"]).exit_code == 0
    assert client.checkpoint_failures(sb.id)[0].log_path == err.log_path


def test_repeat_dump_with_unchanged_memory_is_small(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    hold = "import os, time; data = os.urandom(64 << 20); time.sleep(10**6)"
    sb.run(["sh", "-c", "cat > /opt/t/hold.py"], stdin=hold)
    with sb.turn():
        sb.session.run("python3 /opt/t/hold.py & sleep 1")
    first = sb.checkpoint(kind="full")
    second = sb.checkpoint(kind="full")
    assert first.new_bytes > 64 << 20
    assert second.new_bytes <= 0.05 * first.new_bytes


def test_a_restore_links_a_recent_dump_and_older_ones_come_from_the_store(
    daemon: EmbeddedDaemon, sbx: Callable[..., Sandbox]
) -> None:
    """A sandbox's last few dumps are kept hot (backends/criu/hotimages.py, PER_SANDBOX); an older one is written."""
    sb = sbx()
    ask = ASK_REPL
    secret, n = start_repl(sb)
    older = sb.checkpoint(kind="full")
    recent = []
    for _ in range(hotimages.PER_SANDBOX):
        sb.session.run(ask)
        recent.append(sb.checkpoint(kind="full"))  # the REPL's memory changed: a new image, kept hot
    sb.session.run(ask)
    sb.restore(recent[0])  # the oldest one still kept
    assert sb.session.run(ask).stdout.split() == [secret, b"%d" % (int(n) + 2)]
    sb.restore(older)  # past the sandbox's last few: written from the store
    assert sb.session.run(ask).stdout.split() == [secret, b"%d" % (int(n) + 1)]
    lines = [json.loads(x) for x in daemon.log_file.read_text().splitlines() if '"sandbox restored"' in x]
    assert [x.get("images_from") for x in lines if x.get("sandbox") == sb.id] == ["hot", "blobs"]


def test_filesystem_checkpoints_never_bring_processes(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()
    with sb.turn():
        sb.session.run("sleep 300 &")
    full = sb.checkpoint(kind="full")
    files = sb.checkpoint(kind="fs")  # a later cut with no process image: never paired with `full`
    assert files.parent_id == full.id and files.kind == "fs"
    sb.restore(files)
    assert b"sleep 300" not in sb.run(["ps", "-eo", "args"]).stdout
    sb.restore(full)
    assert b"sleep 300" in sb.run(["ps", "-eo", "args"]).stdout


def test_automatic_recovery_after_a_crash(client: Client, sbx: Callable[..., Sandbox]) -> None:
    sb = sbx(checkpoints="full", recovery="auto")
    with sb.turn():
        sb.session.run("cd /tmp && sleep 300 &")
    with sb.turn():
        sb.run(["sh", "-c", "echo after > /tmp/after"])
    sb.run(["sh", "-c", "echo uncheckpointed > /tmp/lost"])  # an implicit turn, never ended
    crashed = sb.refresh().container_id
    conftest.kill_container(crashed)
    # Recovered into a new container; "dead" may last less than a poll here, so it is not waited for.
    deadline = time.monotonic() + 60
    while not (sb.refresh().state == "running" and sb.info.container_id != crashed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.info.state == "running" and sb.info.container_id != crashed
    assert b"sleep 300" in sb.run(["ps", "-eo", "args"]).stdout
    assert sb.run(["cat", "/tmp/after"]).stdout == b"after\n"
    assert sb.run(["cat", "/tmp/lost"]).exit_code != 0


def test_loopback_works_after_restoring_a_sandbox_without_network(sbx: Callable[..., Sandbox]) -> None:
    sb = sbx()  # network off: runc makes the netns, and a restore leaves its loopback down unless crab acts
    with sb.turn():
        sb.session.run("(setsid python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 </dev/null &); sleep 0.7")
    ask = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').status)\""
    ck = sb.checkpoint(kind="full")
    sb.restore(ck)
    assert sb.session.run(ask).stdout == b"200\n"


def test_a_sandbox_whose_workdir_the_image_lacks_restores_and_recovers(sbx: Callable[..., Sandbox]) -> None:
    # Docker creates a missing working directory in each new container's writable layer;
    # every restore starts a new container, whose upper dir is then not quite empty.
    sb = sbx(workdir="/app", checkpoints="full")
    with sb.turn():
        sb.session.run("echo kept > note.txt && sleep 300 &")
    ckpt = sb.checkpoints()[-1]
    sb.run(["rm", "/app/note.txt"])
    sb.restore(ckpt)
    assert sb.run(["cat", "/app/note.txt"]).stdout == b"kept\n"
    kill_container(sb)
    sb.recover()
    assert sb.session.run("pwd; cat note.txt").stdout == b"/app\nkept\n"
    assert b"sleep 300" in sb.run(["ps", "-eo", "args"]).stdout
