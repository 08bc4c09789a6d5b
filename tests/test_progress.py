"""Training progress read from a rank's output (clusterrun/agent/progress.py): tqdm's own bars (plain,
Lightning's, HuggingFace Trainer's) and the exact lines of pytorch/examples, nanoGPT, torchtitan and
HuggingFace Trainer's logged dicts; a hosts file's own pattern; and what is not progress."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest
import tqdm

from clusterrun.agent.progress import Tracker, parse
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import Event, JobResult, JobState
from clusterrun.store.jobjson import progress_of
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.board import Board
from clusterrun.views.joblist import job_json, training_text
from clusterrun.views.printer import Printer
from tests.test_orchestrator import JOB
from tests.test_watch import _owned, _until

# Lightning's TQDMProgressBar: this bar_format, "Epoch N" as the description, the metrics as postfix.
LIGHTNING_BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def fed(data: str | bytes, now: float = 100.0, pattern: str | None = None) -> Tracker:
    tracker = Tracker(pattern)
    tracker.feed(data.encode() if isinstance(data, str) else data, now)
    return tracker


def test_a_real_tqdm_bar_fed_in_odd_chunks_ends_at_its_total() -> None:
    out = io.StringIO()
    for _ in tqdm.tqdm(range(1000), file=out, mininterval=0, miniters=1, postfix={"loss": 2.31}):
        pass
    data = out.getvalue().encode()
    tracker = Tracker()
    for i in range(0, len(data), 7):  # any split of the bytes
        tracker.feed(data[i:i + 7], 100.0)
    progress = tracker.to_json()
    assert progress is not None
    assert (progress["step"], progress["total"], progress["metrics"]) == (1000, 1000, {"loss": 2.31})
    assert progress["per_second"] > 0 and progress["eta_seconds"] == 0


def test_tqdm_s_own_meter_gives_step_total_rate_eta_and_postfix() -> None:
    line = tqdm.tqdm.format_meter(n=450, total=1000, elapsed=10, postfix="loss=2.31")
    assert line == " 45%|████▌     | 450/1000 [00:10<00:12, 45.00it/s, loss=2.31]"
    progress = fed("\r" + line).to_json()
    assert progress == {"step": 450, "total": 1000, "per_second": 45.0, "eta_seconds": 12.0,
                        "metrics": {"loss": 2.31}, "updated": 100.0, "unit": "step",
                        "curve": {"points": [[450, 2.31]], "spacing": 0.0, "offset": 0.0, "latest": None}}


def test_a_slow_bar_in_seconds_per_step_and_one_without_a_total() -> None:
    slow = fed(tqdm.tqdm.format_meter(n=3, total=10, elapsed=30, rate=0.1)).to_json()
    assert slow is not None
    assert (slow["step"], slow["total"], slow["per_second"], slow["eta_seconds"]) == (3, 10, 0.1, 70)
    open_ended = fed(tqdm.tqdm.format_meter(n=1200, total=None, elapsed=60, unit_scale=True)).to_json()
    assert open_ended is not None and (open_ended["step"], open_ended["total"]) == (1200, None)


def test_lightning_s_bar_with_its_epoch_and_metrics() -> None:
    out = io.StringIO()
    bar = tqdm.tqdm(range(5), file=out, mininterval=0, desc="Epoch 3", bar_format=LIGHTNING_BAR)
    for _ in bar:
        bar.set_postfix({"v_num": 0, "train_loss": "2.310"})
    bar.close()
    progress = fed(out.getvalue()).to_json()
    assert progress is not None
    assert (progress["step"], progress["total"]) == (5, 5)
    assert progress["metrics"] == {"epoch": 3, "v_num": 0, "train_loss": 2.31}


@pytest.mark.parametrize("line", [
    "{'loss': 2.31, 'grad_norm': 1.234, 'learning_rate': 5e-05, 'epoch': 0.45}",  # transformers < 4.46
    "{'loss': '2.31', 'grad_norm': '1.234', 'learning_rate': '5e-05', 'epoch': '0.45'}",  # floats as '.4g' text
])
def test_huggingface_trainer_s_logged_dict_beside_its_bar(line: str) -> None:
    bar = tqdm.tqdm.format_meter(n=450, total=1000, elapsed=10)
    progress = fed(f"\r{bar}\n{line}\n").to_json()
    assert progress is not None and (progress["step"], progress["total"]) == (450, 1000)
    assert progress["metrics"] == {"loss": 2.31, "grad_norm": 1.234, "learning_rate": 5e-05, "epoch": 0.45}


def test_nanogpt_s_iteration_and_eval_lines() -> None:
    tracker = fed("iter 120: loss 2.3051, time 45.02ms, mfu 12.34%\n")
    progress = tracker.to_json()
    assert progress is not None and (progress["step"], progress["metrics"]) == (120, {"loss": 2.3051})
    assert progress["per_second"] == pytest.approx(1000 / 45.02, rel=1e-3)
    tracker.feed(b"step 200: train loss 2.2365, val loss 2.2367\n", 110.0)
    assert tracker.to_json()["metrics"] == {"loss": 2.3051, "train_loss": 2.2365, "val_loss": 2.2367}  # type: ignore[index]


def test_torchtitan_s_coloured_log_line() -> None:
    line = ("[titan] 2025-03-04 10:00:00,123 - root - INFO - \x1b[31mstep: 10  \x1b[32mloss:  8.1234  "
            "\x1b[38;2;180;60;0mgrad_norm:  1.2345  \x1b[38;2;54;234;195mmemory: 20.51GiB(25.93%)  "
            "\x1b[34mtps: 1,234  \x1b[36mtflops: 12.34  \x1b[35mmfu: 5.67%\x1b[39m\n")
    progress = fed(line).to_json()
    assert progress is not None and (progress["step"], progress["metrics"]) == (10, {"loss": 8.1234})


def test_pytorch_examples_mnist_and_imagenet_lines() -> None:
    mnist = fed("Train Epoch: 1 [640/60000 (1%)]\tLoss: 2.284950\n").to_json()
    assert mnist is not None
    assert (mnist["step"], mnist["total"], mnist["metrics"]) == (640, 60000, {"epoch": 1, "loss": 2.28495})
    imagenet = fed("Epoch: [0][  10/5005]\tTime  0.123 ( 0.456)\tData  0.001 ( 0.002)\tLoss 6.9078e+00 (6.9078e+00)"
                   "\tAcc@1   0.00 (  0.00)\tAcc@5   0.00 (  0.39)\n").to_json()
    assert imagenet is not None
    assert (imagenet["step"], imagenet["total"], imagenet["metrics"]) == (10, 5005, {"epoch": 0, "loss": 6.9078})


def test_ps_cell_names_the_epoch_where_the_step_counts_within_it() -> None:
    from clusterrun.core.progress import Progress

    def cell(line: str, ended: bool = False) -> str:
        progress = Progress.from_json(fed(line).to_json())
        assert progress is not None
        return progress.cell(ended)

    assert cell("[RANK0] Epoch 40 | Iter 0 | Train Loss 0.10710\n") == "epoch 40 loss 0.1071"  # minGPT-ddp
    assert cell("Epoch 3 | Iter 100 | Train Loss 0.5\n") == "epoch 3: 100 loss 0.5"
    evaluated = Progress.from_json(fed("[RANK0] Epoch 40 | Iter 0 | Train Loss 0.10710\n"
                                       "[RANK0] Epoch 40 | Iter 0 | Eval Loss 0.07357\n").to_json())
    assert evaluated is not None and evaluated.loss == 0.1071  # the training's loss, not the evaluation's
    assert evaluated.text() == "epoch 40, train loss 0.1071, eval loss 0.07357"  # its first step says nothing more
    assert cell("Train Epoch: 1 [640/60000 (1%)]\tLoss: 2.284950\n") == "epoch 1: 640/60000 1% loss 2.285"
    assert cell("iter 120: loss 2.3051, time 45.02ms\n") == "120 loss 2.305"  # nanoGPT: no epoch
    assert cell("epoch 3 loss 1.5\n") == "epoch 3 loss 1.5"  # it counts epochs only


def test_pytorch_examples_word_language_model_counts_batches_within_its_epoch() -> None:
    line = "| epoch   1 |   200/ 2983 batches | lr 20.00 | ms/batch 45.60 | loss  7.63 | ppl  2063.10\n"
    progress = fed(line).to_json()
    assert progress is not None
    assert (progress["step"], progress["total"], progress["unit"]) == (200, 2983, "step")
    assert progress["metrics"] == {"epoch": 1, "loss": 7.63}
    assert progress["per_second"] == pytest.approx(1000 / 45.6, rel=1e-3)


def test_a_hosts_file_pattern_wins_and_gives_named_metrics() -> None:
    pattern = r"it=(?P<step>\d+)/(?P<total>\d+) nll=(?P<nll>[\d.]+)"
    progress = fed("it=30/300 nll=1.5 loss 9.9 step 5\n", pattern=pattern).to_json()
    assert progress is not None
    assert (progress["step"], progress["total"], progress["metrics"]) == (30, 300, {"nll": 1.5})
    assert fed("step 5 loss 2.0\n", pattern=pattern).to_json() is None  # the pattern alone decides


@pytest.mark.parametrize("line", [
    "[GPU0] Epoch 0 | Batchsize: 32 | Steps: 64",  # the DDP tutorial: no loss
    "loss of connection to the store, retrying",
    "Step 3 of the set-up done",
    "{'train_runtime': 'n/a'}",
    "x" * 5000 + " step 1 loss 2",
])
def test_lines_that_are_not_progress(line: str) -> None:
    assert parse(line) is None or fed(line + "\n").to_json() is None


def test_a_line_that_counts_epochs_only_says_so() -> None:
    progress = fed("epoch 2/3 loss 0.80064\n").to_json()  # examples/train.py
    assert progress is not None and (progress["step"], progress["total"], progress["unit"]) == (2, 3, "epoch")
    assert progress["metrics"] == {"loss": 0.80064}


def test_the_rate_and_eta_come_from_the_steps_seen_when_the_line_gives_none() -> None:
    tracker = Tracker()
    tracker.feed(b"step 100/1100 loss 3.0\n", 1000.0)
    tracker.feed(b"step 200/1100 loss 2.5\n", 1010.0)
    progress = tracker.to_json()
    assert progress is not None and (progress["per_second"], progress["eta_seconds"]) == (10.0, 90.0)
    tracker.feed(b"step 5/1100 loss 2.4\n", 1020.0)  # counted again from the start: the rate too
    assert tracker.to_json()["per_second"] is None  # type: ignore[index]


def test_a_bar_redrawn_in_place_is_read_before_its_line_ends_and_resumes_from_a_saved_reading() -> None:
    tracker = Tracker()
    assert tracker.feed(("\r" + tqdm.tqdm.format_meter(n=10, total=100, elapsed=1)).encode(), 5.0)
    assert tracker.to_json()["step"] == 10  # type: ignore[index]
    assert not tracker.feed(b"", 6.0)
    resumed = Tracker(start=tracker.to_json())
    assert resumed.to_json()["step"] == 10  # type: ignore[index]


# ------------------------------------------------------------------------------ from the host to `ps`, the summary


def test_the_progress_its_host_reads_reaches_the_record_ps_json_the_summary_and_the_board(tmp_path: Path) -> None:
    fake = FakeCluster()
    store = JobStore(tmp_path / "jobs")
    events: list[Event] = []
    runner = _owned(fake, store, tmp_path, events.append)
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    n0, n1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    n0.start_workers(0)
    n1.start_workers(1)
    reading = {"step": 450, "total": 1000, "per_second": 45.0, "eta_seconds": 12.0, "metrics": {"loss": 2.31},
               "updated": time.time()}
    n0.report_progress(reading)
    _until(lambda: store.load(JOB).progress is not None)
    record = store.load(JOB)
    shown = job_json(record)["progress"]
    assert {k: shown[k] for k in ("step", "total", "per_second", "eta_seconds", "metrics", "attempt")} == {
        "step": 450, "total": 1000, "per_second": 45.0, "eta_seconds": 12.0, "metrics": {"loss": 2.31}, "attempt": 1}
    assert training_text(record, progress_of(record), time.time()) == (
        "step 450/1000 (45%), 45 steps/s, loss 2.31, ETA 12 s")
    n0.report_progress(dict(reading, step=1000, eta_seconds=0.0, metrics={"loss": 1.9}))
    _until(lambda: (store.load(JOB).progress or {}).get("step") == 1000)
    printer_out, printer_err = io.StringIO(), io.StringIO()
    printer = Printer(printer_out, printer_err, colour=False)
    board = Board()
    for event in events:
        printer(event)
        board.apply(event)
    n0.exit(0)
    n1.exit(0)
    thread.join(10)
    runner.close()
    printer.summary(JobResult(JOB, (), root_cause=None))
    assert "progress: step 1000/1000 (100%), 45 steps/s, loss 1.9" in printer_err.getvalue()
    assert board.progress is not None and board.progress.step == 1000 and list(board.losses) == [2.31, 1.9]
    assert training_text(store.load(JOB), progress_of(store.load(JOB)), time.time()) == (
        "step 1000/1000 (100%), 45 steps/s, loss 1.9")  # ended: no ETA


def test_ps_job_prefers_what_node_0_says_now_and_names_an_earlier_attempt_s_reading(tmp_path: Path) -> None:
    record = JobRecord(JOB, "train", 0.0, "hosts.yaml", "", "train.py", [], {}, str(tmp_path), 10.0, None, {},
                       attempt=2, state=JobState.RUNNING,
                       progress={"step": 300, "total": 1000, "metrics": {"loss": 2.5}, "attempt": 1})
    assert training_text(record, progress_of(record), 0.0) == "step 300/1000 (30%), loss 2.5 (attempt 1)"
    fresh = {0: {"state": {"state": "running", "progress": {"step": 310, "total": 1000, "metrics": {"loss": 2.4}}}}}
    assert training_text(record, progress_of(record, fresh), 0.0) == "step 310/1000 (31%), loss 2.4"
    assert job_json(record)["progress"]["attempt"] == 1


def test_a_progress_pattern_in_the_hosts_file_is_checked_with_its_line(tmp_path: Path) -> None:
    spec = load_cluster_text("hosts:\n  - host: h0\nprogress: 'it=(?P<step>\\d+)'\n", "hosts.yaml")
    assert spec.watch.progress == r"it=(?P<step>\d+)"
    with pytest.raises(ConfigError) as bad:
        load_cluster_text("hosts:\n  - host: h0\nprogress: 'it=(?P<step>\\d+'\n", "hosts.yaml")
    assert "hosts.yaml:3" in bad.value.render() and "not a regular expression" in bad.value.render()
    with pytest.raises(ConfigError) as unnamed:
        load_cluster_text("hosts:\n  - host: h0\nprogress: 'it=(\\d+)'\n", "hosts.yaml")
    assert "names no group" in unnamed.value.render()
