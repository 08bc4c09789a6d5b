"""The start-up watch, the hang watch, notifications and ``logs --rank``: the policies, pure and on
the fake transport (fast). The real processes are in ``tests/test_watch_e2e.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent import hangwatch
from clusterrun.agent.hangwatch import QuietWatch
from clusterrun.agent.wire import Frame, RankStack, StackAnswer, ThreadStack
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.config.restarts import RestartPolicy
from clusterrun.config.watch import Notify, Watch, parse_duration
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import AttemptStarted, JobHung, JobNote, JobState, LogLines, NodeState, NodeStateChanged
from clusterrun.core.protocol import HostState, NodeStatus, Worker
from clusterrun.core.ranges import parse_ranges, ranges_text
from clusterrun.diagnose.hangreport import HangReport
from clusterrun.life import lifecycle, notify
from clusterrun.life import runner as runner_module
from clusterrun.life.attempt import NextAttempt
from clusterrun.life.recorder import new_record, refresh
from clusterrun.life.runner import Runner
from clusterrun.run import hangwatch as hangwatch_verdict
from clusterrun.run.hangwatch import HangWatch, silent_since
from clusterrun.run.orchestrator import Job
from clusterrun.run.startwatch import StartupWatch, progress_text
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.board import Board
from clusterrun.views.joblist import job_json, job_state_text, node_state_text
from clusterrun.views.printer import only_ranks
from tests.test_orchestrator import FAST, JOB, Seen, owned, spec_of

RUNNING = NodeStatus(HostState.RUNNING)
STARTED = NodeStatus(HostState.RUNNING, workers=(Worker(0, 0, 10, None),))

# ------------------------------------------------------------------------------ settings


def test_durations_and_the_hosts_file_keys() -> None:
    assert [parse_duration(t) for t in ("90", "45s", "10m", "1.5h")] == [90, 45, 600, 5400]
    spec = load_cluster_text("hosts: [a]\nstartup_timeout: 2m\nhang_after: 10m\non_hang: restart\n"
                             "setup_timeout: 1h\nnotify: {command: 'echo $CLUSTERRUN_EVENT', on: [failed, hung]}\n",
                             "h.yaml")
    assert spec.watch == Watch(startup_timeout=120, hang_after=600, on_hang="restart", setup_timeout=3600)
    assert Watch.from_json(spec.watch.to_json()) == spec.watch
    assert spec.notify == Notify("echo $CLUSTERRUN_EVENT", ("failed", "hung"))
    assert load_cluster_text("hosts: [a]\nhang_after: off\n", "h.yaml").watch.hang_after is None
    assert load_cluster_text("hosts: [a]\n", "h.yaml").watch == Watch()


@pytest.mark.parametrize(("line", "says"), [
    ("hang_after: soon", "h.yaml:2: hang_after: expected a duration above 0"),
    ("startup_timeout: 0", "h.yaml:2: startup_timeout: expected a duration above 0"),
    ("setup_timeout: forever", "h.yaml:2: setup_timeout: expected a duration above 0"),
    ("on_hang: reboot", "h.yaml:2: on_hang: must be one of stack, restart, nothing"),
    ("notify: {on: [failed]}", "h.yaml:2: notify: missing required key 'command'"),
    ("notify: {command: x, on: [crashed]}", "h.yaml:2: notify.on: unknown event 'crashed'"),
])
def test_a_bad_watch_key_names_its_line_and_the_fix(line: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_cluster_text(f"hosts: [a]\n{line}\n", "h.yaml")
    assert caught.value.render().startswith(says)


def test_ranges() -> None:
    assert parse_ranges("0,4-7") == [0, 4, 5, 6, 7]
    assert ranges_text([7, 0, 1, 2, 5]) == "0-2,5,7"
    for bad in ("", "a", "3-1", "1-"):
        with pytest.raises(ValueError, match="not a number or a range"):
            parse_ranges(bad)


def test_logs_rank_keeps_only_those_ranks_lines() -> None:
    text = "[rank0]:a\n[rank4]:b\nW torchrun says\n[rank5]:c\n[rank45]:d\n[rank4]:partial"
    assert only_ranks(text, frozenset({4, 5})) == "[rank4]:b\n[rank5]:c\n[rank4]:partial"


# ------------------------------------------------------------------------------ start-up watch


def test_progress_names_the_nodes_that_wait_and_for_how_long() -> None:
    hosts = {0: "gpu01", 1: "gpu02", 2: "gpu03", 3: "gpu04"}
    statuses = {0: STARTED, 1: STARTED, 2: STARTED, 3: RUNNING}
    assert progress_text(hosts, statuses, started=100.0, now=145.0) == (
        "node 3 (gpu04): torchrun waits for the rendezvous for 45 s; nodes 0-2 ready")
    assert progress_text(hosts, {**statuses, 3: STARTED}, 100.0, 145.0) is None
    assert progress_text(hosts, {0: STARTED}, 100.0, 400.0) == (
        "nodes 1 (gpu02), 2 (gpu03), 3 (gpu04): not heard from yet for 5 min 0 s; node 0 ready")


def test_the_start_up_watch_notes_changes_and_expires_after_the_timeout() -> None:
    watch = StartupWatch({0: "h0", 1: "h1"}, started=1000.0, timeout=60.0)
    watch.update(0, RUNNING)
    watch.update(1, RUNNING)
    assert watch.poll(1005.0) is None  # too early to say anything
    assert watch.poll(1011.0) == "nodes 0 (h0), 1 (h1): torchrun waits for the rendezvous for 11 s"
    assert watch.poll(1012.0) is None  # nothing changed
    watch.update(0, STARTED)
    assert watch.poll(1013.0) == "node 1 (h1): torchrun waits for the rendezvous for 13 s; node 0 ready"
    assert not watch.expired(1059.0) and watch.expired(1060.0)
    cause = watch.cause()
    assert (cause.node, cause.host) == (1, "h1")
    assert cause.explanation is not None and "doctor" in cause.explanation.fix
    assert cause.explanation.cause == ("node 1 (h1) started no workers within 60 s (startup_timeout): torchrun "
                                       "waits for the rendezvous")
    watch.update(1, NodeStatus(HostState.EXITED, exit_code=1))  # an ended node waits for nothing
    assert watch.poll(1061.0) == "every node started its workers" and not watch.expired(1062.0)


def test_a_watch_begun_late_waits_for_every_nodes_first_status_before_a_note() -> None:
    """``attach`` to an attempt that started 37 s ago: its nodes are not heard from "yet" only
    because the viewer has just begun to listen; no note until each has answered or the first
    note's wait has passed since then."""
    watch = StartupWatch({0: "h0", 1: "h1"}, started=1000.0, timeout=600.0)
    assert watch.poll(1037.0) is None
    watch.update(0, STARTED)
    assert watch.poll(1037.5) is None
    watch.update(1, STARTED)
    assert watch.poll(1038.0) is None and watch.done  # both had started long ago: nothing to say
    silent = StartupWatch({0: "h0", 1: "h1"}, started=1000.0, timeout=600.0)
    silent.update(0, STARTED)
    assert silent.poll(1037.0) is None
    assert silent.poll(1047.0) == "node 1 (h1): not heard from yet for 47 s; node 0 ready"  # 10 s since: say so


@pytest.fixture
def fake() -> Iterator[FakeCluster]:
    yield FakeCluster()


def test_a_node_that_starts_no_workers_fails_the_job_at_the_start_up_timeout(fake: FakeCluster) -> None:
    seen = Seen()
    spec = dataclasses.replace(spec_of(2), watch=Watch(startup_timeout=1.0))
    job = owned(Job(spec, "train.py", job_id=JOB, name="train", emit=seen, transport_factory=fake.transport,
                    reconnect=FAST))
    job.prepare()
    job.start()
    fake.node(JOB, 0).start_workers(0)  # node 1's torchrun waits for a rendezvous that never completes
    try:
        result = job.run()
    finally:
        job.close()
    assert result is not None and result.failed and not result.stopped
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.FAILED]
    assert fake.node(JOB, 0).stops == 1 and fake.node(JOB, 1).stops == 1
    root = result.root_cause
    assert root is not None and (root.node, root.host) == (1, "h1")
    assert root.describe() == ("torchrun on node 1 (h1): failed: torchrun waits for the rendezvous: no workers "
                               "after 1 s (startup_timeout)")


def test_the_nodes_that_did_not_join_are_named_and_failed_the_others_stopped(fake: FakeCluster) -> None:
    seen = Seen()
    spec = dataclasses.replace(spec_of(3), watch=Watch(startup_timeout=1.0))
    job = owned(Job(spec, "train.py", job_id=JOB, name="train", emit=seen, transport_factory=fake.transport,
                    reconnect=FAST))
    job.prepare()
    job.start()
    fake.node(JOB, 0).rendezvous(True)
    fake.node(JOB, 1).rendezvous(False)  # its host cannot reach the master port
    fake.node(JOB, 2).rendezvous(True)
    try:
        result = job.run()
    finally:
        job.close()
    assert result is not None and [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.FAILED,
                                                                      NodeState.STOPPED]
    root = result.root_cause
    assert root is not None and root.node == 1 and root.explanation is not None
    assert root.explanation.cause == ("node 1 (h1) started no workers within 1 s (startup_timeout): torchrun has not "
                                      "joined the rendezvous (no connection to the master port); nodes 0 (h0), 2 (h2) "
                                      "joined and waited for it")


def test_joined_store_sees_a_connection_to_the_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert not hangwatch.joined_store(os.getpid(), port)  # listening is not joining
        with socket.create_connection(("127.0.0.1", port)):
            assert hangwatch.joined_store(os.getpid(), port)
            assert not hangwatch.joined_store(os.getpid(), port + 1 if port < 65535 else port - 1)
    assert hangwatch.master_port(["python", "-m", "torch.distributed.run", "--master-port=29501", "x.py"]) == 29501


def test_a_viewer_does_not_fail_a_job_that_waits(fake: FakeCluster) -> None:
    """Only the job's owner (fail-fast) enforces the timeout; a viewer (attach) only watches."""
    seen = Seen()
    spec = dataclasses.replace(spec_of(1), watch=Watch(startup_timeout=0.01))
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=seen, transport_factory=fake.transport,
              reconnect=FAST)
    job.prepare()
    job.start()
    thread = threading.Thread(target=job.run, daemon=True)
    thread.start()
    fake.node(JOB, 0).write("[rank0]:step 1\n")
    seen.wait(lambda events: any(getattr(e, "lines", None) == ("[rank0]:step 1",) for e in events))
    assert fake.node(JOB, 0).stops == 0
    fake.node(JOB, 0).exit(0)
    thread.join(10)
    job.close()


# ------------------------------------------------------------------------------ hang watch


def test_a_node_is_quiet_once_its_log_has_not_grown_for_hang_after_whatever_its_cpu() -> None:
    """The host's half: only the log's size counts; CPU is not looked at (gloo's and NCCL's
    threads poll in ranks that wait for ever). Only the crossings are news."""
    now, wall = [0.0], [1000.0]
    watch = QuietWatch(60.0, clock=lambda: now[0], wall=lambda: wall[0])
    assert not watch.sample(True, 500)
    now[0], wall[0] = 59.0, 1059.0
    assert not watch.sample(True, 500) and watch.quiet_since is None
    now[0], wall[0] = 60.0, 1060.0
    assert watch.sample(True, 500) and watch.quiet_since == 1000.0  # since the last output, not since noticed
    now[0], wall[0] = 61.0, 1061.0
    assert not watch.sample(True, 500)  # still quiet: no news
    assert watch.sample(True, 501) and watch.quiet_since is None  # a line written
    now[0], wall[0] = 1000.0, 2000.0
    assert watch.sample(True, 501) and watch.quiet_since is not None
    assert watch.sample(False, 501) and watch.quiet_since is None  # no rank alive (ending, restarting): not quiet
    assert not watch.sample(False, 501)
    assert not QuietWatch(None, clock=lambda: now[0]).sample(True, 1)


def test_a_resumed_monitor_keeps_the_recorded_silence() -> None:
    watch = QuietWatch(60.0, quiet_since=time.time() - 120, clock=lambda: 0.0)
    assert not watch.sample(True, 7) and watch.quiet_since is not None
    assert watch.sample(True, 8) and watch.quiet_since is None


def _quiet(since: float | None, *, ended: bool = False) -> NodeStatus:
    return NodeStatus(HostState.EXITED if ended else HostState.RUNNING, workers=(Worker(0, 0, 10, None),),
                      quiet_since=since)


def test_the_job_is_silent_only_when_every_running_node_is_quiet() -> None:
    """Usually only rank 0 prints: a node whose ranks never print is quiet for the whole run, and
    that alone is no hang while another node prints. The job is silent since the last output anywhere."""
    assert silent_since({0: _quiet(None), 1: _quiet(100.0)}) is None  # node 0 prints: not hung
    assert silent_since({0: _quiet(250.0), 1: _quiet(100.0)}) == 250.0
    assert silent_since({0: _quiet(250.0), 1: None}) is None  # a node not heard from yet
    assert silent_since({0: _quiet(250.0), 1: _quiet(None, ended=True)}) == 250.0  # an ended node does not count
    assert silent_since({0: _quiet(None, ended=True)}) is None


def test_the_hang_watch_says_each_change_once_and_keeps_the_hangs_start() -> None:
    watch = HangWatch([0, 1], 60.0, clock=lambda: 1000.0)
    watch.update(0, _quiet(100.0))
    assert watch.poll() is None
    watch.update(1, _quiet(250.0))
    hung = watch.poll()
    assert hung is not None and (hung.since, hung.nodes) == (250.0, (0, 1))
    assert watch.poll() is None
    watch.update(1, _quiet(260.0, ended=True))  # a node ends meanwhile: the same hang
    assert watch.poll() is None and watch.since == 250.0
    watch.update(0, _quiet(None))  # rank 0 printed
    again = watch.poll()
    assert again is not None and (again.since, again.nodes) == (None, (0, 1))
    watch.update(0, _quiet(None, ended=True))
    assert watch.poll() is None


def test_a_node_that_ended_was_the_jobs_last_sign_of_life() -> None:
    """Rank 0 prints and ends; node 1 never printed and is still in its teardown: not hung then,
    only once node 1 stayed silent for hang_after after rank 0's end."""
    now = [1000.0]
    watch = HangWatch([0, 1], 60.0, clock=lambda: now[0])
    watch.update(0, _quiet(None))
    watch.update(1, _quiet(100.0))  # quiet since its start: rank 0 alone prints
    assert watch.poll() is None
    watch.update(0, _quiet(None, ended=True))
    assert watch.poll() is None
    now[0] = 1059.0
    assert watch.poll() is None
    now[0] = 1060.0
    hung = watch.poll()
    assert hung is not None and (hung.since, hung.nodes) == (1000.0, (1,))



def test_the_hang_watch_looks_at_every_node_again_only_after_a_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's loop polls after every message, log chunks too: at 64 nodes a look at every
    node's status each time was a scan per log message. Time alone changes only an ended node's wait."""
    looked: list[int] = []

    def counted(statuses: Mapping[int, NodeStatus | None]) -> float | None:
        looked.append(len(statuses))
        return silent_since(statuses)

    monkeypatch.setattr(hangwatch_verdict, "silent_since", counted)
    now = [1000.0]
    watch = HangWatch(range(64), 60.0, clock=lambda: now[0])
    for rank in range(64):
        watch.update(rank, _quiet(None))
    for _ in range(100):  # log chunks: no status came
        assert watch.poll() is None
    assert len(looked) == 1
    watch.update(5, _quiet(None, ended=True))
    assert watch.poll() is None and len(looked) == 2
    now[0] = 1030.0
    assert watch.poll() is None and len(looked) == 3  # its end ages: looked at again
    watch.update(0, _quiet(900.0))
    for rank in (r for r in range(64) if r != 5):
        watch.update(rank, _quiet(900.0))
    now[0] = 1060.0
    hung = watch.poll()
    assert hung is not None and hung.since == 1000.0 and len(hung.nodes) == 63
    looked.clear()
    for _ in range(100):
        assert watch.poll() is None
    assert looked == []

def _rank(rank: int, where: str, *, cpu: float, runnable: float | None = None, moved: bool | None = False,
          state: str | None = None) -> RankStack:
    """A rank looked at twice, its main thread's frames ``name:file:line``, innermost first."""
    frames = [Frame(name, file, int(line), lib=file.startswith("torch/"))
              for name, file, line in (f.split(":") for f in where.split())]
    return RankStack(rank=rank, pid=100 + rank, cpu=cpu, runnable=runnable, moved=moved,
                     state=state or ("R" if (runnable or cpu) > 0.5 else "S"),
                     threads=[ThreadStack("MainThread", frames)])


BARRIER = "barrier:torch/distributed/distributed_c10d.py:4500 step:train.py:42"
ALL_REDUCE = "all_reduce:torch/distributed/distributed_c10d.py:2800 step:train.py:40"


def test_the_hang_report_names_the_rank_outside_the_collective_and_the_busy_one() -> None:
    """Busy is what the rank's main thread wanted: on a host whose cores are taken a spinning rank
    gets a fifth of one, and waits for a core the rest of the time."""
    late = _rank(2, "__next__:data.py:88 step:train.py:30", cpu=0.21, runnable=0.97, moved=True)
    waiting = [_rank(0, BARRIER, cpu=0.01, runnable=0.0), _rank(1, BARRIER, cpu=0.0, runnable=0.01)]
    answers = {0: StackAnswer(ok=True, state="running", ranks=waiting), 1: StackAnswer(ok=True, state="running",
                                                                                      ranks=[late])}
    report = HangReport.of(answers, {0: "h0", 1: "h1"}, since=1000.0, apart=3.0, now=1020.0)
    assert report.elsewhere == (2,) and report.busy == (2,) and report.idle == (0, 1) and report.unmoved == (0, 1)
    assert report.summary() == ("rank 2 elsewhere: __next__ at data.py:88 (the others: barrier in step at "
                                "train.py:42) · busy: rank 2 · stacks unmoved: ranks 0-1")
    text = "\n".join(report.render())
    assert text.startswith("hung since 1970-01-01T00:16:40Z: no rank wrote anything for 20 s\n")
    assert "\n2     1     h1    21%  97%       R      moved\n" in text and "ranks 0-1 (node 0 h0):" in text


def test_the_report_s_summary_says_the_rank_elsewhere_is_stopped() -> None:
    stopped = _rank(2, "forward:model.py:57 step:train.py:30", cpu=0.0, state="T")
    answers = {0: StackAnswer(ok=True, state="running", ranks=[_rank(0, BARRIER, cpu=0.0), _rank(1, BARRIER, cpu=0.0)]),
               1: StackAnswer(ok=True, state="running", ranks=[stopped])}
    report = HangReport.of(answers, {0: "h0", 1: "h1"}, since=1000.0, apart=3.0, now=1020.0)
    assert report.summary().startswith("rank 2 elsewhere: forward at model.py:57 (stopped) (the others: barrier in "
                                       "step at train.py:42)"), report.summary()


def test_the_rank_the_others_wait_for_is_named_also_with_two_ranks_or_without_a_collective() -> None:
    two = {0: StackAnswer(ok=True, state="running", ranks=[_rank(0, "linger:train.py:12", cpu=0.0),
                                                           _rank(1, BARRIER, cpu=0.0)])}
    assert HangReport.of(two, {0: "h0"}, 0.0, 3.0).elsewhere == (0,)  # outside the collective, not a majority
    lone = {0: StackAnswer(ok=True, state="running", ranks=[_rank(r, "load:data.py:9", cpu=0.0) for r in range(3)]
                           + [_rank(3, "save:ckpt.py:5", cpu=0.0)])}
    assert HangReport.of(lone, {0: "h0"}, 0.0, 3.0).elsewhere == (3,)  # outside the one largest group
    even = {0: StackAnswer(ok=True, state="running", ranks=[_rank(0, ALL_REDUCE, cpu=0.0), _rank(1, BARRIER, cpu=0.0)])}
    assert HangReport.of(even, {0: "h0"}, 0.0, 3.0).elsewhere == ()  # nothing to single out


def test_a_job_whose_stacks_moved_on_most_ranks_is_said_to_work_without_writing() -> None:
    """A silent step (FSDP's backward, say) looked at twice: most ranks' stacks moved, each caught
    somewhere else in the step. No rank is singled out as the one the others wait for: the
    summary says the ranks moved, and how to keep such a job from being hung."""
    ranks = [_rank(0, "_engine_run_backward:torch/autograd/graph.py:979 main:example.py:102", cpu=0.9, moved=True),
             _rank(1, "reduce_scatter:torch/distributed/distributed_c10d.py:4943 main:example.py:102", cpu=0.9),
             _rank(2, "split_with_sizes_copy:torch/distributed/fsdp/c.py:298 main:example.py:102", cpu=0.9,
                   moved=True),
             _rank(3, "reduce_scatter:torch/distributed/distributed_c10d.py:4943 main:example.py:102", cpu=0.9,
                   moved=True)]
    report = HangReport.of({0: StackAnswer(ok=True, state="running", ranks=ranks)}, {0: "h0"}, 0.0, 3.0)
    assert report.working and report.summary() == (
        "stacks moved: ranks 0,2-3 (the job may be working without writing: print progress more often than "
        "hang_after, or raise it) · busy: ranks 0-3 · stacks unmoved: rank 1")
    assert "elsewhere" not in "\n".join(report.render())
    waiting = [_rank(r, BARRIER, cpu=0.0) for r in range(2)] + [_rank(2, "spin:train.py:7", cpu=1.0, moved=True)]
    assert not HangReport.of({0: StackAnswer(ok=True, state="running", ranks=waiting)}, {0: "h0"}, 0.0, 3.0).working


def test_without_py_spy_the_report_still_says_which_ranks_are_busy() -> None:
    bare = RankStack(rank=0, pid=10, threads=[], cpu=1.0, state="R")
    answers = {0: StackAnswer(ok=True, state="running", ranks=[bare], error="py-spy is not installed on this host",
                              fix="python3 -m pip install py-spy")}
    report = HangReport.of(answers, {0: "h0"}, 0.0, 3.0)
    assert report.busy == (0,) and report.elsewhere == ()
    assert report.summary() == "busy: rank 0 · no stacks: py-spy is not installed on this host"
    assert "  fix: python3 -m pip install py-spy" in report.render()


def test_the_job_is_recorded_hung_once_every_node_is_quiet(fake: FakeCluster, store: JobStore,
                                                          tmp_path: Path) -> None:
    events: list[object] = []
    runner = _owned(fake, store, tmp_path, events.append, watch=Watch(on_hang="nothing"))
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.start_workers(0)
    n1.start_workers(1)
    n1.quiet(time.time() - 900)  # node 1's rank never prints: that alone is no hang
    since = time.time() - 600
    n0.quiet(since)
    _until(lambda: store.load(JOB).nodes[0].hung_since == since)
    record = store.load(JOB)
    assert [n.hung_since for n in record.nodes] == [since, since]  # since the last output anywhere
    assert node_state_text(record.nodes[1], since + 600).startswith("hung since ")
    assert job_state_text(record, since + 600).startswith("running; hung since ")
    node = job_json(record)["nodes"][0]
    assert node["state"] == "hung" and node["last_state"] == "running" and node["hung_since"]
    assert job_json(record)["state"] == "running"  # a hang alone never ends the job
    n0.quiet(None)  # rank 0 printed again
    _until(lambda: store.load(JOB).nodes[1].hung_since is None)
    assert job_json(store.load(JOB))["nodes"][0]["state"] == "running"
    hung = [e for e in events if isinstance(e, JobHung)]
    assert [(e.since, e.nodes) for e in hung] == [(since, (0, 1)), (None, (0, 1))]
    n0.exit(0)
    n1.exit(0)
    thread.join(10)
    runner.close()


def test_on_hang_stack_saves_the_report_naming_the_rank_elsewhere(fake: FakeCluster, store: JobStore, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: fake.transport)
    monkeypatch.setattr(runner_module, "LOOK_APART", 0.0)
    notes: list[str] = []
    runner = _owned(fake, store, tmp_path, lambda e: notes.append(e.text) if isinstance(e, JobNote) else None,
                    watch=Watch(on_hang="stack"))
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.stacks = [_rank(0, BARRIER, cpu=0.0).to_json()]
    n1.stacks = [_rank(1, "spin:train.py:7", cpu=1.0).to_json()]
    n0.quiet(time.time() - 60)
    n1.quiet(time.time() - 60)
    _until(lambda: any(n.startswith("hang report: ") for n in notes))
    report = store.hang_report(JOB, 1)
    assert next(n for n in notes if n.startswith("hang report: ")) == (
        f"hang report: rank 1 elsewhere: spin at train.py:7 (the others: barrier in step at train.py:42) · busy: "
        f"rank 1 · stacks unmoved: ranks 0-1; in {report}")
    assert report.read_text().splitlines()[1].startswith("each rank looked at twice, 0 s apart: rank 1 elsewhere")
    looks = fake.ops("stack")
    assert [(r["looks"], r["node"]) for r in sorted(looks, key=lambda r: r["node"])] == [(2, 0), (2, 1)]
    n0.exit(0)
    n1.exit(0)
    thread.join(10)
    runner.close()


def test_on_hang_restart_stops_the_attempt_and_starts_the_next_within_the_budget(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hang's restart counts against the restart budget (--max-restarts 1): the next hang is reported,
    not restarted (a job that hangs again at once was restarted every ~20 s, for ever)."""
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: fake.transport)
    monkeypatch.setattr(runner_module, "LOOK_APART", 0.0)
    events: list[object] = []
    runner = _owned(fake, store, tmp_path, events.append, watch=Watch(on_hang="restart"), max_restarts=1)
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(runner.follow()), daemon=True)
    thread.start()
    a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    a0.quiet(time.time() - 60)
    a1.quiet(time.time() - 60)
    b0, b1 = fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    assert a0.stops >= 1 and a1.stops >= 1 and not a0.running and not a1.running  # stopped before the next
    record = store.load(JOB)
    assert record.attempt == 2 and str(record.attempts[0].state) == "stopped"
    assert any(isinstance(e, JobNote) and "on_hang: restart" in e.text for e in events)
    assert store.hang_report(JOB, 1).is_file()  # the hung ranks were looked at before the stop
    b0.quiet(time.time() - 60)
    b1.quiet(time.time() - 60)
    _until(lambda: any(isinstance(e, JobNote) and "not restarting" in e.text for e in events))
    (said,) = [e.text for e in events if isinstance(e, JobNote) and "not restarting" in e.text]
    assert said.startswith("the job is hung since ") and said.endswith(
        ": not restarting: the restart budget is used up (1 of 1)"), said
    assert b0.running and b1.running and b1.stops == 0
    b0.exit(0)
    b1.exit(0)
    thread.join(10)
    assert store.load(JOB).state is JobState.SUCCEEDED and store.load(JOB).attempt == 2
    runner.close()


def _left_running(fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  looked_at: Callable[..., Any], said: str) -> list[str]:
    """A job of two nodes under ``on_hang: restart`` hangs and its ranks are looked at (``looked_at``,
    in place of ``stacks_of``): once a note holds ``said``, the notes that do; the job is not restarted
    and ends well."""
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: fake.transport)
    events: list[object] = []
    runner = _owned(fake, store, tmp_path, events.append, watch=Watch(on_hang="restart"), max_restarts=1)
    monkeypatch.setattr(runner_module, "stacks_of", looked_at)
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    nodes = [fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)]
    for node in nodes:
        node.quiet(time.time() - 60)
    _until(lambda: any(isinstance(e, JobNote) and said in e.text for e in events))
    assert all(n.running and n.stops == 0 for n in nodes) and store.load(JOB).attempt == 1
    for node in nodes:
        node.exit(0)
    thread.join(10)
    assert store.load(JOB).state is JobState.SUCCEEDED and store.load(JOB).attempt == 1
    runner.close()
    return [e.text for e in events if isinstance(e, JobNote) and said in e.text]


def test_on_hang_restart_leaves_a_job_that_wrote_while_its_ranks_were_looked_at(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = runner_module.stacks_of

    def looked_at(record: JobRecord, **how: Any) -> Any:  # a rank writes again meanwhile
        for rank in (0, 1):
            fake.wait_started(JOB, rank).quiet(None)
        _until(lambda: all(n.hung_since is None for n in store.load(JOB).nodes))
        return real(record, **how)

    assert _left_running(fake, store, tmp_path, monkeypatch, looked_at, "no hang report") == [
        "a rank wrote while the hung ranks were looked at: no hang report, no restart"]


def test_on_hang_restart_leaves_a_job_whose_ranks_stacks_moved(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks work without a word: their stacks moved between the looks. The hang is reported and
    the job runs on: a restart would throw their work away."""
    def looked_at(record: JobRecord, **how: Any) -> Any:
        return {node: StackAnswer(ok=True, state="running", ranks=[
            _rank(node, f"step{node}:train.py:{40 + node}", cpu=1.0, moved=True)]) for node in (0, 1)}

    (said,) = _left_running(fake, store, tmp_path, monkeypatch, looked_at, "not restarting")
    assert said.endswith(": not restarting: the stacks of ranks 0-1 moved between the looks: the job works without "
                         "writing (print progress more often than hang_after, or raise it)"), said
    assert store.hang_report(JOB, 1).is_file()


def test_what_a_stop_makes_a_hung_job_print_does_not_say_it_runs_again(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun prints as a stop shuts it down: that is the stop's doing, not the job running again."""
    events: list[object] = []
    runner = _owned(fake, store, tmp_path, events.append, watch=Watch(on_hang="nothing"))
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    nodes = [fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)]
    for node in nodes:
        node.quiet(time.time() - 60)
    _until(lambda: any(isinstance(e, JobHung) and e.since is not None for e in events))
    real_stop = fake._stop

    def stop(host: Any, request: dict[str, Any]) -> Any:  # its lines reach the hang watch before its end
        nodes[request["node"]].quiet(None)
        deadline = time.monotonic() + 30
        while runner.job._hang is None or runner.job._hang.since is not None:
            assert time.monotonic() < deadline, "the hang watch never saw the lines"
            fake.changed.wait(0.02)  # the fake answers under its lock: its streams go on meanwhile
        return real_stop(host, request)

    monkeypatch.setattr(fake, "_stop", stop)
    runner.request_stop("down")
    thread.join(10)
    assert not thread.is_alive()
    assert [e.since is None for e in events if isinstance(e, JobHung)] == [False]
    runner.close()


def test_on_hang_restart_without_a_restart_budget_reports_the_hang(fake: FakeCluster, store: JobStore,
                                                                   tmp_path: Path) -> None:
    events: list[object] = []
    runner = _owned(fake, store, tmp_path, events.append, watch=Watch(on_hang="restart"))
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    a0.quiet(time.time() - 60)
    a1.quiet(time.time() - 60)
    _until(lambda: any(isinstance(e, JobNote) and "not restarting" in e.text for e in events))
    (said,) = [e.text for e in events if isinstance(e, JobNote) and "hung" in e.text]
    assert said.startswith("the job is hung since ") and said.endswith(
        ": not restarting: no restarts allowed (restart: max, up --max-restarts)"), said
    assert a0.running and a1.running and a1.stops == 0 and store.load(JOB).attempt == 1
    a0.exit(0)
    a1.exit(0)
    thread.join(10)
    assert store.load(JOB).state is JobState.SUCCEEDED
    runner.close()


# ------------------------------------------------------------------------------ notifications


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "jobs")


def _owned(fake: FakeCluster, store: JobStore, tmp_path: Path, emit: object, *, watch: Watch | None = None,
           notify_with: Notify | None = None, max_restarts: int | None = None) -> Runner:
    hosts = "hosts:\n  - host: h0\n    nproc: 1\n  - host: h1\n    nproc: 1\n"
    watch = watch or Watch()
    spec = dataclasses.replace(load_cluster_text(hosts, "hosts.yaml"), watch=watch, notify=notify_with)
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path), reconnect=FAST)
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(hosts)
    record = new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=hosts, env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None, watch=watch, notify=notify_with,
                        max_restarts=max_restarts)
    store.create(record)
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, record, job, owner, emit)  # type: ignore[arg-type]
    runner.start()
    return runner


def _until(predicate: Callable[[], bool]) -> None:
    """Wait for the owner's record writer (a thread of its own) to have written what ``predicate`` checks.
    A bound, not a timing: a notify sender is a new `python -m clusterrun`, which took over 10 s under
    CI's load once (test_notify's repeat after a killed sender)."""
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, "the record never showed it"
        time.sleep(0.02)  # the writer signals nobody outside the owner: poll the record


def _sent(path: Path, count: int) -> list[dict[str, object]]:
    """The notifications the command wrote (one JSON line each), once there are ``count``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.02)  # the command runs in the background: poll its output file
    raise AssertionError(f"{path}: fewer than {count} notifications")


COMMAND = ("python3 -c 'import json, os, sys; s = json.load(sys.stdin); "
           "print(json.dumps({\"job\": os.environ[\"CLUSTERRUN_JOB\"], \"event\": os.environ[\"CLUSTERRUN_EVENT\"], "
           "\"state\": os.environ[\"CLUSTERRUN_STATE\"], \"id\": s[\"id\"], \"attempts\": len(s[\"attempts\"])}))' "
           ">> {out}")


def test_each_event_is_notified_once_with_its_environment_and_the_summary(fake: FakeCluster, store: JobStore,
                                                                          tmp_path: Path) -> None:
    out = tmp_path / "sent.jsonl"
    runner = _owned(fake, store, tmp_path, None, watch=Watch(on_hang="nothing"),
                    notify_with=Notify(COMMAND.replace("{out}", str(out))))
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.quiet(time.time() - 60)
    n1.quiet(time.time() - 60)
    assert _sent(out, 1) == [{"job": JOB, "event": "hung", "state": "running", "id": JOB, "attempts": 1}]
    n0.exit(0)
    n1.exit(0)
    thread.join(10)
    runner.close()
    sent = _sent(out, 2)
    assert sent[1] == {"job": JOB, "event": "succeeded", "state": "succeeded", "id": JOB, "attempts": 1}
    record = store.load(JOB)
    assert notify.send_due(store, record) == []  # a later owner, or ps, sends nothing again
    assert len(record.notified) == 2 and len(_sent(out, 2)) == 2


def test_the_events_are_read_off_the_record_and_claimed_once(store: JobStore, tmp_path: Path,
                                                            fake: FakeCluster) -> None:
    """A controller killed before it notified leaves the event in the record: the next owner, or
    the command that reconciles the job, sends it; two of them at once send it once."""
    out = tmp_path / "sent.jsonl"
    runner = _owned(fake, store, tmp_path, None, notify_with=Notify(COMMAND.replace("{out}", str(out)),
                                                                   on=("failed", "restarted")))
    runner.close()

    def ended(rec):  # type: ignore[no-untyped-def]
        rec.state = rec.attempts[0].state = JobState.FAILED

    store.update(JOB, ended)
    record = store.load(JOB)
    assert [d.key for d in notify.due(record)] == ["1:failed"]
    claims: list[list[str]] = []
    threads = [threading.Thread(target=lambda: claims.append(notify.send_due(JobStore(store.root), record)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(len, claims)) == [0, 0, 0, 1]
    assert [s["event"] for s in _sent(out, 1)] == ["failed"]
    assert store.load(JOB).notified == ["1:failed"]


def test_every_new_attempt_is_notified_as_restarted_once_by_its_owner(fake: FakeCluster, store: JobStore,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner sends ``restarted`` as it follows each new attempt, the one place for every way to
    start one: here its restart policy's and the user's (the dashboard's R); a later owner sends none again."""
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: fake.transport)
    out = tmp_path / "sent.jsonl"
    runner = _owned(fake, store, tmp_path, None, notify_with=Notify(COMMAND.replace("{out}", str(out)),
                                                                   on=("restarted",)), max_restarts=1)
    runner.policy = RestartPolicy(max=1, backoff_first=0, backoff_most=0)
    following = threading.Thread(target=runner.follow, daemon=True)
    following.start()
    fake.wait_started(JOB, 1)
    fake.wait_started(JOB, 0).exit(1)  # the policy restarts the job
    fake.wait_started(JOB, 0, attempt=2)
    assert [(s["event"], s["attempts"]) for s in _sent(out, 1)] == [("restarted", 2)]
    attempt = NextAttempt(store.load(JOB), lambda event: None, recorded=runner.spec)
    record = runner.restart_by_user(attempt, "restarted by the user", stopped=lambda: following.join(10))
    assert record.attempt == 3 and not following.is_alive()
    following = threading.Thread(target=runner.follow, daemon=True)  # as the dashboard's session follows on
    following.start()
    assert [(s["event"], s["attempts"]) for s in _sent(out, 2)] == [("restarted", 2), ("restarted", 3)]
    for rank in (0, 1):
        fake.wait_started(JOB, rank, attempt=3).exit(0)
    following.join(10)
    assert notify.send_due(store, store.load(JOB)) == [] and store.load(JOB).notified == ["2:restarted",
                                                                                         "3:restarted"]
    assert len(_sent(out, 2)) == 2
    runner.close()


# ------------------------------------------------------------------------------ the dashboard


def test_the_dashboard_shows_a_hung_node_and_filters_a_nodes_log_by_rank() -> None:
    board = Board()
    board.apply(AttemptStarted(None, job_id=JOB, name="train", attempt=1, master_addr="h0", master_port=1,
                               world_size=4, nodes=(("h0", 2, None), ("h1", 2, None))))
    board.apply(NodeStateChanged(1, host="h1", state=NodeState.RUNNING))
    board.apply(LogLines(1, host="h1", lines=("[rank2]:a", "[rank3]:b", "torchrun says")))
    assert list(board.ranks_of(1)) == [2, 3]
    ring = board.watch_rank(1, 3)
    assert ring is not None and list(ring.lines) == ["[rank3]:b"]
    board.apply(LogLines(1, host="h1", lines=("[rank3]:c", "[rank2]:d")))
    board.apply(LogLines(0, host="h0", lines=("[rank0]:e",)))
    assert list(ring.lines) == ["[rank3]:b", "[rank3]:c"]
    assert board.watch_rank(1, None) is None and board.rank_view is None
    board.apply(JobHung(None, since=time.time() - 60, nodes=(1,)))
    assert board.nodes[1].status(time.time()).startswith("hung since ")
    board.apply(JobHung(None, since=None, nodes=(1,)))
    assert board.nodes[1].status(time.time()) == "running"


@pytest.mark.usefixtures("young_heap")
def test_r_in_a_nodes_log_shows_one_rank_after_the_other_then_all() -> None:
    import asyncio

    from clusterrun.tui.logview import RingLog
    from tests.test_tui_snapshots import Scripted, app_for, started

    app = app_for(Scripted(started(), running=True))

    def shown() -> set[str]:
        return {line.split(":", 1)[0] for line in app.query_one("#log", RingLog).lines}

    async def main() -> list[set[str]]:
        seen = []
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("1")  # node 1: ranks 2 and 3
            seen.append(shown())
            for _ in range(3):
                await pilot.press("r")
                seen.append(shown())
            await pilot.press("r", "a")  # rank 2 again, then all nodes: the filter goes with the node view
            seen.append({line.split(" | ", 1)[0] for line in app.query_one("#log", RingLog).lines})
        return seen

    assert asyncio.run(main()) == [{"[rank2]", "[rank3]"}, {"[rank2]"}, {"[rank3]"}, {"[rank2]", "[rank3]"},
                                   {"node0", "node1", "node2"}]


def test_an_end_recorded_by_an_owner_that_died_is_notified_by_the_next_command(store: JobStore, tmp_path: Path,
                                                                               fake: FakeCluster) -> None:
    out = tmp_path / "sent.jsonl"
    runner = _owned(fake, store, tmp_path, None, notify_with=Notify(COMMAND.replace("{out}", str(out))))
    runner.close()

    def ended(rec):  # type: ignore[no-untyped-def]
        rec.state = rec.attempts[0].state = JobState.SUCCEEDED

    store.update(JOB, ended)
    assert refresh(store, Opened(store.load(JOB))).record.state is JobState.SUCCEEDED
    assert _sent(out, 0) == [] and store.load(JOB).notified == []  # the owner lives: it sends, not ps
    assert runner.owner_fd is not None
    store.release(runner.owner_fd)  # the owner died
    refresh(store, Opened(store.load(JOB)))
    refresh(store, Opened(store.load(JOB)))
    assert [s["event"] for s in _sent(out, 1)] == ["succeeded"] and store.load(JOB).notified == ["1:succeeded"]


def test_a_start_nobody_joined_yet_is_starting_until_it_is_late_or_another_node_joined() -> None:
    hosts = {0: "a", 1: "b"}
    not_joined = NodeStatus(HostState.RUNNING, rdzv_joined=False)
    joined = NodeStatus(HostState.RUNNING, rdzv_joined=True)
    both = {0: not_joined, 1: not_joined}
    assert progress_text(hosts, both, 100.0, 110.0) == "nodes 0 (a), 1 (b): torchrun is starting for 10 s"
    assert progress_text(hosts, both, 100.0, 170.0) == (  # late: the firewall's wording
        "nodes 0 (a), 1 (b): torchrun has not joined the rendezvous (no connection to the master port) for 70 s")
    assert progress_text(hosts, {0: joined, 1: not_joined}, 100.0, 110.0) == (
        "node 1 (b): torchrun has not joined the rendezvous (no connection to the master port) for 10 s; "
        "node 0 (a): torchrun joined the rendezvous, waits for the others for 10 s")
    watch = StartupWatch(hosts, 100.0, timeout=20.0)  # a short timeout is late at its half
    watch.update(0, not_joined)
    watch.update(1, not_joined)
    assert watch.poll(107.0) == "nodes 0 (a), 1 (b): torchrun is starting for 7 s"
    assert (watch.poll(140.0) or "").startswith("nodes 0 (a), 1 (b): torchrun has not joined the rendezvous")
