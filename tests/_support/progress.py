"""A job that progresses without a word from most of its ranks: every rank computes and
all_reduces in steps of about argv[3] seconds for argv[1] seconds; only rank 0 writes, every
argv[2] seconds, its step as a progress bar does (on stderr, the line redrawn after a carriage
return, ended once at the end), and a line while torch is imported and the process group formed
(a test's hang_after is shorter than that start on a busy machine); the other nodes write nothing
at all. Rank 0 decides when to stop (a flag in the all_reduce); every rank exits 0."""

import os
import sys
import threading
import time

rank = int(os.environ["RANK"])
duration, every, step = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
started = threading.Event()


def starting() -> None:
    while not started.wait(every):
        print("rank 0 starts", flush=True)


if rank == 0:
    print("rank 0 starts", flush=True)
    threading.Thread(target=starting, daemon=True).start()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def compute(seconds: float) -> None:
    """Work without a word for ``seconds``: matrix products."""
    a = torch.rand(64, 64)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def main() -> None:
    dist.init_process_group("gloo")
    started.set()
    begun = printed = time.monotonic()
    steps = 0
    while True:
        compute(step)
        go = torch.tensor([1.0 if rank != 0 or time.monotonic() - begun < duration else 0.0])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        steps += 1
        if rank == 0 and time.monotonic() - printed >= every:
            sys.stderr.write(f"\rstep {steps}")
            sys.stderr.flush()
            printed = time.monotonic()
        if go.item() == 0.0:
            break
    if rank == 0:
        sys.stderr.write("\n")
        print(f"rank 0 done after {steps} steps", flush=True)
    os._exit(0)  # gloo's teardown may hang (pytorch/pytorch#188266), as examples/allreduce.py says


if __name__ == "__main__":
    main()
