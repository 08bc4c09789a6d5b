"""Training progress end to end: a real DDP training (gloo) whose rank 0 reports progress as tqdm,
Lightning, HuggingFace Trainer, nanoGPT, torchtitan and pytorch/examples do; `ps JOB`, `ps JOB --json`
and `ps` show its step, total, rate, loss and ETA while it runs, and the summary its last reading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SUPPORT, job_id_of, wait_for, write_hosts

pytestmark = pytest.mark.integration

STEPS = 40


def clusterrun(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def progress_of(job: str) -> dict[str, Any] | None:
    shown = clusterrun("ps", job, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["jobs"][0]["progress"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("fmt", ["tqdm", "lightning", "hf", "nanogpt", "torchtitan", "examples"])
def test_ps_shows_a_real_training_s_progress_while_it_runs_and_the_summary_its_end(
        fmt: str, tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir, python=sys.executable)
    gate = tmp_path / "go"
    started = clusterrun("up", "-d", hosts, SUPPORT / "progress_train.py", "--", fmt, str(STEPS), gate)
    assert started.returncode == 0, started.stderr
    job = job_id_of(started.stderr)
    scale = 64 if fmt == "examples" else 1  # pytorch/examples counts samples, not steps

    def halfway() -> dict[str, Any] | None:  # every rank waits at the gate: the reading of step STEPS / 2
        shown = progress_of(job)
        known = shown is not None and shown["step"] == STEPS // 2 * scale
        return shown if known and any(k in shown["metrics"] for k in ("loss", "train_loss")) else None

    try:
        half = wait_for(halfway, timeout=180, what=f"the progress of step {STEPS // 2}")
        assert half["attempt"] == 1 and half["per_second"] > 0, half
        if fmt not in ("nanogpt", "torchtitan"):  # they print no total
            assert half["total"] == STEPS * scale and half["eta_seconds"] is not None, half
        text = clusterrun("ps", job).stdout
        assert f"progress: step {half['step']}" in text and "loss" in text, text
        assert "PROGRESS" in clusterrun("ps").stdout.splitlines()[0]
        # the loss curve: a point per loss printed (the HF Trainer logs every 5th step), the last one the reading's
        curve = half["loss_curve"]
        assert [a for a, _, _ in curve] == [1] * len(curve) and len(curve) >= (STEPS // 2) // 5, curve
        steps = [s for _, s, _ in curve]
        assert steps == sorted(steps) and steps[-1] == half["step"], curve
        loss = half["metrics"].get("loss", half["metrics"].get("train_loss"))
        assert curve[-1][2] == loss, (curve, half)
    finally:
        gate.touch()
    ended = clusterrun("wait", job)
    assert ended.returncode == 0, ended.stdout + ended.stderr
    final = progress_of(job)
    assert final is not None and final["step"] == STEPS * (64 if fmt == "examples" else 1), final
