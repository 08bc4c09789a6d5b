"""Minimal smoke test: every rank contributes rank + 1; the sum must be W * (W + 1) / 2.

Run it with `clusterrun up hosts/local.yaml examples/allreduce.py`.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend)
    dist.barrier()  # every rank connected before anything is printed: a failure to connect is a start-up failure
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    print(f"rank={rank} local_rank={local_rank} world_size={world} node_rank={os.environ['GROUP_RANK']} "
          f"host={socket.gethostname()} backend={backend}", flush=True)
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    print(f"allreduce sum={value.item():g} expected={expected:g} {'OK' if value.item() == expected else 'WRONG'}",
          flush=True)
    leave(0 if value.item() == expected else 1)


def leave(code: int) -> None:
    """Exit once every rank is done, without tearing gloo down: torch 2.13's gloo sometimes aborts
    a rank in its teardown (``terminate called without an active exception``, pytorch/pytorch#188266),
    which would fail a job whose work is complete."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
