"""The owner's policies against the fake transport: restart never overlaps, the start-up retry, hand-over.

Fast (no processes): jobs run on a ``FakeCluster``; their records live in a temporary ``JobStore``.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterrun.core.errors import HostsUnavailable
from clusterrun.core.events import AttemptRestarting, AttemptStarted, Event, JobNote, JobState, NodeStarted, NodeState
from clusterrun.life import lifecycle, logread
from clusterrun.life.attempt import NextAttempt, NotStopped, restart
from clusterrun.life.owner import Asked, Owner
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Runner
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.board import Board
from tests.test_orchestrator import JOB, spec_of

HOSTS_TEXT = "hosts:\n  - host: h0\n    nproc: 1\n  - host: h1\n    nproc: 1\n"
TORCHRUN_REPORT = "  rank      : 1 (local_rank: 0)\n  exitcode  : -6 (pid: 4321)\n"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCluster]:
    cluster = FakeCluster()
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: cluster.transport)
    monkeypatch.setattr(logread, "transport_factory", lambda record: cluster.transport)  # `logs` reads by it
    yield cluster


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "jobs")


def owned_job(fake: FakeCluster, store: JobStore, tmp_path: Path, events: list[Event],
              retry_startup: bool = True, start: bool = True) -> Runner:
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path), reconnect=Reconnect(first=0.01, most=0.02))
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(HOSTS_TEXT)
    record = new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=HOSTS_TEXT, env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None, retry_startup=retry_startup)
    store.create(record)
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, record, job, owner, events.append, retry_startup=retry_startup)
    if start:
        runner.start()
    return runner


def follow_in_thread(runner: Runner) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(runner.follow()), daemon=True)
    thread.start()
    return thread, out


def test_restart_stops_every_node_verified_before_the_next_attempt(fake: FakeCluster, store: JobStore,
                                                                   tmp_path: Path) -> None:
    """Whatever the caller believes of the nodes (a viewer that saw them lost or unreachable), a
    restart stops each one on its host first: two attempts never run at once."""
    runner = owned_job(fake, store, tmp_path, [])
    a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    record = restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                     recorded=Opened(store.load(JOB)).spec())
    assert record.attempt == 2
    assert a0.stops == 1 and a1.stops == 1 and not a0.running and not a1.running
    b0, b1 = fake.node(JOB, 0, 2), fake.node(JOB, 1, 2)
    assert b0.running and b1.running
    starts = [r for r in fake.requests if r[1].get("op") in ("stop", "start")]
    assert [op["op"] for _, op in starts] == ["start", "start", "stop", "stop", "start", "start"]
    runner.close()


def test_restart_is_refused_while_a_node_cannot_be_verified_stopped(fake: FakeCluster, store: JobStore,
                                                                    tmp_path: Path) -> None:
    """A host that cannot be reached refuses the restart at its probe, before anything is stopped;
    a process that would not die refuses it after the stop, before anything new starts."""
    runner = owned_job(fake, store, tmp_path, [])
    a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    fake.host("h1").drop()
    with pytest.raises(HostsUnavailable) as unreachable:
        restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                recorded=Opened(store.load(JOB)).spec())
    assert "h1" in unreachable.value.render()
    assert a0.stops == 0 and a0.running and a1.running  # the running attempt was left alone
    assert (JOB, 0, 2) not in fake.nodes and (JOB, 1, 2) not in fake.nodes  # nothing new started
    runner.recorder.flush()
    assert store.load(JOB).attempt == 1 and store.load(JOB).state == JobState.RUNNING
    a1.leave_on_stop = [{"pid": 77, "name": "escapee"}]  # reachable again, but something would not die
    fake.host("h1").restore()
    with pytest.raises(NotStopped) as refused:
        restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                recorded=Opened(store.load(JOB)).spec())
    assert not refused.value.unreachable and (JOB, 0, 2) not in fake.nodes
    runner.close()


def abort_at_start(node: object) -> None:
    node.write("[rank1]:terminate called without an active exception\n" + TORCHRUN_REPORT)  # type: ignore[attr-defined]
    node.exit(1)  # type: ignore[attr-defined]


def test_a_transient_start_up_failure_is_retried_once_visibly(fake: FakeCluster, store: JobStore,
                                                              tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned_job(fake, store, tmp_path, events)
    thread, out = follow_in_thread(runner)
    fake.wait_started(JOB, 0)
    abort_at_start(fake.wait_started(JOB, 1))
    b0, b1 = fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    abort_at_start(b1)  # again: the retry is once only
    thread.join(10)
    result = out[0]
    assert result is not None and result.failed  # type: ignore[attr-defined]
    said = [e.describe() for e in events if isinstance(e, AttemptRestarting)]
    assert len(said) == 1 and "retrying once as attempt 2" in said[0] and "gloo" in said[0]
    notes = [e.text for e in events if isinstance(e, JobNote)]
    assert len(notes) == 1 and notes[0].startswith("attempts: 1 failed after") and ", restarted · 2 failed" in notes[0]
    # a dashboard learns of attempt 2 before its nodes start, and shows them as attempt 2's
    second = next(i for i, e in enumerate(events) if isinstance(e, AttemptStarted))
    assert events[second].attempt == 2  # type: ignore[attr-defined]
    assert all(e.attempt == 1 for e in events[:second] if isinstance(e, NodeStarted))
    assert sorted((e.node, e.attempt) for e in events[second:] if isinstance(e, NodeStarted)) == [(0, 2), (1, 2)]
    board = Board()
    board.apply(dataclasses.replace(events[second], attempt=1))  # what the dashboard of `up` was shown first
    for event in events:
        board.apply(event)
    assert board.attempt == 2 and "attempt 2 started" in board.notes
    record = store.load(JOB)
    assert record.attempt == 2 and [a.state for a in record.attempts] == ["failed", "failed"]
    assert not b0.running  # fail-fast applied to attempt 2 as well
    runner.close()


@pytest.mark.parametrize("case", ["own output", "other failure", "turned off"])
def test_other_failures_are_not_retried(fake: FakeCluster, store: JobStore, tmp_path: Path, case: str) -> None:
    events: list[Event] = []
    runner = owned_job(fake, store, tmp_path, events, retry_startup=case != "turned off")
    thread, out = follow_in_thread(runner)
    fake.wait_started(JOB, 0)
    node = fake.wait_started(JOB, 1)
    if case == "own output":
        node.write("[rank1]:epoch 1 loss 0.3\n")
    if case == "other failure":
        node.write("[rank1]:ValueError: bad batch\n" + TORCHRUN_REPORT)
        node.exit(1)
    else:
        abort_at_start(node)
    thread.join(10)
    assert out and out[0].failed  # type: ignore[attr-defined]
    assert (JOB, 0, 2) not in fake.nodes and not [e for e in events if isinstance(e, JobNote)]
    runner.close()


def test_hand_over_saves_what_was_shown_and_passes_the_lock(fake: FakeCluster, store: JobStore, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[tuple[str, int | None]] = []
    monkeypatch.setattr(JobStore, "spawn_monitor", lambda self, job_id, fd=None: spawned.append((job_id, fd)))
    events: list[Event] = []
    runner = owned_job(fake, store, tmp_path, events)
    owner = runner.owner_fd
    thread, out = follow_in_thread(runner)
    node = fake.wait_started(JOB, 0)
    node.write("one\ntwo\n")
    shown = threading.Event()
    runner.subscribe(lambda event: "two" in getattr(event, "lines", ()) and shown.set())
    assert shown.wait(10)
    runner.request_hand_over()
    thread.join(10)
    assert out == [None]
    runner.hand_over()
    assert spawned == [(JOB, owner)] and runner.owner_fd is None
    record = store.load(JOB)
    assert record.nodes[0].seen == 8 and record.nodes[0].pid is not None
    assert [n.state for n in record.nodes] == [NodeState.RUNNING.value] * 2
    runner.close()


def test_an_adopted_job_restarted_here_is_owned_here(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """A job another controller started, adopted from its hosts' ``jobs`` answers (``discover``,
    ``--hosts``): a restart here stops it, starts attempt 2 as this controller's own (no longer
    adopted: a monitor is started for it here again), and ``remove`` then clears its hosts."""
    from clusterrun.config.hostsfile import load_cluster_text
    from clusterrun.life.discover import records_from
    from clusterrun.life.lifecycle import remove_on_hosts, stop_job

    elsewhere = JobStore(tmp_path / "elsewhere")
    runner = owned_job(fake, elsewhere, tmp_path, [])
    a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    spec = load_cluster_text(HOSTS_TEXT, "hosts.yaml")
    answers = {rank: fake.transport(host).call({"op": "jobs", "state_dir": spec.state_dir})
               for rank, host in enumerate(spec.hosts)}
    records, notes = records_from(spec, str(tmp_path / "hosts.yaml"), HOSTS_TEXT, answers, known=set(),
                                  local_cwd=str(tmp_path), ssh_config=None)
    assert notes == [] and [(r.job_id, r.attempt, r.adopted) for r in records] == [(JOB, 1, True)]
    store.create(records[0])
    record = restart(store, store.load(JOB), lambda event: None, owner_fd=store.try_own(JOB),
                     recorded=Opened(store.load(JOB)).spec())
    assert record.attempt == 2 and not record.adopted
    assert not a0.running and not a1.running and fake.node(JOB, 0, 2).running and fake.node(JOB, 1, 2).running
    assert fake.node(JOB, 1, 2).argv == a1.argv  # the same command as the first controller's
    stop_job(record, spec=Opened(record).spec())
    removed = remove_on_hosts(Opened(record))
    assert all(isinstance(a, dict) and a["removed"] for a in removed.values()), removed
    assert not [key for key in fake.nodes if key[0] == JOB]  # every attempt of every node
    runner.close()


def test_a_stop_asked_during_the_users_restart_stops_the_new_attempt(fake: FakeCluster, store: JobStore,
                                                                    tmp_path: Path) -> None:
    """The dashboard's K pressed while its R restarts the job: the restart's own stop is done, the
    next attempt is started and stopped at once, verified: the job ends stopped, nothing runs."""
    runner = owned_job(fake, store, tmp_path, [])
    fake.wait_started(JOB, 0)
    fake.wait_started(JOB, 1)
    thread, out = follow_in_thread(runner)
    assert runner.begin_user_restart()
    attempt = NextAttempt(store.load(JOB), lambda event: None, recorded=runner.spec)

    def stopped() -> None:  # the restart's stop is done: K, while the next attempt is being started
        thread.join(10)
        runner.request_stop("stopped from the dashboard")

    try:
        record = runner.restart_by_user(attempt, "restarted from the dashboard", stopped)
    finally:
        attempt.close()
    assert record.attempt == 2 and out and out[0] is not None
    thread, out = follow_in_thread(runner)  # as the dashboard's session follows the new attempt
    thread.join(10)
    assert out and out[0].interrupted == "stopped from the dashboard"  # type: ignore[attr-defined]
    assert store.load(JOB).state is JobState.STOPPED
    assert not fake.node(JOB, 0, 2).running and not fake.node(JOB, 1, 2).running
    runner.close()


def half_started(fake: FakeCluster, store: JobStore, tmp_path: Path) -> Job:
    """A job whose controller died during its start: node 0 started, node 1 never reached, the
    record ``starting`` and owned by nobody."""
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path))
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(HOSTS_TEXT)
    store.create(new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=HOSTS_TEXT,
                            env_overrides={}, local_cwd=str(tmp_path), ssh_config=None))
    job.start([0])
    job.close()
    return job


def run_monitor_in_thread(store: JobStore) -> threading.Thread:
    from clusterrun.life.runner import run_monitor

    monitor = threading.Thread(target=run_monitor, args=(store, JOB, lambda event: None), daemon=True)
    monitor.start()
    return monitor


def test_the_monitor_starts_the_nodes_a_dead_controller_never_reached(fake: FakeCluster, store: JobStore,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    half_started(fake, store, tmp_path)
    monkeypatch.chdir(tmp_path)
    monitor = run_monitor_in_thread(store)
    late = fake.wait_started(JOB, 1)
    assert fake.node(JOB, 0).running and late.running
    fake.node(JOB, 0).exit(0)
    late.exit(0)
    monitor.join(30)
    assert not monitor.is_alive()
    record = store.load(JOB)
    assert record.state is JobState.SUCCEEDED and [a.attempt for a in record.attempts] == [1]
    assert [n.state for n in record.nodes] == [NodeState.SUCCEEDED] * 2


def test_a_start_the_monitor_cannot_finish_fails_the_attempt_and_stops_the_rest(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    half_started(fake, store, tmp_path)
    fake.host("h1").start_error = "cannot start torchrun: no such file"
    monkeypatch.chdir(tmp_path)
    monitor = run_monitor_in_thread(store)
    monitor.join(30)
    assert not monitor.is_alive()
    assert not fake.node(JOB, 0).running and fake.node(JOB, 0).stops >= 1 and (JOB, 1, 1) not in fake.nodes
    record = store.load(JOB)
    assert record.state is JobState.FAILED
    assert record.attempts[0].root_cause is not None and "no such file" in record.attempts[0].root_cause


def test_the_owner_decides_a_restart_in_its_own_thread_outside_any_write_of_the_record(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder only records: the restart decision runs in the thread that follows the job,
    never on the record's writer thread nor inside ``JobStore.update`` (its lock held)."""
    writing: set[int] = set()
    update = JobStore.update

    def watched_update(self: JobStore, job_id: str, change: object) -> object:
        writing.add(threading.get_ident())
        try:
            return update(self, job_id, change)  # type: ignore[arg-type]
        finally:
            writing.discard(threading.get_ident())

    monkeypatch.setattr(JobStore, "update", watched_update)
    decided: list[tuple[str, bool]] = []
    decide = Runner._decide

    def watched_decide(self: Runner, record: object, result: object) -> object:
        decided.append((threading.current_thread().name, threading.get_ident() in writing))
        return decide(self, record, result)  # type: ignore[arg-type]

    monkeypatch.setattr(Runner, "_decide", watched_decide)
    runner = owned_job(fake, store, tmp_path, [])
    thread, out = follow_in_thread(runner)
    fake.wait_started(JOB, 0)
    abort_at_start(fake.wait_started(JOB, 1))  # restarted: the start-up retry
    abort_at_start(fake.wait_started(JOB, 1, 2))  # not again
    thread.join(10)
    assert out and out[0].failed  # type: ignore[attr-defined]
    assert decided == [(thread.name, False)] * 2
    assert [a.restart for a in store.load(JOB).attempts] == ["start-up", None]
    runner.close()


def test_what_the_owner_was_asked_is_one_value_a_stop_wins_and_stays() -> None:
    F, R, H, S = Asked.FOLLOW, Asked.RESTART, Asked.HAND_OVER, Asked.STOP
    taken = {(now, asked) for now in Asked for asked in Asked if now.asks(asked)}
    assert taken == {(F, R), (F, H), (R, H), (F, S), (R, S), (H, S), (S, S)}


def test_the_owners_state_is_replaced_whole_and_a_restart_done_keeps_a_stop_asked_meanwhile() -> None:
    new = Owner(started=False)
    restarting = new.start().ask(Asked.RESTART, "hung").decided(spares={"h1": "s0"}).blamed((1,))
    assert new == Owner(started=False) and restarting.started and restarting.replace == {"h1": "s0"}
    assert restarting.next_attempt() == Owner()  # the restart done, its spares in use, nobody blamed
    stopped = restarting.ask(Asked.STOP, "Ctrl-C").ask(Asked.RESTART, "hung again")
    assert (stopped.asked, stopped.reason) == (Asked.STOP, "Ctrl-C")
    assert (stopped.next_attempt().asked, stopped.next_attempt().reason) == (Asked.STOP, "Ctrl-C")
    assert new.start(failed=True).start_failed and not new.start().start_failed
    by_user = restarting.begin_user_restart().restarted()  # the dashboard's R: a new attempt, nobody blamed
    assert (by_user.late, by_user.replace, by_user.user_restart, by_user.asked) == ((), {}, False, Asked.FOLLOW)
    restart_stop = restarting.begin_user_restart().ask(Asked.STOP, "R")
    assert restart_stop.restarted("R").asked is Asked.FOLLOW  # the restart's own stop is done
    assert (restart_stop.ask(Asked.STOP, "K").restarted("R").asked, restart_stop.ask(Asked.STOP, "K").restarted(
        "R").reason) == (Asked.STOP, "K")  # a stop asked meanwhile stays, for the new attempt


def test_requests_from_signal_handlers_are_taken_in_order_and_never_wait_for_the_lock(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """A signal can arrive while the owner's thread changes its state (the lock held): the
    handler's request is queued, not locked, and the change after takes it in."""
    runner = owned_job(fake, store, tmp_path, [], start=False)
    handled = []

    def handler(signum: int, frame: object) -> None:
        runner.request_hand_over()
        runner.request_stop("SIGUSR1")
        handled.append(signum)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        def change(state: Owner) -> Owner:
            signal.raise_signal(signal.SIGUSR1)  # its handler runs here, in this thread, the lock held
            return state.begin_user_restart()

        runner._move(change)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert handled == [signal.SIGUSR1]
    state = runner.state
    assert (state.asked, state.reason, state.user_restart) == (Asked.STOP, "SIGUSR1", True)
    assert runner.begin_user_restart() is False  # one user's restart at a time
    runner.end_user_restart()
    assert runner.begin_user_restart() is True
    runner.close()
