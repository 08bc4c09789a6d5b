"""Ranks blocked in a gloo barrier while one rank (``STACK_LATE_RANK``, default the last) sleeps
before it: the stacks ``clusterrun stack`` must show, grouped (tests/test_stack.py)."""

import os
import sys
import time

import torch.distributed as dist


def linger(seconds: float) -> None:
    time.sleep(seconds)


def wait_for_peers() -> None:
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    late = int(os.environ.get("STACK_LATE_RANK", world - 1))
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 600.0
    print(f"rank {rank} {'lingers' if rank == late else 'waits'}", flush=True)
    if rank == late:
        linger(seconds)
    wait_for_peers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
