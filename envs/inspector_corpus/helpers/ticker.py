"""Appends a line to a log every 0.1 s: a server that keeps writing (corpus helper)."""

import sys
import time

while True:
    with open(sys.argv[1], "a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(0.1)
