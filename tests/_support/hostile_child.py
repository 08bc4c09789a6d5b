"""A job (in torchrun's place) whose processes make stopping hard: argv KIND PIDDIR [wait] [exit].

Every process it makes records `<pid> <start time>` in PIDDIR/<kind>-<pid>.pid once it runs (pids
as this host's /proc sees them), then sleeps; the main process ignores SIGTERM. With `wait` it
first waits for PIDDIR/go, so that a test can SIGKILL the supervisor before anything escapes.
With `exit` the main process exits (0) once the others are ready, leaving them behind.

escape   double fork, setsid, every descriptor closed, then exec `sleep 3600` under `env -i`
         (no marker): out of the job's tree, sessions and environment at once
unshare  `unshare --pid --fork` a process into a new PID namespace
sigterm  a child that ignores SIGTERM
storm    a bounded fork storm: a tree of 15 processes ignoring SIGTERM, each forking a new child
         when its child dies (at most 20 times)
PIDDIR/ready appears once every process of the kind has recorded itself.
"""

import os
import signal
import sys
import time

kind, piddir = sys.argv[1], sys.argv[2]


def record(name: str) -> None:
    pid = int(os.readlink("/proc/self"))  # as /proc sees it: in a PID namespace of its own getpid() is 1
    start = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
    path = os.path.join(piddir, f"{name}-{pid}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(f"{pid} {start}")
    os.rename(path + ".tmp", path)


def wait_for(count: int) -> None:
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(piddir) if n.endswith(".pid")]) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    open(os.path.join(piddir, "ready"), "w").close()


def storm_node(depth: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record("storm")
    if depth == 0:
        while True:
            time.sleep(3600)
    children = set()
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            storm_node(depth - 1)
        children.add(pid)
    reforks = 0
    while True:
        pid, _ = os.wait()
        if reforks < 20:  # a replacement for every child killed: a sweep by pid keeps finding new ones
            reforks += 1
            if os.fork() == 0:
                storm_node(0)


if kind == "inner":  # inside the new PID namespace: /proc is still the host's, so the pid recorded is too
    record("unshared")
    while True:
        time.sleep(3600)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
record("main")
if "wait" in sys.argv[3:]:
    while not os.path.exists(os.path.join(piddir, "go")):
        time.sleep(0.02)
if kind == "escape":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            record("escape")
            os.closerange(0, 1 << 16)
            os.execve("/bin/sleep", ["sleep", "3600"], {})
        os._exit(0)
    os.wait()
    wait_for(2)
elif kind == "unshare":
    code = f"import sys; sys.argv[1:] = {['inner', piddir]!r}; exec(open({__file__!r}).read())"
    if os.fork() == 0:
        os.execvp("unshare", ["unshare", "--pid", "--fork", sys.executable, "-c", code])
    wait_for(2)
elif kind == "sigterm":
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record("sigterm")
        while True:
            time.sleep(3600)
    wait_for(2)
elif kind == "storm":
    if os.fork() == 0:
        storm_node(3)
    wait_for(16)
print("ready", flush=True)
if "exit" in sys.argv[3:]:
    sys.exit(0)
while True:
    time.sleep(3600)
