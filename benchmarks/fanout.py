"""Fan-out benchmark: how long until every host runs the job, clusterrun beside pdsh, clush and the floor.

For N simulated hosts (tests/simhosts.py: separate network and PID namespaces, a real sshd each)
it measures, in the same run and on the same hosts:

- clusterrun: from starting `clusterrun up --no-tui` to the moment it reports every node started
  (the node's agent answered that its supervisor runs torchrun);
- pdsh -R ssh (fan-out 256) and ClusterShell's clush (fan-out N): from their start to their exit,
  having started the same torchrun command line on every host, detached (setsid, stdio redirected);
- the floor: N parallel `ssh HOST true` (handshake, authentication, one exec), cold; and the same
  over ControlMaster connections opened beforehand (the lower bound for warm connections).

Every OpenSSH client (pdsh's, clush's, the floor's) runs twice: at clusterrun's key exchange and
cipher (paramiko's choice against OpenSSH 9.2: curve25519-sha256 and aes128-gcm, ``--equal``) and
at OpenSSH's defaults (sntrup761x25519-sha512 and chacha20-poly1305); the two are printed as two
tables. CPU is accounted by cgroups (cpuacct: every process, exited ones included, to the
nanosecond): the controller's (clusterrun with its `ssh -G`s; pdsh, clush or ssh with their ssh
children) and the hosts' (their sshd's and what they run), each per host, until every node started.

The job is a torchrun of a script that exits at once (``--stub-torchrun``: `sleep 2` instead, for
every tool, to measure the fan-out alone); each run waits for the job to end on every host before
the next one starts. Needs root (namespaces, cgroups) and installs pdsh and OpenSSH with apt.

    python benchmarks/fanout.py --sizes 1,8,32,64 --repeat 3 --stub-torchrun [--preflight] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.simhosts import PARAMIKO_TERMS, SimCluster, close_on_signals  # noqa: E402

SCRIPT = ROOT / "tests" / "_support" / "counter.py"
PYTHON = sys.executable
STUB = "sleep 2"
KEXES = {"equal": PARAMIKO_TERMS, "default": ()}  # the OpenSSH clients on paramiko's terms, and on their own


class Run(NamedTuple):
    seconds: float
    controller: float  # CPU seconds per host
    hosts: float  # CPU seconds per host, on the hosts


class CpuGroup:
    """A cpuacct cgroup (v1) of this machine: ``join`` puts a process in (its children follow)."""

    def __init__(self, name: str) -> None:
        self.path = Path("/sys/fs/cgroup/cpuacct") / f"crbench-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)

    def join(self, pid: int = 0) -> None:
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def usage(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError as exc:
            print(f"fanout: could not remove {self.path}: {exc}", file=sys.stderr)


CONTROLLER: CpuGroup
HOSTS: CpuGroup


def spawn(argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
    """``argv`` started in the controller's cgroup."""
    return subprocess.Popen(argv, preexec_fn=CONTROLLER.join, text=True, **kwargs)  # type: ignore[call-overload]


def measure(start: Callable[[], None], n: int) -> Run:
    """Time and CPU (controller, hosts; per host) of ``start``, which returns when every host is done."""
    ctl0, hosts0, began = CONTROLLER.usage(), HOSTS.usage(), time.monotonic()
    start()
    seconds = time.monotonic() - began
    return Run(seconds, (CONTROLLER.usage() - ctl0) / n, (HOSTS.usage() - hosts0) / n)


def make_stub(folder: Path) -> str:
    """An interpreter that runs Python as usual but `-m torch.distributed.run ...` as `sleep 2`."""
    shim = folder / "python-stub"
    shim.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then exec {STUB}; fi\n'
                    f'exec {shlex.quote(sys.executable)} "$@"\n')
    shim.chmod(0o755)
    return str(shim)


def hosts_file(folder: Path, cluster: SimCluster) -> Path:
    lines = [f"state_dir: {folder / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
             f"  python: {PYTHON}", f"  workdir: {ROOT}", "  nproc: 1", "hosts:"]
    lines += [f"  - host: {h.name}" for h in cluster.hosts]
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


FOLDED = re.compile(r"clusterrun: (\d+) nodes ")  # the printer's line for nodes alike (printer.alike_lines)


def run_clusterrun(folder: Path, cluster: SimCluster, *options: str, tree: Path = ROOT) -> Run:
    """`up --no-tui` (of the source ``tree``) until it reports every node started; it then follows
    the job to its end."""
    n = len(cluster.hosts)
    argv = [sys.executable, "-m", "clusterrun", "up", "--no-tui", *options, str(hosts_file(folder, cluster)),
            str(SCRIPT), "0", "0"]
    env = dict(os.environ, XDG_STATE_HOME=str(folder / "xdg"), PYTHONPATH=str(tree))  # its job records too
    proc: list[subprocess.Popen[str]] = []

    def start() -> None:
        proc.append(spawn(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env))
        started = 0
        for line in proc[0].stderr:  # type: ignore[union-attr]
            if ": started attempt " in line:  # past 8 nodes one line says it of many: "32 nodes 0-31 (...): started"
                many = FOLDED.match(line)
                started += int(many.group(1)) if many else 1
            if started >= n:
                return

    run = measure(start, n)
    proc[0].stderr.read()  # type: ignore[union-attr]
    if proc[0].wait() != 0:
        raise SystemExit(f"clusterrun failed (exit {proc[0].returncode}) with {n} hosts")
    return run


def job_command(cluster: SimCluster, port: int, logs: Path) -> str:
    """The shell command that starts the job detached on one host (its node rank from its hostname)."""
    torchrun = shlex.join([PYTHON, "-m", "torch.distributed.run", f"--nnodes={len(cluster.hosts)}",
                           "--nproc-per-node=1", "--rdzv-backend=static", f"--master-addr={cluster.hosts[0].address}",
                           f"--master-port={port}", "--max-restarts=0", "--tee=3"])
    # "cd X; cmd > log &" and not "cd X && cmd &": the latter backgrounds a subshell that keeps
    # the SSH session's output open, so the tool would wait for the job to end.
    return (f"cd {shlex.quote(str(ROOT))}; OMP_NUM_THREADS=1 setsid {torchrun} "
            "--node-rank=$(( $(hostname | tr -dc 0-9) - 1 )) "
            f"{shlex.quote(str(SCRIPT))} 0 0 > {shlex.quote(str(logs))}/$(hostname).log 2>&1 < /dev/null &")


def wait_job_gone(cluster: SimCluster, logs: Path) -> None:
    """Wait until the job ended on every host, so that it does not weigh on the next run."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        texts = [(logs / f"{h.name}.log").read_text() if (logs / f"{h.name}.log").exists() else ""
                 for h in cluster.hosts]
        if (PYTHON != sys.executable or all("done" in t or "Error" in t for t in texts)) and not any(
                "torch.distributed.run" in (ps := h.run("ps", "-eo", "args=").stdout) or STUB in ps
                for h in cluster.hosts):
            break
        time.sleep(0.5)
    for h in cluster.hosts:
        (logs / f"{h.name}.log").unlink(missing_ok=True)


def run_tool(folder: Path, cluster: SimCluster, tool: str, kex: Sequence[str], port: int) -> Run:
    """pdsh or clush starting the job detached on every host, until the tool exits."""
    n = len(cluster.hosts)
    logs = folder / "job-logs"
    logs.mkdir(exist_ok=True)
    command = job_command(cluster, port, logs)
    ssh_options = ["-F", str(cluster.ssh_config), "-o", "BatchMode=yes", "-x", *kex]
    names = ",".join(h.name for h in cluster.hosts)
    if tool == "pdsh":
        argv = ["pdsh", "-R", "ssh", "-f", "256", "-w", names, command]
        env = dict(os.environ, PDSH_SSH_ARGS=shlex.join(ssh_options) + " -l%u %h")
    else:
        argv = ["clush", "-f", str(max(n, 1)), "-o", shlex.join(ssh_options), "-w", names, command]
        env = dict(os.environ)
    result: list[tuple[int, str]] = []

    def start() -> None:
        proc = spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = proc.communicate()
        result.append((proc.returncode, err))

    run = measure(start, n)
    if result[0][0] != 0:
        raise SystemExit(f"{tool} failed: {result[0][1]}")
    wait_job_gone(cluster, logs)
    return run


def run_floor(cluster: SimCluster, kex: Sequence[str], control: Path | None = None) -> Run:
    """N parallel `ssh HOST true`; over the ControlMaster sockets in ``control`` when given."""
    n = len(cluster.hosts)
    base = ["ssh", "-F", str(cluster.ssh_config), "-o", "BatchMode=yes", *kex]
    if control is not None:
        base += ["-o", "ControlMaster=no", "-o", f"ControlPath={control}/%h"]

    def start() -> None:
        # each in a session of its own, as pdsh starts its ssh's: with the kernel's autogroups each
        # session gets its own share of a busy machine (one session for all ran 3x slower here)
        procs = [spawn([*base, h.name, "true"], start_new_session=True) for h in cluster.hosts]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("ssh HOST true failed")

    return measure(start, n)


def open_masters(cluster: SimCluster, control: Path) -> None:
    """A ControlMaster connection to every host, in the background (outside the accounted cgroups)."""
    control.mkdir(exist_ok=True)
    procs = [subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), "-o", "BatchMode=yes", "-o", "ControlMaster=yes",
                               "-o", f"ControlPath={control}/%h", "-o", "ControlPersist=600", "-fN", h.name])
             for h in cluster.hosts]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("could not open the ControlMaster connections")


def close_masters(cluster: SimCluster, control: Path) -> None:
    for h in cluster.hosts:
        subprocess.run(["ssh", "-F", str(cluster.ssh_config), "-o", f"ControlPath={control}/%h", "-O", "exit", h.name],
                       capture_output=True)


def median(runs: list[Run]) -> Run:
    return Run(*(statistics.median(r[i] for r in runs) for i in range(3)))


def bench_size(n: int, repeat: int, preflight: bool, stub: bool, baseline: Path | None) -> dict[str, Run]:
    """Every tool ``repeat`` times on one cluster of ``n`` hosts, interleaved; the medians by label."""
    global PYTHON
    cluster = SimCluster.start(n)
    runs: dict[str, list[Run]] = {}
    try:
        for host in cluster.hosts:
            HOSTS.join(host.pid)
        folder = cluster.dir / "bench"
        folder.mkdir()
        control = folder / "control"
        PYTHON = make_stub(folder) if stub else sys.executable
        for i in range(repeat):
            measured = {}
            if baseline is not None and i % 2:  # the two trees take turns going first: what the run
                # before left on the hosts (the ControlMasters' sshd's ending) falls on the first
                measured[f"clusterrun of {baseline.name}"] = run_clusterrun(folder, cluster, tree=baseline)
            measured["clusterrun"] = run_clusterrun(folder, cluster)
            if baseline is not None and not i % 2:
                measured[f"clusterrun of {baseline.name}"] = run_clusterrun(folder, cluster, tree=baseline)
            if preflight:
                measured["clusterrun --no-preflight"] = run_clusterrun(folder, cluster, "--no-preflight")
            for name, kex in KEXES.items():
                measured[f"pdsh/{name}"] = run_tool(folder, cluster, "pdsh", kex, 29000 + 2 * i)
                measured[f"clush/{name}"] = run_tool(folder, cluster, "clush", kex, 29001 + 2 * i)
                measured[f"floor/{name}"] = run_floor(cluster, kex)
            open_masters(cluster, control)
            try:
                measured["warm"] = run_floor(cluster, (), control)
            finally:
                close_masters(cluster, control)
            for label, run in measured.items():
                runs.setdefault(label, []).append(run)
            print(f"N={n:3d} run {i + 1}: " + ", ".join(f"{k} {v.seconds:.2f} s" for k, v in measured.items()),
                  file=sys.stderr, flush=True)
    finally:
        cluster.close()
    return {label: median(r) for label, r in runs.items()}


def table(results: dict[int, dict[str, Run]], name: str, title: str) -> None:
    print(f"\n### {title}\n")
    print("| N | tool | all started (s) | × floor | controller CPU/host (ms) | host CPU/host (ms) |")
    print("|---|---|---|---|---|---|")
    for n, by in results.items():
        floor = by[f"floor/{name}"].seconds
        rows = [(label, by[label]) for label in by if label.startswith("clusterrun")]
        rows += [("pdsh -R ssh", by[f"pdsh/{name}"]), ("clush", by[f"clush/{name}"]),
                 ("floor: ssh HOST true", by[f"floor/{name}"]),
                 ("lower bound, warm: ssh HOST true over ControlMaster", by["warm"])]
        for label, run in rows:
            print(f"| {n} | {label} | {run.seconds:.2f} | {run.seconds / floor:.2f} | {run.controller * 1000:.1f} "
                  f"| {run.hosts * 1000:.1f} |")


def main() -> None:
    global CONTROLLER, HOSTS
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    # The controller as pip installs it, its modules' bytecode cached: with PYTHONDONTWRITEBYTECODE
    # set (as on the project's machine) every run compiled clusterrun from source.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,32,64")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stub-torchrun", action="store_true", help="start `sleep 2` instead of torchrun")
    parser.add_argument("--preflight", action="store_true",
                        help="also run `up --no-preflight` in each repeat: what the preflight's checks cost")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also run `up` of the clusterrun source tree in DIR in each repeat (git archive REV)")
    args = parser.parse_args()
    subprocess.run(["sh", str(ROOT / "tests" / "_support" / "install_sshd.sh"), "pdsh"], check=True,
                   capture_output=True)
    CONTROLLER, HOSTS = CpuGroup("controller"), CpuGroup("hosts")
    results: dict[int, dict[str, Run]] = {}
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            results[n] = bench_size(n, args.repeat, args.preflight, args.stub_torchrun, args.baseline)
    finally:
        CONTROLLER.remove()
        HOSTS.remove()
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end; median of "
          f"{args.repeat} interleaved runs; torchrun {'stubbed by ' + repr(STUB) if args.stub_torchrun else 'real'}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    table(results, "equal",
          "OpenSSH clients at clusterrun's terms (curve25519-sha256, aes128-gcm): the fair comparison")
    table(results, "default", "OpenSSH clients at their defaults (sntrup761x25519-sha512, chacha20-poly1305)")


if __name__ == "__main__":
    main()
