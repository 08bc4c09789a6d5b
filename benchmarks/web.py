"""`clusterrun web`'s CPU while viewers watch a job: a quiet job, then RATE lines/s, with VIEWERS viewers.

    python benchmarks/web.py [--rate 100] [--viewers 3] [--seconds 60]

Starts a real job on two local nodes (``up -d``, the counter of tests/_support printing RATE lines/s in
all), one ``clusterrun web`` and VIEWERS event streams of the job's page (plain HTTP clients reading
them as a browser's EventSource does). Once every viewer has a line, it reads the server's CPU time
(``utime + stime`` of ``/proc/PID/stat``) and that of its node readers (the agents' ``follow``, its
children), waits SECONDS, and reads them again; the lines each viewer got in that time are counted
(each must get them all). The same is measured first with the job quiet (the counter waiting at its gate:
it prints nothing), which should cost the server nothing measurable. Everything it started is
stopped at the end (``down``, the server by its pid) and its folder removed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._pump import cpu_seconds as cpu  # noqa: E402


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(p) for p in text]
    return found


def tree_cpu(pid: int) -> float:
    """CPU seconds of the live descendants of ``pid`` (the node readers' agents)."""
    total = 0.0
    for child in children(pid):
        try:
            total += cpu(child) + tree_cpu(child)
        except OSError:
            pass
    return total


class Viewer(threading.Thread):
    """One event stream, read to the end; counts the log lines it carried."""

    def __init__(self, url: str, cookie: str) -> None:
        super().__init__(daemon=True)
        self.request = urllib.request.Request(url, headers={"Cookie": cookie})
        self.lines = 0

    def run(self) -> None:
        with urllib.request.urlopen(self.request) as stream:
            for raw in stream:
                self.lines += raw.count(b'class="l"')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--viewers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()

    def leave(signum: int, frame: object) -> None:  # SIGTERM, SIGHUP: through the finally below, as Ctrl-C
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)
    work = Path(tempfile.mkdtemp(prefix="clusterrun-web-bench-"))
    env = {**os.environ, "XDG_STATE_HOME": str(work / "controller"), "PYTHONPATH": str(ROOT)}
    hosts = work / "hosts.yaml"
    hosts.write_text(f"state_dir: {work / 'hosts'}\ndefaults:\n  transport: local\n  nproc: 1\n"
                     "hosts:\n  - local-a\n  - local-b\n")
    gate = work / "gate"
    count = int(args.rate / 2 * (args.seconds * 2 + 600))  # each rank's lines: enough for the whole run
    jobs: list[str] = []
    server: subprocess.Popen[str] | None = None
    try:
        # the quiet job prints one line, then waits for the gate (made at the end): a job that prints nothing
        for name, script_args in (("webbench", ["2", "0", str(gate)]),
                                  ("webbench-busy", [str(count), str(2 / args.rate)])):
            up = subprocess.run([sys.executable, "-m", "clusterrun", "up", "-d", "--name", name, hosts,
                                 ROOT / "tests/_support/counter.py", *script_args],
                                capture_output=True, text=True, env=env, cwd=work, check=True)
            jobs.append(up.stdout.strip())
        quiet_job, busy_job = jobs
        server = subprocess.Popen([sys.executable, "-m", "clusterrun", "web", "--port", "0"], env=env, cwd=work,
                                  stderr=subprocess.PIPE, text=True)
        assert server.stderr is not None
        found = re.search(r"(http://[^/]+)/\?token=(\S+)", server.stderr.readline())
        assert found, "no URL"
        base, cookie = found.group(1), f"clusterrun_web={found.group(2)}"
        for job, label in ((quiet_job, "quiet job"), (busy_job, f"{args.rate:g} lines/s")):
            viewers = [Viewer(f"{base}/jobs/{job}/stream?tail=0", cookie) for _ in range(args.viewers)]
            for viewer in viewers:
                viewer.start()
            if job == busy_job:
                while min(v.lines for v in viewers) == 0:
                    time.sleep(0.1)
            time.sleep(5)  # the readers' agents started, the pages' first lines sent
            before, agents_before, lines_before = cpu(server.pid), tree_cpu(server.pid), [v.lines for v in viewers]
            time.sleep(args.seconds)
            used, agents = cpu(server.pid) - before, tree_cpu(server.pid) - agents_before
            got = [v.lines - b for v, b in zip(viewers, lines_before, strict=True)]
            print(f"{label}, {args.viewers} viewers, {args.seconds:g} s: server {used:.2f} s CPU "
                  f"({100 * used / args.seconds:.2f} % of a core); its node readers (agents) {agents:.2f} s "
                  f"({100 * agents / args.seconds:.2f} %); lines per viewer {got}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        gate.touch()
        for job in jobs:
            subprocess.run([sys.executable, "-m", "clusterrun", "down", job], capture_output=True, env=env, cwd=work)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
