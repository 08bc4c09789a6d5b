"""Import a module before joining the process group, as a training script does; then an all-reduce.

    import_module.py MODULE     every rank imports MODULE (ModuleNotFoundError where it is missing)
"""

import importlib
import sys

import torch
import torch.distributed as dist

importlib.import_module(sys.argv[1])
dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} sum={int(tensor.item())}", flush=True)
dist.destroy_process_group()
