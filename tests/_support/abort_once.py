"""Rank 1 aborts as gloo sometimes does while connecting, the first time only; then an all-reduce.

    abort_once.py MARKER    the first run (MARKER absent) creates MARKER and rank 1 aborts (SIGABRT)
                            before joining the process group, with gloo's last words
"""

import os
import sys

import torch
import torch.distributed as dist

marker = sys.argv[1]
if int(os.environ["RANK"]) == 1 and not os.path.exists(marker):
    open(marker, "w").close()
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()
dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} sum={int(tensor.item())}", flush=True)
dist.destroy_process_group()
