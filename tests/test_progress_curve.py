"""The loss curve: bounded and evenly spread on a days-long run, a checkpoint's resume and an epoch's new bar,
carried across attempts by the record, and to ``ps --json`` and the dashboard's sparkline."""

from __future__ import annotations

from pathlib import Path

from clusterrun.agent.progress import POINTS as AGENT_POINTS
from clusterrun.agent.progress import Curve, Tracker
from clusterrun.core.events import JobState, ProgressChanged
from clusterrun.core.progress import POINTS, Progress, thin
from clusterrun.life.recorder import Recorder
from clusterrun.store.jobjson import progress_of
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.views.board import Board
from clusterrun.views.joblist import job_json


def test_the_agent_and_the_controller_keep_as_many_points() -> None:
    assert AGENT_POINTS == POINTS  # the agent is stdlib-only: its own constant, held to the controller's


def test_a_days_long_run_keeps_a_bounded_curve_evenly_spread_over_all_of_it() -> None:
    curve = Curve()
    steps = 1_000_000  # a step a tenth of a second for a day and more
    for step in range(1, steps + 1):
        curve.add(step, 10.0 / step, None)
    shown = curve.to_json()
    points = [p[0] for p in shown["points"]]
    assert POINTS // 2 <= len(points) <= POINTS
    assert points[0] == 1 and shown["latest"] in (None, [steps, 1e-05])
    assert (Progress.from_json({"step": steps, "curve": shown}) or Progress()).curve[-1] == (steps, 1e-05)
    gaps = [b - a for a, b in zip(points, points[1:], strict=False)]
    assert max(gaps) <= 2 * min(gaps)  # evenly spread, not the start's detail and then nothing


def test_the_curve_keeps_six_significant_digits_of_each_loss_the_latest_too() -> None:
    curve = Curve()
    for step in range(1, AGENT_POINTS + 2):  # one over the bound: every other point dropped, kept 2 steps apart
        curve.add(step, 1 / 3, None)
    curve.add(AGENT_POINTS + 2, 2 / 3, None)  # closer than that to the last kept point: shown, not kept
    shown = curve.to_json()
    assert {y for _, y in shown["points"]} == {0.333333} and shown["latest"] == [AGENT_POINTS + 2, 0.666667]


def test_every_loss_line_is_a_point_until_the_bound() -> None:
    tracker = Tracker()
    losses = [round(2.5 - i / 100, 4) for i in range(1, 41)]
    tracker.feed("".join(f"iter {i}: loss {loss:.4f}, time 45.02ms\n" for i, loss in enumerate(losses, 1)).encode(),
                 100.0)
    progress = Progress.from_json(tracker.to_json())
    assert progress is not None and progress.curve == tuple((float(i), loss) for i, loss in enumerate(losses, 1))
    resumed = Tracker(start=tracker.to_json())  # a monitor that takes over: the curve goes on
    resumed.feed(b"iter 41: loss 2.0000\n", 101.0)
    assert (Progress.from_json(resumed.to_json()) or Progress()).curve[-2:] == ((40.0, 2.1), (41.0, 2.0))


def test_a_resume_from_a_checkpoint_drops_what_came_after_it_and_a_new_epoch_s_bar_goes_on() -> None:
    curve = Curve()
    for step in range(1, 11):
        curve.add(step, 1.0, None)
    curve.add(6, 0.5, None)  # went back to step 5's checkpoint
    assert [p[0] for p in curve.to_json()["points"]] == [1, 2, 3, 4, 5, 6]
    epochs = Curve()
    for epoch in (0, 1):
        for step in range(1, 4):
            epochs.add(step, 1.0 - epoch / 10, float(epoch))
    assert [p[0] for p in epochs.to_json()["points"]] == [1, 2, 3, 4, 5, 6]
    firsts = Curve()  # minGPT-ddp prints a bar's first step only: `Epoch 4 | Iter 0 | Train Loss 2.37`
    for epoch in range(1, 5):
        firsts.add(0, 3.0 - epoch / 2, float(epoch))
    assert firsts.to_json()["points"] == [[0, 2.5], [1, 2.0], [2, 1.5], [3, 1.0]]


def test_the_record_carries_the_earlier_attempts_curves_to_ps_json() -> None:
    first = Progress(step=3, attempt=1, curve=((1, 3.0), (2, 2.0), (3, 1.5)), metrics=(("loss", 1.5),))
    second = Progress(step=2, attempt=2, curve=((1, 2.9), (2, 1.9)), metrics=(("loss", 1.9),)).after(first)
    assert second.series == ((1, 1, 3.0), (1, 2, 2.0), (1, 3, 1.5), (2, 1, 2.9), (2, 2, 1.9))
    again = Progress(step=3, attempt=2, curve=((1, 2.9), (2, 1.9), (3, 1.4))).after(
        Progress.from_json(second.to_json()))  # the same attempt's next reading: the earlier curve stays
    assert again.earlier == first.series
    record = JobRecord("j1", "train", 0.0, "hosts.yaml", "", "train.py", [], {}, "/", 10.0, None, {},
                       attempt=2, state=JobState.RUNNING, progress=second.to_json())
    fresh = {0: {"state": {"state": "running", "progress": {"step": 3, "metrics": {"loss": 1.4},
                                                            "curve": {"points": [[1, 2.9], [2, 1.9], [3, 1.4]]}}}}}
    assert job_json(record, hosts=fresh)["progress"]["loss_curve"] == [
        [1, 1, 3.0], [1, 2, 2.0], [1, 3, 1.5], [2, 1, 2.9], [2, 2, 1.9], [2, 3, 1.4]]
    assert progress_of(record) == second


def test_the_owner_s_recorder_keeps_the_earlier_attempts_curves_under_the_new_one_s(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    first = Progress(step=2, attempt=1, curve=((1, 3.0), (2, 2.0)), metrics=(("loss", 2.0),))
    store.create(JobRecord("j-20261128-100000-abcd", "train", 0.0, "hosts.yaml", "", "train.py", [], {}, "/", 10.0,
                           None, {}, attempt=2, state=JobState.RUNNING, progress=first.to_json()))
    recorder = Recorder(store, "j-20261128-100000-abcd", 2)
    for curve in (((1, 2.9),), ((1, 2.9), (2, 1.9))):  # two readings of attempt 2 (its host knows only its own)
        recorder(ProgressChanged(0, host="h0", progress=Progress(step=len(curve), curve=curve)))
        recorder.flush()
    kept = Progress.from_json(store.load("j-20261128-100000-abcd").progress)
    assert kept is not None and kept.series == ((1, 1, 3.0), (1, 2, 2.0), (2, 1, 2.9), (2, 2, 1.9))


def test_thinning_keeps_each_attempt_s_last_point_and_the_bound() -> None:
    marks = [(a, float(s), 1.0) for a in (1, 2, 3) for s in range(400)]
    kept = thin(marks)
    assert len(kept) <= POINTS and {(1, 399.0, 1.0), (2, 399.0, 1.0), (3, 399.0, 1.0)} <= set(kept)
    assert len(thin([(a, 1.0, 1.0) for a in range(1, 600)])) == POINTS


def test_the_dashboard_s_sparkline_shows_the_host_s_curve_though_it_came_later() -> None:
    board = Board()
    board.apply(ProgressChanged(0, host="h0", progress=Progress(step=3, curve=((1, 3.0), (2, 2.0), (3, 1.5)))))
    assert list(board.losses) == [3.0, 2.0, 1.5]
