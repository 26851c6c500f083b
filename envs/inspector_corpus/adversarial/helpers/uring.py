"""io_uring without liburing: raw syscalls through ctypes (adversarial corpus helper).

    uring.py write FD OFFSET TEXT     write TEXT into an inherited fd (OFFSET -1: at its position)
    uring.py create PATH TEXT         openat, write and close, all three as ring operations
    uring.py rename OLD NEW           renameat as a ring operation
    uring.py unlink PATH              unlinkat as a ring operation

Every file operation goes through the ring, so no open/write/rename
syscall of this process names the file: only io_uring_setup and
io_uring_enter are seen.  Exits 0 when every operation succeeded.
"""

import ctypes
import mmap
import os
import struct
import sys

SETUP, ENTER = 425, 426
OP_OPENAT, OP_CLOSE, OP_WRITE, OP_RENAMEAT, OP_UNLINKAT = 18, 19, 23, 35, 36
AT_FDCWD = -100
OFF_SQ_RING, OFF_SQES = 0, 0x10000000
ENTER_GETEVENTS = 1

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keep = []  # buffers the kernel reads must outlive their operation


def cstr(s):
    b = ctypes.create_string_buffer(s.encode() if isinstance(s, str) else s)
    keep.append(b)
    return ctypes.addressof(b), len(b) - 1


class Ring:
    def __init__(self, entries=8):
        params = ctypes.create_string_buffer(120)
        fd = libc.syscall(SETUP, entries, params)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "io_uring_setup")
        self.fd = fd
        p = params.raw
        self.sq_entries, self.cq_entries = struct.unpack_from("II", p, 0)
        sq = struct.unpack_from("IIIIIIII", p, 40)  # head tail mask entries flags dropped array resv
        cq = struct.unpack_from("IIIIIIII", p, 80)  # head tail mask entries overflow cqes flags resv
        self.sq_head, self.sq_tail, self.sq_mask, self.sq_array = sq[0], sq[1], sq[2], sq[6]
        self.cq_head, self.cq_tail, self.cq_mask, self.cqes = cq[0], cq[1], cq[2], cq[5]
        size = max(self.sq_array + self.sq_entries * 4, self.cqes + self.cq_entries * 16)
        # IORING_FEAT_SINGLE_MMAP (every kernel since 5.4): one mapping holds both rings.
        self.ring = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=OFF_SQ_RING)
        self.sqes = mmap.mmap(fd, self.sq_entries * 64, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=OFF_SQES)

    def u32(self, off):
        return struct.unpack_from("I", self.ring, off)[0]

    def run(self, opcode, fd=0, off=0, addr=0, length=0, op_flags=0):
        tail = self.u32(self.sq_tail)
        i = tail & self.sq_mask
        sqe = struct.pack("<BBHiQQIIQHHiQQ", opcode, 0, 0, fd, off & (2**64 - 1), addr, length, op_flags, 7, 0, 0, 0, 0, 0)
        self.sqes[i * 64 : i * 64 + 64] = sqe
        struct.pack_into("I", self.ring, self.sq_array + i * 4, i)
        struct.pack_into("I", self.ring, self.sq_tail, tail + 1)
        n = libc.syscall(ENTER, self.fd, 1, 1, ENTER_GETEVENTS, None, 0)
        if n < 0:
            raise OSError(ctypes.get_errno(), "io_uring_enter")
        head = self.u32(self.cq_head)
        _, res, _ = struct.unpack_from("<QiI", self.ring, self.cqes + (head & self.cq_mask) * 16)
        struct.pack_into("I", self.ring, self.cq_head, head + 1)
        if res < 0:
            raise OSError(-res, f"io_uring op {opcode}")
        return res


def main(argv):
    r = Ring()
    op = argv[0]
    if op == "write":
        fd, off, text = int(argv[1]), int(argv[2]), argv[3]
        a, n = cstr(text)
        r.run(OP_WRITE, fd=fd, off=off, addr=a, length=n)
    elif op == "create":
        a, _ = cstr(argv[1])
        fd = r.run(OP_OPENAT, fd=AT_FDCWD, addr=a, length=0o644, op_flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        b, n = cstr(argv[2])
        r.run(OP_WRITE, fd=fd, off=0, addr=b, length=n)
        r.run(OP_CLOSE, fd=fd)
    elif op == "rename":
        a, _ = cstr(argv[1])
        b, _ = cstr(argv[2])
        # RENAMEAT: fd = old dirfd, addr = old path, len = new dirfd, off (addr2) = new path.
        r.run(OP_RENAMEAT, fd=AT_FDCWD, addr=a, length=AT_FDCWD & 0xFFFFFFFF, off=b)
    elif op == "unlink":
        a, _ = cstr(argv[1])
        r.run(OP_UNLINKAT, fd=AT_FDCWD, addr=a)
    else:
        raise SystemExit(f"unknown operation {op}")


if __name__ == "__main__":
    main(sys.argv[1:])
