"""A worker whose processes make stopping hard, every kind at once: argv PIDDIR [fail RANK].

The rank ignores SIGTERM and starts one tests/_support/hostile_child.py per kind (an escapee by
double fork + setsid + closed fds + `env -i`, `unshare --pid --fork`, a child ignoring SIGTERM, a
bounded fork storm), each recording its processes in PIDDIR/a<attempt>-rank<r>-<kind>/ as
`<pid> <start time>` (pids as the host's /proc sees them). Once all are ready the rank records
itself and creates PIDDIR/a<attempt>-rank<r>.ready. With `fail R`, rank R then exits 1 as soon as
PIDDIR/fail exists, leaving its hostile processes behind.
"""

import os
import signal
import subprocess
import sys
import time

piddir = sys.argv[1]
rank = int(os.environ["RANK"])
attempt = os.environ["CLUSTERRUN_JOB"].rsplit(".", 1)[1]  # <job>.<node>.<attempt>
fails = sys.argv[2:4] == ["fail", str(rank)]
KINDS = ["escape", "unshare", "sigterm", "storm"]
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_child.py")

signal.signal(signal.SIGTERM, signal.SIG_IGN)
prefix = os.path.join(piddir, f"a{attempt}-rank{rank}")
for kind in KINDS:
    os.makedirs(f"{prefix}-{kind}")
    subprocess.Popen([sys.executable, CHILD, kind, f"{prefix}-{kind}"], stdout=subprocess.DEVNULL)
deadline = time.monotonic() + 120
while not all(os.path.exists(f"{prefix}-{kind}/ready") for kind in KINDS) and time.monotonic() < deadline:
    time.sleep(0.05)
os.makedirs(f"{prefix}-rank")
pid = int(os.readlink("/proc/self"))
start = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
with open(f"{prefix}-rank/rank-{pid}.pid", "w") as f:
    f.write(f"{pid} {start}")
open(f"{prefix}.ready", "w").close()
print(f"rank {rank} of attempt {attempt}: hostile and ready", flush=True)
while not (fails and os.path.exists(os.path.join(piddir, "fail"))):
    time.sleep(0.05 if fails else 3600)
sys.exit(1)
