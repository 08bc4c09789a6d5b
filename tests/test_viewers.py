"""A viewer (`logs -f`, `attach --no-tui`) at an attempt's end: the job's end, a restart followed to
the next attempt, a stop during the backoff, a detach. Fast: scripted viewers, a record its owner
would move, moved by the test; end to end with real torchrun: ``tests/test_recovery_e2e.py``."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.cli import follow
from clusterrun.core.events import JobResult, JobState, NodeResult, NodeState
from clusterrun.life import lifecycle
from clusterrun.store.jobs import AttemptRecord, JobRecord, JobStore
from clusterrun.store.opened import Opened
from tests.test_joblist import make_record

JOB = "train-20261123-100000-aaaa"


class Scripted:
    """One attempt's viewer: ``then()`` (the owner's moves meanwhile), then ``result`` (None: detached)."""

    def __init__(self, attempt: int, result: JobResult | None, then: Callable[[], None] = lambda: None) -> None:
        self.attempt, self.offsets, self.result, self.then = attempt, {0: 0}, result, then
        self.closed = False

    def run(self) -> JobResult | None:
        self.then()
        return self.result

    def detach(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def ended(state: NodeState) -> JobResult:
    return JobResult(JOB, (NodeResult(0, "a", state, exit_code=1 if state is NodeState.FAILED else 0),))


@pytest.fixture
def store(controller_state: Path, monkeypatch: pytest.MonkeyPatch) -> JobStore:
    monkeypatch.setattr(follow, "_refresh", lambda store, opened: opened)  # no hosts: the record as written
    monkeypatch.setattr(lifecycle, "POLL", 0.01)
    made = JobStore(controller_state / "clusterrun" / "jobs")
    made.create(make_record(JOB, "running", None))
    return made


def moved(store: JobStore, state: JobState, attempt: int | None = None) -> Callable[[], None]:
    """The owner's write: the job in ``state``, and at ``attempt`` (a restart started it)."""
    def change(record: JobRecord) -> None:
        record.state = state
        record.restart_at = 0.0 if state is JobState.RESTARTING else None
        if attempt is not None:
            record.attempt = attempt
            record.attempts.append(AttemptRecord(attempt, started=0.0, master_port=29501, state=state))
    return lambda: None if store.update(JOB, change) else None


def follow_from(store: JobStore, *viewers: Scripted) -> tuple[JobResult | None, list[tuple[str, bool]], list[int]]:
    """``follow_attempts`` from the first viewer, the next ones in turn; what it summed up, whom it followed."""
    summed: list[tuple[str, bool]] = []
    followed: list[int] = []
    rest = list(viewers[1:])

    def next_viewer(opened: Opened) -> Scripted:
        followed.append(opened.record.attempt)
        return rest.pop(0)

    result, _ = follow.follow_attempts(store, Opened(store.load(JOB)), viewers[0],
                                       lambda result, again: summed.append((result.nodes[0].state.value, again)),
                                       next_viewer, [signal.SIGUSR1])
    return result, summed, followed


def test_the_jobs_end_is_summed_up_once(store: JobStore) -> None:
    last = Scripted(1, ended(NodeState.SUCCEEDED), then=moved(store, JobState.SUCCEEDED))
    result, summed, followed = follow_from(store, last)
    assert result is not None and result.ok and summed == [("succeeded", False)] and followed == [] and last.closed


def polled(store: JobStore, *moves: Callable[[], None] | None) -> None:
    """At each of the viewer's looks at the record, the owner's next move first (None: no move yet)."""
    pending = list(moves)
    load = store.load

    def looked(job_id: str) -> JobRecord:
        move = pending.pop(0) if pending else None
        if move is not None:
            store.load = load  # type: ignore[method-assign]  # the owner's write reads the record too
            try:
                move()
            finally:
                store.load = looked  # type: ignore[method-assign]
        return load(job_id)

    store.load = looked  # type: ignore[method-assign]


def test_a_restart_is_followed_to_the_next_attempt_and_its_end(store: JobStore) -> None:
    first = Scripted(1, ended(NodeState.FAILED))
    second = Scripted(2, ended(NodeState.SUCCEEDED))
    # the owner: not decided yet at the first look, then restarting (its backoff), then attempt 2 runs; it ends
    polled(store, None, moved(store, JobState.RESTARTING), None, moved(store, JobState.RUNNING, attempt=2), None,
           moved(store, JobState.SUCCEEDED))
    result, summed, followed = follow_from(store, first, second)
    assert summed == [("failed", True), ("succeeded", False)]  # attempt 1 as an attempt's end, then the job's
    assert followed == [2] and result is not None and result.ok and first.closed and second.closed


def test_a_stop_during_the_backoff_ends_the_following_with_the_jobs_outcome(
        store: JobStore, capsys: pytest.CaptureFixture[str]) -> None:
    polled(store, moved(store, JobState.RESTARTING), None, moved(store, JobState.STOPPED))  # `down` meanwhile
    result, summed, followed = follow_from(store, Scripted(1, ended(NodeState.FAILED)))
    assert summed == [("failed", True)] and followed == [] and result is not None and not result.ok
    err = capsys.readouterr().err
    assert f"job {JOB} is restarting: attempt 2 starts in 0 s" in err and f"job {JOB} stopped (attempt 1)" in err


def test_a_detached_viewer_ends_the_following_without_a_summary(store: JobStore) -> None:
    result, summed, followed = follow_from(store, Scripted(1, None))
    assert result is None and summed == [] and followed == []
