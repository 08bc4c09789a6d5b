"""A small but real DDP training run on synthetic data.

Every rank trains the same model on its shard of the data (DistributedSampler); gradients are
averaged by DistributedDataParallel. gloo on CPU, nccl when CUDA is available. At the end the
ranks all-gather a checksum of their parameters: DDP keeps replicas identical, so they must agree.

    clusterrun up hosts/local.yaml examples/train.py -- --epochs 3
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def synthetic_data(samples: int) -> TensorDataset:
    """y = x · w + noise, the same on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen)
    y = x @ w + 0.01 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    dist.barrier()  # every rank connected before anything is printed: a failure to connect is a start-up failure
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    print(f"RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world} NODE_RANK={os.environ['GROUP_RANK']} "
          f"host={socket.gethostname()} device={device}", flush=True)

    torch.manual_seed(1234)  # DDP also broadcasts rank 0's initial weights
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    data = synthetic_data(args.samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    optimiser = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimiser.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimiser.step()
            total, batches = total + loss.item(), batches + 1
        mean = torch.tensor([total / batches], device=device)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {mean.item() / world:.5f}", flush=True)

    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    gathered = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    values = [g.item() for g in gathered]
    agree = all(abs(v - values[0]) < 1e-9 for v in values)
    if rank == 0:
        print(f"parameters {'agree' if agree else 'DIFFER'} across {world} ranks: checksum={values[0]:.9f}",
              flush=True)
    leave(0 if agree else 1)


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
