"""Notifications when a process dies on the way: claimed, then sent, each event with one id.

Real processes (the sender is ``clusterrun _notify``), fake hosts: a claimant SIGKILLed before
its command ran leaves the event to the next process that looks, which sends it once; a sender
SIGKILLed after its command ran but before it recorded "sent" makes one repeat with the same id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from clusterrun.cli import main
from clusterrun.config.watch import Notify
from clusterrun.core.events import JobState
from clusterrun.life import notify
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.joblist import job_json
from tests import test_runner
from tests.test_orchestrator import JOB
from tests.test_watch import _owned, _until

fake, store = test_runner.fake, test_runner.store  # the fixtures: a FakeCluster, a JobStore in tmp_path
ROOT = Path(__file__).resolve().parent.parent


def _failed_job(fake: FakeCluster, store: JobStore, tmp_path: Path, command: str) -> JobRecord:
    """A job whose attempt 1 failed, its ``failed`` event not sent yet, ``command`` its notify command."""
    _owned(fake, store, tmp_path, None, notify_with=Notify(command, on=("failed",))).close()

    def ended(rec: JobRecord) -> None:
        rec.state = rec.attempts[0].state = JobState.FAILED

    return store.update(JOB, ended)


def _notice(store: JobStore) -> notify.Notice:
    return notify.notices(store.load(JOB))["1:failed"]


def test_a_claimant_killed_before_its_command_leaves_the_event_to_the_next_which_sends_it_once(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    out = tmp_path / "sent"
    record = _failed_job(fake, store, tmp_path, f'echo "$CLUSTERRUN_EVENT_ID" >> {out}')
    claim_and_die = ("import os, signal, sys; from pathlib import Path; from clusterrun.life import notify; "
                     "from clusterrun.store.jobs import JobStore; s = JobStore(Path(sys.argv[1])); "
                     "assert notify.claim(s, s.load(sys.argv[2]))[1]; os.kill(os.getpid(), signal.SIGKILL)")
    died = subprocess.run([sys.executable, "-c", claim_and_die, str(store.root), JOB], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert died.returncode == -9, died.stderr
    assert _notice(store).state == "claimed" and _notice(store).orphaned and not out.exists()
    assert [d.key for d in notify.due(store.load(JOB))] == ["1:failed"]
    assert notify.send_due(store, record) == ["1:failed"]  # the successor (a monitor, or `ps`)
    _until(lambda: _notice(store).state == "sent")
    assert out.read_text().splitlines() == [f"{JOB}:1:failed"]
    assert notify.send_due(store, store.load(JOB)) == [] and _notice(store).tries == 2


def test_a_sender_killed_after_its_command_but_before_sent_makes_one_repeat_with_the_same_id(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    out, once = tmp_path / "sent", tmp_path / "killed-once"
    # the command itself kills its sender ($PPID) after it has sent, the first time only
    command = f'echo "$CLUSTERRUN_EVENT_ID" >> {out}; [ -e {once} ] || {{ touch {once}; kill -9 $PPID; }}'
    record = _failed_job(fake, store, tmp_path, command)
    assert notify.send_due(store, record) == ["1:failed"]
    _until(lambda: once.exists() and _notice(store).orphaned)
    assert _notice(store).state == "claimed"  # it never recorded "sent"
    assert notify.send_due(store, store.load(JOB)) == ["1:failed"]
    _until(lambda: _notice(store).state == "sent")
    assert out.read_text().splitlines() == [f"{JOB}:1:failed"] * 2  # a receiver drops the repeated id
    assert notify.send_due(store, store.load(JOB)) == []


def test_a_failing_command_is_recorded_and_reported_once_not_retried(fake: FakeCluster, store: JobStore,
                                                                     tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    record = _failed_job(fake, store, tmp_path, f"echo run >> {runs}; echo 'webhook said 403' >&2; exit 7")
    notes: list[str] = []
    assert notify.send_due(store, record, notes.append) == ["1:failed"]
    _until(lambda: bool(notes))
    assert notes == ["notify command for failed exited 7: webhook said 403"]
    notice = _notice(store)
    assert (notice.state, notice.code, notice.error) == ("failed", 7, "webhook said 403")
    assert notify.send_due(store, store.load(JOB), notes.append) == [] and runs.read_text() == "run\n"
    assert job_json(store.load(JOB))["notifications"] == [  # ps --json (and ps JOB says it in words)
        {"id": f"{JOB}:1:failed", "state": "failed", "exit_code": 7, "error": "webhook said 403"}]


def test_the_command_gets_the_event_id_in_its_environment_and_on_stdin(fake: FakeCluster, store: JobStore,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "sent"
    record = _failed_job(fake, store, tmp_path, f'(echo "$CLUSTERRUN_EVENT_ID"; cat) > {out}')
    notify.send_due(store, record)
    _until(lambda: _notice(store).state == "sent")
    first, summary = out.read_text().split("\n", 1)
    assert first == f"{JOB}:1:failed"
    assert json.loads(summary)["event_id"] == first and json.loads(summary)["event"] == "failed"


def test_ps_job_shows_a_notification_that_failed(fake: FakeCluster, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    store = JobStore()  # the one `ps` reads
    record = _failed_job(fake, store, tmp_path, "echo 'webhook said 403' >&2; exit 7")
    notify.send_due(store, record)
    _until(lambda: _notice(store).state == "failed")
    shown = CliRunner().invoke(main, ["ps", JOB])
    assert shown.exit_code == 0, shown.output
    assert f"notification {JOB}:1:failed: exited 7: webhook said 403\n" in shown.output


class _HeldSender:
    """A sender's process as ``notify.start`` waits for it: it "ends" (killed) when ``ended`` is set."""

    def __init__(self) -> None:
        self.ended, self.returncode, self.pid = threading.Event(), -9, 0

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        self.ended.wait()
        return b"", b""


def test_a_late_waiter_of_a_dead_sender_leaves_the_same_process_s_next_claim_alone(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose sender died claims the event again; the thread that waited for the dead
    sender, late, must not take that new claim for its own unsent one (it wrote "failed", and the
    new sender found nothing to send)."""
    record = _failed_job(fake, store, tmp_path, "true")
    senders: list[_HeldSender] = []

    def held(*args: object, **kwargs: object) -> _HeldSender:
        senders.append(_HeldSender())
        return senders[-1]

    monkeypatch.setattr(notify.subprocess, "Popen", held)
    before = set(threading.enumerate())
    assert notify.send_due(store, record) == ["1:failed"]
    first = [t for t in threading.enumerate() if t not in before]

    def taken_by_a_dead_sender(rec: JobRecord) -> None:  # it took the claim over, ran the command, was killed
        rec.notices["1:failed"] = dict(rec.notices["1:failed"], by=f"{2**22 + 1} 1")

    store.update(JOB, taken_by_a_dead_sender)
    assert _notice(store).orphaned
    assert notify.send_due(store, store.load(JOB)) == ["1:failed"]  # claimed again, by this process
    senders[0].ended.set()  # the first sender's waiter runs only now
    for thread in first:
        thread.join(10)
    assert not any(t.is_alive() for t in first)
    assert (_notice(store).state, _notice(store).tries) == ("claimed", 2)  # left to its own sender
    second = [t for t in threading.enumerate() if t not in before and t not in first]
    senders[1].ended.set()
    for thread in second:  # it writes what its own sender left: done before the test's files go
        thread.join(10)
    assert _notice(store).state == "failed"  # its sender "died" before it took the claim over
