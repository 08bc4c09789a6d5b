"""Fails until its Nth run: each run of rank 0 adds a line to COUNTER; it exits 1 while fewer than N.

    fail_until.py COUNTER N
"""

import os
import sys

counter, needed = sys.argv[1], int(sys.argv[2])
if os.environ["RANK"] == "0":
    with open(counter, "a") as f:
        f.write("run\n")
    with open(counter) as f:
        runs = len(f.readlines())
    print(f"run {runs}", flush=True)
    sys.exit(0 if runs >= needed else 1)
