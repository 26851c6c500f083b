"""crabd.util.libc.ioctl: the ioctl(2) the btrfs calls use (it lets other threads run, unlike fcntl.ioctl)."""

from __future__ import annotations

import errno
import socket
import struct
import termios

import pytest

from crabd.util import libc


def test_the_argument_is_read_and_written_in_place() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"hello")
        buf = bytearray(4096)  # larger than fcntl.ioctl's 1024-byte copy: the size of btrfs's arguments
        assert libc.ioctl(b.fileno(), termios.FIONREAD, buf) == 0
        assert struct.unpack_from("i", buf)[0] == 5


def test_a_failure_is_an_oserror_with_its_errno() -> None:
    a, b = socket.socketpair()
    fd = a.fileno()
    a.close()
    b.close()
    with pytest.raises(OSError) as exc:
        libc.ioctl(fd, termios.FIONREAD, bytearray(8))
    assert exc.value.errno == errno.EBADF
