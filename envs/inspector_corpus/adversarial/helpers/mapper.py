"""Writes a file only through a shared mapping, on SIGUSR1 (adversarial corpus helper).

    mapper.py PATH &      map PATH (MAP_SHARED, writable), close the fd, write "A..." at 0, wait
    kill -USR1 PID        write the next letter ("B...", "C...") over the first 8 bytes

The fd is closed at once: afterwards no syscall of this process names the
file.  Its page stays dirty and writable in the page table between the
writes, so the later writes fault nothing and leave the file's mtime and
ctime alone (the kernel updates them on the first write fault after a
writeback, at most every 30 s here): only the content changes.
"""

import mmap
import os
import signal
import sys

fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)
letter = [ord("A")]
m[0:8] = bytes([letter[0]]) * 8


def poke(signum, frame):
    letter[0] += 1
    m[0:8] = bytes([letter[0]]) * 8


signal.signal(signal.SIGUSR1, poke)
while True:
    signal.pause()
