"""Raw system calls the adversarial corpus needs and bookworm's tools lack (corpus helper).

    sysc.py exchange A B           renameat2(RENAME_EXCHANGE)
    sysc.py noreplace A B          renameat2(RENAME_NOREPLACE)
    sysc.py fchmodat2 PATH MODE    fchmodat2 (Linux 6.6; MODE in octal)
    sysc.py setxattrat PATH NAME VALUE   setxattrat (Linux 6.13)
    sysc.py mprotect FD TEXT       mmap FD read-only shared, mprotect it writable, write TEXT at 0
    sysc.py tmpfile DIR NAME TEXT  open(DIR, O_TMPFILE), write, link it in as DIR/NAME via /proc/self/fd
    sysc.py getfd PID FD TEXT      pidfd_getfd another process's FD and write TEXT through it
    sysc.py aio FD OFFSET TEXT     Linux AIO (io_submit) pwrite of TEXT into an inherited FD

Exits non-zero (with the errno) when the kernel or the sandbox's seccomp
profile refuses the call: the corpus then records the refusal, not a write.
"""

import ctypes
import mmap
import os
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
AT_FDCWD = -100
NR = {"renameat2": 316, "fchmodat2": 452, "setxattrat": 463, "pidfd_open": 434, "pidfd_getfd": 438,
      "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209}  # fmt: skip


def call(name, *args):
    r = libc.syscall(NR[name], *args)
    if r < 0:
        e = ctypes.get_errno()
        raise SystemExit(f"{name}: {os.strerror(e)} (errno {e})")
    return r


def b(s):
    return s.encode()


def main(argv):
    op = argv[0]
    if op in ("exchange", "noreplace"):
        call("renameat2", AT_FDCWD, b(argv[1]), AT_FDCWD, b(argv[2]), 2 if op == "exchange" else 1)
    elif op == "fchmodat2":
        call("fchmodat2", AT_FDCWD, b(argv[1]), int(argv[2], 8), 0)
    elif op == "setxattrat":
        value = ctypes.create_string_buffer(b(argv[3]))
        args = struct.pack("<QII", ctypes.addressof(value), len(argv[3]), 0)
        call("setxattrat", AT_FDCWD, b(argv[1]), 0, b(argv[2]), args, len(args))
    elif op == "mprotect":
        fd, text = int(argv[1]), b(argv[2])
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise SystemExit(f"mmap: {os.strerror(ctypes.get_errno())}")
        if libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise SystemExit(f"mprotect: {os.strerror(ctypes.get_errno())}")
        ctypes.memmove(addr, text, min(len(text), size))
        libc.msync(addr, size, 4)  # MS_SYNC
        libc.munmap(addr, size)
    elif op == "tmpfile":
        fd = os.open(argv[1], os.O_TMPFILE | os.O_WRONLY, 0o644)
        os.write(fd, b(argv[3]))
        os.link(f"/proc/self/fd/{fd}", os.path.join(argv[1], argv[2]), follow_symlinks=True)
        os.close(fd)
    elif op == "getfd":
        pidfd = call("pidfd_open", int(argv[1]), 0)
        fd = call("pidfd_getfd", pidfd, int(argv[2]), 0)
        os.write(fd, b(argv[3]))
    elif op == "aio":
        fd, off, text = int(argv[1]), int(argv[2]), ctypes.create_string_buffer(b(argv[3]))
        ctx = ctypes.c_ulong(0)
        call("io_setup", 4, ctypes.byref(ctx))
        iocb = ctypes.create_string_buffer(64)
        # struct iocb: data, key, rw_flags, opcode (1 = PWRITE), reqprio, fildes, buf, nbytes, offset, ...
        struct.pack_into("<QIIHhIQQq", iocb, 0, 0, 0, 0, 1, 0, fd, ctypes.addressof(text), len(argv[3]), off)
        ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(iocb))
        call("io_submit", ctx, 1, ptrs)
        events = ctypes.create_string_buffer(32)
        call("io_getevents", ctx, 1, 1, events, None)
        res = struct.unpack_from("<q", events, 16)[0]
        call("io_destroy", ctx)
        if res < 0:
            raise SystemExit(f"aio pwrite: {os.strerror(-res)}")
    else:
        raise SystemExit(f"unknown operation {op}")


if __name__ == "__main__":
    main(sys.argv[1:])
