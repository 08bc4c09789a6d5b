"""Recovery benchmark: from a rank's failure to every rank of the next attempt joined, clusterrun
beside the same job's cold start and torchrun's own ``--max-restarts``, in one run.

For N simulated hosts (tests/simhosts.py: network and PID namespaces, a real sshd each), one rank
each, the job is benchmarks/_recover_train.py (real torch, gloo on the CPU): every rank joins
(process group and a first all_reduce), then the last rank fails once (exit 1, its wall time
written first). Measured, on this machine's wall clock:

- clusterrun (`up --no-tui --timings`, `restart: {max: 1, backoff: 0s}`): the cold start (`up`
  started → every rank joined); from the rank's failure (its wall time), seen (the failed node's
  first line: `failing`, its rank's exit, or `failed`) and every rank joined again; and
  clusterrun's own part as its own clock has it (`timings: attempt 2: failure seen → stopped →
  checked → started`, the restart's phases of `ps JOB`): from the failure seen, every node
  stopped (the failed one too) and verified, the next attempt checked, every node started;
- torchrun's own restart (`torchrun --max-restarts 1`, static rendezvous, started on every host
  over OpenSSH): failure → every rank of its second round joined, or "did not recover".

    python benchmarks/recovery.py [--sizes 1,4,16] [--repeat 3]

Needs root (namespaces). Interrupted (Ctrl-C, SIGTERM), it closes its hosts first.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.simhosts import SimCluster, close_on_signals  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "_recover_train.py"
TIMEOUT = 300.0
# torchrun's own restart, when it does not recover, hangs in gloo's connect until killed: a restart
# is not waited for past two minutes (the cold start at N = 16 takes under one).
TORCHRUN_TIMEOUT = 120.0
PHASES = ("cold start", "seen", "stopped", "checked", "started (own part)", "joined", "torchrun joined")
OWN = re.compile(r"timings: attempt 2: failure seen → stopped ([0-9.]+) s → checked ([0-9.]+) s → started ([0-9.]+) s")


def joined(lines: list[tuple[float, str]], attempt: int, ranks: int) -> float | None:
    """When the last rank of ``attempt`` said it joined (its own wall time), if all did."""
    found = {int(m[1]): float(m[2]) for _, line in lines
             if (m := re.search(rf"JOINED {attempt} (\d+) ([0-9.]+)", line))}
    return max(found.values()) if len(found) == ranks else None


def read_lines(proc: subprocess.Popen[str], into: list[tuple[float, str]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append((time.time(), line.rstrip("\n")))


def clusterrun_run(cluster: SimCluster, work: Path, n: int) -> dict[str, float]:
    flag = work / "flag"
    flag.unlink(missing_ok=True)
    hosts = work / "hosts.yaml"
    hosts.write_text("\n".join([f"state_dir: {work / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
                                f"  python: {sys.executable}", f"  workdir: {ROOT}", "restart: {max: 1, backoff: 0s}",
                                f"hosts: [{', '.join(h.name for h in cluster.hosts)}]"]) + "\n")
    lines: list[tuple[float, str]] = []
    began = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "clusterrun", "up", "--no-tui", "--timings", str(hosts), str(SCRIPT),
                             str(flag)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    reader = threading.Thread(target=read_lines, args=(proc, lines), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    if proc.returncode != 0 or not flag.exists():
        raise RuntimeError(f"clusterrun's run failed ({proc.returncode}):\n" + "\n".join(t for _, t in lines[-30:]))
    failed = float(flag.read_text())
    after = [(t, line) for t, line in lines if t >= failed]
    seen = next(t for t, line in after if re.search(r"clusterrun: node\d+ \S+: fail(ed|ing)", line))
    own = next(m for _, line in after if (m := OWN.search(line)))  # printed once every rank joined
    first, second = joined(lines, 1, n), joined(lines, 2, n)
    assert first is not None and second is not None, "\n".join(t for _, t in lines[-30:])
    return {"cold start": first - began, "seen": seen - failed, "stopped": float(own[1]), "checked": float(own[2]),
            "started (own part)": float(own[3]), "joined": second - failed}


def torchrun_run(cluster: SimCluster, work: Path, n: int, port: int) -> float | None:
    flag = work / "flag-torchrun"
    flag.unlink(missing_ok=True)
    master = cluster.hosts[0].address
    procs, outputs = [], []
    for rank, host in enumerate(cluster.hosts):
        command = (f"cd {ROOT} && exec {sys.executable} -m torch.distributed.run --nnodes {n} --nproc-per-node 1 "
                   f"--node-rank {rank} --master-addr {master} --master-port {port} --max-restarts 1 "
                   f"{SCRIPT} {flag}")
        lines: list[tuple[float, str]] = []
        proc = subprocess.Popen(cluster.ssh_argv(host.name, command), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=read_lines, args=(proc, lines), daemon=True).start()
        procs.append(proc)
        outputs.append(lines)
    try:
        deadline = time.monotonic() + TORCHRUN_TIMEOUT
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # A torchrun left behind (its round never ended) dies with its host's namespace at the end of
        # this size; the next repeat uses another port.
    everything = [item for lines in outputs for item in lines]
    second = joined(everything, 2, n)
    return None if second is None or not flag.exists() else second - float(flag.read_text())


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4,16")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| N | " + " | ".join(PHASES) + " |")
    print("|---" * (len(PHASES) + 1) + "|")
    for n in (int(s) for s in args.sizes.split(",")):
        cluster = SimCluster.start(n)
        try:
            with tempfile.TemporaryDirectory(prefix="clusterrun-recovery-") as folder:
                runs = [clusterrun_run(cluster, Path(folder), n) for _ in range(args.repeat)]
                torchrun = [torchrun_run(cluster, Path(folder), n, 29533 + i) for i in range(args.repeat)]
        finally:
            cluster.close()
        cells = [f"{statistics.median(r[p] for r in runs):.2f} s" for p in PHASES[:-1]]
        recovered = [t for t in torchrun if t is not None]
        cells.append(f"{statistics.median(recovered):.2f} s" + (f" ({len(recovered)} of {len(torchrun)})"
                                                                 if len(recovered) < len(torchrun) else "")
                     if recovered else f"did not recover ({len(torchrun)} of {len(torchrun)})")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
