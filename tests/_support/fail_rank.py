"""One rank fails (exit code or exception) while the others block in a collective.

    fail_rank.py RANK exit CODE       rank RANK prints a line and exits with CODE
    fail_rank.py RANK raise MESSAGE   rank RANK raises RuntimeError(MESSAGE), no @record
    fail_rank.py RANK kill SIGNAL     rank RANK sends itself SIGNAL (a number), as the OOM killer sends 9
"""

import os
import sys
import time

import torch
import torch.distributed as dist

target, how, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
dist.barrier()
if rank == target:
    time.sleep(0.5)
    print(f"rank {rank} is about to fail", flush=True)
    if how == "exit":
        os._exit(int(what))
    if how == "kill":
        os.kill(os.getpid(), int(what))
    raise RuntimeError(what)
tensor = torch.ones(1)
dist.all_reduce(tensor)  # blocks: the failing rank never joins
print(f"rank {rank} should never get here", flush=True)
