"""Ranks in a gloo all_reduce while one rank (``SPIN_RANK``, default the last) spins in Python
before it, printing nothing: the busy rank a hang report must name (tests/test_watch_e2e.py)."""

import os

print(f"rank {os.environ['RANK']} starts", flush=True)  # before torch's import: the job's first output

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def spin() -> None:
    count = 0
    while True:
        count += 1


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spinner = int(os.environ.get("SPIN_RANK", world - 1))
    print(f"rank {rank} {'spins' if rank == spinner else 'reduces'}", flush=True)
    if rank == spinner:
        spin()
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    main()
