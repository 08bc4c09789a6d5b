"""An all_reduce over gloo that prints, per rank, the interface variables it saw and the address gloo used.

Each rank prints ``NET rank=R host=H gloo_ifname=X nccl_ifname=Y sum=S expected=E``; the exit skips gloo's
teardown as examples/allreduce.py does (pytorch/pytorch#188266).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"NET rank={rank} host={socket.gethostname()} gloo_ifname={os.environ.get('GLOO_SOCKET_IFNAME')} "
      f"nccl_ifname={os.environ.get('NCCL_SOCKET_IFNAME')} sum={value.item():g} expected={world * (world + 1) / 2:g}",
      flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
