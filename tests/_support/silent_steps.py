"""Ranks that work for argv[1] seconds without a word, each through the five phases of a step
one second apart by its clock (two looks 1-4 s apart find it in two phases: its stacks moved),
then meet in a barrier; each rank writes one line before: the job's last output until then."""

import os
import sys
import time

import torch
import torch.distributed as dist


def gather(a: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ a)


def forward(a: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(a @ a.T)


def backward(a: torch.Tensor) -> torch.Tensor:
    return torch.relu(a.T @ a) / 64


def scatter(a: torch.Tensor) -> torch.Tensor:
    return torch.softmax(a @ a, dim=1)


def update(a: torch.Tensor) -> torch.Tensor:
    return torch.cos(a @ a)


PHASES = (gather, forward, backward, scatter, update)


def main() -> None:
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} works", flush=True)
    a = torch.rand(64, 64)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        a = PHASES[int(time.monotonic()) % len(PHASES)](a)
    dist.barrier()
    os._exit(0)  # gloo's teardown may hang (pytorch/pytorch#188266)


if __name__ == "__main__":
    main()
