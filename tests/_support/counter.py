"""Each rank prints `rank R line I` for I in 0..COUNT-1, DELAY seconds apart, then `rank R done`."""

import os
import sys
import time

count, delay = int(sys.argv[1]), float(sys.argv[2])
rank = os.environ["RANK"]
for i in range(count):
    print(f"rank {rank} line {i}", flush=True)
    time.sleep(delay)
print(f"rank {rank} done", flush=True)
