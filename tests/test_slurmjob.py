"""The record of a job of ``up --from-slurm`` (``slurmjob``), without Slurm: what ``ps`` says of
one whose ``up`` is gone, by what Slurm lists (``steps``) or where Slurm cannot be asked."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
from pathlib import Path

import pytest

from clusterrun.core.events import Event, JobFinished, JobState, LogLines, NodeState
from clusterrun.slurm.job import SLURM, hosts_text, refresh, slurm_record
from clusterrun.slurm.step import SlurmStep, launch_plan
from clusterrun.store.jobs import JobRecord, JobStore, process_id, restart_pending
from clusterrun.store.slurmlogs import LogFiles, SlurmFollower, node_dir, read_chunks
from clusterrun.views.joblist import job_state_text

STEP = SlurmStep(job_id="t-20261125-000000-abcd", name="t", script="t.py", script_args=(), argv=("srun",), env={},
                 nodes=("n1", "n2"), nprocs=(2, 2), master_addr="n1", master_port=20001)


def _recorded(tmp_path: Path) -> tuple[JobStore, JobRecord]:
    plan = launch_plan(STEP)
    record = slurm_record(plan, STEP, allocation="41", hosts_file=None, env_overrides={}, grace=3.0)
    store = JobStore(tmp_path / "jobs")
    store.create(record)
    store.update(record.job_id, lambda rec: setattr(rec, "state", JobState.RUNNING))
    return store, store.load(record.job_id)


def test_the_record_names_the_engine_the_allocation_and_the_nodes(tmp_path: Path) -> None:
    store, record = _recorded(tmp_path)
    assert (record.engine, record.slurm and record.slurm["job"], record.hosts, record.grace) == (
        SLURM, "41", ["n1", "n2"], 3.0)
    assert hosts_text(STEP).count("nproc: 2") == 2


def test_an_owned_record_is_left_as_its_up_writes_it(tmp_path: Path) -> None:
    store, record = _recorded(tmp_path)
    owner = store.try_own(record.job_id)
    try:
        assert refresh(store, record, steps=lambda: []) is record
    finally:
        assert owner is not None
        store.release(owner)


def test_a_step_slurm_still_runs_is_running_unwatched(tmp_path: Path) -> None:
    store, record = _recorded(tmp_path)
    now = refresh(store, record, steps=lambda: [record.job_id])
    assert now.state is JobState.RUNNING
    assert job_state_text(now, 0).startswith("running; its `up --from-slurm` (pid ")
    assert "Slurm still runs its step, and no more of its output is kept" in job_state_text(now, 0)


def test_a_step_slurm_no_longer_lists_is_lost(tmp_path: Path) -> None:
    store, record = _recorded(tmp_path)
    now = refresh(store, record, steps=lambda: ["another-job"])
    assert now.state is JobState.LOST
    assert {n.state for n in now.nodes} == {NodeState.LOST}
    assert "no longer runs its step: how it ended is not known here (`sacct -j 41` says)" in str(now.nodes[0].error)


def test_without_slurm_here_the_record_says_it_could_not_be_checked(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue
    store, record = _recorded(tmp_path)
    now = refresh(store, record)
    assert now.state is JobState.RUNNING
    assert "whether Slurm still runs its step could not be checked here" in job_state_text(now, 0)


def test_the_kept_logs_are_read_in_whole_lines_with_their_times_and_followed_to_the_end(tmp_path: Path) -> None:
    store, record = _recorded(tmp_path)
    kept = LogFiles(store, record.job_id, 1, warn=lambda text: None)
    kept(LogLines(1, host="n2", lines=("[rank2]:one", "[rank3]:two")))
    kept(LogLines(1, host="n2", lines=("[rank2]:three",)))
    kept.close()
    log = node_dir(store, record.job_id, 1, 1) / "output.log"
    with open(log, "ab") as f:
        f.write(b"[rank3]:partial")  # a line still being written
    chunks = list(read_chunks(store, record, 1, 1))
    assert "".join(c.data for c in chunks) == "[rank2]:one\n[rank3]:two\n[rank2]:three\n"
    assert [t[0] for c in chunks for t in c.times] == [0, 24]  # one entry per write, at its offset
    assert "".join(c.data for c in read_chunks(store, record, 1, 1, tail=1)) == "[rank2]:three\n"
    assert list(read_chunks(store, record, 0, 1)) == []  # node 0 wrote nothing

    ended = store.update(record.job_id, lambda rec: setattr(rec, "state", JobState.SUCCEEDED))
    events: list[Event] = []
    follower = SlurmFollower(store, record, events.append, attempt=1, ranks=[1], tail=1, reload=lambda: ended)
    result = follower.run()
    assert [e.lines for e in events if isinstance(e, LogLines)] == [("[rank2]:three", "[rank3]:partial")]
    assert isinstance(events[-1], JobFinished) and events[-1].result == result  # the end, as over SSH
    assert result is not None and result.job_id == record.job_id


def test_a_record_over_ssh_is_written_without_the_slurm_fields_and_a_slurm_one_with_them(tmp_path: Path) -> None:
    store, record = _recorded(tmp_path)
    assert (record.to_json()["engine"], record.to_json()["slurm"]["job"]) == ("slurm", "41")
    over_ssh = dataclasses.replace(record, engine="ssh", slurm=None)
    assert "engine" not in over_ssh.to_json() and "slurm" not in over_ssh.to_json()  # as older clusterruns wrote it
    assert JobRecord.from_json(over_ssh.to_json()).engine == "ssh"


def test_a_restart_is_pending_while_its_process_lives_and_before_its_deadline(tmp_path: Path) -> None:
    """The mark ``restart`` writes before it stops a Slurm job's step: a viewer waits for the next
    attempt while it holds; a restart that died, or ran past its deadline, is waited for no more."""
    _, record = _recorded(tmp_path)
    assert record.slurm is not None and not restart_pending(record)
    here, gone = socket.gethostname(), subprocess.Popen(["true"])
    gone.wait()
    record.slurm["restarting"] = {"process": process_id(), "host": here, "until": 1000.0}
    assert restart_pending(record, now=999.0) and not restart_pending(record, now=1000.0)
    record.slurm["restarting"] = {"process": process_id(gone.pid), "host": here, "until": 1000.0}
    assert not restart_pending(record, now=999.0)  # its process is gone
    record.slurm["restarting"] = {"process": process_id(gone.pid), "host": "elsewhere", "until": 1000.0}
    assert restart_pending(record, now=999.0)  # another machine's: its deadline alone
    record.slurm["restarting"] = None
    assert not restart_pending(record, now=999.0)

