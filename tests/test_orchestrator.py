"""The orchestrator's policies against the fake transport: fail-fast, losing contact, offsets, stops.

Fast (no processes): the fake cluster answers the agent protocol from memory and the tests script
what its hosts do. ``tests/test_transport_contract.py`` holds the fake to the real transports.
"""

from __future__ import annotations

import io
import queue
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from clusterrun.config.hostsfile import HostSpec, load_cluster_text
from clusterrun.core.errors import HostsUnavailable
from clusterrun.core.events import (
    Event,
    JobFinished,
    JobResult,
    LogLines,
    NodeDegraded,
    NodeExited,
    NodeLink,
    NodeState,
    NodeStopped,
    iso,
)
from clusterrun.life.runner import stop_for
from clusterrun.run import orchestrator
from clusterrun.run.follower import BUDGET_NODES, FOLLOW_INTERVALS, MESSAGE_BUDGET, Node, follow_interval
from clusterrun.run.inbox import Inbox
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.printer import Printer, node_end_text, stop_text

JOB = "train-20261123-120000-abcd"
FAST = Reconnect(first=0.01, most=0.02)


def spec_of(n: int = 2):  # type: ignore[no-untyped-def]
    hosts = "\n".join(f"  - host: h{i}\n    nproc: 1" for i in range(n))
    return load_cluster_text(f"hosts:\n{hosts}\n", "hosts.yaml")


def owned(job: Job) -> Job:
    """``job`` with its owner's stop orders (the ``Runner``'s ``stop_for``: fail-fast, the start-up
    timeout), as the owner's loop gives them: after each event, from the job's own thread."""
    def decide(event: Event) -> None:
        order = stop_for(event)
        if order is not None:
            job.stop(order)

    job.subscribe(decide)
    return job


@dataclass
class Seen:
    """Every event, in order, from any thread."""

    events: list[Event] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __call__(self, event: Event) -> None:
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def wait(self, predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.events), timeout), self.events

    def lines(self, node: int) -> list[str]:
        return [line for e in self.events if isinstance(e, LogLines) and e.node == node for line in e.lines]

    def of(self, kind: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


class Running:
    """A job started on a fake cluster, ``run()`` in a thread."""

    def __init__(self, fake: FakeCluster, n: int = 2, *, owner: bool = True, **options: object) -> None:
        self.seen = Seen()
        self.job = Job(spec_of(n), "train.py", job_id=JOB, name="train", emit=self.seen,
                       transport_factory=fake.transport, reconnect=options.pop("reconnect", FAST),  # type: ignore[arg-type]
                       **options)  # type: ignore[arg-type]
        if owner:
            owned(self.job)
        self.job.prepare()
        self.job.start()
        self.result: JobResult | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.result = self.job.run()

    def finish(self, timeout: float = 10.0) -> JobResult | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run() did not return"
        self.job.close()
        return self.result


@pytest.fixture
def fake() -> Iterator[FakeCluster]:
    yield FakeCluster()


def test_a_failed_rank_stops_the_other_nodes_and_is_the_root_cause(fake: FakeCluster) -> None:
    run = Running(fake)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n1.write("[rank1]:Traceback (most recent call last):\n[rank1]:ValueError: bad batch\n"
             "  rank      : 1 (local_rank: 0)\n  exitcode  : 1 (pid: 4321)\n")  # torchrun's failure report
    n1.exit(1)
    result = run.finish()
    assert result is not None and result.failed
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.FAILED]
    assert result.root_cause is not None and result.root_cause.node == 1
    assert result.root_cause.message == "ValueError: bad batch"
    assert n0.stops == 1 and n1.stops == 0  # the failed node is not stopped: it has ended
    assert [r.node for r in result.stops] == [0]
    # the stopped node says why it was stopped, not how its torchrun ended (by clusterrun's SIGTERM)
    assert (result.nodes[0].stopped_after, result.nodes[0].error) == (1, "stopped by clusterrun after node 1 failed")
    exited = {e.node: e.result for e in run.seen.of(NodeExited)}  # type: ignore[attr-defined]
    assert exited[0].stopped_after == 1 and exited[1].stopped_after is None
    err = io.StringIO()
    Printer(err=err).summary(result)
    assert "clusterrun: node0 h0: stopped by clusterrun after node 1 failed\n" in err.getvalue()


def test_a_node_that_ended_before_the_stop_came_is_failed_not_stopped(fake: FakeCluster,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail-fast's stop finds node 0 already ended (its rank died in a collective just before):
    the stop killed nothing, so the node is not reported both as "nothing was running" and as
    stopped with its exit code."""
    run = Running(fake)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    real_stop = fake._stop

    def stop(host, request):  # type: ignore[no-untyped-def]
        if request["node"] == 0:
            n0.exit(1)
        return real_stop(host, request)

    monkeypatch.setattr(fake, "_stop", stop)
    n1.write("[rank1]:ValueError: bad batch\n")
    n1.exit(1)
    result = run.finish()
    assert result is not None and [r.node for r in result.stops] == [0]
    assert stop_text(result.stops[0]) == "node0 h0: nothing was running; no process of the job was found"
    assert [(n.state, n.exit_code) for n in result.nodes] == [(NodeState.FAILED, 1), (NodeState.FAILED, 1)]
    assert [n.stopped_after for n in result.nodes] == [None, None]
    assert result.root_cause is not None and result.root_cause.node == 1


class Clock:
    """``time.monotonic`` that can jump forward, as it does for a controller paused or asleep."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, idle: float = 3600.0) -> None:
        self.real = time.monotonic
        self.skipped = 0.0
        monkeypatch.setattr(time, "monotonic", lambda: self.real() + self.skipped)

    def pause(self, seconds: float) -> None:
        self.skipped += seconds


@pytest.mark.parametrize("give_up_after", [None, 60.0])
def test_losing_contact_for_any_time_never_stops_the_job(fake: FakeCluster, monkeypatch: pytest.MonkeyPatch,
                                                         give_up_after: float | None) -> None:
    """The controller cannot reach a host (a laptop asleep for an hour, a VPN drop): the node is
    shown unreachable, retried, and followed on from its offset when the host is back; nothing is
    stopped. An --unreachable-timeout does not count the controller's own pause."""
    clock = Clock(monkeypatch)
    # 50 failed reconnections in about 0.1 s (1 s at FAST's pace)
    run = Running(fake, reconnect=Reconnect(first=0.001, most=0.002, give_up_after=give_up_after))
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.write("line 1\n")
    run.seen.wait(lambda ev: "line 1" in run.seen.lines(0))
    fake.host("h0").drop()
    clock.pause(3600)
    run.seen.wait(lambda ev: any(isinstance(e, NodeLink) and not e.up for e in ev))
    n0.write("line 2\n")  # written while nobody could see it
    before = fake.host("h0").connects
    fake.wait(lambda: fake.host("h0").connects >= before + 50, what="50 failed reconnections")
    assert not fake.ops("stop") and n0.running and n1.running
    fake.host("h0").restore()
    run.seen.wait(lambda ev: any(isinstance(e, NodeLink) and e.up for e in ev))
    n0.write("line 3\n")
    n0.exit(0)
    n1.exit(0)
    result = run.finish()
    assert result is not None and result.ok, result
    assert run.seen.lines(0) == ["line 1", "line 2", "line 3"]  # each exactly once
    assert not fake.ops("stop")
    # one notice that it is unreachable and one that it is back, however many reconnections failed
    assert [(e.node, e.up) for e in run.seen.events if isinstance(e, NodeLink)] == [(0, False), (0, True)]


def test_a_host_is_unreachable_since_its_word_was_due_not_since_its_silence_was_noticed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead link is noticed after a silence (the stream's read times out: FOLLOW_TIMEOUT), but the
    agent speaks every HEARTBEAT: the host was gone by then after its last message. On one line."""
    from types import SimpleNamespace

    from clusterrun.agent.wire import HEARTBEAT
    from clusterrun.core.errors import ConnectError
    from clusterrun.run import follower
    from clusterrun.transports.sshlib import map_error

    wall = [1000.0]
    monkeypatch.setattr(follower, "time", SimpleNamespace(time=lambda: wall[0], monotonic=time.monotonic))

    class Silent:  # one heartbeat, then a silence noticed 20 s later; then refused
        name = "h0"

        def stream(self, request: object) -> Iterator[dict[str, str]]:
            if wall[0] > 1000.0:
                raise ConnectError("h0", "connection refused")
            yield {"t": "beat"}
            wall[0] += 20.0
            raise map_error("h0", TimeoutError())

    inbox: queue.Queue[tuple[int, object]] = queue.Queue()
    detach = threading.Event()
    run = follower.Follower(0, Node(None, Silent()), lambda where: where, inbox=inbox,  # type: ignore[arg-type]
                            reconnect=Reconnect(first=0.001, most=0.001), tail=None, offset=0, before=0,
                            detach=detach, stopping=threading.Event(), wake=threading.Event())
    thread = threading.Thread(target=run.run)
    thread.start()
    try:
        assert inbox.get(timeout=10) == (0, follower.Link(
            up=False, error="h0: timed out; is the host up and reachable on its SSH port?", since=1000.0 + HEARTBEAT))
    finally:
        detach.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_an_unreachable_timeout_is_opt_in_and_then_counts_as_lost(fake: FakeCluster) -> None:
    run = Running(fake, reconnect=Reconnect(first=0.01, most=0.02, give_up_after=0.2))
    n0, _ = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    fake.host("h1").drop()
    result = run.finish()
    assert result is not None and result.failed
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.LOST]
    assert "--unreachable-timeout" in (result.nodes[1].error or "")
    assert n0.stops == 1 and not n0.running


@pytest.mark.parametrize("how", ["unreachable", "rebooted", "killed"])
def test_a_lost_node_is_the_root_cause_never_a_node_our_stop_ended(fake: FakeCluster, how: str) -> None:
    """torchrun exits 1 on the SIGTERM of the fail-fast stop (SignalException): that is not why the
    job failed. The lost node is, also when its exit status is unknown (its processes killed on the
    same boot: the monitor an agent starts then says so), with when its host went away."""
    give_up = 0.2 if how == "unreachable" else None
    run = Running(fake, reconnect=Reconnect(first=0.01, most=0.02, give_up_after=give_up))
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.stop_exit_code = 1
    before = time.time()
    fake.host("h1").drop()
    if how != "unreachable":
        run.seen.wait(lambda ev: any(isinstance(e, NodeLink) and not e.up for e in ev))
        if how == "rebooted":
            fake.host("h1").reboot()
        else:
            n1.vanish()
        fake.host("h1").restore()
    result = run.finish()
    assert result is not None and [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.LOST]
    cause = result.root_cause
    assert cause is not None and cause.node == 1 and cause.lost, cause
    if how == "unreachable":
        assert re.fullmatch(r"node 1 \(h1\): the host went away at \d\d:\d\d:\d\dZ and has not answered since "
                            r"\(unreachable for 0.2 s \(--unreachable-timeout\): .*\)", cause.describe()), cause
        return
    away = re.fullmatch(r"node 1 \(h1\): the host went away at (\d\d:\d\d:\d\d)Z; (.*)", cause.describe())
    assert away is not None, cause.describe()
    assert iso(before - 1)[11:19] <= away.group(1) <= iso(time.time())[11:19]
    assert away.group(2) == ("its boot id changed (it restarted)" if how == "rebooted" else
                             "when it came back none of the job's processes was left (torchrun's exit status is "
                             "unknown: the survivor that waited for it ended first (killed?))")


def test_a_host_back_from_a_reboot_is_evidence_and_fails_fast(fake: FakeCluster) -> None:
    run = Running(fake)
    n0, _ = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    fake.host("h1").drop()
    run.seen.wait(lambda ev: any(isinstance(e, NodeLink) and not e.up for e in ev))
    fake.host("h1").reboot()
    fake.host("h1").restore()
    result = run.finish()
    assert result is not None and [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.LOST]
    assert result.root_cause is not None and result.root_cause.node == 1
    assert n0.stops == 1


def test_processes_vanishing_is_evidence_too(fake: FakeCluster) -> None:
    run = Running(fake)
    _, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n1.vanish()
    result = run.finish()
    assert result is not None and [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.LOST]


@pytest.mark.parametrize("how", ["vanished", "rebooted"])
def test_a_node_that_ends_unknown_during_a_stop_from_elsewhere_is_stopped_and_fails_nothing(
        fake: FakeCluster, how: str) -> None:
    """``down`` or a viewer's K stops the hosts itself while the owner follows, and node 0 ends with
    its exit unknown (its supervisor was killed) or lost: the stop ended it. A fail-fast stop of the
    owner's would kill node 1 at once, inside the grace the user's stop gives it."""
    run = Running(fake)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.stop_asked()
    n1.stop_asked()
    if how == "rebooted":
        fake.host("h0").reboot()
    else:
        n0.vanish()
    run.seen.wait(lambda ev: any(isinstance(e, NodeExited) and e.node == 0 for e in ev))
    n1.exit(signal=9)  # the other controller's stop, after its grace
    result = run.finish()
    assert result is not None and [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.STOPPED]
    assert not fake.ops("stop")


def test_a_viewer_never_stops_anything(fake: FakeCluster) -> None:
    run = Running(fake, owner=False)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n1.exit(1)
    run.seen.wait(lambda ev: any(isinstance(e, NodeExited) and e.node == 1 for e in ev))
    assert n0.running and not fake.ops("stop")
    n0.exit(0)
    result = run.finish()
    assert result is not None and [n.state for n in result.nodes] == [NodeState.SUCCEEDED, NodeState.FAILED]


def test_a_viewer_says_who_stopped_a_node_as_its_host_recorded_it(fake: FakeCluster) -> None:
    """The owner's fail-fast stops node 0 after node 1 failed: a viewer, which stopped nothing and
    knows no order, says so from node 0's host (how torchrun ended, SIGKILL, would only puzzle)."""
    run = Running(fake, owner=False)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n1.exit(1)
    n0.stop_asked(by="fail-fast after node 1 failed")
    n0.exit(signal=9)
    result = run.finish()
    assert result is not None and [(n.state, n.error) for n in result.nodes] == [
        (NodeState.STOPPED, "stopped by fail-fast after node 1 failed"), (NodeState.FAILED, None)]
    said = {e.node: e.result for e in run.seen.of(NodeExited)}  # type: ignore[attr-defined]
    assert node_end_text(said[0]) == node_end_text(result.nodes[0]) == "stopped by fail-fast after node 1 failed"


def test_a_stop_that_cannot_reach_a_host_says_it_may_still_run(fake: FakeCluster) -> None:
    run = Running(fake)
    _, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    fake.host("h1").drop()
    run.seen.wait(lambda ev: any(isinstance(e, NodeLink) and not e.up for e in ev))
    run.job.request_stop("SIGINT")
    result = run.finish()
    assert result is not None and result.interrupted == "SIGINT"
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.UNREACHABLE]
    stops = {r.node: r for r in result.stops}
    assert stops[0].ok and stops[1].error and not stops[1].ok
    assert n1.running  # it really may: nothing reached it


def test_offsets_count_only_what_was_emitted(fake: FakeCluster) -> None:
    """A viewer that detaches while lines are queued but not yet shown saves the offset of what it
    showed: the next viewer starts there (no line lost), and nothing shown is repeated."""
    release, first_shown = threading.Event(), threading.Event()
    shown: list[str] = []

    class Slow(Seen):
        def __call__(self, event: Event) -> None:
            if isinstance(event, LogLines) and event.node == 0:
                if shown:
                    release.wait(10)  # the consumer is slow from the second batch on
                shown.extend(event.lines)
                first_shown.set()
            super().__call__(event)

    job = Job(spec_of(1), "train.py", job_id=JOB, name="train", emit=Slow(), transport_factory=fake.transport,
              reconnect=FAST)
    job.prepare()
    job.start()
    node = fake.wait_started(JOB, 0)
    node.write("a\n")
    thread = threading.Thread(target=job.run, daemon=True)
    thread.start()
    assert first_shown.wait(10)
    for i in range(200):  # 20 batches the follower queues while the consumer is stuck on the second
        node.write(f"line {i}\n")
        if i % 10 == 9:
            fake.wait(lambda: node.sent_to == len(node.log))
    job.detach()
    release.set()
    thread.join(10)
    job.close()
    seen_bytes = job.offsets[0]
    assert seen_bytes == sum(len(line) + 1 for line in shown)  # exactly what was shown, not what was read
    assert seen_bytes < len(node.log)  # and some lines were queued, not shown
    # the next viewer resumes there and gets the rest exactly once
    viewer_seen = Seen()
    viewer = Job(spec_of(1), "train.py", job_id=JOB, name="train", emit=viewer_seen,
                 transport_factory=fake.transport, offsets={0: seen_bytes})
    viewer.resume(job.plan)  # type: ignore[arg-type]
    node.exit(0)
    assert viewer.run() is not None
    viewer.close()
    assert shown + viewer_seen.lines(0) == ["a", *(f"line {i}" for i in range(200))]


def test_a_viewer_resuming_gets_the_lines_before_its_resume_point_once_as_scrollback(fake: FakeCluster) -> None:
    """attach's scrollback: the last N lines before where the last viewer stopped come first, in one
    LogLines(earlier=True); then every line after that point, once (multi-byte text cut by bytes)."""
    starter = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    starter.prepare()
    starter.start()
    starter.close()
    lines = [f"ligne {i} é" for i in range(20)]
    fake.wait_started(JOB, 0).write("".join(f"{line}\n" for line in lines))
    fake.wait_started(JOB, 1).write("x\n")
    resume = len("".join(f"{line}\n" for line in lines[:10]).encode())
    seen = Seen()
    viewer = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=seen, transport_factory=fake.transport,
                 offsets={0: resume, 1: 0}, scrollback=3)
    viewer.resume(starter.plan)  # type: ignore[arg-type]
    fake.node(JOB, 0).exit(0)
    fake.node(JOB, 1).exit(0)
    assert viewer.run() is not None
    viewer.close()
    node0 = [e for e in seen.of(LogLines) if e.node == 0]  # type: ignore[attr-defined]
    assert node0[0].earlier and list(node0[0].lines) == lines[7:10]  # type: ignore[attr-defined]
    assert not any(e.earlier for e in node0[1:]) and seen.lines(0)[3:] == lines[10:]  # type: ignore[attr-defined]
    assert seen.lines(1) == ["x"] and not any(e.earlier for e in seen.of(LogLines) if e.node == 1)  # type: ignore
    assert fake.ops("follow", "h1")[-1].get("before") is None  # nothing before offset 0
    assert viewer.offsets[0] == len(fake.node(JOB, 0).log)
    assert {op["interval"] for op in fake.ops("follow", "h0") + fake.ops("follow", "h1")} == {follow_interval(2)}


def test_the_controller_shares_its_message_budget_among_the_nodes_it_follows() -> None:
    """One node is read as often as the supervisor merges; up to BUDGET_NODES share a bounded
    number of messages a second, more nodes fewer (200 for 64); each node is read at most twice a
    second."""
    assert follow_interval(1) == FOLLOW_INTERVALS[0] < follow_interval(8)
    assert follow_interval(8) == 8 / MESSAGE_BUDGET < follow_interval(BUDGET_NODES) < follow_interval(64)
    assert BUDGET_NODES / follow_interval(BUDGET_NODES) == pytest.approx(MESSAGE_BUDGET)
    assert 64 / follow_interval(64) == pytest.approx(MESSAGE_BUDGET / 2)
    intervals = [follow_interval(n) for n in range(1, 200)]
    assert intervals == sorted(intervals) and all(n / i <= MESSAGE_BUDGET for n, i in enumerate(intervals, 1))
    assert follow_interval(1000) == FOLLOW_INTERVALS[1]


def test_a_degraded_supervisor_is_reported_once_while_the_job_runs(fake: FakeCluster) -> None:
    run = Running(fake, owner=False)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n1.degrade("the supervisor could not write its state (no space left on the file system of /s)")
    run.seen.wait(lambda ev: any(isinstance(e, NodeDegraded) for e in ev))
    n1.write("more\n")
    n0.exit(0)
    n1.exit(0)
    run.finish()
    degraded = run.seen.of(NodeDegraded)
    assert [(e.node, e.reason) for e in degraded] == [  # type: ignore[attr-defined]
        (1, "the supervisor could not write its state (no space left on the file system of /s)")]


def test_a_failed_start_stops_what_started(fake: FakeCluster) -> None:
    fake.host("h1").start_error = "cannot start torchrun: no such file"
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=Seen(), transport_factory=fake.transport)
    job.prepare()
    with pytest.raises(HostsUnavailable) as raised:
        job.start()
    assert "no such file" in raised.value.render()
    job.close()
    assert fake.node(JOB, 0).stops == 1 and not fake.node(JOB, 0).running


def test_stop_reports_are_emitted_for_each_stopped_node(fake: FakeCluster) -> None:
    run = Running(fake, n=3)
    for rank in range(3):
        fake.wait_started(JOB, rank)
    fake.node(JOB, 2).leave_on_stop = [{"pid": 4242, "name": "escapee"}]
    run.job.request_stop("SIGTERM")
    result = run.finish()
    assert result is not None
    reports = {e.report.node: e.report for e in run.seen.of(NodeStopped)}  # type: ignore[attr-defined]
    assert sorted(reports) == [0, 1, 2]
    assert reports[0].ok and not reports[2].ok and reports[2].left[0]["name"] == "escapee"
    assert any(isinstance(e, JobFinished) for e in run.seen.events)


def test_the_monitor_names_the_root_cause_as_up_does(fake: FakeCluster) -> None:
    """Followed without its logs (the background monitor), a failed job still names the rank,
    its exception and last lines: the failed nodes' tails are read for the diagnosis."""
    run = Running(fake, follow_logs=False)
    _, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n1.write("".join(f"[rank1]:step {i}\n" for i in range(500)))
    n1.write("[rank1]:Traceback (most recent call last):\n[rank1]:ValueError: bad batch\n"
             "  rank      : 1 (local_rank: 0)\n  exitcode  : 1 (pid: 4321)\n")
    n1.exit(1)
    result = run.finish()
    assert result is not None and result.root_cause is not None
    assert result.root_cause.describe() == "rank 1 on node 1 (h1, local rank 0): exit code 1: ValueError: bad batch"
    assert result.root_cause.last_lines[-2:] == ("Traceback (most recent call last):", "ValueError: bad batch")
    assert not run.seen.lines(1)  # nothing of the log was emitted


def test_a_transport_fault_the_transport_did_not_translate_is_retried_not_fatal(fake: FakeCluster) -> None:
    """paramiko raises EOFError when a channel of a dead connection is closed: a follower must
    retry as for any lost connection, not die and leave the job followed by nobody."""
    run = Running(fake)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    fake.host("h0").close_error = EOFError()
    fake.host("h0").drop()
    run.seen.wait(lambda ev: any(isinstance(e, NodeLink) and not e.up for e in ev))
    fake.host("h0").close_error = None
    fake.host("h0").restore()
    n0.write("after\n")
    n0.exit(0)
    n1.exit(0)
    result = run.finish()
    assert result is not None and result.ok and run.seen.lines(0) == ["after"]


def test_an_agent_of_another_protocol_is_refused_before_anything_starts(fake: FakeCluster) -> None:
    fake.host("h1").protocol = 0  # an agent from before the protocol had a version
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    with pytest.raises(HostsUnavailable) as raised:
        job.prepare()
    job.close()
    assert "h1: the agent speaks protocol 0, this controller 2" in raised.value.render()
    assert not fake.ops("start")


def test_a_job_starts_only_what_it_was_asked_to_prepare(fake: FakeCluster) -> None:
    """``start()`` never prepares (probes, plans, runs setup) on its own: the attempt's owner asks
    for each step; a start before it is a programming error, and nothing reaches a host."""
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    try:
        with pytest.raises(RuntimeError, match="before prepare"):
            job.start()
        assert fake.ops("probe") == [] and fake.ops("start") == []
    finally:
        job.close()


def test_setups_lines_come_before_the_start_they_preceded_and_are_not_shown_twice(fake: FakeCluster) -> None:
    """Setup ran before torchrun: the stream shows its ``[setup]:`` lines, then ``started attempt
    1``; the follower goes on after them (each line once, the offsets counting them)."""
    for name in ("h0", "h1"):
        fake.host(name).setup_output = f"hello from {name}\nready"
    spec = load_cluster_text("defaults:\n  setup: echo hello\nhosts: [h0, h1]\n", "hosts.yaml")
    stream = io.StringIO()
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=Printer(out=stream, err=stream, colour=False),
              transport_factory=fake.transport, reconnect=FAST)
    job.prepare()
    job.start()
    for rank in (0, 1):
        node = fake.wait_started(JOB, rank)
        node.write(f"[rank{rank}]:training\n")
        node.exit(0)
    assert job.run() is not None
    job.close()
    lines = stream.getvalue().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"node{rank} ") or f"node{rank} h{rank}:" in line]
        pid = fake.node(JOB, rank).state["torchrun"]["pid"]
        assert [re.sub(r" +", " ", line) for line in mine[:4]] == [
            f"node{rank} h{rank} | [setup]: hello from h{rank}", f"node{rank} h{rank} | [setup]: ready",
            f"clusterrun: node{rank} h{rank}: started attempt 1 (torchrun pid {pid})",
            f"node{rank} h{rank} rank{rank} | training"], lines
    assert job.offsets == {r: len(fake.node(JOB, r).log) for r in (0, 1)}


class Waits:
    """``Inbox.wait`` recorded: the timeouts the job's loop asked for; ``idle`` set once it sleeps
    for ``orchestrator.IDLE`` (nothing that changes with time alone is left to check)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, idle: float = 3600.0) -> None:
        self.timeouts: list[float | None] = []
        self.idle = threading.Event()
        wait = Inbox.wait

        def recorded(inbox: Inbox, timeout: float | None) -> None:
            self.timeouts.append(timeout)
            if timeout == orchestrator.IDLE:
                self.idle.set()
            wait(inbox, timeout)

        monkeypatch.setattr(orchestrator, "IDLE", idle)  # an hour: a loop left asleep would outlast the test
        monkeypatch.setattr(Inbox, "wait", recorded)


def test_a_quiet_job_sleeps_until_a_stop_from_another_thread_wakes_it(fake: FakeCluster,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """While the start-up watch waits, the loop looks every TICK; once every node started its
    workers it sleeps until something comes (a message, a stop, a detach), not in timed polls."""
    waits = Waits(monkeypatch)
    run = Running(fake)
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.start_workers(0)
    n1.start_workers(1)
    assert waits.idle.wait(10), waits.timeouts
    assert orchestrator.TICK in waits.timeouts  # the start-up watch was stepped while it waited
    run.job.request_stop("SIGTERM")  # from this thread: rings the inbox
    result = run.finish()
    assert result is not None and result.interrupted == "SIGTERM"
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.STOPPED]


def test_a_stop_from_a_signal_handler_wakes_the_loop_it_interrupted(fake: FakeCluster,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``up``'s Ctrl-C: the handler runs in the loop's own thread, during its wait; the stop is
    carried out (at the latest at the loop's next IDLE wake-up: a ring from a handler was seen
    to be missed now and then, with IDLE an hour)."""
    waits = Waits(monkeypatch, idle=orchestrator.IDLE)
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              reconnect=FAST)
    job.prepare()
    job.start()
    for rank in (0, 1):
        fake.wait_started(JOB, rank).start_workers(rank)
    previous = signal.signal(signal.SIGUSR1, lambda *_: job.request_stop("SIGINT"))
    ended, loop = threading.Event(), threading.get_ident()  # run() below: this thread handles signals

    def kill_when_idle() -> None:
        if waits.idle.wait(10) and not ended.is_set():
            signal.pthread_kill(loop, signal.SIGUSR1)

    def watchdog() -> None:  # a loop the handler did not wake: the nodes' own end wakes it, not interrupted
        if not ended.wait(30):
            fake.node(JOB, 0).exit(0)
            fake.node(JOB, 1).exit(0)

    threading.Thread(target=kill_when_idle, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        result = job.run()
    finally:
        ended.set()
        signal.signal(signal.SIGUSR1, previous)
        job.close()
    assert waits.idle.is_set()
    assert result is not None and result.interrupted == "SIGINT"
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.STOPPED]


def test_an_agent_handed_to_a_node_after_its_job_was_closed_is_closed(fake: FakeCluster) -> None:
    """A probe's or a carried-on follow's agent that reaches its node after the job was closed (Ctrl-C
    while connecting, a viewer that detached) is closed there: nobody else would close it."""
    transport = fake.transport(HostSpec(host="gpu-a"))
    node = Node(launch=None, transport=transport)
    kept = transport.session()
    assert node.hold(kept) and node.agent is kept and kept.idle
    node.close()
    assert node.agent is None and not kept.idle  # the job's close closed it
    late = transport.session()
    assert not node.hold(late) and node.agent is None and not late.idle
