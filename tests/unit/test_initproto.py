from __future__ import annotations

import asyncio
import os
import struct

import pytest

from crabd.errors import InitProtocolError
from crabd.runtime import initproto as ip


def test_frames_round_trip_in_pieces() -> None:
    data = ip.encode_frame(ip.HELLO) + ip.encode_frame(ip.STDIN, b"x" * 70000) + ip.encode_frame(ip.LIST)
    dec = ip.FrameDecoder()
    got: list[tuple[int, bytes]] = []
    for i in range(0, len(data), 333):
        dec.feed(data[i : i + 333])
        got.extend(dec)
    assert got == [(ip.HELLO, b""), (ip.STDIN, b"x" * 70000), (ip.LIST, b"")]


def test_oversize_and_zero_length_rejected() -> None:
    with pytest.raises(InitProtocolError):
        ip.encode_frame(ip.STDIN, b"x" * ip.MAX_FRAME)
    for length in (0, ip.MAX_FRAME + 1):
        dec = ip.FrameDecoder()
        dec.feed(struct.pack(">IB", length, 1))
        with pytest.raises(InitProtocolError):
            list(dec)


def test_spawn_encoding() -> None:
    spec = ip.SpawnSpec(argv=["sh", b"-c"], env={"A": "1"}, cwd="/w", uid=5, name="s", persistent=True, stdin_null=True)
    raw = spec.encode()
    flags, uid, gid = struct.unpack_from(">III", raw)
    assert flags == ip.F_PERSISTENT | ip.F_STDIN_NULL and uid == 5 and gid == ip.KEEP
    assert raw.endswith(struct.pack(">I", 1) + struct.pack(">I", 3) + b"A=1")


def test_exit_codes() -> None:
    assert ip.Exit(3 << 8).exit_code == 3
    assert ip.Exit(9).exit_code == 137 and ip.Exit(9).signal == 9
    assert os.WIFEXITED(0) and ip.Exit(0).exit_code == 0


def test_spawn_control_flag() -> None:
    flags = struct.unpack_from(">I", ip.SpawnSpec(argv=["bash"], control=True, persistent=True, name="s").encode())[0]
    assert flags == ip.F_CONTROL | ip.F_PERSISTENT and ip.F_CONTROL == 8


def _entry(name: bytes, pid: int, alive: int, status: int, attached: int, rejected: int) -> bytes:
    return struct.pack(">I", len(name)) + name + struct.pack(">IIBiBQ", pid, 7, alive, status, attached, rejected)


def test_list_reply_carries_control_rejections() -> None:
    payload = struct.pack(">I", 2) + _entry(b"s", 5, 1, -1, 1, 3) + _entry(b"t", 6, 0, 2 << 8, 0, 0)
    a, b = ip.parse_list(payload)
    assert (a.name, a.pid, a.alive, a.wait_status, a.attached, a.control_rejected) == ("s", 5, True, None, True, 3)
    assert (b.alive, b.wait_status, b.control_rejected) == (False, 2 << 8, 0)
    for bad in (payload[:-1], payload + b"x", struct.pack(">I", 1) + struct.pack(">I", 99) + b"s"):
        with pytest.raises(InitProtocolError):
            ip.parse_list(bad)


def test_spawn_pty_flag_and_size() -> None:
    raw = ip.SpawnSpec(argv=["bash"], persistent=True, name="s", pty=(40, 120)).encode()
    assert struct.unpack_from(">I", raw)[0] == ip.F_PTY | ip.F_PERSISTENT and ip.F_PTY == 16
    assert raw.endswith(struct.pack(">I", 0) + struct.pack(">II", 40, 120))  # no env, then the size
    assert not ip.SpawnSpec(argv=["bash"]).encode().endswith(struct.pack(">II", 40, 120))


def test_list_reply_of_protocol_3_carries_each_terminal() -> None:
    entries = struct.pack(">I", 2) + _entry(b"s", 5, 1, -1, 1, 0) + _entry(b"t", 6, 1, -1, 0, 0)
    a, b = ip.parse_list(entries + struct.pack(">BHHBHH", 1, 40, 120, 0, 0, 0))
    assert a.pty == (40, 120) and b.pty is None
    assert [p.pty for p in ip.parse_list(entries)] == [None, None]  # protocol 2: no terminals
    with pytest.raises(InitProtocolError):  # a partial trailer is stray bytes
        ip.parse_list(entries + struct.pack(">BHH", 1, 40, 120))


def _conn(*frames: bytes) -> ip.InitConnection:
    reader = asyncio.StreamReader()
    for f in frames:
        reader.feed_data(f)
    reader.feed_eof()
    return ip.InitConnection(reader, None)  # type: ignore[arg-type]  # reading only


def test_control_frames_are_events() -> None:
    async def go() -> list[ip.Event]:
        c = _conn(
            ip.encode_frame(ip.STDOUT, b"DONE:ab:0\0"),  # output stays output, whatever it says
            ip.encode_frame(ip.CONTROL, b"DONE:ab:0\0"),
            ip.encode_frame(ip.CONTROL_REJECTED, struct.pack(">II", 2, 41)),
            ip.encode_frame(ip.EXIT, struct.pack(">i", 0)),
        )
        return [await c.next_event() for _ in range(4)]

    assert asyncio.run(go()) == [
        ip.Stdout(b"DONE:ab:0\0"),
        ip.Control(b"DONE:ab:0\0"),
        ip.ControlRejected(2, 41),
        ip.Exit(0),
    ]

    async def bad() -> None:
        await _conn(ip.encode_frame(ip.CONTROL_REJECTED, b"\0")).next_event()

    with pytest.raises(InitProtocolError):
        asyncio.run(bad())


def test_hello_reports_refused_peers_and_open_connections() -> None:
    class W:  # a writer that accepts the HELLO request
        def write(self, data: bytes) -> None:
            assert data == ip.encode_frame(ip.HELLO)

        async def drain(self) -> None:
            return None

    async def go(payload: bytes) -> ip.Hello:
        reader = asyncio.StreamReader()
        reader.feed_data(ip.encode_frame(ip.HELLO_OK, payload))
        return await ip.InitConnection(reader, W()).hello()  # type: ignore[arg-type]

    assert asyncio.run(go(struct.pack(">IIQI", 2, 1, 5, 3))) == ip.Hello(2, 1, 5, 3)
    assert asyncio.run(go(struct.pack(">IIQ", 2, 1, 5))) == ip.Hello(2, 1, 5, None)  # no count yet
    assert asyncio.run(go(struct.pack(">II", 1, 1))) == ip.Hello(1, 1, 0)  # an old init
    with pytest.raises(InitProtocolError):
        asyncio.run(go(b"\0" * 5))
