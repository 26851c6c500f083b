from __future__ import annotations

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
