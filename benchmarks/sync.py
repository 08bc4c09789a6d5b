"""Sync benchmark: clusterrun's sync beside ``rsync -a`` over ssh, to the same simulated hosts, in one run.

For N simulated hosts (tests/simhosts.py: separate namespaces, a real sshd each; their filesystem
is this machine's, so each host gets a workdir of its own) and a tree of many small files and a few
big ones, it measures four cases, each for every tool, all hosts in parallel:

- ``full``: every workdir empty (the whole tree to every host);
- ``none``: nothing changed since (every file compared, nothing copied);
- ``one``: one small file edited and one big file touched (same content, new mtime);
- ``part``: 4 KB rewritten in the middle of a big file (what rsync's delta spares sending).

clusterrun: in this process, from opening the SSH connections (as ``up`` does before its probe:
connect, start the agent) to the end of ``sync_hosts``, as it chooses the carrier of the data
(``choice``) and once with each forced (``--via``: rsync through the open connection, the agent);
rsync: ``rsync -a`` per host, all started at once, from the first start to the last exit (its ssh
connections included, on clusterrun's terms: tests/simhosts.py ``PARAMIKO_TERMS``). Wall seconds,
the controller's CPU seconds (this process's and its rsyncs' for clusterrun, rsync's and ssh's for
rsync) and the whole machine's CPU seconds (hosts' sshd, agents and rsyncs included), median of
``--repeat`` runs, each led by another tool; the disks are synced before each tool (the last one's
writes would land in its time).
Needs root (namespaces); installs rsync with apt when missing.

    python benchmarks/sync.py --hosts 4 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clusterrun.config.hostsfile import load_cluster  # noqa: E402
from clusterrun.sync import copy  # noqa: E402
from clusterrun.sync.copy import sync_hosts  # noqa: E402
from clusterrun.transports import transport_for  # noqa: E402
from tests.simhosts import PARAMIKO_TERMS, SimCluster, close_on_signals  # noqa: E402


def machine_cpu() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, *_ = map(int, f.readline().split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def make_tree(root: Path, small: int, small_size: int, big: int, big_size: int) -> int:
    """``small`` files of ``small_size`` bytes in 20 directories and ``big`` of ``big_size``; total bytes."""
    rng = random.Random(1)
    for i in range(small):
        folder = root / "src" / f"pkg{i % 20:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"mod{i:05d}.py").write_bytes(rng.randbytes(small_size))
    (root / "weights").mkdir(parents=True, exist_ok=True)
    for i in range(big):
        (root / "weights" / f"part{i}.bin").write_bytes(os.urandom(big_size))
    return small * small_size + big * big_size


def hosts_file(folder: Path, cluster: SimCluster, source: Path, name: str) -> Path:
    lines = [f"ssh_config: {cluster.ssh_config}", "defaults:", f"  python: {sys.executable}",
             f"  sync: {source}", "hosts:"]
    for host in cluster.hosts:
        lines += [f"  - host: {host.name}", f"    workdir: {folder / name / host.name}"]
    path = folder / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_clusterrun(hosts: Path, via: str) -> tuple[float, float, float, str]:
    """``sync_hosts`` with ``via`` carrying the data (``copy.carrier`` forced), or ``choice``: as it
    chooses."""
    original = copy.carrier
    copy.carrier = original if via == "choice" else lambda *_: via  # type: ignore[assignment]
    try:
        return _run_clusterrun(hosts, via)
    finally:
        copy.carrier = original  # type: ignore[assignment]


def _run_clusterrun(hosts: Path, via: str) -> tuple[float, float, float, str]:
    spec = load_cluster(str(hosts))
    transports = [transport_for(h, ssh_config=spec.ssh_config) for h in spec.hosts]
    cpu0, children0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    machine0, began = machine_cpu(), time.monotonic()
    sessions = []
    try:
        for t in transports:  # as `up` does before its probe (one connection per host, one agent each)
            t.connect()
            sessions.append(t.session())
        reports = sync_hosts(spec, list(zip(transports, sessions, strict=True)))
        wall = time.monotonic() - began
        if reports[0].copied and reports[0].via != via and via != "choice":
            raise SystemExit(f"clusterrun's sync went by {reports[0].via}, not {via}")
        # rsync's own CPU (a child of this process) is the controller's too
        spent = cpu(resource.RUSAGE_SELF) - cpu0 + cpu(resource.RUSAGE_CHILDREN) - children0
        return (wall, spent, machine_cpu() - machine0,
                f"{reports[0].copied} files, {reports[0].bytes / 2**20:.1f} MB per host" +
                (f" by {reports[0].via}" if via == "choice" and reports[0].copied else ""))
    finally:
        for s in sessions:
            s.close()
        for t in transports:
            t.close()


def run_rsync(folder: Path, cluster: SimCluster, source: Path) -> tuple[float, float, float, str]:
    (folder / "rs").mkdir(exist_ok=True)  # rsync makes the last directory of the target only
    cpu0, machine0, began = cpu(resource.RUSAGE_CHILDREN), machine_cpu(), time.monotonic()
    procs = [subprocess.Popen(["rsync", "-a", "--stats", "--exclude=.git", "-e",
                               shlex.join(["ssh", "-F", str(cluster.ssh_config), *PARAMIKO_TERMS]),
                               f"{source}/", f"{h.name}:{folder / 'rs' / h.name}/"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in cluster.hosts]
    outs = [p.communicate() for p in procs]
    wall = time.monotonic() - began
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"rsync failed: {err}")
    stats = dict(line.split(": ", 1) for line in outs[0][0].splitlines() if ": " in line)
    return (wall, cpu(resource.RUSAGE_CHILDREN) - cpu0, machine_cpu() - machine0,
            f"{stats.get('Number of regular files transferred', '?')} files per host")


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small", type=int, default=2000, help="small files (default 2000 of 10 KB)")
    parser.add_argument("--big", type=int, default=3, help="big files (default 3 of 10 MB)")
    parser.add_argument("--via", default="choice,rsync,agent", help="what carries clusterrun's data "
                        "(copy.carrier; choice: as it chooses), each measured as a tool of its own "
                        "(default: choice,rsync,agent)")
    args = parser.parse_args()
    if unknown := set(args.via.split(",")) - {"choice", "rsync", "agent"}:
        parser.error(f"--via: no carrier {', '.join(sorted(unknown))} (choice, rsync, agent)")
    if shutil.which("rsync") is None:
        subprocess.run(["apt-get", "install", "-y", "-qq", "rsync"], check=True)
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="crsync-bench-"))
    source = folder / "proj"
    total = make_tree(source, args.small, 10_000, args.big, 10 * 2**20)
    print(f"tree: {args.small} files of 10 KB + {args.big} of 10 MB = {total / 2**20:.1f} MB, "
          f"to {args.hosts} hosts, median of {args.repeat}")
    cluster = SimCluster.start(args.hosts)
    try:
        tools: dict[str, Callable[[], tuple[float, float, float, str]]] = {
            f"cr {via}": partial(run_clusterrun, hosts_file(folder, cluster, source, f"cr-{via}"), via)
            for via in args.via.split(",")}
        tools["rsync -a"] = lambda: run_rsync(folder, cluster, source)
        edited = source / "src" / "pkg00" / "mod00000.py"
        touched = source / "weights" / "part0.bin"

        def edit() -> None:
            edited.write_bytes(edited.read_bytes()[::-1])
            stamp = time.time_ns()
            os.utime(touched, ns=(stamp, stamp))

        def edit_part() -> None:  # 4 KB in the middle of a big file: what rsync's delta spares sending
            with open(source / "weights" / "part1.bin", "r+b") as f:
                f.seek(5 * 2**20)
                f.write(os.urandom(4096))

        print(f"{'case':<6} {'tool':<11} {'wall s':>7} {'ctl cpu s':>9} {'machine cpu s':>13}  copied")
        for case in ("full", "none", "one", "part"):
            figures: dict[str, list[tuple[float, float, float, str]]] = {name: [] for name in tools}
            for turn in range(args.repeat):
                if case == "full":
                    for copies in [folder / "rs", *folder.glob("cr-*")]:
                        shutil.rmtree(copies, ignore_errors=True)
                elif case in ("one", "part"):
                    (edit if case == "one" else edit_part)()  # the same change for every tool, each copying it once
                names = list(tools)
                for name in names[turn % len(names):] + names[:turn % len(names)]:  # each goes first in turn
                    os.sync()  # the last tool's writes go to disk before this one's clock starts, not during it
                    figures[name].append(tools[name]())
            for name, runs in figures.items():
                wall, ccpu, mcpu = (statistics.median(f[i] for f in runs) for i in range(3))
                print(f"{case:<6} {name:<11} {wall:7.2f} {ccpu:9.2f} {mcpu:13.2f}  {runs[-1][3]}", flush=True)
            if case == "full":  # both tools left the same tree
                for h in cluster.hosts:
                    for copy in [folder / "rs" / h.name, *folder.glob(f"cr-*/{h.name}")]:
                        check = subprocess.run(["diff", "-r", str(source), str(copy)], capture_output=True, text=True)
                        if check.returncode != 0:
                            raise SystemExit(f"the copy {copy} differs: {check.stdout[:500]}")
    finally:
        cluster.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
