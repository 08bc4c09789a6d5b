"""The recovery benchmark's job (benchmarks/recovery.py): a real gloo job that fails once.

Every rank prints ``JOINED <attempt> <rank> <wall time>`` once the process group is up and a first
all_reduce has gone round. In the first run (no file FLAG yet) the last rank writes FLAG with the
wall time and exits 1 two seconds later; the others wait in an all_reduce (and fail in it). In the
next run every rank does one more all_reduce and exits 0. ``ATTEMPT`` is torchrun's restart count
(its own ``--max-restarts``) or clusterrun's attempt (``CLUSTERRUN_JOB=<job>.<node>.<attempt>``).

Usage: _recover_train.py FLAG
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

flag = Path(sys.argv[1])
marker = os.environ.get("CLUSTERRUN_JOB", "")
attempt = marker.rsplit(".", 1)[-1] if marker else str(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.ones(1)
dist.all_reduce(value)
print(f"JOINED {attempt} {rank} {time.time():.6f}", flush=True)
if not flag.exists():
    if rank == world - 1:
        time.sleep(2)
        flag.write_text(f"{time.time():.6f}\n")
        os._exit(1)
    dist.all_reduce(value)  # fails when the last rank is gone
    os._exit(1)
dist.all_reduce(value)
print(f"DONE {attempt} {rank}", flush=True)
os._exit(0)  # skips gloo's teardown (pytorch/pytorch#188266)
