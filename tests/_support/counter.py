"""Each rank prints `rank R line I` for I in 0..COUNT-1, DELAY seconds apart, then `rank R done`.

With a third argument GATE (a path), each rank prints its first half, then waits for the file GATE
to exist before it prints the rest: a test decides when the job may end. A ``{rank}`` in GATE is
the rank's number: each rank has a gate of its own (a test decides which node ends first)."""

import os
import sys
import time

count, delay = int(sys.argv[1]), float(sys.argv[2])
rank = os.environ["RANK"]
gate = sys.argv[3].replace("{rank}", rank) if len(sys.argv) > 3 else None
for i in range(count):
    if gate and i == count // 2:
        while not os.path.exists(gate):
            time.sleep(0.02)
    print(f"rank {rank} line {i}", flush=True)
    time.sleep(delay)
print(f"rank {rank} done", flush=True)
