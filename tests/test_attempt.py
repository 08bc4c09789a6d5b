"""The attempt owner's every transition against the fake transport, faults included.

Fast (no processes): jobs run on a ``FakeCluster``; their records live in a temporary ``JobStore``.
Each test follows the job's recorded state (``jobstate``) through one path of its life.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from clusterrun.core.errors import ClusterrunError, ConfigError, HostsUnavailable
from clusterrun.core.events import Event, JobNote, JobState, NodeState, NodeStateChanged
from clusterrun.life.attempt import NextAttempt, begin_stop, restart, stop
from clusterrun.life.recorder import Recorder, mark_failed_start, new_record
from clusterrun.life.runner import Runner, run_monitor
from clusterrun.life.session import Session
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster
from tests import test_runner
from tests.test_opened import parses  # noqa: F401 - a fixture
from tests.test_orchestrator import JOB, spec_of
from tests.test_runner import HOSTS_TEXT, owned_job

fake, store = test_runner.fake, test_runner.store  # the fixtures: a FakeCluster, a JobStore in tmp_path

SECRET = "HF_TOKEN"


def states(store: JobStore) -> tuple[JobState, list[JobState]]:
    record = store.load(JOB)
    return record.state, [a.state for a in record.attempts]


def running_job(fake: FakeCluster, store: JobStore, tmp_path: Path, events: list[Event] | None = None) -> Runner:
    runner = owned_job(fake, store, tmp_path, events if events is not None else [])
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    runner.recorder.flush()
    return runner


def test_an_attempt_starts_runs_and_succeeds(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    runner = running_job(fake, store, tmp_path)
    assert states(store) == (JobState.RUNNING, [JobState.RUNNING])
    fake.node(JOB, 0).exit(0)
    fake.node(JOB, 1).exit(0)
    assert runner.follow() is not None
    record = store.load(JOB)
    assert record.state is JobState.SUCCEEDED and record.attempts[0].ended is not None
    runner.close()


def test_a_failed_node_fails_the_attempt_with_its_root_cause(fake: FakeCluster, store: JobStore,
                                                             tmp_path: Path) -> None:
    runner = running_job(fake, store, tmp_path)
    fake.node(JOB, 1).write("Traceback (most recent call last):\nValueError: bad batch\n")
    fake.node(JOB, 1).exit(1)
    runner.follow()
    record = store.load(JOB)
    assert record.state is JobState.FAILED and record.attempts[0].state is JobState.FAILED
    assert record.attempts[0].root_cause and "node 1" in record.attempts[0].root_cause
    runner.close()


def test_a_supervisor_that_died_loses_the_node_and_the_job(fake: FakeCluster, store: JobStore,
                                                           tmp_path: Path) -> None:
    runner = running_job(fake, store, tmp_path)
    fake.node(JOB, 0).vanish()
    runner.follow()
    record = store.load(JOB)
    assert record.state is JobState.LOST and record.nodes[0].state is NodeState.LOST
    runner.close()


def test_a_stop_after_a_supervisor_died_stays_stopped(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """``down`` after node 0's supervisor died: the job is stopped, and the follower that sees node 0
    lost afterwards (the monitor) does not turn the record into lost/failed with a root cause."""
    runner = running_job(fake, store, tmp_path)
    fake.node(JOB, 0).vanish()
    reports, unrecorded = down_now(store)
    assert unrecorded is None and all(r.ok for r in reports.values())
    assert states(store) == (JobState.STOPPED, [JobState.STOPPED])
    runner.follow()  # the monitor's late view: node 0 lost
    record = store.load(JOB)
    assert record.state is JobState.STOPPED and record.attempts[0].root_cause is None
    runner.close()


def test_a_stop_that_cannot_reach_a_host_leaves_the_job_running(fake: FakeCluster, store: JobStore,
                                                                tmp_path: Path) -> None:
    runner = running_job(fake, store, tmp_path)
    fake.host("h1").drop()
    reports, _ = down_now(store)
    assert reports[1].error and reports[0].ok
    record = store.load(JOB)
    assert record.state is JobState.RUNNING  # it may still run on h1: the next ps asks
    assert record.nodes[0].state is NodeState.STOPPED and record.nodes[1].state is NodeState.RUNNING
    fake.host("h1").restore()
    runner.close()


def test_a_stop_during_the_start_is_not_undone_by_the_starts_news(fake: FakeCluster, store: JobStore,
                                                                  tmp_path: Path) -> None:
    """The record is ``starting`` when a stop lands; the start's news (nodes running, or its failure)
    comes after it and leaves the job stopped."""
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(HOSTS_TEXT)
    store.create(new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=HOSTS_TEXT, env_overrides={},
                            local_cwd=str(tmp_path), ssh_config=None))
    recorder = Recorder(store, JOB, 1)
    down_now(store)
    for rank in (0, 1):
        recorder(NodeStateChanged(rank, host=f"h{rank}", state=NodeState.RUNNING))
    recorder.flush()
    mark_failed_start(store, JOB, 1, HostsUnavailable([ConfigError("h1: start refused")]))
    assert states(store) == (JobState.STOPPED, [JobState.STOPPED])
    assert store.load(JOB).attempts[0].root_cause is None
    job.close()


def test_a_stop_whose_stopper_died_is_carried_out_by_the_next_owner(fake: FakeCluster, store: JobStore,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``down`` recorded ``stopping`` and died before the agents' stop: the monitor that owns the job
    next stops it, and the job ends stopped (not failed, as its killed nodes might say)."""
    runner = running_job(fake, store, tmp_path)
    begin_stop(store, store.load(JOB))
    assert store.load(JOB).state is JobState.STOPPING
    assert runner.owner_fd is not None
    os.close(runner.owner_fd)  # the owner is gone
    runner.close()
    monkeypatch.chdir(tmp_path)  # the monitor moves to the job's directory
    monitor = threading.Thread(target=run_monitor, args=(store, JOB, lambda event: None), daemon=True)
    monitor.start()
    monitor.join(timeout=30)
    assert not monitor.is_alive(), "the monitor follows the job instead of stopping it"
    assert fake.node(JOB, 0).stops == 1 and not fake.node(JOB, 0).running and not fake.node(JOB, 1).running
    assert states(store) == (JobState.STOPPED, [JobState.STOPPED])


def test_ctrl_c_of_the_owner_records_a_stop(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    runner = running_job(fake, store, tmp_path)
    runner.request_stop("SIGINT")
    result = runner.follow()
    assert result is not None and result.interrupted == "SIGINT"
    assert states(store) == (JobState.STOPPED, [JobState.STOPPED])
    runner.close()


def test_a_restart_stops_then_starts_the_next_attempt(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    runner = running_job(fake, store, tmp_path)
    record = restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                     recorded=Opened(store.load(JOB)).spec())
    assert record.attempt == 2
    assert states(store) == (JobState.RUNNING, [JobState.STOPPED, JobState.RUNNING])
    assert not fake.node(JOB, 0).running and fake.node(JOB, 0, 2).running
    runner.close()


def test_a_restart_reads_the_hosts_file_once(fake: FakeCluster, store: JobStore, tmp_path: Path,
                                             parses: list[str]) -> None:  # noqa: F811
    """The next attempt is read from the record once (``AttemptSpec``) and passed on: the checks,
    the stop and the start do not parse the recorded hosts file again."""
    runner = running_job(fake, store, tmp_path)
    parsed = len(parses)  # the count starts now
    assert restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                   recorded=Opened(store.load(JOB)).spec()).attempt == 2
    assert len(parses) == parsed + 1
    runner.close()


def test_a_restart_that_another_restart_overtook_stops_nothing(fake: FakeCluster, store: JobStore,
                                                               tmp_path: Path) -> None:
    """Two restarts checked from the same record: the one carried out second finds the record at a
    later attempt when it comes to stop (under the record's lock) and stops nothing of it."""
    runner = running_job(fake, store, tmp_path)
    late = NextAttempt(store.load(JOB), lambda event: None, recorded=Opened(store.load(JOB)).spec())
    try:
        assert restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd, full_preflight=False,
                       recorded=Opened(store.load(JOB)).spec()).attempt == 2
        with pytest.raises(ClusterrunError, match="restarted meanwhile"):
            late.replace(store, owner_fd=runner.owner_fd)
    finally:
        late.close()
    assert fake.node(JOB, 0, 2).running and fake.node(JOB, 1, 2).running
    assert fake.node(JOB, 0, 2).stops == 0 and fake.node(JOB, 1, 2).stops == 0
    assert states(store) == (JobState.RUNNING, [JobState.STOPPED, JobState.RUNNING])
    runner.close()


def test_a_restart_refused_by_the_preflight_stops_nothing(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """The script is gone from a host: the restart's preflight refuses, the running attempt runs on."""
    runner = running_job(fake, store, tmp_path)
    fake.host("h1").missing = {"train.py"}
    with pytest.raises(HostsUnavailable) as refused:
        restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                recorded=Opened(store.load(JOB)).spec())
    assert "(preflight)" in refused.value.render() and "train.py" in refused.value.render()
    assert fake.ops("stop") == [] and fake.node(JOB, 0).running and fake.node(JOB, 1).running
    assert states(store) == (JobState.RUNNING, [JobState.RUNNING])
    runner.close()


def test_a_restart_without_a_secret_stops_nothing(fake: FakeCluster, store: JobStore, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A job started with a secret ``--env`` value, restarted from a shell without it: refused before
    anything stops (the value was never written to the record)."""
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              env_overrides={SECRET: "hf_abc"}, local_cwd=str(tmp_path), reconnect=Reconnect(first=0.01, most=0.02))
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(HOSTS_TEXT)
    record = new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=HOSTS_TEXT,
                        env_overrides={SECRET: "hf_abc"}, local_cwd=str(tmp_path), ssh_config=None)
    assert "hf_abc" not in str(record.to_json())
    store.create(record)
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, record, job, owner)
    runner.start()
    fake.wait_started(JOB, 1)
    monkeypatch.delenv(SECRET, raising=False)
    with pytest.raises(ConfigError, match=SECRET):
        restart(store, store.load(JOB), lambda event: None, owner_fd=owner, recorded=Opened(store.load(JOB)).spec())
    assert fake.ops("stop") == [] and fake.ops("probe") == fake.ops("probe")[:2]  # not even probed again
    assert fake.node(JOB, 0).running and store.load(JOB).attempt == 1
    monkeypatch.setenv(SECRET, "hf_abc")
    assert restart(store, store.load(JOB), lambda event: None, owner_fd=owner,
                   recorded=Opened(store.load(JOB)).spec()).attempt == 2
    assert fake.node(JOB, 0, 2).env[SECRET] == "hf_abc"
    runner.close()


def test_the_dashboards_refused_restart_stops_nothing_and_keeps_following(fake: FakeCluster, store: JobStore,
                                                                          tmp_path: Path) -> None:
    """R in a dashboard that views a job (its monitor owns it): refused by the preflight, nothing is
    stopped, the view goes on following the running attempt and says why."""
    runner = running_job(fake, store, tmp_path)
    events: list[Event] = []
    session = Session(store, store.load(JOB), events.append)
    session.begin()
    fake.host("h1").missing = {"train.py"}
    following = session._thread
    session.restart()
    checks = session._thread
    assert checks is not None and checks is not following
    checks.join(timeout=30)
    assert not checks.is_alive() and session._thread is following
    assert session.error is not None and "(preflight)" in session.error.render()
    assert any(isinstance(e, JobNote) and "nothing was stopped" in e.text for e in events)
    assert fake.ops("stop") == [] and fake.node(JOB, 0).running and session.running
    fake.node(JOB, 0).exit(0)
    fake.node(JOB, 1).exit(0)
    assert runner.follow() is not None  # the owner records the end, which the view waits for
    session.wait(timeout=30)
    assert session._thread is not None and not session._thread.is_alive()
    assert session.result is not None and session.result.ok  # it followed the attempt to its end
    runner.close()


@pytest.mark.parametrize("when", ["checks", "start"])
def test_k_during_a_viewers_restart_stops_the_job(fake: FakeCluster, store: JobStore, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """K in a dashboard that views a job, while its R restarts the job: during the checks nothing new
    starts; once the next attempt is being started, that attempt is stopped. Either way the job ends
    stopped and nothing runs."""
    runner = running_job(fake, store, tmp_path)
    owner = runner.owner_fd
    assert owner is not None
    monitor = threading.Thread(target=lambda: (runner.follow(), runner.close(), store.release(owner)),
                               daemon=True)  # the job's owner, as its monitor: it lets go once its attempt ended
    monitor.start()
    monkeypatch.setattr(JobStore, "spawn_monitor", lambda self, job_id, owner_fd=None: True)  # the next one's
    session = Session(store, store.load(JOB), gpu_interval=None)
    session.begin()
    original = NextAttempt.__init__ if when == "checks" else NextAttempt.replace

    def pressed_k(attempt: NextAttempt, *args: Any, **kwargs: Any) -> Any:
        session.kill()
        return original(attempt, *args, **kwargs)

    monkeypatch.setattr(NextAttempt, "__init__" if when == "checks" else "replace", pressed_k)
    session.restart()
    session.wait(timeout=30)
    monitor.join(30)
    record = store.load(JOB)
    assert session.error is None, session.error
    assert record.state is JobState.STOPPED, record.state
    assert record.attempt == (1 if when == "checks" else 2)
    assert not any(node.running for node in fake.nodes.values())
    assert not session.running and not session.busy


def test_the_owners_dashboard_restart_keeps_its_one_owner(fake: FakeCluster, store: JobStore,
                                                          tmp_path: Path) -> None:
    """R in `up`'s dashboard: the attempt is stopped (verified) and the next one started, and the
    same owner (one Runner: its listeners, its hosts file, its lock) follows it to its end."""
    events: list[Event] = []
    runner = owned_job(fake, store, tmp_path, [], start=False)
    owner = runner.owner_fd
    session = Session(store, store.load(JOB), events.append, runner=runner)
    session.begin()
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    session.restart()
    fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    fake.node(JOB, 0, 2).exit(0)
    fake.node(JOB, 1, 2).exit(0)
    session.wait(timeout=30)
    assert session.error is None and session.result is not None and session.result.ok
    assert session.runner is runner and runner.job.attempt == 2 and runner.owner_fd == owner
    record = store.load(JOB)
    assert record.state is JobState.SUCCEEDED and [a.state for a in record.attempts] == [JobState.STOPPED,
                                                                                         JobState.SUCCEEDED]
    assert not fake.node(JOB, 0).running and not fake.node(JOB, 1).running
    runner.close()


def test_the_owner_restarts_and_follows_the_next_attempt_without_parsing_the_hosts_file_again(
        fake: FakeCluster, store: JobStore, tmp_path: Path, parses: list[str]) -> None:  # noqa: F811
    """The owner parses its job's recorded hosts file once and carries it: an automatic restart
    (the start-up retry: checks, stop, start) and the follower of the next attempt use it."""
    from tests.test_runner import abort_at_start, follow_in_thread

    runner = running_job(fake, store, tmp_path)
    runner.spec  # noqa: B018 - parsed now, before the count starts
    parsed = len(parses)
    thread, out = follow_in_thread(runner)
    abort_at_start(fake.node(JOB, 1))
    fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    fake.node(JOB, 0, 2).exit(0)
    fake.node(JOB, 1, 2).exit(0)
    thread.join(10)
    assert out and out[0] is not None and not out[0].failed  # type: ignore[attr-defined]
    assert store.load(JOB).attempt == 2 and len(parses) == parsed
    runner.close()


def test_the_owner_carries_the_record_through_a_restart_and_reads_it_only_to_poll(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner keeps the record its own writes return: deciding the end, the backoff's start and
    the next attempt's read none; it is read only where another process may have changed it (the
    backoff's poll for a ``down``; a ``down`` after it is refused by the start's locked write)."""
    from tests.test_runner import abort_at_start, follow_in_thread

    runner = running_job(fake, store, tmp_path)
    loads: list[str] = []
    inside = threading.local()  # a write reads the record under its lock: that is no load of the owner's
    load, update = store.load, store.update

    def counted_update(*args: Any, **kwargs: Any) -> Any:
        inside.writing = True
        try:
            return update(*args, **kwargs)
        finally:
            inside.writing = False

    def counted_load(job_id: str) -> Any:
        if not getattr(inside, "writing", False):
            loads.append(job_id)
        return load(job_id)

    monkeypatch.setattr(store, "update", counted_update)
    monkeypatch.setattr(store, "load", counted_load)
    thread, out = follow_in_thread(runner)
    abort_at_start(fake.node(JOB, 1))
    fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    fake.node(JOB, 0, 2).exit(0)
    fake.node(JOB, 1, 2).exit(0)
    thread.join(10)
    assert out and out[0] is not None and not out[0].failed  # type: ignore[attr-defined]
    assert loads == [JOB]  # the backoff's poll
    assert load(JOB).attempt == 2
    runner.close()


def down_now(store: JobStore):  # type: ignore[no-untyped-def]
    """``attempt.stop`` of the recorded job now, as ``clusterrun down`` makes it."""
    record = store.load(JOB)
    return stop(store, record, spec=Opened(record).spec())
