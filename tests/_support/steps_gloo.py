"""A real gloo job of STEPS all_reduce steps, SECONDS apart: each rank prints ``step N rank=R host=H sum=S``
(S checked against the world size) and, once every step is done, ``done rank=R``. The exit skips gloo's
teardown as examples/allreduce.py does (pytorch/pytorch#188266).

Usage: steps_gloo.py STEPS SECONDS
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist

steps, apart = int(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(1, steps + 1):
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    assert value.item() == world, value
    print(f"step {step} rank={rank} host={socket.gethostname()} sum={value.item():g}", flush=True)
    time.sleep(apart)
print(f"done rank={rank}", flush=True)
os._exit(0)
