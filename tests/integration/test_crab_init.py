"""crab-init, the real binary: as PID 1 of a fresh pid namespace on the host, and of a container.

crab-init serves only peers outside its pid namespace (crabd); so the host
tests run it the way a sandbox does, as PID 1 of its own pid namespace
(``unshare --pid --fork --mount-proc``, so ``/proc`` inside shows its own
pids), and talk to it from the test's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

import pytest

from crabd.coordinator.runner import SESSION_NAME, Session
from crabd.coordinator.sessionkeep import CaptureCounts, IdleReading
from crabd.errors import InitSpawnError, InitUnavailable
from crabd.host import images
from crabd.runtime import initbin, session_proto
from crabd.runtime.initproto import CLOSE_WAIT_S, Exit, InitConnection, SpawnSpec, Stderr, Stdout
from crabd.util.netns import Netns

T = TypeVar("T")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


class Init(NamedTuple):
    name: str  # its abstract socket
    pid: int  # crab-init's pid on the host (1 in its namespace)


def _child_of(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise AssertionError("unshare did not start crab-init")


@pytest.fixture
def init() -> Iterator[Init]:
    binary = initbin.build()
    name = f"crab-init-test-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", str(binary)],
        env={"CRAB_INIT_SOCKET": name},
        start_new_session=True,
    )
    pid = _child_of(proc.pid)

    async def ready() -> None:
        for _ in range(200):
            try:
                c = await InitConnection.open(name)
            except InitUnavailable:
                await asyncio.sleep(0.01)
                continue
            await c.hello()
            # Until init closed its end: a test that counts init's sockets must not find this one going.
            await c.aclose(until_init_closed=True)
            return
        raise AssertionError("init did not come up")

    try:
        run(ready())
        yield Init(name, pid)
    finally:
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(5) == 0  # unshare exits with crab-init's status


async def collect(c: InitConnection) -> tuple[bytes, bytes, Exit]:
    out, err = b"", b""
    while True:
        ev = await c.next_event()
        if isinstance(ev, Stdout):
            out += ev.data
        elif isinstance(ev, Stderr):
            err += ev.data
        elif isinstance(ev, Exit):
            return out, err, ev


def one(name: str, argv: list[str], **kw: object) -> tuple[bytes, bytes, Exit]:
    async def go() -> tuple[bytes, bytes, Exit]:
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=argv, env=ENV, **kw))  # type: ignore[arg-type]
            return await collect(c)

    return run(go())


def test_exit_codes_and_streams(init: Init) -> None:
    name, _ = init
    assert one(name, ["sh", "-c", "exit 3"])[2].exit_code == 3
    assert one(name, ["sh", "-c", "kill -9 $$"])[2].exit_code == 137
    out, err, ex = one(name, ["sh", "-c", "echo o; echo e >&2"])
    assert (out, err, ex.exit_code) == (b"o\n", b"e\n", 0)
    out, err, _ = one(name, ["sh", "-c", "echo o; echo e >&2"], merge_stderr=True)
    assert out == b"o\ne\n" and err == b""
    assert one(name, ["pwd"], cwd="/tmp")[0] == b"/tmp\n"
    assert one(name, ["sh", "-c", "echo $A"], stdin_null=True)[0] == b"\n"  # exact env, nothing inherited


def test_a_command_inherits_no_descriptor_of_inits(init: Init) -> None:
    """Only 0-2 reach a command (init closes the rest with close_range(2), around what it keeps)."""
    name, pid = init
    assert len(os.listdir(f"/proc/{pid}/fd")) > 3  # init holds its socket, signalfd, connection...
    out, _, ex = one(name, ["sh", "-c", "ls /proc/$$/fd"])
    assert ex.exit_code == 0 and out.split() == [b"0", b"1", b"2"]
    out, _, _ = one(name, ["sh", "-c", "ls /proc/$$/fd"], stdin_null=True, merge_stderr=True)
    assert out.split() == [b"0", b"1", b"2"]


def test_spawn_errors(init: Init) -> None:
    name, _ = init
    with pytest.raises(InitSpawnError) as info:
        one(name, ["/no/such/thing"])
    assert info.value.errno == 2 and "exec" in info.value.init_message
    with pytest.raises(InitSpawnError) as info:
        one(name, ["true"], cwd="/no/such/dir")
    assert "chdir" in info.value.init_message


def test_stdin_pipe(init: Init) -> None:
    name, _ = init

    async def go() -> bytes:
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["cat"], env=ENV))
            await c.write_stdin(b"x" * 3_000_000)
            await c.close_stdin()
            out, _, _ = await collect(c)
            return out

    assert run(go()) == b"x" * 3_000_000


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_large_output_slow_reader_keeps_init_small(init: Init) -> None:
    name, pid = init

    async def go() -> int:
        total, peak = 0, 0
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["head", "-c", str(50 << 20), "/dev/zero"], env=ENV))
            while True:
                ev = await c.next_event()
                if isinstance(ev, Exit):
                    return total if peak < 16 << 10 else -peak
                assert isinstance(ev, Stdout | Stderr)
                total += len(ev.data)
                if total % (4 << 20) < len(ev.data):
                    await asyncio.sleep(0.05)  # a slow reader
                    peak = max(peak, _rss_kib(pid))

    assert run(go()) == 50 << 20


def test_disconnect_kills_the_process_group(init: Init) -> None:
    name, _ = init
    marker = f"crab-disconnect-{os.getpid()}"

    async def go() -> None:
        c = await InitConnection.open(name)
        await c.spawn(SpawnSpec(argv=["sh", "-c", f"sleep 1000 & exec -a {marker} sleep 1000"], env=ENV))
        await c.aclose()

    run(go())
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
    assert marker not in ps


def _sockets_of(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed between the listing and the readlink
            if (link := os.readlink(fd)).startswith("socket:"):
                found.add(link)
    return found


@pytest.mark.parametrize("stdin", ["none", "more than init reads", "more than the socket holds"])
def test_init_closes_its_end_though_a_child_holds_a_copy_of_crabds(init: Init, stdin: str) -> None:
    """A process dump fails on any socket in the sandbox whose peer lives outside it.  A child
    crabd forked at the moment it closes a connection holds a copy of that descriptor, so a
    close(2) alone would leave init's end open.  aclose shuts the socket down, which init sees
    also while stdin backpressure stops it reading; HELLO counts init's connections, and
    ``until_init_closed`` returns once init closed its end.  Stdin that cannot be sent at all is
    given up after CLOSE_WAIT_S."""
    name, pid = init
    before = _sockets_of(pid)
    # A command that never reads its stdin gets 64 KiB into its pipe and 1 MiB into init's
    # buffer; then init stops reading the socket, whose buffers hold ~200 KiB more.
    size = {"none": 0, "more than init reads": (1 << 20) + (160 << 10), "more than the socket holds": 4 << 20}[stdin]

    async def go() -> None:
        c = await InitConnection.open(name)
        # connect(2) returns once the kernel queued the connection; init's accept(2) may come
        # later (CI saw it), and only a reply proves init holds its end.
        await c.hello()
        if size:
            await c.spawn(SpawnSpec(argv=["sleep", "1000"], env=ENV))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.write_stdin(b"x" * size), 1)
        assert len(_sockets_of(pid) - before) == 1
        fd = c._writer.get_extra_info("socket").fileno()
        holder = subprocess.Popen(["sleep", "30"], pass_fds=(fd,))  # a forked child's copy
        try:
            started = time.monotonic()
            await c.aclose()
            waited = time.monotonic() - started
            assert waited < (CLOSE_WAIT_S + 1 if size > 2 << 20 else 1)
            async with await InitConnection.open(name) as asking:
                deadline = time.monotonic() + 5
                while (await asking.hello()).connections != 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert (await asking.hello()).connections == 1, "init still holds its end of the closed one"
                await asking.aclose(until_init_closed=True)
                assert _sockets_of(pid) == before
        finally:
            holder.kill()
            holder.wait()

    run(go())


def _after(gate: Path, command: str) -> bytes:
    """A shell line that runs ``command`` once ``gate`` exists.  What init relays while a client
    is attached goes to that client, and is gone with it if it leaves without reading; so a
    test of what init keeps for a detached process opens the gate only after it detached
    (on a loaded host the shell can otherwise answer before the client's close)."""
    return f"while [ ! -e {gate} ]; do sleep 0.01; done; {command}\n".encode()


async def _exists(path: Path) -> None:
    while not path.exists():
        await asyncio.sleep(0.01)


def test_persistent_process_ring_and_attach(init: Init, tmp_path: Path) -> None:
    name, _ = init
    gate, written = tmp_path / "detached", tmp_path / "written"

    async def go() -> None:
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["sh"], env=ENV, name="sess", persistent=True))
            await c.write_stdin(_after(gate, f"head -c 1500000 /dev/zero; echo end; : > {written}"))
        gate.touch()
        await _exists(written)
        await asyncio.sleep(0.2)  # init reads the pipe as it fills; the last line is in its ring
        async with await InitConnection.open(name) as c, await InitConnection.open(name) as other:
            att = await c.attach("sess")
            assert att.dropped_stdout == 1_500_004 - (1 << 20)
            with pytest.raises(InitSpawnError) as info:
                await other.attach("sess")
            assert info.value.errno == 16  # EBUSY; `other` stays usable
            assert [p.name for p in await other.list()] == ["sess"]
            got = b""
            while not got.endswith(b"end\n"):
                ev = await c.next_event()
                assert isinstance(ev, Stdout)
                got += ev.data
            assert len(got) == 1 << 20
            await c.write_stdin(b"exit 5\n")
            assert (await c.next_event()) == Exit(5 << 8)
            info2 = await other.list()
            assert not info2[0].alive and info2[0].wait_status == 5 << 8
            await other.forget("sess")
            assert await other.list() == []

    run(go())


def test_attach_listed_tells_a_live_session_from_one_that_already_exited(init: Init, tmp_path: Path) -> None:
    """One round trip says whether the attached process still runs.  A live one's kept output
    comes next; a finished one's kept frames are dropped and the connection stays in step
    (a forget right after works); a missing one is ENOENT, and the connection stays usable."""
    name, _ = init
    gate = tmp_path / "detached"

    async def go() -> None:
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["sh"], env=ENV, name="live", persistent=True))
            await c.write_stdin(_after(gate, "echo kept"))
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["sh"], env=ENV, name="gone", persistent=True))
            await c.write_stdin(_after(gate, "echo last; exit 3"))
        gate.touch()
        async with await InitConnection.open(name) as c:
            while any(p.alive for p in await c.list() if p.name == "gone"):
                await asyncio.sleep(0.02)
        async with await InitConnection.open(name) as c:
            _, listed = await c.attach_listed("live")
            assert {p.name: p.alive for p in listed} == {"live": True, "gone": False}
            assert await c.next_event() == Stdout(b"kept\n")
            await c.write_stdin(b"exit 0\n")
            assert await c.next_event() == Exit(0)
        async with await InitConnection.open(name) as c:
            _, listed = await c.attach_listed("gone")
            assert not next(p for p in listed if p.name == "gone").alive
            await c.forget("gone")
            with pytest.raises(InitSpawnError) as info:
                await c.attach_listed("gone")
            assert info.value.errno == 2  # ENOENT
            assert [p.name for p in await c.list()] == ["live"]

    run(go())


def test_background_grandchild_does_not_delay_exit(init: Init) -> None:
    name, _ = init
    t0 = time.monotonic()
    out, _, ex = one(name, ["sh", "-c", "sleep 100 & echo hi"])
    assert out == b"hi\n" and ex.exit_code == 0
    assert time.monotonic() - t0 < 2


def test_orphans_are_reaped(init: Init) -> None:
    name, pid = init
    one(name, ["sh", "-c", "(sleep 0.2 &) ; true"])
    time.sleep(1)
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    zombies = [c for c in children if Path(f"/proc/{c}/stat").read_text().split(")")[-1].split()[0] == "Z"]
    assert zombies == []


def test_malformed_frame_closes_only_that_connection(init: Init) -> None:
    name, _ = init

    async def go() -> None:
        bad = await InitConnection.open(name)
        bad._writer.write(b"\xff\xff\xff\xff\x01")
        with pytest.raises((InitSpawnError, InitUnavailable)):
            await bad.hello()
        await bad.aclose()
        async with await InitConnection.open(name) as good:
            assert (await good.hello()).version == 3

    run(go())


def test_pid1_in_a_container(crab_tmp: Path) -> None:
    binary = initbin.install(crab_tmp)
    image = images.find_recipe("busybox").image_ref
    cname = f"crab-test-init-{os.getpid()}"
    subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--name",
            cname,
            "--network",
            "none",
            "-v",
            f"{binary}:/.crab/init:ro",
            "--entrypoint",
            "/.crab/init",
            image,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        pid_text, cid = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Pid}} {{.Id}}", cname],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        ns = Netns(int(pid_text), cid)

        async def go() -> bytes:
            async with await InitConnection.open(netns=ns) as c:
                assert (await c.hello()).pid == 1
                await c.spawn(SpawnSpec(argv=["sh", "-c", "cat /proc/self/stat"], env=ENV))
                out, _, _ = await collect(c)
                return out

        stat = run(go()).split(b")")[-1].split()
        assert stat[1] == b"1"  # the spawned shell's parent is PID 1

        async def peek() -> tuple[bytes, bytes]:
            # Root in the container, Docker's default capabilities (no CAP_SYS_PTRACE):
            # init is not dumpable, so its memory, environment and fds are closed to it.
            async with await InitConnection.open(netns=ns) as c:
                script = "cat /proc/1/environ >/dev/null && echo env; readlink /proc/1/fd/0 >/dev/null && echo fd"
                script += "; id -u"
                await c.spawn(SpawnSpec(argv=["sh", "-c", script], env=ENV))
                out, err, _ = await collect(c)
                return out, err

        out, err = run(peek())
        assert out == b"0\n" and b"Permission denied" in err
        t0 = time.monotonic()
        subprocess.run(["docker", "stop", "-t", "5", cname], check=True, capture_output=True, timeout=60)
        assert time.monotonic() - t0 < 4  # init handled SIGTERM itself, no 5 s SIGKILL wait
    finally:
        subprocess.run(["docker", "rm", "-f", cname], capture_output=True, timeout=60)


def test_unknown_socket_is_unavailable(init: Init) -> None:
    with pytest.raises(InitUnavailable):
        run(InitConnection.open("crab-init-does-not-exist"))


# --- who may talk to init -------------------------------------------------------

#: Run inside init's pid namespace: connect to init's socket and ask it to
#: create a file as root.  Prints "refused" when init hangs up unread.
INTRUDER = r"""
import socket, struct, sys
def s_(b): return struct.pack(">I", len(b)) + b
spawn = (struct.pack(">III", 0, 0xFFFFFFFF, 0xFFFFFFFF) + s_(b"") + s_(b"/")
         + struct.pack(">I", 2) + s_(b"/usr/bin/touch") + s_(sys.argv[2].encode()) + struct.pack(">I", 0))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
try:
    s.sendall(struct.pack(">IB", 1, 1) + struct.pack(">IB", len(spawn) + 1, 2) + spawn)
    got = s.recv(100)
except OSError as e:
    got = b""
print("refused" if not got else "answered %r" % got)
"""


def test_peers_inside_the_pid_namespace_are_refused(init: Init, tmp_path: Path) -> None:
    name, _ = init
    marker = tmp_path / "pwned"
    attempts = [
        (["/usr/bin/python3", "-c", INTRUDER, name, str(marker)], None),  # root
        (["/usr/bin/python3", "-c", INTRUDER, name, str(marker)], 65534),  # nobody
        # A pid namespace of its own (a descendant of init's): still visible to init.
        (["unshare", "--pid", "--fork", "/usr/bin/python3", "-c", INTRUDER, name, str(marker)], None),
    ]
    for argv, uid in attempts:
        out, err, ex = one(name, argv, uid=uid, gid=uid)
        assert (out, ex.exit_code) == (b"refused\n", 0), (argv, uid, err)
    assert not marker.exists()

    async def count() -> int:
        async with await InitConnection.open(name) as c:  # from outside its namespace: served
            return (await c.hello()).refused_peers

    assert run(count()) == len(attempts)
    one(name, ["touch", str(marker)])
    assert marker.exists()


# --- the session's control channel ----------------------------------------------


def session(name: str, pty: tuple[int, int] | None = None) -> Session:
    async def connect() -> InitConnection:
        return await InitConnection.open(name)

    return Session(connect, {**ENV, "HOME": "/root"}, "/", pty=pty)


def counted_session(name: str) -> tuple[Session, list[int]]:
    """A session on init ``name``, and a list that grows by one at each connection it opens."""
    opened: list[int] = []

    async def connect() -> InitConnection:
        opened.append(1)
        return await InitConnection.open(name)

    return Session(connect, {**ENV, "HOME": "/root"}, "/", CaptureCounts()), opened


def forge(nonce: str) -> str:
    """Shell text printing done markers (old and new style) and a fake capture for ``nonce``."""
    return (
        f"printf '\\036__CRAB_DONE_{nonce}_0\\036DONE:{nonce}:0\\0'; "
        f"printf '\\036__CRAB_DONE_{nonce}_0\\036DONE:{nonce}:0\\0' >&2; "
        "printf 'STATE\\0CWD\\0=/forged\\0END\\0'; "
    )


def test_session_ends_only_on_the_authenticated_marker(init: Init, monkeypatch: pytest.MonkeyPatch) -> None:
    name, _ = init
    nonce = "feed" * 4  # crabd's side of the nonce, known to the test
    monkeypatch.setattr(session_proto, "new_nonce", lambda: nonce)
    # A subshell writes the marker into bash's saved copy of the control fd.
    steal = (
        "for f in /proc/$$/fd/*; do case $(readlink $f) in socket:*) "
        f"( printf 'DONE:{nonce}:0\\0STATE\\0CWD\\0=/forged\\0END\\0' >&${{f##*/}} ) && echo wrote;; esac; done; "
    )

    async def go() -> None:
        s = session(name)
        r = await s.run(forge(nonce) + "sleep 0.3; echo after; (exit 3)", timeout_s=30, max_output=1 << 20)
        assert (r.exit_code, r.timed_out, r.session_ended) == (3, False, False)
        assert r.stdout == f"\x1e__CRAB_DONE_{nonce}_0\x1eDONE:{nonce}:0\0STATE\0CWD\0=/forged\0END\0after\n".encode()
        assert r.stderr == f"\x1e__CRAB_DONE_{nonce}_0\x1eDONE:{nonce}:0\0".encode()
        r = await s.run("cd /tmp; " + steal + "sleep 0.3; echo after; (exit 4)", timeout_s=30, max_output=1 << 20)
        assert (r.exit_code, r.stdout) == (4, b"wrote\nafter\n"), r.stderr
        assert s.control_rejections >= 1
        async with await InitConnection.open(name) as c:
            (info,) = await c.list()
            assert info.name == SESSION_NAME and info.control_rejected == s.control_rejections
        state = await s.capture_state()
        assert state is not None and state.cwd == "/tmp"

    run(go())


def test_a_capture_that_found_no_session_asks_init_again_only_after_a_command(init: Init) -> None:
    name, _ = init

    async def go() -> None:
        s, opened = counted_session(name)
        assert await s.capture_state() is None
        assert await s.capture_state() is None
        assert await s.capture_state() is None
        assert len(opened) == 1  # nothing can start a session but this object: no need to ask
        r = await s.run("cd /tmp", timeout_s=30, max_output=1)
        assert r.exit_code == 0
        state = await s.capture_state()
        assert state is not None and state.cwd == "/tmp"
        # The bash ends: the next capture must look again, and finds none.
        await s.run("exit 0", timeout_s=30, max_output=1)
        before = len(opened)
        assert await s.capture_state() is None
        assert len(opened) == before + 1
        assert s.captured_pid(60) == (None,)

    run(go())


def test_a_kept_capture_is_reused_only_while_the_witness_holds(init: Init) -> None:
    """Session's side of coordinator/sessionkeep.py, with a real bash and the witness set by the test."""
    name, _ = init

    async def go() -> None:
        s, opened = counted_session(name)
        witness: list[tuple[object, ...] | None] = [("w", 1)]
        nofile = [1024]

        async def probe(nspid: int) -> IdleReading:
            return IdleReading({"nofile": [nofile[0], 4096]}, [], witness[0])

        s.probe = probe
        await s.run("cd /tmp; A=1", timeout_s=30, max_output=1)
        first = await s.capture_state()
        n = len(opened)
        nofile[0] = 100
        again = await s.capture_state()
        assert len(opened) == n and s.counts.snapshot() == {"captured": 1, "reused": 1}
        assert again is not None and first is not None and again.variables == first.variables
        assert again.limits == {"nofile": [100, 4096]}  # read anew at every reuse
        bash = await s.pid()
        assert bash is not None and s.captured_pid(60) == (bash,)  # a reuse stands for a capture
        witness[0] = ("w", 2)  # the bash ran, or something wrote its memory
        await s.capture_state()
        assert len(opened) == n + 2 and s.counts.captured == 2  # (+1: the pid() above)
        await s.capture_state()
        assert s.counts.reused == 2  # kept again under the new witness
        await s.run("A=2", timeout_s=30, max_output=1)  # a command forgets the kept capture
        state = await s.capture_state()
        assert state is not None and 'A="2"' in state.variables["A"] and s.counts.captured == 3
        await s.run("trap 'A=3' USR1", timeout_s=30, max_output=1)
        await s.capture_state()
        await s.capture_state()  # a trap's code runs without a command: nothing was kept
        assert (s.counts.captured, s.counts.reused) == (5, 2)
        await s.run("trap - USR1", timeout_s=30, max_output=1)
        witness[0] = None  # no probes: nothing vouches
        await s.capture_state()
        await s.capture_state()
        assert (s.counts.captured, s.counts.reused) == (7, 2)

    run(go())


def test_session_forged_capture_in_the_background_changes_nothing(init: Init) -> None:
    name, _ = init
    fake = "\\036CWD\\036/forged\\036OLDPWD\\036\\036END\\036STATE\\0CWD\\0=/forged\\0END\\0"

    async def go() -> None:
        s = session(name)
        await s.run(
            f"cd /usr; (for i in $(seq 100); do printf '{fake}'; sleep 0.01; done) &", timeout_s=30, max_output=1
        )
        for _ in range(5):
            state = await s.capture_state()
            assert state is not None and state.cwd == "/usr"
        await s.run("wait", timeout_s=30, max_output=1)

    run(go())


def test_session_output_precedes_the_marker_under_backpressure(init: Init) -> None:
    name, _ = init

    async def go() -> None:
        s = session(name)
        cmd = "head -c 3000000 /dev/zero; printf end; head -c 300000 /dev/zero >&2; printf E >&2"
        for _ in range(3):
            r = await s.run(cmd, timeout_s=60, max_output=4 << 20)
            assert r.exit_code == 0 and r.stdout == b"\0" * 3_000_000 + b"end"
            assert r.stderr == b"\0" * 300_000 + b"E"

    run(go())


def test_pty_session_output_precedes_the_marker_however_much_and_stays_exact(init: Init) -> None:
    """A terminal's bytes reach its master through a kernel worker: init reads it dry before the marker."""
    name, _ = init

    async def go() -> None:
        s = session(name, pty=(33, 111))
        cmd = "head -c 3000000 /dev/zero; printf end; head -c 300000 /dev/zero >&2; printf 'E\\n'"
        for _ in range(3):
            r = await s.run(cmd, timeout_s=60, max_output=8 << 20)
            assert r.exit_code == 0 and r.stderr == b""
            assert r.stdout == b"\0" * 3_000_000 + b"end" + b"\0" * 300_000 + b"E\n"  # raw: no "\r\n"
        for i in range(30):  # many small outputs, one right after another
            r = await s.run(f"printf {i}", timeout_s=30, max_output=100)
            assert r.stdout == str(i).encode()
        r = await s.run(
            "[ -t 1 ] && [ -t 2 ] && ! [ -t 0 ] && stty size </dev/tty && tty <&1", timeout_s=30, max_output=100
        )
        assert r.stdout.startswith(b"33 111\n/dev/pts/"), r
        async with await InitConnection.open(name) as c:
            (info,) = await c.list()
            assert info.pty == (33, 111)

    run(go())


def test_pty_one_shot_and_its_end_when_every_holder_closed(init: Init) -> None:
    """EIO from a master whose slave is closed everywhere is the end of the stream, as EOF of a pipe.

    Init then closes the master: the terminal hangs up, and its session's leader gets SIGHUP.
    """
    name, _ = init
    out, err, ex = one(name, ["sh", "-c", "tty <&1; echo e >&2; exec >&- 2>&-; sleep 5; exit 7"], pty=(5, 6))
    assert (ex.signal, err) == (signal.SIGHUP, b"") and out.startswith(b"/dev/pts/") and out.endswith(b"\ne\n")
    out, _, ex = one(name, ["sh", "-c", "echo o; exit 7"], pty=(5, 6))
    assert (ex.exit_code, out) == (7, b"o\n")
    with pytest.raises(InitSpawnError) as info:  # a size out of range: the request is refused
        one(name, ["true"], pty=(0, 80))
    assert info.value.errno == 22


def test_session_marker_written_while_detached_is_not_taken_for_the_next(init: Init) -> None:
    """crabd went away mid-command: the old marker waits in the channel; the next command ignores it."""
    name, _ = init

    async def go() -> None:
        s = session(name)
        assert (await s.run("true", timeout_s=30, max_output=100)).exit_code == 0
        c = await InitConnection.open(name)
        await c.attach(SESSION_NAME)
        await c.write_stdin(session_proto.wrap_command("sleep 0.3; (exit 9)", "0" * 16))
        await c.aclose()  # no DETACH: like a crabd killed mid-command
        await asyncio.sleep(1.0)
        r = await s.run("echo new; (exit 5)", timeout_s=30, max_output=100)
        assert (r.exit_code, r.stdout) == (5, b"new\n")

    run(go())


@pytest.mark.parametrize(
    "state",
    [
        b"{}",
        b'{"id": "c1", "status": "creating"}',
        b'{"pid": -1}',
        b'{"pid": 0}',
        b'{"pid": 99999999999999999999}',  # would overflow a long: refused past PID_MAX_LIMIT
        b'{"pid" 12}',
        b"{" + b" " * (70 << 10) + b"}",  # over the 64 KiB read
    ],
    ids=["empty", "no-pid", "negative", "zero", "huge", "no-colon", "oversize"],
)
def test_lo_up_refuses_a_state_without_a_usable_pid(state: bytes) -> None:
    """`crab-init --lo-up` (the restore's prestart hook) exits non-zero and says why; it enters no namespace."""
    r = subprocess.run([str(initbin.build()), "--lo-up"], input=state, capture_output=True, timeout=10)
    assert r.returncode == 1 and r.stderr.startswith(b"crab-init: --lo-up: "), r.stderr


def test_lo_up_brings_loopback_up_in_the_netns_of_runcs_pid() -> None:
    holder = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        ns = f"/proc/{holder.pid}/ns/net"
        deadline = time.monotonic() + 10
        while os.stat(ns).st_ino == os.stat("/proc/self/ns/net").st_ino and time.monotonic() < deadline:
            time.sleep(0.01)  # until unshare has made the new namespace
        show = ["nsenter", f"--net={ns}", "ip", "-o", "link", "show", "lo"]
        assert b"state DOWN" in subprocess.run(show, capture_output=True, check=True).stdout
        state = b'{"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": %d, "bundle": "/b"}' % holder.pid
        r = subprocess.run([str(initbin.build()), "--lo-up"], input=state, capture_output=True, timeout=10)
        assert r.returncode == 0, r.stderr
        assert b"UP" in subprocess.run(show, capture_output=True, check=True).stdout.split(b">")[0]
        # crab-init's own netns (the host's here) is untouched: it entered the pid's only.
    finally:
        holder.kill()
        holder.wait()
