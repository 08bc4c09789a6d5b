"""The plain output of a job of many nodes: a phase's status lines fold into one line per set of
nodes alike past ``FOLD_PAST`` nodes, the odd ones named on their own, no node lost.

Fast: ``up --no-tui`` of 64 nodes on the fake transport, the stop reports as ``down`` prints
them. On simulated SSH hosts (integration): ``down`` of a 16-node job of the stub torchrun.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

import clusterrun.cli.launch as launch_cli
import clusterrun.cli.up as up_cli
from clusterrun.checks.doctor import Check, HostReport, Report, Verdict, warnings
from clusterrun.cli import main
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.config.nodesets import FOLD_PAST
from clusterrun.core.events import JobHung, NodeLink, NodeStarted, StopReport
from clusterrun.core.ranges import parse_ranges
from clusterrun.life import lifecycle
from clusterrun.life.attempt import restart
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Runner
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.sync.copy import SyncProgress, SyncReport
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.printer import Printer
from clusterrun.views.sync import SyncView
from tests.conftest import SUPPORT, cli_runner
from tests.simhosts import SimCluster, namespace_problem, unavailable
from tests.test_orchestrator import JOB

N = 64
HOLD = 600.0  # a phase is printed when it is complete, however slow a loaded machine, not after 2 s
ONE = re.compile(r"^clusterrun: (?:sync )?node(\d+) (\S+): (.*)$")
FOLDED = re.compile(r"^clusterrun: (?:sync )?(\d+) nodes ([\d,-]+) \((\S+)\): (.*)$")


def who(line: str) -> tuple[list[int], str] | None:
    """The node ranks a status line speaks of, and what it says of them (None: not a node's line).
    A folded line's count must be its node set's size."""
    if (one := ONE.match(line)) is not None:
        return [int(one.group(1))], one.group(3)
    if (many := FOLDED.match(line)) is not None:
        ranks = parse_ranges(many.group(2))
        assert len(ranks) == int(many.group(1)), line
        return ranks, many.group(4)
    return None


def phase(lines: list[str], says: Callable[[str], bool]) -> tuple[list[str], Counter[int]]:
    """The lines of a phase (those whose text ``says``), and how often each node is in them."""
    chosen = [line for line in lines if (w := who(line)) is not None and says(w[1])]
    return chosen, Counter(rank for line in chosen for rank in (who(line) or ([], ""))[0])


def hosts_yaml(n: int) -> str:
    return "hosts:\n" + "".join(f"  - host: gpu{i + 1:02d}\n    nproc: 1\n" for i in range(n))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCluster]:
    cluster = FakeCluster()
    monkeypatch.setattr(launch_cli, "Printer", partial(Printer, hold=HOLD))
    monkeypatch.setattr(up_cli, "transport_for", lambda spec, **_: cluster.transport(spec))
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: cluster.transport)
    yield cluster


def up_failing_node(fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int,
                    failing: int) -> tuple[list[str], list[str]]:
    """``up --no-tui`` of ``n`` fake nodes, each rank printing a line, then node ``failing``
    failing (fail-fast stops the others): its stdout and stderr lines."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts.yaml").write_text(hosts_yaml(n))
    started = threading.Event()

    def script() -> None:
        fake.wait(lambda: len(fake.nodes) == n, timeout=60, what=f"{n} nodes started")
        job = next(iter(fake.nodes))[0]
        nodes = [fake.wait_started(job, rank) for rank in range(n)]
        for rank, node in enumerate(nodes):
            node.write(f"[rank{rank}]:hello from rank {rank}\n")
        nodes[failing].write(f"[rank{failing}]:ValueError: bad batch\n")
        nodes[failing].exit(1)
        started.set()

    thread = threading.Thread(target=script, daemon=True)
    thread.start()
    result = cli_runner().invoke(main, ["up", "--no-tui", "hosts.yaml", "train.py"])
    thread.join(timeout=60)
    assert started.is_set() and result.exit_code == 1, (result.output, result.exception)
    return result.stdout.splitlines(), result.stderr.splitlines()


def test_up_of_64_nodes_prints_a_line_per_phase_the_odd_node_named_and_every_log_line_prefixed(
        fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = up_failing_node(fake, tmp_path, monkeypatch, N, failing=17)
    assert len(err) <= 12, err  # was 64 + 63 + 63 + 64 lines
    everyone, others = Counter(range(N)), Counter(r for r in range(N) if r != 17)
    lines, nodes = phase(err, lambda text: text == "started attempt 1")
    assert lines == ["clusterrun: 64 nodes 0-63 (gpu[01-64]): started attempt 1"] and nodes == everyone
    lines, nodes = phase(err, lambda text: text.startswith("stopping"))
    assert lines == ["clusterrun: 63 nodes 0-16,18-63 (gpu[01-17,19-64]): stopping (node 17 (gpu18) failed)"]
    lines, nodes = phase(err, lambda text: text.startswith(("stopped torchrun", "nothing was running")))
    assert lines == ["clusterrun: 63 nodes 0-16,18-63 (gpu[01-17,19-64]): stopped torchrun; "
                     "no process of the job was found"] and nodes == others
    summary = err[err.index("clusterrun: " + lines[0].split(": ", 1)[1]) + 1:]
    ends, nodes = phase(summary, lambda text: True)
    assert ends == ["clusterrun: 63 nodes 0-16,18-63 (gpu[01-17,19-64]): stopped by clusterrun after node 17 failed",
                    "clusterrun: node17 gpu18: failed (exit code 1)"] and nodes == everyone
    assert err.count("clusterrun: node17 gpu18: failed (exit code 1)") == 2  # as it happened, and in the summary
    assert [line for line in err if line.startswith("clusterrun: network:")] == [
        "clusterrun: network: 64 nodes 0-63 (gpu[01-64]): eth0"]
    for rank in range(N):  # every node's log line keeps its own prefix
        assert f"node{rank} gpu{rank + 1:02d} rank{rank}".ljust(len("node63 gpu64 rank63")) + \
            f" | hello from rank {rank}" in out


def test_up_of_up_to_8_nodes_keeps_a_line_per_node(fake: FakeCluster, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, err = up_failing_node(fake, tmp_path, monkeypatch, FOLD_PAST, failing=3)
    started = [line for line in err if "started attempt 1" in line]
    assert [who(line) for line in started] == [([r], f"started attempt 1 (torchrun pid {pid})")
                                               for r, pid in enumerate(int(s.rsplit(" ", 1)[1][:-1]) for s in started)]
    assert len([line for line in err if "stopped by clusterrun after node 3 failed" in line]) == FOLD_PAST - 1


def test_a_restart_of_64_nodes_is_a_line_for_the_stop_and_one_for_the_start(
        fake: FakeCluster, tmp_path: Path) -> None:
    """``restart``'s stream (``attempt.restart`` with the printer ``restart`` gives it)."""
    text = hosts_yaml(N)
    job = Job(load_cluster_text(text, "hosts.yaml"), "train.py", job_id=JOB, name="train", emit=None,
              transport_factory=fake.transport, local_cwd=str(tmp_path), reconnect=Reconnect(first=0.01, most=0.02))
    (tmp_path / "hosts.yaml").write_text(text)
    store = JobStore(tmp_path / "jobs")
    store.create(new_record(job.prepare(), hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=text,
                            env_overrides={}, local_cwd=str(tmp_path), ssh_config=None))
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, store.load(JOB), job, owner, lambda event: None)
    runner.start()
    err = io.StringIO()
    try:
        restart(store, store.load(JOB), Printer(err=err, nnodes=N, hold=HOLD), owner_fd=runner.owner_fd,
                recorded=Opened(store.load(JOB)).spec())
    finally:
        runner.close()
    assert err.getvalue().splitlines() == [
        "clusterrun: 64 nodes 0-63 (gpu[01-64]): stopped torchrun; no process of the job was found",
        "clusterrun: 64 nodes 0-63 (gpu[01-64]): started attempt 2"]


def up_refused(fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``up --no-tui`` of 64 fake nodes with a ``setup:`` that the caller made fail: its stderr lines."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts.yaml").write_text(hosts_yaml(N) + "defaults:\n  setup: ['pip install -r req.txt']\n")
    result = cli_runner().invoke(main, ["up", "--no-tui", "hosts.yaml", "train.py"])
    assert result.exit_code == 3, (result.output, result.exception)
    return result.stderr.splitlines()


def test_a_node_that_cannot_start_is_named_and_the_others_fold(fake: FakeCluster, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fake.host("gpu18").start_error = "cannot start: no space left on device"
    err = up_refused(fake, tmp_path, monkeypatch)
    assert err[2:] == ["clusterrun: node17 gpu18: failed (cannot start: no space left on device)",  # never held
                       "clusterrun: 63 nodes 0-16,18-63 (gpu[01-17,19-64]): started attempt 1",
                       "clusterrun: 63 nodes 0-16,18-63 (gpu[01-17,19-64]): stopped torchrun; "
                       "no process of the job was found",
                       "clusterrun: error: 1 host(s) cannot run the job; nothing was started",
                       "gpu18: cannot start: no space left on device"]


def test_one_problem_of_many_hosts_is_one_line_and_the_odd_host_its_own(fake: FakeCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for rank in range(N):
        fake.host(f"gpu{rank + 1:02d}").setup_error = "setup failed: `pip install -r req.txt` exited 1"
    fake.host("gpu18").setup_error = "setup failed: no space left on device"
    assert up_refused(fake, tmp_path, monkeypatch) == [
        "clusterrun: error: 64 host(s) cannot run the job; nothing was started",
        "63 hosts gpu[01-17,19-64]: setup failed: `pip install -r req.txt` exited 1",
        "gpu18: setup failed: no space left on device"]


def test_a_preflight_warning_of_many_hosts_is_one_line_and_the_odd_host_its_own() -> None:
    old_python = Check("python", Verdict.WARN, "3.9 is old", fix="python 3.10 or newer")
    hosts = [HostReport(rank, f"gpu{rank + 1:02d}", [Check("ssh", Verdict.OK, "ok"), old_python])
             for rank in range(N)]
    hosts[17].checks[1] = Check("python", Verdict.WARN, "3.8 is old", fix="python 3.10 or newer")
    assert warnings(Report(hosts)) == [
        "63 hosts gpu[01-17,19-64]: python: 3.9 is old (fix: python 3.10 or newer)",
        "gpu18: python: 3.8 is old (fix: python 3.10 or newer)"]
    assert warnings(Report(hosts[:FOLD_PAST])) == [
        f"gpu{rank + 1:02d}: python: 3.9 is old (fix: python 3.10 or newer)" for rank in range(FOLD_PAST)]


def test_the_sync_of_64_hosts_is_announced_once_and_reported_per_set_of_hosts_alike_without_times() -> None:
    reports = {rank: SyncReport(rank, f"gpu{rank + 1:02d}", "/src", "/work", copied=3, bytes=3000, unchanged=9,
                                seconds=0.1 * rank, via="rsync") for rank in range(N)}
    reports[17] = SyncReport(17, "gpu18", "/src", "/work", unchanged=12, seconds=0.2)
    err = io.StringIO()
    with SyncView(err=err, live=False, hosts=N) as view:
        for rank in range(N):  # as the copies start, each host's first progress
            view(SyncProgress(rank, f"gpu{rank + 1:02d}", "copy", 0, 0 if rank == 17 else 3, 0, 3000))
    view.report(reports)
    assert err.getvalue().splitlines() == [
        "clusterrun: sync gpu01: copying 3 file(s), 3.0 kB (the first host; past 8 hosts the others' copies are not "
        "announced: the report follows)",
        "clusterrun: sync 63 nodes 0-16,18-63 (gpu[01-17,19-64]): 3 file(s) copied (3.0 kB by rsync), 9 unchanged, "
        "to /work",
        "clusterrun: sync node17 gpu18: 0 file(s) copied (0 B), 12 unchanged, to /work in 0.2 s"]


def report(rank: int, **fields: object) -> StopReport:
    killed = ({"pid": 1000 + rank, "name": "torchrun", "signal": "SIGTERM"},
              {"pid": 2000 + rank, "name": "python", "signal": "SIGTERM"},
              {"pid": 3000 + rank, "name": "python", "signal": "SIGTERM"})
    values: dict[str, object] = {"killed": killed, "containment": "cgroup", "verified": True, **fields}
    return StopReport(rank, f"gpu{rank + 1:02d}", **values)  # type: ignore[arg-type]


def test_stop_reports_fold_only_stops_alike_and_keep_each_guarantee_and_failure_on_its_own_line() -> None:
    """What ``down`` prints of 64 nodes: the verified stops on one line; a swept one, and those
    that left a process or could not be reached, each on its own line with its host even where
    two say the same; the remarks of a degraded host after them."""
    escapee = ({"pid": 77, "name": "escapee", "state": "S"},)
    odd = {5: report(5, containment="sweep", verified=False, fallbacks=("no cgroup: not delegated",)),
           9: report(9, killed=(), left=escapee), 10: report(10, killed=(), left=escapee),
           40: StopReport(40, "gpu41", error="timed out"), 41: StopReport(41, "gpu42", error="timed out"),
           42: report(42, degraded="its disk is full", notes=("the exit file could not be written",))}
    err = io.StringIO()
    Printer(err=err).reports([odd.get(rank) or report(rank) for rank in range(N)], N)
    lines = err.getvalue().splitlines()
    verified = "stopped torchrun and 2 other processes; nothing left (verified by cgroup)"
    assert lines == [
        f"clusterrun: 59 nodes 0-4,6-8,11-39,42-63 (gpu[01-05,07-09,12-40,43-64]): {verified}",
        "clusterrun: node5 gpu06: stopped torchrun (pid 1005) and 2 other processes; nothing left",
        "clusterrun: node9 gpu10: nothing was running; STILL RUNNING: escapee[77] state S",
        "clusterrun: node10 gpu11: nothing was running; STILL RUNNING: escapee[77] state S",
        "clusterrun: node40 gpu41: could not be stopped: timed out",
        "clusterrun: node41 gpu42: could not be stopped: timed out",
        "clusterrun: no cgroup on gpu06 (not delegated): \"nothing left\" there is of what could be seen; processes "
        "that left the job's tree, session and environment could not be seen",
        "clusterrun: node42 gpu43: degraded: its disk is full",
        "clusterrun: node42 gpu43: the exit file could not be written"]
    _, nodes = phase([line for line in lines if "no cgroup on" not in line],
                     lambda text: not text.startswith(("degraded", "the exit file")))
    assert nodes == Counter(range(N))  # every node in exactly one line of the stop


def test_a_hang_is_one_line_and_nodes_unreachable_at_once_share_one() -> None:
    """A collective that hangs everywhere is the job's hang, said once whatever the number of
    nodes; a switch that fails: one line, without the time that differs by a second from node to node."""
    err = io.StringIO()
    printer = Printer(err=err, nnodes=N, hold=HOLD)
    now = time.time()
    printer(JobHung(None, since=now - 600, nodes=tuple(range(N))))
    for rank in range(N):
        printer(NodeLink(rank, host=f"gpu{rank + 1:02d}", up=False, since=now - rank % 2, detail="no route"))
    printer.flush()
    lines = err.getvalue().splitlines()
    assert re.fullmatch(r"clusterrun: the job is hung since \S+: no rank wrote anything for 600 s", lines[0])
    assert lines[1:] == ["clusterrun: 64 nodes 0-63 (gpu[01-64]): unreachable (no route); the job runs on there as "
                         "far as anybody knows; reconnecting"]


def test_a_phase_whose_last_nodes_are_slow_is_shown_so_far_after_the_hold() -> None:
    """Nodes that started are not kept unsaid while one host takes long: after ``hold`` seconds
    the lines held so far are printed, the late node on a line of its own when it comes."""
    err = io.StringIO()
    printer = Printer(err=err, hold=0.05, nnodes=N)
    for rank in range(N - 1):
        printer(NodeStarted(rank, host=f"gpu{rank + 1:02d}", attempt=1, pid=100 + rank))
    expected = "clusterrun: 63 nodes 0-62 (gpu[01-63]): started attempt 1\n"
    deadline = time.monotonic() + 30
    while err.getvalue() != expected and time.monotonic() < deadline:  # the timer's thread prints it
        time.sleep(0.01)
    assert err.getvalue() == expected
    printer(NodeStarted(N - 1, host="gpu64", attempt=1, pid=999))
    printer.flush()
    assert err.getvalue() == expected + "clusterrun: node63 gpu64: started attempt 1 (torchrun pid 999)\n"


@pytest.mark.integration
@pytest.mark.fake_torchrun
def test_down_of_a_16_node_job_on_simulated_hosts_is_one_line_for_the_nodes_alike(
        sim_cluster: Callable[..., SimCluster], tmp_path: Path) -> None:
    from tests.test_lifecycle import clusterrun, up_detached, wait_state
    from tests.test_ssh import ssh_hosts

    if (reason := namespace_problem()) is not None:
        unavailable(reason)
    cluster = sim_cluster(16)
    hosts = ssh_hosts(tmp_path, cluster, [1] * 16, tmp_path / "state")
    job = up_detached(hosts, SUPPORT / "counter.py", "100000", "0.05")
    wait_state(job, "running")
    down = clusterrun("down", job)
    assert down.returncode == 0, down.stderr
    lines = down.stderr.splitlines()
    stops, nodes = phase(lines, lambda text: text.startswith(("stopped", "nothing was running")))
    assert nodes == Counter(range(16)), lines  # every node in exactly one line
    one = "clusterrun: 16 nodes 0-15 (sim[1-16]): stopped torchrun"  # the stub torchrun, a python process
    assert len(stops) == 1 and stops[0].startswith(one), lines
    assert stops[0].endswith("; nothing left (verified by cgroup)"), lines
    assert lines[-1] == f"clusterrun: job {job} stopped; nothing of it is left on any host (verified by cgroup)"
