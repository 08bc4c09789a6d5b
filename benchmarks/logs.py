"""Log benchmark: clusterrun's `logs`, `logs -f` and `up --no-tui` beside `ssh cat` and `ssh tail -F`,
and beside the same commands read over paramiko (the floor of any paramiko client).

For N simulated hosts (tests/simhosts.py: separate network and PID namespaces, a real sshd each),
each running a real torchrun with one worker per node that writes numbered, timestamped lines
(benchmarks/_log_writer.py, every line flushed at once), it measures in the same run and on the
same hosts:

- latency: every writer prints RATE lines/s for SECONDS; `up --no-tui` (the job's own foreground
  controller), `logs -f JOB` and one `ssh HOST tail -n +1 -F FILE` per host all follow the job at
  the same time. A line's latency is the time the benchmark read it from that reader's stdout
  minus the `time.time()` the worker wrote in it (all hosts share this machine's clock): it
  includes the worker's write, torchrun's per-rank file, the supervisor merging it into the
  node's output.log, the agent, SSH and the controller's printing. p50, p99 and max; lines lost
  or shown twice are counted. Beside them, the merge's part ("merge": when output.times says
  the line's batch was written to output.log, minus when it was written), which no reader of
  output.log can avoid, and `ssh tail -F` of the worker's own file (before the merge). With
  --apart, `up --no-tui` and `logs -f` (of a job of `up -d`) each follow a run of their own
  beside the tails, so that neither reader's CPU slows the other.
- paramiko: "paramiko tail -F" runs the tails' very command on every host over paramiko, in one
  process (benchmarks/_paramiko_tail.py: clusterrun's SSH transport connects, one thread reads
  every channel through a selector and prints complete lines); it follows beside the tails in
  the latency and flood runs, and "paramiko cat" reads the finished files beside `ssh cat`.
  Each clusterrun reader is given against it as against OpenSSH. With --paramiko-per-host the
  latency run also has it in a process per host, as `ssh` runs: one process's cost apart. With
  --paramiko-threads the latency and flood runs also have it read as clusterrun's controller
  reads (a thread per channel blocking in recv, one queue, the main thread printing), once with
  Python's switch interval and once with clusterrun's 0.5 ms: what the threads cost apart.
- throughput, following: every writer prints LINES lines as fast as it can while `logs -f JOB`,
  the N `ssh tail -F` and "paramiko tail -F" follow; lines/s from the moment the writers are
  released to the last line read, beside the writers' own rate.
- throughput, whole files: once that job has ended, `logs JOB` (every node, prefixed) beside N
  `ssh HOST cat FILE` started at once, and `logs JOB --node 0` beside one `ssh sim1 cat FILE`;
  from starting the command (start-up and connecting included) to its exit; MB/s counts the log
  files' bytes, not the prefixes. Median of --repeat runs; every clusterrun output is checked
  for lost and repeated lines.
- `attach JOB --tail 100 --no-tui` on a one-node job of 1,000,000 lines: time from starting it
  to its first log line on stdout, beside `ssh sim1 tail -n 100 FILE` (median of --repeat).

Every `ssh` runs on paramiko's terms (tests/simhosts.py `PARAMIKO_TERMS`: its key exchange and
clusterrun's cipher); the whole-file run also has `ssh cat` on OpenSSH's own terms.
FILE is the node's log on the host, `<state_dir>/jobs/<job>/node<N>/attempt1/output.log`, where
the supervisor appends the worker's lines tagged `[rankR]:`. Every reader is started before the
writers are released (a go-file on the shared filesystem) and has shown the writers' `ready`
line. Needs root (namespaces); installs OpenSSH with apt when missing. Takes a few minutes.
--profile DIR samples `up --no-tui` through the latency run, by thread (benchmarks/_spy.py), at
--profile-rate samples a second (--profile-python: without native stacks nor pauses). Each
reader's CPU (its processes' user + system time, start-up included) is given beside its latency.
--split-cpus: the hosts' processes (sshd and all it starts) on the first half of the cores, this
process and every reader on the rest, as if the hosts were other machines; without it all share.

    python benchmarks/logs.py [--hosts 8] [--lines 100000] [--rate 1000] [--seconds 10] [--apart]
                              [--paramiko-per-host] [--paramiko-threads] [--profile DIR] [--split-cpus]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._pump import DONE, READY, Pump, Source, hosts_apart  # noqa: E402
from benchmarks._spy import Spy, split  # noqa: E402
from tests.simhosts import PARAMIKO_TERMS, SimCluster, close_on_signals  # noqa: E402

WRITER = ROOT / "benchmarks" / "_log_writer.py"
PARAMIKO_READER = ROOT / "benchmarks" / "_paramiko_tail.py"
PYTHON = sys.executable
CLUSTERRUN = [PYTHON, "-m", "clusterrun"]
WIDTH = 100  # bytes per written line, newline included (the log file adds `[rankR]:`)
BIG = 1_000_000
RANK = re.compile(rb"rank(\d+)")
# --paramiko-threads: the paramiko readers in the controller's shape (benchmarks/_paramiko_tail.py)
THREADED = {"paramiko tail -F, threads": ("--threads",),
            "paramiko tail -F, threads, 0.5 ms switch": ("--threads", "--switch-interval", "0.0005")}
JOB_ID = re.compile(r"clusterrun: job ([A-Za-z0-9][A-Za-z0-9._-]*): \d+ nodes")


def log(text: str) -> None:
    print(f"logs.py: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- the figures


def parse(source: Source) -> list[tuple[int, int, float, float]]:
    """(node, seq, written, read) of every timed line a source showed."""
    out = []
    for when, line in source.lines():
        at = line.find(b"seq=")
        if at < 0:
            continue
        seq, stamp = line[at:].split(b" ", 2)[:2]
        if source.node is not None:
            node = source.node
        else:
            found = RANK.search(line, 0, at)
            node = int(found.group(1)) if found else -1
        out.append((node, int(seq[4:]), float(stamp[2:]), when))
    return out


def completeness(records: list[tuple[int, int, float, float]], nodes: Iterable[int], count: int) -> tuple[int, int]:
    """(lines lost, lines shown more than once) against seq 0..count-1 on every node."""
    seen: dict[int, bytearray] = {node: bytearray(count) for node in nodes}
    extra = 0
    for node, seq, _, _ in records:
        marks = seen.get(node)
        if marks is None or not 0 <= seq < count:
            extra += 1
        elif marks[seq]:
            extra += 1
        else:
            marks[seq] = 1
    lost = sum(count - sum(marks) for marks in seen.values())
    return lost, extra


def tail_command(path: Path) -> str:
    """Follow ``path`` from its first line until stdin closes (for `ssh` and the paramiko reader alike)."""
    return f"tail -n +1 -F {shlex.quote(str(path))} & read _; kill $!"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# ------------------------------------------------------------------------------------- the runs


def hosts_file(path: Path, folder: Path, cluster: SimCluster, count: int) -> Path:
    lines = [f"state_dir: {folder / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
             f"  python: {PYTHON}", f"  workdir: {ROOT}", "  nproc: 1", "hosts:"]
    lines += [f"  - host: {h.name}" for h in cluster.hosts[:count]]
    path.write_text("\n".join(lines) + "\n")
    return path


class Bench:
    def __init__(self, cluster: SimCluster, folder: Path, threaded: bool = False, profile: Path | None = None,
                 profile_rate: int = 20, native: bool = True) -> None:
        self.cluster = cluster
        self.folder = folder
        self.variants = THREADED if threaded else {}  # more paramiko readers, by name: their flags
        self.profile, self.profile_rate, self.native = profile, profile_rate, native  # py-spy's, of `up --no-tui`
        self.env = dict(os.environ, XDG_STATE_HOME=str(folder / "xdg"))
        self.pump = Pump(folder / "out", self.env)
        self.jobs: list[str] = []  # started by this benchmark, for `down` if something fails

    def output_log(self, job: str, node: int) -> Path:
        return self.folder / "state" / "jobs" / job / f"node{node}" / "attempt1" / "output.log"

    def clusterrun(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLUSTERRUN, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=120)

    def up_detached(self, name: str, hosts: Path, *script_args: str) -> str:
        done = self.clusterrun("up", "-d", "--name", name, str(hosts), str(WRITER), *script_args)
        if done.returncode != 0 or not done.stdout.strip():
            raise RuntimeError(f"up -d failed (exit {done.returncode}):\n{done.stderr}")
        job = done.stdout.strip().splitlines()[-1]
        self.jobs.append(job)
        return job

    def wait_ready_in_files(self, job: str, n: int, timeout: float = 180) -> None:
        """Until every node's output.log holds the writer's `ready` line (read here, on the shared disk)."""
        deadline = time.monotonic() + timeout
        while True:
            paths = [self.output_log(job, node) for node in range(n)]
            if all(p.exists() and READY in p.read_bytes()[:4096] for p in paths):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job}: the writers were not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def worker_log(self, job: str, node: int) -> Path:
        """torchrun's file of the worker's stdout (local rank 0), which the supervisor merges into output.log."""
        found = sorted(self.output_log(job, node).parent.glob("torchrun/*/attempt_*/0/stdout.log"))
        if len(found) != 1:
            raise RuntimeError(f"job {job} node {node}: expected one worker stdout file, found {found}")
        return found[0]

    def start_tails(self, job: str, n: int, tag: str, worker: bool = False) -> list[Source]:
        """`ssh HOST tail -n +1 -F FILE` per node (FILE: output.log, or the worker's own stdout file);
        it ends when its stdin is closed."""
        tails = []
        for node in range(n):
            path = self.worker_log(job, node) if worker else self.output_log(job, node)
            argv = self.cluster.ssh_argv(self.cluster.hosts[node].name, tail_command(path), terms=PARAMIKO_TERMS)
            tails.append(self.pump.start(f"{tag}-tail-{node}", argv, node=node, stdin=True))
        return tails

    def paramiko_tail(self, hosts: Path, job: str, n: int, tag: str, *flags: str) -> Source:
        """The paramiko baseline of `ssh tail -F`: the same command on the same files, every host read
        in one thread of one process (benchmarks/_paramiko_tail.py; ``flags``: another way); its
        lines carry their rank; it ends when its stdin is closed."""
        commands = [tail_command(self.output_log(job, node)) for node in range(n)]
        return self.pump.start(f"{tag}-paramiko{''.join('-' + f.lstrip('-') for f in flags)}",
                               [PYTHON, str(PARAMIKO_READER), *flags, str(hosts), *commands], stdin=True)

    def paramiko_variants(self, hosts: Path, job: str, n: int, tag: str) -> dict[str, Source]:
        return {name: self.paramiko_tail(hosts, job, n, tag, *flags) for name, flags in self.variants.items()}

    def paramiko_tails(self, hosts: Path, job: str, n: int, tag: str) -> list[Source]:
        """The same as ``paramiko_tail``, one process per host (as `ssh` is), for --paramiko-per-host."""
        return [self.pump.start(f"{tag}-paramiko-{node}", [PYTHON, str(PARAMIKO_READER), str(hosts),
                                                           *["-"] * node, tail_command(self.output_log(job, node))],
                                node=node, stdin=True) for node in range(n)]

    def stop_tails(self, tails: list[Source]) -> None:
        for tail in tails:
            assert tail.proc.stdin is not None
            tail.proc.stdin.close()
        self.pump.run(lambda: all(t.end is not None for t in tails), 30, "ssh tail to end")
        for tail in tails:
            self.pump.finish(tail)

    def job_state(self, job: str) -> str:
        done = self.clusterrun("ps", job, "--json")
        return str(json.loads(done.stdout)["jobs"][0]["state"]) if done.returncode == 0 else "?"

    def wait_job(self, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job)) not in ("succeeded", "failed", "stopped", "lost"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} still {state} after {timeout:.0f} s")
            time.sleep(1)
        if state != "succeeded":
            raise RuntimeError(f"job {job} {state}")
        self.jobs.remove(job)

    # ----------------------------------------------------------------------------- latency

    def paced(self, hosts: Path, n: int, rate: float, seconds: float,
              readers: tuple[str, ...] = ("up", "logs"), per_host: bool = False) -> dict[str, dict[str, float]]:
        """One latency run: the clusterrun ``readers`` ("up": the job's own `up --no-tui`; "logs":
        `logs -f`, of a job started by `up -d` if "up" is not among them) beside the tails."""
        tag = "-".join(readers)
        go = self.folder / f"go-paced-{tag}"
        script = [str(WRITER), str(go), "paced", str(rate), str(seconds), str(WIDTH)]
        named: list[tuple[str, Source]] = []  # the clusterrun readers
        job = ""
        if "up" in readers:
            up = self.pump.start(f"paced-{tag}-up", [*CLUSTERRUN, "up", "--no-tui", "--name", f"paced-{tag}",
                                                     str(hosts), *script])
            named.append(("clusterrun up --no-tui", up))

            def have_id() -> bool:
                nonlocal job
                found = JOB_ID.search(self.pump.stderr(up))
                job = found.group(1) if found else ""
                return bool(job)

            self.pump.run(have_id, 120, "the job id from `up --no-tui`", alive=[up])
            self.jobs.append(job)
        else:
            job = self.up_detached(f"paced-{tag}", hosts, *script[1:])
        if "logs" in readers:
            named.append(("clusterrun logs -f", self.pump.start(f"paced-{tag}-logs-f",
                                                                 [*CLUSTERRUN, "logs", "-f", job])))
        shown = [source for _, source in named]
        self.wait_ready_in_files(job, n)
        tails = self.start_tails(job, n, f"paced-{tag}")
        raw = self.start_tails(job, n, f"paced-{tag}-raw", worker=True)
        pm = self.paramiko_tail(hosts, job, n, f"paced-{tag}")
        pms = self.paramiko_tails(hosts, job, n, f"paced-{tag}") if per_host else []
        variants = self.paramiko_variants(hosts, job, n, f"paced-{tag}")
        every = [*shown, *tails, *raw, pm, *pms, *variants.values()]
        self.pump.run(lambda: all(r.marks[READY] >= (1 if r.node is not None else n) for r in every), 120,
                      "every reader to show the writers' `ready`", alive=every)
        log(f"paced ({' and '.join(readers)}): every reader is ready, {n} writers at {rate:.0f} lines/s "
            f"for {seconds:.0f} s")
        ones = [pm, *variants.values()]  # the one-process readers of every host
        spies = [Spy(source.proc.pid, self.profile, source.name, self.profile_rate, self.native) for source in shown
                 if self.profile and source.name.endswith("-up")]
        go.touch()
        self.pump.run(lambda: all(s.end is not None for s in shown) and all(t.marks[DONE] for t in [*tails, *raw, *pms])
                      and all(p.marks[DONE] >= n for p in ones), seconds + 180, "the paced job to end",
                      alive=[*tails, *raw, *ones, *pms])
        self.stop_tails([*tails, *raw, *ones, *pms])
        for source in ones:
            log(f"paced ({' and '.join(readers)}): {source.name}: {self.pump.stderr(source).strip().splitlines()[-1]}")
        for spy in spies:
            log(f"py-spy of {spy.path.name} exited {spy.wait(60)}; by thread:\n{split(spy.path)}")
        for source in shown:
            if self.pump.finish(source) != 0 and source.name.endswith("-up"):
                raise RuntimeError(f"up --no-tui failed:\n{self.pump.stderr(source)[-3000:]}")
        if "up" in readers:
            self.jobs.remove(job)
        else:
            self.wait_job(job, 120)
        count = int(rate * seconds)
        results = {"merge (written → in output.log)": self.merged(job, n, count)}
        each_host = [("paramiko tail -F, a process per host", pms)] if pms else []
        for name, group in (("ssh tail -F (worker's stdout file)", raw), ("ssh tail -F", tails),
                            ("paramiko tail -F", [pm]), *((name, [v]) for name, v in variants.items()), *each_host,
                            *((name, [source]) for name, source in named)):
            records = [r for source in group for r in parse(source)]
            lost, extra = completeness(records, range(n), count)
            delays = [read - written for _, _, written, read in records]
            results[name] = {"lines": len(records), "lost": lost, "extra": extra, "p50": percentile(delays, 0.5),
                             "p99": percentile(delays, 0.99), "max": max(delays)}
            cpu = [source.cpu for source in group]
            if all(c is not None for c in cpu):  # every reader's processes, the whole run, start-up included
                results[name]["cpu"] = sum(c for c in cpu if c is not None)
        return results

    def merged(self, job: str, n: int, count: int) -> dict[str, float]:
        """When each timed line reached its node's output.log (the supervisor's merge, timed in
        output.times: ``<offset> <ns>`` before each batch written from offset on) minus when it
        was written: the part of every reader's latency spent before anything can read it."""
        delays = []
        for node in range(n):
            path = self.output_log(job, node)
            stamps = [tuple(map(int, line.split())) for line in
                      path.with_name("output.times").read_text().splitlines() if len(line.split()) == 2]
            data, at = path.read_bytes(), 0
            offsets = [o for o, _ in stamps]
            for line in data.split(b"\n"):
                found = line.find(b"seq=")
                if found >= 0 and (k := bisect.bisect_right(offsets, at) - 1) >= 0:
                    written = float(line[found:].split(b" ", 2)[1][2:])
                    delays.append(stamps[k][1] / 1e9 - written)
                at += len(line) + 1
        lost = n * count - len(delays)
        return {"lines": len(delays), "lost": lost, "extra": 0, "p50": percentile(delays, 0.5),
                "p99": percentile(delays, 0.99), "max": max(delays)}

    # -------------------------------------------------------------------------- throughput

    def fast(self, hosts: Path, n: int, lines: int, repeat: int) -> dict[str, dict[str, float]]:
        go = self.folder / "go-fast"
        job = self.up_detached("fast", hosts, str(go), "fast", str(lines), str(WIDTH))
        follow = self.pump.start("fast-logs-f", [*CLUSTERRUN, "logs", "-f", job])
        self.wait_ready_in_files(job, n)
        tails = self.start_tails(job, n, "fast")
        pm = self.paramiko_tail(hosts, job, n, "fast")
        variants = self.paramiko_variants(hosts, job, n, "fast")
        ones = [pm, *variants.values()]
        self.pump.run(lambda: all(r.marks[READY] >= (1 if r.node is not None else n) for r in [follow, *tails, *ones]),
                      120, "every reader to show the writers' `ready`", alive=[follow, *tails, *ones])
        log(f"fast: every reader is ready, {n} writers of {lines} lines each")
        began = time.time()
        go.touch()
        self.pump.run(lambda: follow.end is not None and all(t.marks[DONE] for t in tails)
                      and all(p.marks[DONE] >= n for p in ones), 600, "the fast job to end", alive=[*tails, *ones])
        self.stop_tails([*tails, *ones])
        for source in ones:
            log(f"fast: {source.name}: {self.pump.stderr(source).strip().splitlines()[-1]}")
        self.pump.finish(follow)
        self.wait_job(job, 120)
        results: dict[str, dict[str, float]] = {}
        total = n * lines
        written_last = 0.0
        for name, group in (("ssh tail -F", tails), ("paramiko tail -F", [pm]),
                            *((name, [v]) for name, v in variants.items()), ("clusterrun logs -f", [follow])):
            records = [r for source in group for r in parse(source)]
            lost, extra = completeness(records, range(n), lines)
            last = max(read for _, _, _, read in records)
            written_last = max(written for _, _, written, _ in records)
            results[name] = {"seconds": last - began, "rate": len(records) / (last - began), "lost": lost,
                             "extra": extra, "lag": last - written_last,
                             "cpu": sum(source.cpu or 0.0 for source in group)}
        results["writers"] = {"seconds": written_last - began, "rate": total / (written_last - began)}
        files = [self.output_log(job, node) for node in range(n)]
        size_all, size_one = sum(p.stat().st_size for p in files), files[0].stat().st_size
        lines_all = sum(p.read_bytes().count(b"\n") for p in files)
        lines_one = files[0].read_bytes().count(b"\n")
        cats = [shlex.join(["cat", str(path)]) for path in files]  # the same command for ssh and paramiko
        runs: dict[str, list[tuple[float, float]]] = {}
        for i in range(repeat):
            for name, commands, nodes in (
                (f"ssh cat ×{n} at once", [self.cluster.ssh_argv(self.cluster.hosts[k].name, cats[k],
                                                                  terms=PARAMIKO_TERMS) for k in range(n)], None),
                (f"ssh cat ×{n}, OpenSSH's terms", [self.cluster.ssh_argv(self.cluster.hosts[k].name, cats[k])
                                                    for k in range(n)], None),
                (f"paramiko cat ×{n}", [[PYTHON, str(PARAMIKO_READER), str(hosts), *cats]], range(n)),
                ("clusterrun logs JOB", [[*CLUSTERRUN, "logs", job]], range(n)),
                ("ssh sim1 cat (node 0)", [self.cluster.ssh_argv(self.cluster.hosts[0].name, cats[0],
                                                                 terms=PARAMIKO_TERMS)], None),
                ("paramiko cat (node 0)", [[PYTHON, str(PARAMIKO_READER), str(hosts), cats[0]]], range(1)),
                ("clusterrun logs JOB --node 0", [[*CLUSTERRUN, "logs", job, "--node", "0"]], range(1)),
            ):
                sources = [self.pump.start(f"read-{i}-{len(runs.get(name, []))}-{k}", argv) for k, argv in
                           enumerate(commands)]
                self.pump.run(lambda s=sources: all(x.end is not None for x in s), 600, name)
                codes = [self.pump.finish(x) for x in sources]
                if any(codes):
                    raise RuntimeError(f"{name} failed: exit {codes}:\n{self.pump.stderr(sources[0])[-3000:]}")
                began_at = min(x.started for x in sources)
                elapsed = max(x.end or 0 for x in sources) - began_at
                first = min(x.first or float("inf") for x in sources) - began_at
                if nodes is not None:  # lines carry their rank: `node0 sim1 rank0 | ` or `[rank0]:`
                    lost, extra = completeness(parse(sources[0]), nodes, lines)
                    if lost or extra:
                        log(f"{name}: {lost} lines lost, {extra} extra")
                    results.setdefault(f"{name} check", {"lost": 0, "extra": 0})
                    results[f"{name} check"]["lost"] += lost
                    results[f"{name} check"]["extra"] += extra
                got = sum(x.nbytes for x in sources)
                runs.setdefault(name, []).append((elapsed, first))
                log(f"{name}: {elapsed:.2f} s ({got / 1e6:.1f} MB on stdout), first line after {first:.2f} s")
                self.pump.sources = [s for s in self.pump.sources if s not in sources]
        for name, values in runs.items():
            size, count = (size_one, lines_one) if "node 0" in name else (size_all, lines_all)
            elapsed = statistics.median(e for e, _ in values)
            results[name] = {"seconds": elapsed, "first": statistics.median(f for _, f in values),
                             "rate": count / elapsed, "mbps": size / elapsed / 1e6, "lines": count, "bytes": size}
        return results

    # ------------------------------------------------------------------------- attach --tail

    def big(self, hosts: Path, repeat: int) -> dict[str, dict[str, float]]:
        job = self.up_detached("big", hosts, "-", "fast", str(BIG), str(WIDTH))
        self.wait_job(job, 600)
        path = self.output_log(job, 0)
        count = path.read_bytes().count(b"\n")
        log(f"big: job {job} ended; its log has {count} lines, {path.stat().st_size / 1e6:.0f} MB")
        runs: dict[str, list[tuple[float, float, int]]] = {}
        for i in range(repeat):
            for name, argv in (("ssh sim1 tail -n 100", self.cluster.ssh_argv("sim1", "tail", "-n", "100", str(path),
                                                                              terms=PARAMIKO_TERMS)),
                               ("clusterrun attach --tail 100", [*CLUSTERRUN, "attach", job, "--tail", "100",
                                                                 "--no-tui"])):
                source = self.pump.start(f"big-{i}-{name.split()[0]}", argv)
                self.pump.run(lambda s=source: s.end is not None, 120, name)
                self.pump.finish(source)
                shown = sum(1 for _ in source.lines())
                runs.setdefault(name, []).append(((source.first or float("inf")) - source.started,
                                                  (source.end or 0) - source.started, shown))
                self.pump.sources.remove(source)
        return {name: {"first": statistics.median(f for f, _, _ in v), "first_max": max(f for f, _, _ in v),
                       "seconds": statistics.median(e for _, e, _ in v), "lines": v[-1][2], "file_lines": count}
                for name, v in runs.items()}

    def down_all(self) -> None:
        for job in list(self.jobs):
            log(f"stopping job {job}")
            with contextlib.suppress(Exception):
                self.clusterrun("down", job)


# ----------------------------------------------------------------------------------- reporting


def latency_target(results: dict[str, dict[str, float]]) -> str:
    """The clusterrun readers' worst p99 against `ssh tail -F`'s of the same run, and each reader's
    p99 against paramiko's (the floor of a paramiko client) and paramiko's against OpenSSH's."""
    p99 = max(r["p99"] for name, r in results.items() if name.startswith("clusterrun"))
    floor, pm = results["ssh tail -F"]["p99"], results["paramiko tail -F"]["p99"]
    each = ", ".join(f"{name.removeprefix('clusterrun ')} {r['p99'] / floor:.1f}× ssh, {r['p99'] / pm:.1f}× paramiko"
                     for name, r in results.items() if name.startswith("clusterrun"))
    return (f"p99 ≤ 2 × ssh tail -F's: {p99 / floor:.1f} × → {'met' if p99 <= 2 * floor else 'NOT met'} "
            f"({each}; paramiko tail -F itself {pm / floor:.1f}× ssh tail -F's p99)")


def report(args: argparse.Namespace, n: int, isolated: bool, paced: list[dict[str, dict[str, float]]],
           fast: dict[str, dict[str, float]], big: dict[str, dict[str, float]]) -> None:
    print(f"{os.cpu_count()} cores; {n} hosts isolated in namespaces: {isolated}; one worker per node; "
          f"lines of {WIDTH} bytes as written" + ("; the hosts and the readers on separate cores" if args.split_cpus
                                                  else ""))
    for results in paced:
        print(f"\n### Latency: {n} hosts × {args.rate:.0f} lines/s for {args.seconds:.0f} s, these readers at once\n")
        print("| reader | lines read | lost | shown twice | p50 (ms) | p99 (ms) | max (ms) | p99 vs ssh tail -F "
              "| vs paramiko tail -F | CPU (s) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        ssh, pm = results["ssh tail -F"]["p99"], results["paramiko tail -F"]["p99"]
        for name, r in results.items():
            cpu = f"{r['cpu']:.2f}" if "cpu" in r else ""
            print(f"| {name} | {r['lines']:.0f} | {r['lost']:.0f} | {r['extra']:.0f} | {r['p50'] * 1000:.0f} "
                  f"| {r['p99'] * 1000:.0f} | {r['max'] * 1000:.0f} | {r['p99'] / ssh:.2f} | {r['p99'] / pm:.2f} "
                  f"| {cpu} |")
    total = n * args.lines
    print(f"\n### Throughput, following: {n} hosts × {args.lines} lines as fast as they can "
          f"({total} lines), these readers at once\n")
    print("| reader | lines/s | last line read after (s) | lag of the last line (s) | lost | shown twice "
          "| vs ssh tail -F | vs paramiko tail -F | CPU (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    w = fast["writers"]
    print(f"| (the writers themselves) | {w['rate']:.0f} | {w['seconds']:.2f} | | | | | | |")
    for name in ("ssh tail -F", "paramiko tail -F", *(v for v in THREADED if v in fast), "clusterrun logs -f"):
        r = fast[name]
        print(f"| {name} | {r['rate']:.0f} | {r['seconds']:.2f} | {r['lag']:.2f} | {r['lost']:.0f} "
              f"| {r['extra']:.0f} | {r['rate'] / fast['ssh tail -F']['rate']:.2f} "
              f"| {r['rate'] / fast['paramiko tail -F']['rate']:.2f} | {r['cpu']:.2f} |")
    one = fast["ssh sim1 cat (node 0)"]
    every = fast[f"ssh cat ×{n} at once"]
    print(f"\n### Throughput, whole files of the finished job (median of {args.repeat}; start-up included)\n")
    print(f"{n} files: {every['lines']:.0f} lines, {every['bytes'] / 1e6:.1f} MB; node 0: {one['lines']:.0f} lines, "
          f"{one['bytes'] / 1e6:.1f} MB.\n")
    print("| reader | time (s) | first line after (s) | lines/s | MB/s (log bytes) | vs ssh cat | vs paramiko cat |")
    print("|---|---|---|---|---|---|---|")
    every_pm, one_pm = fast[f"paramiko cat ×{n}"], fast["paramiko cat (node 0)"]
    for name, base, base_pm in ((f"ssh cat ×{n} at once", every, every_pm), (f"ssh cat ×{n}, OpenSSH's terms", every,
                                                                             every_pm),
                                (f"paramiko cat ×{n}", every, every_pm),
                                ("clusterrun logs JOB", every, every_pm), ("ssh sim1 cat (node 0)", one, one_pm),
                                ("paramiko cat (node 0)", one, one_pm), ("clusterrun logs JOB --node 0", one, one_pm)):
        r = fast[name]
        print(f"| {name} | {r['seconds']:.2f} | {r['first']:.2f} | {r['rate']:.0f} | {r['mbps']:.1f} "
              f"| {r['rate'] / base['rate']:.2f} | {r['rate'] / base_pm['rate']:.2f} |")
    for name in (f"paramiko cat ×{n} check", "clusterrun logs JOB check", "paramiko cat (node 0) check",
                 "clusterrun logs JOB --node 0 check"):
        r = fast.get(name, {"lost": 0, "extra": 0})
        print(f"{name.removesuffix(' check')}: {r['lost']:.0f} lines lost, {r['extra']:.0f} shown twice "
              f"(all runs)")
    if not args.skip_big:
        print(f"\n### `attach --tail 100` on a job of {BIG} lines (1 node; median of {args.repeat})\n")
        print("| command | first line after (s) | worst (s) | exit after (s) | lines shown |")
        print("|---|---|---|---|---|")
    for name, r in big.items() if not args.skip_big else ():
        print(f"| {name} | {r['first']:.2f} | {r['first_max']:.2f} | {r['seconds']:.2f} | {r['lines']:.0f} |")
    ratio = fast["clusterrun logs JOB"]["rate"] / every["rate"]
    ratio_one = fast["clusterrun logs JOB --node 0"]["rate"] / one["rate"]
    follow = fast["clusterrun logs -f"]["rate"] / fast["ssh tail -F"]["rate"]
    follow_pm = fast["clusterrun logs -f"]["rate"] / fast["paramiko tail -F"]["rate"]
    floor = fast["paramiko tail -F"]["rate"] / fast["ssh tail -F"]["rate"]
    first = big["clusterrun attach --tail 100"]["first_max"]
    print(f"\nTargets: `logs` ≥ 1.0 × ssh cat: {ratio:.2f} for every node, {ratio_one:.2f} for node 0 → "
          f"{'met' if min(ratio, ratio_one) >= 1 else 'NOT met'} (against paramiko cat: "
          f"{fast['clusterrun logs JOB']['rate'] / every_pm['rate']:.2f}, "
          f"{fast['clusterrun logs JOB --node 0']['rate'] / one_pm['rate']:.2f}; paramiko cat itself "
          f"{every_pm['rate'] / every['rate']:.2f}, {one_pm['rate'] / one['rate']:.2f} × ssh cat); "
          f"`logs -f` following ≥ 1.0 × tail -F's lines/s: {follow:.2f} → {'met' if follow >= 1 else 'NOT met'} "
          f"({follow_pm:.2f} × paramiko tail -F's; paramiko tail -F itself {floor:.2f} × ssh tail -F's)", end="")
    for results in paced:
        print(f"; {latency_target(results)}", end="")
    if not args.skip_big:
        print(f"; attach --tail 100 first line ≤ 1 s: {first:.2f} s (worst) → {'met' if first <= 1 else 'NOT met'}",
              end="")
    print()


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    # The controller as pip installs it, its modules' bytecode cached: with PYTHONDONTWRITEBYTECODE
    # set (as on the project's machine) every run compiled clusterrun from source (--help: 0.29 s
    # instead of 0.17 s).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--lines", type=int, default=100_000, help="lines per host for the throughput runs")
    parser.add_argument("--rate", type=float, default=1000, help="lines/s per host for the latency run")
    parser.add_argument("--seconds", type=float, default=10, help="duration of the latency run")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each whole-file read and attach")
    parser.add_argument("--skip-big", action="store_true", help="leave out the 1,000,000-line attach check")
    parser.add_argument("--latency-only", action="store_true", help="only the latency run (a quick check)")
    parser.add_argument("--apart", action="store_true",
                        help="latency: `up --no-tui` and `logs -f` each in a run of its own beside the tails")
    parser.add_argument("--paramiko-per-host", action="store_true",
                        help="latency: paramiko's tail -F also in a process per host (as ssh), beside the one")
    parser.add_argument("--paramiko-threads", action="store_true",
                        help="latency and flood: paramiko's tail -F also read in clusterrun's shape (threads, a queue)")
    parser.add_argument("--profile", type=Path, help="py-spy's samples of the latency run's up --no-tui, by thread")
    parser.add_argument("--profile-rate", type=int, default=20, help="--profile's samples a second")
    parser.add_argument("--profile-python", action="store_true", help="--profile: Python stacks only, no pauses")
    parser.add_argument("--skip-latency", action="store_true", help="leave out the latency run (throughput only)")
    parser.add_argument("--split-cpus", action="store_true",
                        help="the hosts' processes on the first half of the cores, the readers on the rest")
    args = parser.parse_args()
    subprocess.run(["sh", str(ROOT / "tests" / "_support" / "install_sshd.sh")], check=True, capture_output=True)
    n = args.hosts
    with hosts_apart(args.split_cpus) as split:  # the readers it starts and the ssh clients: the controller's side
        cluster = SimCluster.start(n)
    if split:
        log(split)
    bench = None
    try:
        folder = cluster.dir / "bench"
        (folder / "out").mkdir(parents=True)
        bench = Bench(cluster, folder, args.paramiko_threads, args.profile, args.profile_rate, not args.profile_python)
        every = hosts_file(folder / "hosts.yaml", folder, cluster, n)
        began = time.monotonic()
        rounds: list[tuple[str, ...]] = [] if args.skip_latency else [("up",), ("logs",)] if args.apart else [
            ("up", "logs")]
        paced = [bench.paced(every, n, args.rate, args.seconds, readers, args.paramiko_per_host) for readers in rounds]
        log(f"latency run done after {time.monotonic() - began:.0f} s")
        if args.latency_only:
            for results in paced:
                for name, r in results.items():
                    cpu = f", CPU {r['cpu']:.2f} s" if "cpu" in r else ""
                    print(f"{name}: p50 {r['p50'] * 1000:.0f} ms, p99 {r['p99'] * 1000:.0f} ms, "
                          f"max {r['max'] * 1000:.0f} ms, {r['lost']:.0f} lost, {r['extra']:.0f} twice{cpu}")
                print(latency_target(results))
            return
        fast = bench.fast(every, n, args.lines, args.repeat)
        log(f"throughput runs done after {time.monotonic() - began:.0f} s")
        big = {} if args.skip_big else bench.big(hosts_file(folder / "one.yaml", folder, cluster, 1), args.repeat)
        log(f"all done after {time.monotonic() - began:.0f} s")
    except BaseException:
        if bench is not None:
            bench.pump.close()
            bench.down_all()
        raise
    finally:
        if bench is not None:
            bench.pump.close()
        cluster.close()
    if not big:
        big = {"clusterrun attach --tail 100": {"first": 0, "first_max": 0, "seconds": 0, "lines": 0}}
    report(args, n, cluster.isolated, paced, fast, big)


if __name__ == "__main__":
    main()
