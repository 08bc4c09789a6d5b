"""A worker that makes stopping hard, recording every process it creates in PIDDIR.

Rank 0 ignores SIGTERM itself; every rank starts a child that calls setsid, a double-forked
grandchild (orphaned, so re-parented to the nearest subreaper) and a child under `env -i`
(which loses clusterrun's marker variable). Each process writes `<pid> <start time>` to
PIDDIR/<name>.pid once it runs, then they all sleep.
"""

import os
import signal
import subprocess
import sys
import time

piddir = sys.argv[1]
rank = os.environ["RANK"]
SLEEPER = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.argv[2] == 'setsid':\n"
    "    os.setsid()\n"
    "start = open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]\n"
    "open(sys.argv[1] + '.tmp', 'w').write('%d %s' % (os.getpid(), start))\n"
    "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "time.sleep(3600)\n"
)


def record(name: str) -> None:
    start = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
    with open(os.path.join(piddir, name + ".tmp"), "w") as f:
        f.write(f"{os.getpid()} {start}")
    os.rename(os.path.join(piddir, name + ".tmp"), os.path.join(piddir, name))


def sleeper(name: str, setsid: bool = False, env: dict | None = None) -> subprocess.Popen:
    """A child that ignores SIGTERM too."""
    argv = [sys.executable, "-c", SLEEPER, os.path.join(piddir, name), "setsid" if setsid else "-"]
    return subprocess.Popen(argv, env=env)


if rank == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sleeper(f"rank{rank}-setsid.pid", setsid=True)
sleeper(f"rank{rank}-env-i.pid", env={})  # like `env -i`: no CLUSTERRUN_JOB marker
if os.fork() == 0:  # double fork: the grandchild is orphaned at once
    if os.fork() == 0:
        os.setsid()
        record(f"rank{rank}-grandchild.pid")
        time.sleep(3600)
    os._exit(0)
record(f"rank{rank}-worker.pid")
print(f"rank {rank} hostile and ready", flush=True)
time.sleep(3600)
