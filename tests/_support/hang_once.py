"""The last rank stalls before a barrier once, so that every rank goes silent: a hang.

    hang_once.py FLAG

In the first run (no FLAG yet) the last rank writes FLAG and sleeps while the others wait in the
barrier; in the next run every rank passes it and exits 0. Each rank says where it is before and
after importing torch, so that only the stall is a silence longer than a few seconds.
"""

import os
import sys
import time

print(f"rank {os.environ['RANK']} imports torch", flush=True)
import torch.distributed as dist  # noqa: E402


def stall() -> None:
    time.sleep(600)


def main() -> None:
    flag = sys.argv[1]
    again = os.path.exists(flag)  # read before the stalling rank writes it, after the rendezvous
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stalls = rank == world - 1 and not again
    print(f"rank {rank} {'stalls' if stalls else 'waits'}", flush=True)
    if stalls:
        open(flag, "w").close()
        stall()
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    os._exit(0)  # skips gloo's teardown (pytorch/pytorch#188266)


if __name__ == "__main__":
    main()
