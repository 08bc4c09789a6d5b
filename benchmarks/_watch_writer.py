"""The job of benchmarks/watching.py: log lines on command, nothing in between.

    _watch_writer.py FOLDER

It prints ``ready``, then reads commands from the FIFO ``FOLDER/ctl-<RANK>`` (blocked in a read, so
a quiet phase costs no CPU on the host): ``paced RATE SECONDS`` writes RATE lines a second for
SECONDS, ``fast COUNT`` writes COUNT lines as fast as it can; each line is 100 bytes, flushed at
once; after each command it prints ``phase done``. It exits when the FIFO ends (the benchmark
closed it, or died).
"""

from __future__ import annotations

import os
import sys
import time

WIDTH = 100


def main() -> None:
    ctl = os.path.join(sys.argv[1], f"ctl-{os.environ.get('RANK', '0')}")
    out = sys.stdout
    print("ready", flush=True)
    pad = "x" * WIDTH
    seq = 0
    with open(ctl) as commands:
        for command in commands:
            words = command.split()
            if words[:1] == ["paced"]:
                rate, seconds = float(words[1]), float(words[2])
                count, began = int(rate * seconds), time.time()
                for n in range(count):
                    wait = began + n / rate - time.time()
                    if wait > 0:
                        time.sleep(wait)
                    head = f"seq={seq} t={time.time():.6f} "
                    out.write(head + pad[: WIDTH - 1 - len(head)] + "\n")
                    out.flush()
                    seq += 1
            elif words[:1] == ["fast"]:
                for _ in range(int(words[1])):
                    head = f"seq={seq} "
                    out.write(head + pad[: WIDTH - 1 - len(head)] + "\n")
                    out.flush()
                    seq += 1
            print("phase done", flush=True)


if __name__ == "__main__":
    main()
