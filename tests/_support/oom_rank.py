"""One rank runs out of memory in a memory cgroup of its own while the others block in a collective.

    oom_rank.py RANK CGROUP   rank RANK moves itself into CGROUP (a cgroup v1 memory cgroup with a small
                              memory.limit_in_bytes, made by the test) and allocates until the kernel's
                              OOM killer kills it; it exits 3 if it was not killed after 4 GiB

Only that rank is in the cgroup: its memory before the move stays charged where it was, what it
allocates after counts against the limit.
"""

import os
import sys

import torch
import torch.distributed as dist

target, cgroup = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
dist.barrier()
if rank == target:
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
    print(f"rank {rank} (pid {os.getpid()}) allocates in {cgroup}", flush=True)
    held = [bytearray(16 << 20) for _ in range(256)]  # zero-filled: every page is touched, and charged
    print(f"rank {rank} was not killed after {len(held) * 16} MiB", flush=True)
    sys.exit(3)
tensor = torch.ones(1)
dist.all_reduce(tensor)  # blocks: the killed rank never joins
print(f"rank {rank} should never get here", flush=True)
