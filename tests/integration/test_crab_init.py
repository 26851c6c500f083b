"""crab-init, the real binary: on the host (as a subreaper) and as PID 1 of a container."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from crabd.errors import InitSpawnError, InitUnavailable
from crabd.host import images
from crabd.runtime import initbin
from crabd.runtime.initproto import Exit, InitConnection, SpawnSpec, Stderr, Stdout

T = TypeVar("T")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def init() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    binary = initbin.build()
    name = f"crab-init-test-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([str(binary)], env={"CRAB_INIT_SOCKET": name}, start_new_session=True)

    async def ready() -> None:
        for _ in range(200):
            try:
                async with await InitConnection.open(name) as c:
                    await c.hello()
                    return
            except InitUnavailable:
                await asyncio.sleep(0.01)
        raise AssertionError("init did not come up")

    run(ready())
    yield name, proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(5) == 0


async def collect(c: InitConnection) -> tuple[bytes, bytes, Exit]:
    out, err = b"", b""
    while True:
        ev = await c.next_event()
        if isinstance(ev, Stdout):
            out += ev.data
        elif isinstance(ev, Stderr):
            err += ev.data
        else:
            return out, err, ev


def one(name: str, argv: list[str], **kw: object) -> tuple[bytes, bytes, Exit]:
    async def go() -> tuple[bytes, bytes, Exit]:
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=argv, env=ENV, **kw))  # type: ignore[arg-type]
            return await collect(c)

    return run(go())


def test_exit_codes_and_streams(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, _ = init
    assert one(name, ["sh", "-c", "exit 3"])[2].exit_code == 3
    assert one(name, ["sh", "-c", "kill -9 $$"])[2].exit_code == 137
    out, err, ex = one(name, ["sh", "-c", "echo o; echo e >&2"])
    assert (out, err, ex.exit_code) == (b"o\n", b"e\n", 0)
    out, err, _ = one(name, ["sh", "-c", "echo o; echo e >&2"], merge_stderr=True)
    assert out == b"o\ne\n" and err == b""
    assert one(name, ["pwd"], cwd="/tmp")[0] == b"/tmp\n"
    assert one(name, ["sh", "-c", "echo $A"], stdin_null=True)[0] == b"\n"  # exact env, nothing inherited


def test_spawn_errors(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, _ = init
    with pytest.raises(InitSpawnError) as info:
        one(name, ["/no/such/thing"])
    assert info.value.errno == 2 and "exec" in info.value.init_message
    with pytest.raises(InitSpawnError) as info:
        one(name, ["true"], cwd="/no/such/dir")
    assert "chdir" in info.value.init_message


def test_stdin_pipe(init: tuple[str, subprocess.Popen[bytes]]) -> None:
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


def test_large_output_slow_reader_keeps_init_small(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, proc = init

    async def go() -> int:
        total, peak = 0, 0
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["head", "-c", str(50 << 20), "/dev/zero"], env=ENV))
            while True:
                ev = await c.next_event()
                if isinstance(ev, Exit):
                    return total if peak < 16 << 10 else -peak
                total += len(ev.data)
                if total % (4 << 20) < len(ev.data):
                    await asyncio.sleep(0.05)  # a slow reader
                    peak = max(peak, _rss_kib(proc.pid))

    assert run(go()) == 50 << 20


def test_disconnect_kills_the_process_group(init: tuple[str, subprocess.Popen[bytes]]) -> None:
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


def test_persistent_process_ring_and_attach(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, _ = init

    async def go() -> None:
        async with await InitConnection.open(name) as c:
            await c.spawn(SpawnSpec(argv=["sh"], env=ENV, name="sess", persistent=True))
            await c.write_stdin(b"head -c 1500000 /dev/zero; echo end\n")
        await asyncio.sleep(1.0)  # detached: init buffers the output
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


def test_background_grandchild_does_not_delay_exit(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, _ = init
    t0 = time.monotonic()
    out, _, ex = one(name, ["sh", "-c", "sleep 100 & echo hi"])
    assert out == b"hi\n" and ex.exit_code == 0
    assert time.monotonic() - t0 < 2


def test_orphans_are_reaped(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, proc = init
    one(name, ["sh", "-c", "(sleep 0.2 &) ; true"])
    time.sleep(1)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    zombies = [c for c in children if Path(f"/proc/{c}/stat").read_text().split(")")[-1].split()[0] == "Z"]
    assert zombies == []


def test_malformed_frame_closes_only_that_connection(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    name, _ = init

    async def go() -> None:
        bad = await InitConnection.open(name)
        bad._writer.write(b"\xff\xff\xff\xff\x01")
        with pytest.raises((InitSpawnError, InitUnavailable)):
            await bad.hello()
        await bad.aclose()
        async with await InitConnection.open(name) as good:
            assert (await good.hello())[0] == 1

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
        pid = int(
            subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Pid}}", cname],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
        )

        async def go() -> bytes:
            async with await InitConnection.open(netns=f"/proc/{pid}/ns/net") as c:
                assert (await c.hello())[1] == 1
                await c.spawn(SpawnSpec(argv=["sh", "-c", "cat /proc/self/stat"], env=ENV))
                out, _, _ = await collect(c)
                return out

        stat = run(go()).split(b")")[-1].split()
        assert stat[1] == b"1"  # the spawned shell's parent is PID 1
        t0 = time.monotonic()
        subprocess.run(["docker", "stop", "-t", "5", cname], check=True, capture_output=True, timeout=60)
        assert time.monotonic() - t0 < 4  # init handled SIGTERM itself, no 5 s SIGKILL wait
    finally:
        subprocess.run(["docker", "rm", "-f", cname], capture_output=True, timeout=60)


def test_unknown_socket_is_unavailable(init: tuple[str, subprocess.Popen[bytes]]) -> None:
    with pytest.raises(InitUnavailable):
        run(InitConnection.open("crab-init-does-not-exist"))
