"""Appends numbered lines in a loop that outlives the turn (adversarial corpus helper).

    appender.py PATH N DELAY &    line i (0..N-1) through one O_APPEND fd, DELAY s apart, then exit

A full checkpoint taken mid-run must hold the file and the process at the
same instant: restored, the process goes on from its own counter, and the
file ends as exactly N lines 0..N-1 only if the two agree (lines missing
or repeated otherwise).
"""

import os
import sys
import time

path, n, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
for i in range(n):
    os.write(fd, f"{i}\n".encode())
    if delay:
        time.sleep(delay)
os.close(fd)
