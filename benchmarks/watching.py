"""The cost of watching: CPU and memory of following a running job, on the controller and the hosts.

For N simulated hosts (tests/simhosts.py: network and PID namespaces, a real sshd each), one rank
each, the job is benchmarks/_watch_writer.py: it writes nothing until told, through a FIFO per rank,
to write RATE lines/s (or a number of lines as fast as it can). Measured, with the load average
beside every figure:

- ``up --no-tui`` in the foreground (the job's owner): its CPU (``utime + stime``) over SECONDS of
  a quiet job, then over SECONDS at RATE lines/s per node, as % of one core;
- ``up -d``'s detached monitor (``clusterrun _monitor``) and an ``attach --no-tui`` of that job,
  both at once, likewise;
- the hosts' side in the same windows: the job's supervisor (the survivor and the monitor that
  merges the ranks' files), the agents that stream the log (``follow``, one per controller
  process), and sshd; per node and in all;
- with ``--memory LINES``: only that, on one host: ``up --no-tui``'s resident memory while one
  rank writes LINES lines at ``--memory-rate`` lines/s (0: as fast as it can), at every million
  lines shown.

With ``--split-cpus`` the hosts' processes run on the first half of the cores and the
controller's on the rest, as if the hosts were other machines.

    python benchmarks/watching.py [--hosts 16] [--rate 100] [--seconds 30] [--memory 10000000] [--split-cpus]

Needs root (namespaces). Interrupted (Ctrl-C, SIGTERM), it stops its jobs and closes its hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._pump import exited, hosts_apart  # noqa: E402
from tests.simhosts import SimCluster, close_on_signals  # noqa: E402

WRITER = ROOT / "benchmarks" / "_watch_writer.py"
CLUSTERRUN = [sys.executable, "-m", "clusterrun"]
TICK = os.sysconf("SC_CLK_TCK")
READY = b"| ready\n"


def log(text: str) -> None:
    print(f"watching.py: {text}", file=sys.stderr, flush=True)


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# --------------------------------------------------------------------------------- processes


def stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds used) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def snapshot() -> dict[int, tuple[int, float]]:
    """Every process of this machine: pid → (parent, CPU seconds)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                found[int(entry)] = stat(int(entry))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def host_parts(cluster: SimCluster, procs: dict[int, tuple[int, float]]) -> dict[int, str]:
    """The hosts' processes that are clusterrun's or sshd's, by part: ``sshd``, ``follow`` (an
    agent under an sshd session: streaming a log) or ``supervisor`` (reparented to the host's first
    process: the survivor and the monitor). torchrun and its workers are the job's, left out."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    parts: dict[int, str] = {}
    for host in cluster.hosts:
        stack = [(host.pid, 0)]
        while stack:
            pid, parent = stack.pop()
            line = cmdline(pid)
            if "torch.distributed.run" in line:
                continue
            if pid == host.pid or comm(pid) == "sshd":
                parts[pid] = "sshd"
            else:
                parts[pid] = "follow" if parent != host.pid and parts.get(parent) == "sshd" else "supervisor"
            stack += [(child, pid) for child in children.get(pid, [])]
    return parts


class Reader(threading.Thread):
    """Drains a controller's stdout, counting its lines and the writers' ``ready`` lines."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines, self.ready = proc, 0, 0

    def run(self) -> None:
        assert self.proc.stdout is not None
        edge = b""
        while data := os.read(self.proc.stdout.fileno(), 1 << 20):
            self.lines += data.count(b"\n")
            self.ready += (edge + data).count(READY)
            edge = data[-len(READY):]


# ----------------------------------------------------------------------------------- the runs


class Bench:
    def __init__(self, cluster: SimCluster, n: int) -> None:
        self.cluster, self.n = cluster, n
        self.folder = cluster.dir / "watching"
        self.folder.mkdir()
        self.env = dict(os.environ, XDG_STATE_HOME=str(self.folder / "xdg"))
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)  # the controller as installed: bytecode cached
        self.hosts = self.folder / "hosts.yaml"
        lines = [f"state_dir: {self.folder / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
                 f"  python: {sys.executable}", f"  workdir: {ROOT}", "  nproc: 1", "hosts:"]
        self.hosts.write_text("\n".join([*lines, *(f"  - host: {h.name}" for h in cluster.hosts[:n])]) + "\n")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.jobs: list[str] = []
        self.fifos: list[int] = []

    def open_fifos(self, tag: str) -> Path:
        """A folder of FIFOs ``ctl-<rank>``, each held open here (read and write: never blocks)."""
        folder = self.folder / tag
        folder.mkdir()
        self.close_fifos()
        for rank in range(self.n):
            os.mkfifo(folder / f"ctl-{rank}")
            self.fifos.append(os.open(folder / f"ctl-{rank}", os.O_RDWR))
        return folder

    def tell(self, command: str) -> None:
        for fd in self.fifos:
            os.write(fd, command.encode() + b"\n")

    def close_fifos(self) -> None:
        """The writers read the end of their FIFO and exit: the job succeeds."""
        for fd in self.fifos:
            os.close(fd)
        self.fifos.clear()

    def start(self, argv: list[str], name: str) -> tuple[subprocess.Popen[bytes], Reader]:
        with open(self.folder / f"{name}.err", "wb") as err:
            proc = subprocess.Popen([*CLUSTERRUN, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=err, cwd=ROOT, env=self.env)
        self.procs.append(proc)
        reader = Reader(proc)
        reader.start()
        return proc, reader

    def wait(self, until: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    def windows(self, who: dict[str, int], readers: list[Reader], rate: float, seconds: float,
                settle: float) -> list[dict[str, object]]:
        """CPU of the controller processes ``who`` (name → pid) and of the hosts' parts over a
        quiet window, then over one at ``rate`` lines/s per node."""
        time.sleep(settle)  # the start's scans and first state writes are over
        rows = []
        for label in ("quiet", f"{rate:g} lines/s per node")[:2 if rate else 1]:  # --rate 0: quiet only
            told = [r.lines for r in readers]
            if label != "quiet":
                self.tell(f"paced {rate} {seconds + 4}")
                time.sleep(2)  # steady: the first lines through
            before, lines_before, load_before = snapshot(), [r.lines for r in readers], os.getloadavg()[0]
            time.sleep(seconds)
            after, load_after = snapshot(), os.getloadavg()[0]
            row: dict[str, object] = {"window": label, "load": f"{load_before:.1f}–{load_after:.1f}"}
            for name, pid in who.items():
                row[name] = 100 * (after[pid][1] - before[pid][1]) / seconds
            parts = host_parts(self.cluster, after)
            for part in ("supervisor", "follow", "sshd"):
                used = sum(after[p][1] - (before[p][1] if p in before else 0) for p, kind in parts.items()
                           if kind == part and p in after)
                row[f"hosts: {part}"] = 100 * used / seconds
            row["lines shown"] = [r.lines - b for r, b in zip(readers, lines_before, strict=True)]
            rows.append(row)
            log(f"{row}")
            if label != "quiet":
                self.wait(lambda told=told: all(r.lines - b >= rate * (seconds + 4) * self.n  # type: ignore[misc]
                                                for r, b in zip(readers, told, strict=True)), 120, "the lines")
        return rows

    def foreground(self, rate: float, seconds: float, settle: float) -> list[dict[str, object]]:
        folder = self.open_fifos("fg")
        up, reader = self.start(["up", "--no-tui", "--name", "watch-fg", str(self.hosts), str(WRITER), str(folder)],
                                "up")
        self.wait(lambda: reader.ready >= self.n, 300, "every writer's `ready` from up --no-tui")
        log(f"up --no-tui: every writer ready ({load()})")
        rows = self.windows({"up --no-tui": up.pid}, [reader], rate, seconds, settle)
        self.close_fifos()
        if up.wait(120) != 0:
            raise RuntimeError(f"up --no-tui failed: see {self.folder / 'up.err'}")
        return rows

    def detached(self, rate: float, seconds: float, settle: float) -> list[dict[str, object]]:
        folder = self.open_fifos("bg")
        done = subprocess.run([*CLUSTERRUN, "up", "-d", "--name", "watch-bg", str(self.hosts), str(WRITER),
                               str(folder)], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"up -d failed:\n{done.stderr}")
        job = done.stdout.strip().splitlines()[-1]
        self.jobs.append(job)
        monitor = [pid for pid in snapshot() if re.search(rf"clusterrun _monitor {re.escape(job)}\b", cmdline(pid))]
        if len(monitor) != 1:
            raise RuntimeError(f"expected one monitor of {job}, found {monitor}")
        attach, reader = self.start(["attach", job, "--no-tui"], "attach")
        self.wait(lambda: reader.ready >= self.n, 300, "every writer's `ready` from attach")
        log(f"up -d and attach: every writer ready ({load()})")
        rows = self.windows({"detached monitor": monitor[0], "attach --no-tui": attach.pid}, [reader], rate,
                            seconds, settle)
        self.close_fifos()
        attach.wait(120)
        # The monitor ends with the job, unless it missed a node's end (a link lost under load): it
        # would retry that host for ever once the hosts are gone, so ``close`` stops the job then.
        if exited(monitor[0], 120):
            self.jobs.remove(job)
        return rows

    def memory(self, lines: int, rate: float) -> list[tuple[int, float, str]]:
        """``up --no-tui``'s RSS at every million lines shown of one rank's ``lines``, written at
        ``rate`` lines/s (0: as fast as it can, when RSS also holds what is in flight)."""
        folder = self.open_fifos("mem")
        up, reader = self.start(["up", "--no-tui", "--name", "watch-mem", str(self.hosts), str(WRITER), str(folder)],
                                "up-mem")
        self.wait(lambda: reader.ready >= self.n, 300, "the writer's `ready`")
        self.tell(f"paced {rate} {lines / rate}" if rate else f"fast {lines}")
        samples, mark, began = [], 1_000_000, time.monotonic()
        while reader.lines < lines:
            if up.poll() is not None:
                raise RuntimeError(f"up --no-tui ended early: see {self.folder / 'up-mem.err'}")
            if reader.lines >= mark:
                samples.append((reader.lines, rss_mb(up.pid), load()))
                log(f"{reader.lines} lines after {time.monotonic() - began:.0f} s: RSS {samples[-1][1]:.1f} MB")
                mark += 1_000_000
            time.sleep(0.05)
        samples.append((reader.lines, rss_mb(up.pid), load()))
        self.close_fifos()
        up.wait(120)
        return samples

    def close(self) -> None:
        self.close_fifos()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for job in self.jobs:  # its detached monitor would otherwise try the gone hosts for ever
            subprocess.run([*CLUSTERRUN, "down", job], cwd=ROOT, env=self.env, capture_output=True, timeout=120)


def table(rows: list[dict[str, object]]) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(row.get(k, "")) for k in keys
                                 for v in [row.get(k)]) + " |")


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--rate", type=float, default=100, help="lines/s per node in the busy window (0: none)")
    parser.add_argument("--seconds", type=float, default=30, help="the length of each window")
    parser.add_argument("--settle", type=float, default=15, help="seconds after the start before measuring")
    parser.add_argument("--memory", type=int, default=0, help="only the memory run: lines of one rank")
    parser.add_argument("--memory-rate", type=float, default=20_000, help="its lines/s (0: as fast as it can)")
    parser.add_argument("--split-cpus", action="store_true",
                        help="the hosts' processes on the first half of the cores, the controller's on the rest")
    args = parser.parse_args()
    subprocess.run(["sh", str(ROOT / "tests" / "_support" / "install_sshd.sh")], check=True, capture_output=True)
    n = 1 if args.memory else args.hosts
    with hosts_apart(args.split_cpus) as split:
        cluster = SimCluster.start(n)
    bench = Bench(cluster, n)
    try:
        log(f"{n} hosts up ({load()})" + (f"; {split}" if split else ""))
        if args.memory:
            samples = bench.memory(args.memory, args.memory_rate)
            pace = f"at {args.memory_rate:g} lines/s" if args.memory_rate else "as fast as it can"
            print(f"up --no-tui, one node writing {args.memory} lines of 100 bytes {pace}:\n")
            print("| lines shown | RSS (MB) | load |\n|---|---|---|")
            for count, mb, where in samples:
                print(f"| {count} | {mb:.1f} | {where} |")
            return
        rows = bench.foreground(args.rate, args.seconds, args.settle)
        rows += bench.detached(args.rate, args.seconds, args.settle)
    finally:
        bench.close()
        cluster.close()
    print(f"{n} simulated hosts, one rank each; windows of {args.seconds:g} s; % of one core "
          f"(hosts: all {n} together)" + (f"; {split}" if split else "") + "\n")
    table(rows)


if __name__ == "__main__":
    main()
