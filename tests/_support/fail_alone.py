"""Rank 1 exits with code 3 after the group worked, while the others wait without a collective.

The ranks all-reduce once and leave the process group, so that rank 1's end does not end the
others through gloo: they are still running when fail-fast stops them (tests/test_stop_marks.py).
"""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
print(f"rank {rank} ready", flush=True)
if rank == 1:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(600)
