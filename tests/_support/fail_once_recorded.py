"""One rank fails once, under torch elastic's ``@record``, while the others wait ignoring SIGTERM.

    fail_once_recorded.py FLAG RANK MESSAGE

In the first run (no FLAG yet) rank RANK writes FLAG and raises RuntimeError(MESSAGE) (its error
file written by ``@record``); the other ranks ignore SIGTERM and sleep, so torchrun's own teardown
cannot end before its stop timeout. In the next run every rank passes a barrier and exits 0.
"""

import os
import signal
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    flag, target, message = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    again = os.path.exists(flag)  # before the barrier, after which the failing rank writes it
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    print(f"rank {rank} joined", flush=True)
    if again:
        dist.barrier()
        os._exit(0)  # skips gloo's teardown (pytorch/pytorch#188266)
    if rank == target:
        with open(flag, "w") as f:
            f.write("failed\n")
        print(f"rank {rank} is about to fail", flush=True)
        raise RuntimeError(message)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


if __name__ == "__main__":
    main()
