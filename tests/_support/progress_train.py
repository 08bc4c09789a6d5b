"""A real DDP training (gloo, CPU) whose rank 0 reports its progress the way a known tool does.

    progress_train.py FORMAT STEPS GATE [LATER]     FORMAT: tqdm, lightning, hf, nanogpt, torchtitan, examples

Every step all-reduces the gradients of a tiny model; rank 0 prints its progress in FORMAT (tqdm's
own bar where the tool uses one). Halfway, every rank waits until the file GATE exists (so that a
test can look at the job while it runs), and at three quarters until LATER does if given; then the
training goes on to STEPS and ends.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import tqdm
from torch.nn.parallel import DistributedDataParallel

fmt, steps, gate = sys.argv[1], int(sys.argv[2]), sys.argv[3]
later = sys.argv[4] if len(sys.argv) > 4 else None
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data, target = torch.randn(64, 8), torch.randn(64, 1)
titan = logging.getLogger("root")
if rank == 0 and fmt == "torchtitan":  # torchtitan's own logging set-up, colours included
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    titan.addHandler(handler)
    titan.setLevel(logging.INFO)

bar = None
if rank == 0 and fmt in ("tqdm", "lightning", "hf"):
    options = {"bar_format": "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
               "desc": "Epoch 0"} if fmt == "lightning" else {}
    bar = tqdm.tqdm(total=steps, mininterval=0, file=sys.stderr, **options)  # type: ignore[arg-type]


def step_once() -> float:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(data), target)
    loss.backward()
    opt.step()
    return float(loss.item())


for step in range(1, steps + 1):
    began = time.time()
    loss = step_once()
    if rank == 0:
        if bar is not None:
            if fmt == "tqdm":
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            elif fmt == "lightning":
                bar.set_postfix({"v_num": 0, "train_loss": f"{loss:.3f}"}, refresh=False)
            bar.update(1)
            if fmt == "hf" and step % 5 == 0:  # the Trainer's logging_steps: its dict, written through the bar
                bar.write(str({"loss": f"{loss:.4g}", "grad_norm": "0.5", "learning_rate": "5e-05",
                               "epoch": f"{step / steps:.4g}"}))
        elif fmt == "nanogpt":
            print(f"iter {step}: loss {loss:.4f}, time {(time.time() - began) * 1000:.2f}ms, mfu -100.00%")
        elif fmt == "torchtitan":
            titan.info(f"\033[31mstep: {step:2}  \033[32mloss: {loss:7.4f}  \033[33mmemory:  0.00GiB(0.00%)  "
                       f"\033[34mtps: 1,234  \033[36mtflops: 0.00  \033[35mmfu: 0.00%\033[39m")
        elif fmt == "examples":
            print(f"Train Epoch: 1 [{step * 64}/{steps * 64} ({100.0 * step / steps:.0f}%)]\tLoss: {loss:.6f}")
    waits = gate if step == steps // 2 else later if step == steps * 3 // 4 else None
    if waits is not None:
        while not os.path.exists(waits):
            time.sleep(0.1)
        dist.barrier()
    else:
        time.sleep(0.05)
if bar is not None:
    bar.close()
dist.destroy_process_group()
