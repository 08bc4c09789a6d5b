"""Fan-out benchmark: how long until torchrun runs on every host, clusterrun beside pdsh.

For N simulated hosts (tests/simhosts.py: separate network and PID namespaces, a real sshd each)
it measures, in the same run and on the same hosts:

- clusterrun: from starting `clusterrun up` to the moment it reports every node started (the
  node agent answered that its supervisor runs torchrun), and the controller's CPU time per host;
- pdsh -R ssh: from starting pdsh to its exit, having started the same torchrun command line on
  every host, detached (setsid, stdio redirected), and pdsh's CPU time (with its ssh children).

The job is a torchrun of a script that exits at once; each run waits for the job to end on every
host before the next one starts. On a small machine the torch imports of the torchruns already
started slow down everything else, for both tools alike; ``--stub-torchrun`` replaces torchrun by
``sleep 2`` (through an interpreter shim, for both tools) to measure the fan-out alone. Needs root
(namespaces) and installs pdsh and OpenSSH with apt when missing.

    python benchmarks/fanout.py --sizes 1,8,32 --repeat 3 [--stub-torchrun] [--preflight]
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.simhosts import SimCluster  # noqa: E402

SCRIPT = ROOT / "tests" / "_support" / "counter.py"


def machine_cpu() -> float:
    """CPU seconds spent so far by every process on this machine (hosts, sshd's and controller alike)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, *_ = map(int, f.readline().split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


PYTHON = sys.executable
STUB = "sleep 2"


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


def run_clusterrun(folder: Path, cluster: SimCluster, *options: str) -> tuple[float, float, float]:
    """Seconds to every node started, controller CPU seconds (the whole run, per host), and the
    machine's CPU seconds until every node started (per host); ``options`` go to `up`."""
    n = len(cluster.hosts)
    cpu0 = children_cpu()
    machine0 = machine_cpu()
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "clusterrun", "up", "--no-tui", *options,
                             str(hosts_file(folder, cluster)),
                             str(SCRIPT), "0", "0"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, XDG_STATE_HOME=str(folder / "xdg")))  # job records too
    assert proc.stderr is not None
    started = 0
    elapsed = None
    for line in proc.stderr:
        if ": started attempt " in line:
            started += 1
            if started == n:
                elapsed = time.monotonic() - began
                machine = machine_cpu() - machine0
    if proc.wait() != 0 or elapsed is None:
        raise SystemExit(f"clusterrun failed (exit {proc.returncode}) with {n} hosts")
    return elapsed, (children_cpu() - cpu0) / n, machine / n


def run_pdsh(folder: Path, cluster: SimCluster, port: int) -> tuple[float, float, float]:
    """Seconds until pdsh has started torchrun detached on every host, its CPU per host, and the
    machine's CPU seconds until then (per host)."""
    n = len(cluster.hosts)
    logs = folder / "pdsh-logs"
    logs.mkdir(exist_ok=True)
    torchrun = shlex.join([PYTHON, "-m", "torch.distributed.run", f"--nnodes={n}", "--nproc-per-node=1",
                           "--rdzv-backend=static", f"--master-addr={cluster.hosts[0].address}",
                           f"--master-port={port}", "--max-restarts=0", "--tee=3"])
    # hosts are sim1..simN: node rank = the number in the hostname - 1
    # "cd X; cmd > log &" and not "cd X && cmd &": the latter backgrounds a subshell that keeps
    # the SSH session's output open, so pdsh would wait for the job to end.
    command = (f"cd {shlex.quote(str(ROOT))}; OMP_NUM_THREADS=1 setsid {torchrun} "
               "--node-rank=$(( $(hostname | tr -dc 0-9) - 1 )) "
               f"{shlex.quote(str(SCRIPT))} 0 0 > {shlex.quote(str(logs))}/$(hostname).log 2>&1 < /dev/null &")
    env = dict(os.environ, PDSH_SSH_ARGS=f"-F {cluster.ssh_config} -o BatchMode=yes -x -l%u %h")
    cpu0 = children_cpu()
    machine0 = machine_cpu()
    began = time.monotonic()
    proc = subprocess.run(["pdsh", "-R", "ssh", "-f", "256", "-w", ",".join(h.name for h in cluster.hosts), command],
                          env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - began
    machine = machine_cpu() - machine0
    if proc.returncode != 0:
        raise SystemExit(f"pdsh failed: {proc.stderr}")
    cpu = (children_cpu() - cpu0) / n
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # wait for the job to end everywhere before measuring again
        texts = [(logs / f"{h.name}.log").read_text() if (logs / f"{h.name}.log").exists() else ""
                 for h in cluster.hosts]
        if (PYTHON != sys.executable or all("done" in t or "Error" in t for t in texts)) and not any(
                "torch.distributed.run" in (ps := h.run("ps", "-eo", "args=").stdout) or STUB in ps
                for h in cluster.hosts):
            break
        time.sleep(0.5)
    for h in cluster.hosts:
        (logs / f"{h.name}.log").unlink(missing_ok=True)
    return elapsed, cpu, machine / n


def main() -> None:
    # The controller as pip installs it, its modules' bytecode cached: with PYTHONDONTWRITEBYTECODE
    # set (as on the project's machine) every run compiled clusterrun from source (--help: 0.29 s
    # instead of 0.17 s).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stub-torchrun", action="store_true", help="start `sleep 2` instead of torchrun")
    parser.add_argument("--preflight", action="store_true",
                        help="also run `up --no-preflight` in each repeat: what the preflight's checks cost")
    args = parser.parse_args()
    subprocess.run(["sh", str(ROOT / "tests" / "_support" / "install_sshd.sh"), "pdsh"], check=True,
                   capture_output=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        cluster = SimCluster.start(n)
        try:
            folder = cluster.dir / "bench"
            folder.mkdir()
            global PYTHON
            PYTHON = make_stub(folder) if args.stub_torchrun else sys.executable
            ours, theirs, bare = [], [], []
            for i in range(args.repeat):
                ours.append(run_clusterrun(folder, cluster))
                if args.preflight:
                    bare.append(run_clusterrun(folder, cluster, "--no-preflight"))
                theirs.append(run_pdsh(folder, cluster, 29000 + i))
                print(f"N={n:3d} run {i + 1}: clusterrun {ours[-1][0]:.2f} s, pdsh {theirs[-1][0]:.2f} s"
                      + (f", clusterrun --no-preflight {bare[-1][0]:.2f} s" if bare else ""),
                      file=sys.stderr, flush=True)
        finally:
            cluster.close()
        if bare:
            print(f"N={n}: clusterrun {statistics.median(r[0] for r in ours):.2f} s, with --no-preflight "
                  f"{statistics.median(r[0] for r in bare):.2f} s; controller CPU/host "
                  f"{statistics.median(r[1] for r in ours) * 1000:.0f} ms against "
                  f"{statistics.median(r[1] for r in bare) * 1000:.0f} ms")
        rows.append((n, *(statistics.median(run[i] for run in ours) for i in range(3)),
                     *(statistics.median(run[i] for run in theirs) for i in range(3)), cluster.isolated))
    print(f"{os.cpu_count()} cores; median of {args.repeat} runs; hosts isolated in namespaces: "
          f"{all(r[7] for r in rows)}; torchrun {'stubbed by ' + repr(STUB) if args.stub_torchrun else 'real'}")
    print("| N | clusterrun: all started (s) | pdsh -R ssh: all started (s) | ratio | clusterrun CPU/host (ms) "
          "| pdsh CPU/host (ms) | machine CPU/host until all started (ms): clusterrun | pdsh |")
    print("|---|---|---|---|---|---|---|---|")
    for n, t, c, m, pt, pc, pm, _ in rows:
        print(f"| {n} | {t:.2f} | {pt:.2f} | {t / pt:.2f} | {c * 1000:.0f} | {pc * 1000:.0f} | {m * 1000:.0f} "
              f"| {pm * 1000:.0f} |")
    if len(rows) > 1:
        print(f"clusterrun t({rows[-1][0]})/t({rows[0][0]}) = {rows[-1][1] / rows[0][1]:.2f}; "
              f"pdsh: {rows[-1][4] / rows[0][4]:.2f}")

if __name__ == "__main__":
    main()
