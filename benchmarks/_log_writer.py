"""The job of benchmarks/logs.py: print numbered, timestamped log lines, flushed one by one.

    _log_writer.py GO_FILE fast COUNT [WIDTH]          COUNT lines as fast as possible
    _log_writer.py GO_FILE paced RATE SECONDS [WIDTH]  RATE lines a second for SECONDS

It first prints ``ready``, then waits until GO_FILE exists (``-`` for no wait: start at once), so
that the benchmark can have every reader connected before the first timed line is written.
Each line is ``seq=<n> t=<time.time()> `` padded with ``x`` to WIDTH bytes (newline included,
default 100) and written with its own flush; a paced writer writes line n at start + n / RATE
(late lines are written at once, never skipped). Last comes ``done lines=<n> seconds=<s>``.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    go, mode = sys.argv[1], sys.argv[2]
    out = sys.stdout
    print("ready", flush=True)
    while go != "-" and not os.path.exists(go):
        time.sleep(0.005)
    if mode == "fast":
        count, rate, width = int(sys.argv[3]), 0.0, int(sys.argv[4]) if len(sys.argv) > 4 else 100
    else:
        rate, seconds = float(sys.argv[3]), float(sys.argv[4])
        count, width = int(rate * seconds), int(sys.argv[5]) if len(sys.argv) > 5 else 100
    pad = "x" * width
    began = time.time()
    clock = time.time
    for n in range(count):
        if rate:
            wait = began + n / rate - clock()
            if wait > 0:
                time.sleep(wait)
        head = f"seq={n} t={clock():.6f} "
        out.write(head + pad[: width - 1 - len(head)] + "\n")
        out.flush()
    print(f"done lines={count} seconds={time.time() - began:.3f}", flush=True)


if __name__ == "__main__":
    main()
