"""The job-level restart policy: its decisions (pure), and the owner applying it on the fake transport.

Fast (no processes, no sleeps): jobs run on a ``FakeCluster``; the backoff's clock is a fake one
that only moves when the owner waits.
"""

from __future__ import annotations

import dataclasses
import io
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.config.restarts import COUNTED, RestartPolicy, parse_backoff, parse_duration
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import (
    AttemptRestarting,
    AttemptStarted,
    Event,
    JobFinished,
    JobNote,
    JobResult,
    JobState,
    iso,
)
from clusterrun.life.attempt import Cancelled, attempt_event, restart, stop
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Clock, Runner, history, run_monitor
from clusterrun.life.session import Session
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.store.jobs import OWNER_FD_VAR, JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.board import Board
from clusterrun.views.printer import Printer
from tests import test_runner
from tests.test_orchestrator import JOB, spec_of
from tests.test_runner import HOSTS_TEXT

fake, store = test_runner.fake, test_runner.store  # the fixtures: a FakeCluster, a JobStore in tmp_path

# ------------------------------------------------------------------------------ the policy, pure


def test_durations_and_backoffs_parse() -> None:
    assert [parse_duration(t) for t in ("30s", "10m", "6h", "1d", "250ms", "5")] == [30, 600, 21600, 86400, 0.25, 5]
    assert parse_backoff("30s..10m") == (30, 600) and parse_backoff("1m") == (60, 60)
    for bad in ("soon", "-1s", "10m..30s", "1x"):
        with pytest.raises(ValueError):
            parse_backoff(bad)


def test_the_backoff_doubles_up_to_its_longest_with_jitter_below() -> None:
    policy = RestartPolicy(max=10, backoff_first=30, backoff_most=600)
    rng = random.Random(7)
    for number, base in [(1, 30), (2, 60), (3, 120), (5, 480), (6, 600), (60, 600)]:
        delay = policy.delay(number, rng)
        assert 0.75 * base <= delay <= base


def test_the_budget_the_exit_codes_and_the_window() -> None:
    policy = RestartPolicy(max=2, on_exit_codes=(1, 3), window=3600)
    assert policy.refusal([], 1, now=10_000) is None
    assert "not one of restart.on_exit_codes (1, 3)" in (policy.refusal([], 2, now=10_000) or "")
    assert "used up (2 of 2 within 1h)" in (policy.refusal([9000, 9500], 1, now=10_000) or "")
    assert policy.refusal([1000, 9500], 3, now=10_000) is None  # the first restart left the window
    assert "no restarts allowed" in (RestartPolicy().refusal([], 1, now=0) or "")
    assert RestartPolicy(max=1).with_max(None).max == 1 and RestartPolicy(max=1).with_max(4).max == 4


def test_a_hang_is_restarted_within_the_same_budget_whatever_the_exit_codes() -> None:
    policy = RestartPolicy(max=2, on_exit_codes=(1,), window=3600)
    assert policy.hang_refusal([], now=10_000) is None  # a hang has no exit code: on_exit_codes is for failures
    assert "used up (2 of 2 within 1h)" in (policy.hang_refusal([9000, 9500], now=10_000) or "")
    assert "no restarts allowed" in (RestartPolicy().hang_refusal([], now=0) or "")
    assert set(COUNTED) == {"policy", "requested"}  # a hang's restart is "requested"; the start-up retry is free


def test_the_hosts_files_restart_block_is_typed_and_checked() -> None:
    text = "hosts: [a]\nrestart: {max: 3, backoff: 1s..1m, on_exit_codes: [1], window: 6h}\n"
    assert load_cluster_text(text).restart == RestartPolicy(3, 1.0, 60.0, (1,), 21600.0)
    assert load_cluster_text("hosts: [a]\n").restart == RestartPolicy()
    with pytest.raises(ConfigError) as bad:
        load_cluster_text("hosts: [a]\nrestart:\n  backoff: 10m..1s\n", "h.yaml")
    assert bad.value.render().startswith("h.yaml:3: restart.backoff: the longest wait (1s) is shorter")
    for window in ("0", "0s", "0m"):  # no restart would ever count: the budget would never run out
        with pytest.raises(ConfigError) as bad:
            load_cluster_text(f"hosts: [a]\nrestart: {{max: 1, window: {window}}}\n", "h.yaml")
        assert bad.value.render().startswith("h.yaml:2: restart.window: expected a duration above 0 (30m, 6h), "
                                             "got "), bad.value.render()
    with pytest.raises(ConfigError) as bad:
        load_cluster_text("hosts: [a]\nrestart: {max: 1001}\n", "h.yaml")
    assert bad.value.render().startswith("h.yaml:2: restart.max: expected a count from 0 to 1000")


# ------------------------------------------------------------------------------ the owner, on the fake


class FakeClock:
    """Time moves only when the owner waits; ``on_wait`` runs at the first wait (a `down` from elsewhere)."""

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self.t = 1_000_000.0
        self.waits: list[float] = []
        self.woken: list[bool] = []  # per wait: whether a request had woken the owner already
        self.on_wait = on_wait

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if self.on_wait is not None:
            self.on_wait, hook = None, self.on_wait
            hook()
        self.waits.append(seconds)
        self.woken.append(event.is_set())
        self.t += seconds
        return event.is_set()

    def clock(self) -> Clock:
        return Clock(now=lambda: self.t, wait=self.wait, poll=60.0, show=120.0, rng=random.Random(1))


def owned(fake: FakeCluster, store: JobStore, tmp_path: Path, policy: RestartPolicy, events: list[Event],
          clock: FakeClock) -> Runner:
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path), reconnect=Reconnect(first=0.01, most=0.02))
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(HOSTS_TEXT)
    record = new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=HOSTS_TEXT, env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None, max_restarts=policy.max)
    store.create(record)
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, record, job, owner, events.append, policy=policy, clock=clock.clock())
    runner.start()
    return runner


def run(runner: Runner, drive: Callable[[], None]) -> JobResult | None:
    """``runner.follow()`` in a thread while ``drive`` plays the nodes here."""
    out: list[JobResult | None] = []
    thread = threading.Thread(target=lambda: out.append(runner.follow()), daemon=True)
    thread.start()
    drive()
    thread.join(30)
    assert out, "follow() did not return"
    return out[0]


def fail(fake: FakeCluster, attempt: int, code: int = 1) -> None:
    node = fake.wait_started(JOB, 1, attempt)
    fake.wait_started(JOB, 0, attempt)
    node.write("[rank1]:ValueError: bad batch\n")
    node.exit(code)


def one_at_a_time(fake: FakeCluster, events: list[Event]) -> Callable[[Event], None]:
    """A listener that notes every attempt's start while a node of an earlier one still ran."""
    def check(event: Event) -> None:
        if isinstance(event, AttemptStarted):
            events.append(JobNote(None, text="OVERLAP") if any(
                n.running for key, n in fake.nodes.items() if key[2] < event.attempt) else event)
    return check


def test_a_job_failing_twice_succeeds_on_its_third_attempt(fake: FakeCluster, store: JobStore,
                                                          tmp_path: Path) -> None:
    events: list[Event] = []
    clock = FakeClock()
    runner = owned(fake, store, tmp_path, RestartPolicy(max=2, backoff_first=30, backoff_most=600), events, clock)
    runner.subscribe(one_at_a_time(fake, events))

    def drive() -> None:
        fail(fake, 1)
        fail(fake, 2)
        fake.wait_started(JOB, 0, 3).exit(0)
        fake.wait_started(JOB, 1, 3).exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok
    record = store.load(JOB)
    assert record.state is JobState.SUCCEEDED and record.attempt == 3 and record.restart_at is None
    assert [(a.state, a.restart) for a in record.attempts] == [("failed", "policy"), ("failed", "policy"),
                                                                ("succeeded", None)]
    assert record.attempts[0].root_cause == "torchrun on node 1 (h1): exit code 1"
    assert not [e for e in events if isinstance(e, JobNote) and e.text == "OVERLAP"]
    counting = [e for e in events if isinstance(e, AttemptRestarting)]
    assert [(e.attempt, e.restart, e.most) for e in counting][:1] == [(2, 1, 2)] and counting[-1].attempt == 3
    assert 22.5 <= sum(clock.waits[:1]) <= 30 and 45 <= sum(clock.waits[1:]) <= 60  # backoff doubled, jittered
    assert len({a.master_port for a in record.attempts}) >= 1 and (JOB, 0, 4) not in fake.nodes
    runner.close()


def test_a_budget_used_up_fails_the_job_with_its_history(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, RestartPolicy(max=1, backoff_first=0, backoff_most=0), events, FakeClock())

    def drive() -> None:
        fail(fake, 1)
        fail(fake, 2)

    result = run(runner, drive)
    assert result is not None and result.failed and result.interrupted is None
    record = store.load(JOB)
    assert record.state is JobState.FAILED and [a.state for a in record.attempts] == ["failed", "failed"]
    assert [a.restart for a in record.attempts] == ["policy", None] and (JOB, 0, 3) not in fake.nodes
    notes = [e.text for e in events if isinstance(e, JobNote)]
    assert notes == ["not restarting: the restart budget is used up (1 of 1)",
                     "attempts: 1 failed after 0 s (torchrun on node 1 (h1): exit code 1), restarted · "
                     "2 failed after 0 s (torchrun on node 1 (h1): exit code 1)"]
    runner.close()


def test_a_down_during_the_backoff_starts_no_attempt(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    events: list[Event] = []
    clock = FakeClock(on_wait=lambda: down_now(store))  # `clusterrun down` from another shell
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=3600, backoff_most=3600), events, clock)
    result = run(runner, lambda: fail(fake, 1))
    assert result is not None and result.stopped
    record = store.load(JOB)
    assert record.state is JobState.STOPPED and record.attempt == 1 and (JOB, 0, 2) not in fake.nodes
    assert len(clock.waits) == 1  # the first poll of the record saw the stop
    runner.close()


def test_a_stop_asked_of_the_owner_during_the_backoff_is_recorded(fake: FakeCluster, store: JobStore,
                                                                  tmp_path: Path) -> None:
    events: list[Event] = []
    holder: list[Runner] = []
    clock = FakeClock(on_wait=lambda: holder[0].request_stop("SIGINT"))  # Ctrl-C of `up` during the countdown
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=3600, backoff_most=3600), events, clock)
    holder.append(runner)
    result = run(runner, lambda: fail(fake, 1))
    assert result is not None and result.interrupted == "SIGINT"
    assert store.load(JOB).state is JobState.STOPPED and (JOB, 0, 2) not in fake.nodes
    ends = [e for e in events if isinstance(e, JobFinished)]  # the attempt's, then the job's: said, never silent
    assert [(e.restarting, e.result.interrupted) for e in ends] == [(True, None), (False, "SIGINT")]
    runner.close()


def test_the_users_stop_is_never_restarted(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=0, backoff_most=0), events, FakeClock())

    def drive() -> None:
        fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
        runner.request_stop("SIGTERM")

    result = run(runner, drive)
    assert result is not None and result.stopped
    assert store.load(JOB).state is JobState.STOPPED and (JOB, 0, 2) not in fake.nodes
    runner.close()


@pytest.mark.parametrize(("code", "restarted"), [(3, True), (1, False)])
def test_only_the_listed_exit_codes_are_restarted(fake: FakeCluster, store: JobStore, tmp_path: Path, code: int,
                                                  restarted: bool) -> None:
    events: list[Event] = []
    policy = RestartPolicy(max=1, backoff_first=0, backoff_most=0, on_exit_codes=(3,))
    runner = owned(fake, store, tmp_path, policy, events, FakeClock())

    def drive() -> None:
        fail(fake, 1, code)
        if restarted:
            fake.wait_started(JOB, 0, 2).exit(0)
            fake.wait_started(JOB, 1, 2).exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok is restarted
    assert ((JOB, 0, 2) in fake.nodes) is restarted
    if not restarted:
        notes = [e.text for e in events if isinstance(e, JobNote)]
        assert notes == ["not restarting: exit code 1 is not one of restart.on_exit_codes (3)"]
    runner.close()


def test_an_automatic_restart_of_a_stopped_job_starts_nothing(fake: FakeCluster, store: JobStore,
                                                              tmp_path: Path) -> None:
    """The start itself refuses what is no longer ``restarting`` (a `down` between the wait and the start)."""
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=3600, backoff_most=3600), [], FakeClock())
    fail(fake, 1)
    assert runner.job.run() is not None and store.load(JOB).state is JobState.RESTARTING
    down_now(store)
    with pytest.raises(Cancelled):
        restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd, automatic=True,
                recorded=Opened(store.load(JOB)).spec())
    assert store.load(JOB).state is JobState.STOPPED and (JOB, 0, 2) not in fake.nodes
    runner.close()


def test_a_users_restart_during_the_backoff_leaves_the_attempt_failed_and_restarted_by_the_user(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """`clusterrun restart` while the policy counts down: attempt 1 failed (its stop during the
    backoff finds it ended), and the user restarted it, not the policy."""
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=3600, backoff_most=3600), [], FakeClock())
    fail(fake, 1)
    assert runner.job.run() is not None and store.load(JOB).state is JobState.RESTARTING
    record = restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                     recorded=Opened(store.load(JOB)).spec())
    assert record.attempt == 2 and (JOB, 0, 2) in fake.nodes
    assert [(str(a.state), a.restart) for a in record.attempts[:1]] == [("failed", "user")]
    assert record.attempts[1].restart is None
    assert history(record) == ("attempts: 1 failed after 0 s (torchrun on node 1 (h1): exit code 1), restarted by "
                               f"the user · 2 {record.attempts[1].state}")
    runner.close()


def test_an_owner_whose_backoff_a_restart_from_elsewhere_ended_says_so_not_that_the_job_ended(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    events: list[Event] = []
    holder: list[Runner] = []

    def restarted_elsewhere() -> None:  # `clusterrun restart` from another shell, during the countdown
        restart(store, store.load(JOB), lambda event: None, owner_fd=holder[0].owner_fd,
                recorded=Opened(store.load(JOB)).spec())

    clock = FakeClock(on_wait=restarted_elsewhere)
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=3600, backoff_most=3600), events, clock)
    holder.append(runner)
    run(runner, lambda: fail(fake, 1))
    assert store.load(JOB).attempt == 2
    assert [e.restarting for e in events if isinstance(e, JobFinished)] == [True]  # not the job's end
    assert any(isinstance(e, JobNote) and e.text == "the job was restarted from elsewhere as attempt 2; its new "
               "owner follows it" for e in events)
    runner.close()


def test_after_the_dashboards_restart_a_backoff_waits_its_time_and_is_not_woken_by_the_old_stop(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """The dashboard's R stops the attempt through the owner (a request that wakes a backoff);
    once the next attempt runs, that request is done: a later backoff waits, it does not spin."""
    clock = FakeClock()
    runner = owned(fake, store, tmp_path, RestartPolicy(max=1, backoff_first=30, backoff_most=30), [], clock)
    session = Session(store, store.load(JOB), runner=runner, gpu_interval=None)
    session.begin()
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    session.restart()
    fail(fake, 2)
    fake.wait_started(JOB, 0, 3).exit(0)
    fake.wait_started(JOB, 1, 3).exit(0)
    session.wait(timeout=30)
    assert session.result is not None and session.result.ok and not session.busy
    assert [a.restart for a in store.load(JOB).attempts] == ["user", "policy", None]
    assert clock.waits and clock.woken == [False] * len(clock.waits)
    runner.close()


def test_a_down_during_the_backoff_leaves_the_attempt_failed_and_not_restarted(fake: FakeCluster, store: JobStore,
                                                                              tmp_path: Path) -> None:
    runner = owned(fake, store, tmp_path, RestartPolicy(max=3, backoff_first=3600, backoff_most=3600), [], FakeClock())
    fail(fake, 1)
    assert runner.job.run() is not None and store.load(JOB).state is JobState.RESTARTING
    down_now(store)
    record = store.load(JOB)
    assert record.state is JobState.STOPPED
    assert [(str(a.state), a.restart) for a in record.attempts] == [("failed", None)]
    runner.close()


def test_a_monitor_given_the_job_during_the_backoff_restarts_it(fake: FakeCluster, store: JobStore, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` closed (SIGHUP) while it counts down: the monitor resumes the wait where it was, then restarts."""
    spawned: list[int | None] = []
    monkeypatch.setattr(JobStore, "spawn_monitor", lambda self, job_id, fd=None: spawned.append(fd))
    holder: list[Runner] = []
    clock = FakeClock(on_wait=lambda: holder[0].request_hand_over())
    runner = owned(fake, store, tmp_path, RestartPolicy(max=1, backoff_first=600, backoff_most=600), [], clock)
    holder.append(runner)
    assert run(runner, lambda: fail(fake, 1)) is None
    runner.hand_over()
    assert store.load(JOB).state is JobState.RESTARTING and (JOB, 0, 2) not in fake.nodes
    monkeypatch.setenv(OWNER_FD_VAR, str(spawned[0]))
    monkeypatch.chdir(tmp_path)  # the monitor works in the job's directory; the test's is given back
    later = FakeClock()
    later.t = clock.t + 300  # half the backoff went by before the monitor took over
    events: list[Event] = []
    thread = threading.Thread(target=lambda: run_monitor(store, JOB, events.append, clock=later.clock()), daemon=True)
    thread.start()
    fake.wait_started(JOB, 0, 2).exit(0)
    fake.wait_started(JOB, 1, 2).exit(0)
    thread.join(30)
    record = store.load(JOB)
    assert record.state is JobState.SUCCEEDED and record.attempt == 2
    assert 0 < sum(later.waits) <= 300  # only what was left of the wait
    runner.close()


def test_restart_with_new_arguments_records_them(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    runner = owned(fake, store, tmp_path, RestartPolicy(), [], FakeClock())
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    record = restart(store, store.load(JOB), lambda event: None, owner_fd=runner.owner_fd,
                     script_args=["--lr", "0.1"], recorded=Opened(store.load(JOB)).spec())
    assert record.attempt == 2 and record.script_args == ["--lr", "0.1"]
    assert fake.wait_started(JOB, 0, 2).argv[-2:] == ["--lr", "0.1"]
    assert fake.node(JOB, 0, 1).argv[-1] == "train.py"  # attempt 1 ran with none
    runner.close()


def test_a_requested_restart_stops_the_attempt_and_starts_the_next_at_once(fake: FakeCluster, store: JobStore,
                                                                          tmp_path: Path) -> None:
    """``Runner.request_restart`` (``on_hang: restart``, which checks the budget itself): no backoff."""
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, RestartPolicy(), events, FakeClock())

    def drive() -> None:
        a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
        runner.request_restart("hung: no output nor CPU for 10m")
        b0, b1 = fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
        assert not a0.running and not a1.running and a0.stops >= 1
        b0.exit(0)
        b1.exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok
    record = store.load(JOB)
    assert [(a.state, a.restart, a.root_cause) for a in record.attempts] == [
        ("stopped", "requested", "hung: no output nor CPU for 10m"), ("succeeded", None, None)]
    said = [e for e in events if isinstance(e, AttemptRestarting)]
    assert [(e.kind, e.attempt) for e in said] == [("requested", 2)]
    assert said[0].describe() == "attempt 1 stopped (hung: no output nor CPU for 10m); restarting the job as attempt 2"
    runner.close()


def test_a_restart_its_checks_refuse_fails_the_job_with_why(fake: FakeCluster, store: JobStore,
                                                             tmp_path: Path) -> None:
    """The restart runs up's preflight: a host that lost the script meanwhile refuses it; the job ends failed."""
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, RestartPolicy(max=2, backoff_first=0, backoff_most=0), events, FakeClock())

    fake.host("h1").missing = {"train.py"}  # after the start: attempt 1 runs
    result = run(runner, lambda: fail(fake, 1))
    assert result is not None and result.failed and (JOB, 0, 2) not in fake.nodes
    record = store.load(JOB)
    assert record.state is JobState.FAILED and record.restart_at is None
    why = record.attempts[-1].root_cause or ""
    assert "; not restarted: " in why and "train.py is missing" in why
    assert any(isinstance(e, JobNote) and e.text.startswith("could not restart: ") for e in events)
    assert [e.restarting for e in events if isinstance(e, JobFinished)] == [True, False]  # then the job's end
    runner.close()


def test_the_dashboard_shows_the_countdown_then_the_new_attempt(fake: FakeCluster, store: JobStore,
                                                                tmp_path: Path) -> None:
    board = Board()
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, RestartPolicy(max=1, backoff_first=30, backoff_most=30), events, FakeClock())
    states: list[str] = []

    def show(event: Event) -> None:
        board.apply(event)
        if isinstance(event, (AttemptRestarting, AttemptStarted, JobFinished)):
            states.append(board.state)  # at the failed attempt's end too: restarting, never failed

    board.apply(dataclasses.replace(attempt_event(runner.job.plan, 1), attempt=1))  # what `up` shows first
    runner.subscribe(show)

    def drive() -> None:
        fail(fake, 1)
        fake.wait_started(JOB, 0, 2).exit(0)
        fake.wait_started(JOB, 1, 2).exit(0)

    assert run(runner, drive) is not None
    assert "failed" not in states[:-1] and states[0] == "restarting", states
    assert states[-1] == "succeeded" and board.attempt == 2
    countdown = [note for note in board.notes if "· restarting at " in note]
    assert len(countdown) == 1 and "as attempt 2 (restart 1 of 1;" in countdown[0], board.notes  # once, with its time
    runner.close()


def test_the_printed_stream_says_an_attempt_failed_and_only_the_jobs_end_failed(fake: FakeCluster, store: JobStore,
                                                                                tmp_path: Path) -> None:
    """`up --no-tui`'s stream: a restarted attempt reads as the attempt failing and the job going
    on; "FAILED" is said once, at the job's real end."""
    err = io.StringIO()
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, RestartPolicy(max=1, backoff_first=30, backoff_most=30), events, FakeClock())
    runner.subscribe(Printer(out=io.StringIO(), err=err, colour=False))
    result = run(runner, lambda: (fail(fake, 1), fail(fake, 2)))
    assert result is not None and result.failed
    lines = err.getvalue().splitlines()
    restarting = [i for i, line in enumerate(lines) if line.startswith("clusterrun: attempt 1 failed: ")]
    assert restarting and "· restarting at " in lines[restarting[0]], lines
    assert "torchrun on node 1 (h1): exit code 1" in lines[restarting[0]]
    assert "as attempt 2 (restart 1 of 1; `clusterrun down` cancels)" in lines[restarting[0]]
    failed = [i for i, line in enumerate(lines) if line == f"clusterrun: job {JOB} FAILED"]
    assert len(failed) == 1 and failed[0] > restarting[0], lines  # the job's end, after attempt 2
    runner.close()


def test_the_countdown_is_one_line_with_the_restarts_time_and_each_failure_is_said_once(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """A 30 s backoff, shown every 10 s by the owner: the stream says the attempt failed once, with
    the time of the restart, and the failed node's end once (not again in the attempt's summary)."""
    err = io.StringIO()
    ticks = FakeClock()
    runner = owned(fake, store, tmp_path, RestartPolicy(max=1, backoff_first=30, backoff_most=30), [], ticks)
    runner.clock = dataclasses.replace(ticks.clock(), poll=1.0, show=10.0)
    shown: list[AttemptRestarting] = []
    runner.subscribe(lambda e: shown.append(e) if isinstance(e, AttemptRestarting) else None)
    runner.subscribe(Printer(out=io.StringIO(), err=err, colour=False))
    board = Board()
    runner.subscribe(board.apply)

    def drive() -> None:
        fail(fake, 1)
        fake.wait_started(JOB, 0, 2).exit(0)
        fake.wait_started(JOB, 1, 2).exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok
    assert len([note for note in board.notes if "· restarting at " in note]) == 1, board.notes
    assert len(shown) == 3  # the owner counts down: at 30, 20 and 10 s
    lines = err.getvalue().splitlines()
    first = lines[:next(i for i, line in enumerate(lines) if "started attempt 2" in line)]
    restarting = [line for line in first if line.startswith("clusterrun: attempt 1 failed: ")]
    at = shown[0].at
    assert restarting == [f"clusterrun: attempt 1 failed: torchrun on node 1 (h1): exit code 1 · restarting at "
                          f"{iso(at)[11:]} (in {shown[0].remaining:.0f} s) as attempt 2 (restart 1 of 1; "
                          "`clusterrun down` cancels)"], lines
    assert first.count("clusterrun: node1 h1: failed (exit code 1)") == 1, lines
    runner.close()


def down_now(store: JobStore):  # type: ignore[no-untyped-def]
    """``attempt.stop`` of the recorded job now, as ``clusterrun down`` makes it."""
    record = store.load(JOB)
    return stop(store, record, spec=Opened(record).spec())
