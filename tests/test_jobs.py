"""The controller's job records: naming jobs, and a state directory that cannot be written."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterrun.errors import JobNotFound
from clusterrun.jobs import JobRecord, JobStore


def record(job_id: str, name: str, created: float, state: str = "running") -> JobRecord:
    return JobRecord(job_id=job_id, name=name, created=created, hosts_file="hosts.yaml", hosts_text="",
                     script="train.py", script_args=[], env_overrides={}, local_cwd="/", grace=1.0,
                     ssh_config=None, plan={}, state=state)


def test_a_name_of_several_jobs_is_ambiguous_and_lists_their_ids(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    store.create(record("dup-20261123-100000-aaaa", "dup", 1.0, state="succeeded"))
    store.create(record("dup-20261123-110000-bbbb", "dup", 2.0))
    store.create(record("solo-20261123-110000-cccc", "solo", 3.0))
    with pytest.raises(JobNotFound) as ambiguous:
        store.resolve("dup")
    text = ambiguous.value.render()
    assert ("'dup' is ambiguous: it matches 2 jobs named 'dup': dup-20261123-110000-bbbb (running), "
            "dup-20261123-100000-aaaa (succeeded)") in text
    assert "hint: name the job by its id" in text
    assert store.resolve("dup-20261123-100000-aaaa") == "dup-20261123-100000-aaaa"
    assert store.resolve("dup-20261123-11") == "dup-20261123-110000-bbbb"
    assert store.resolve("solo") == "solo-20261123-110000-cccc"
    with pytest.raises(JobNotFound, match="matches 2 jobs: "):
        store.resolve("dup-2026")
