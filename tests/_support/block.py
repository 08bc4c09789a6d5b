"""Each rank prints `rank R ready`, then waits without output or CPU: until the file argv[1]
exists (checked every 0.5 s) and exits 0, or, without an argument, for ten minutes (a hang)."""

import os
import sys
import time

print(f"rank {os.environ['RANK']} ready", flush=True)
if len(sys.argv) < 2:
    time.sleep(600)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.5)
print(f"rank {os.environ['RANK']} done", flush=True)
