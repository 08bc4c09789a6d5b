"""A real job (gloo) whose rank 1 fails once, when the test says: each run prints lines until then.

    fail_once_gated.py COUNTER GATE

Rank 0 counts the runs in COUNTER and tells every rank its number (a broadcast). Each rank prints
``run R rank K line I`` every 0.1 s. In run 1, once GATE exists, rank 1 exits 1 (a restart policy
starts run 2); later runs print on until stopped.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

counter, gate = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
runs = torch.zeros(1)
if rank == 0:
    with open(counter, "a") as f:
        f.write("run\n")
    with open(counter) as f:
        runs += len(f.readlines())
dist.broadcast(runs, 0)
run = int(runs.item())
line = 0
while True:
    print(f"run {run} rank {rank} line {line}", flush=True)
    line += 1
    if run == 1 and rank == 1 and os.path.exists(gate):
        print(f"run {run} rank {rank} fails", flush=True)
        sys.exit(1)
    time.sleep(0.1)
