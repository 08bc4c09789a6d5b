"""A job opened once per command (``store.opened.Opened``): its recorded hosts file parsed at most once,
shared by the job's later records; and the commands that reconcile a job and ask its hosts (``ps JOB``,
``logs``, ``wait``, ``down``) parse it no more than once each.

Fast: the jobs run on a ``FakeCluster``; the commands run in this process (click's ``CliRunner``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.store import opened
from clusterrun.store.jobs import AttemptRecord, JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster
from tests.test_states import JOB, fake, run, started, store  # noqa: F401 - fixtures

SPARES_TEXT = "hosts:\n  - host: h0\n    nproc: 1\n  - host: h1\n    nproc: 1\nspares:\n  - host: s0\n    nproc: 1\n"


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of every parse of a recorded hosts file from now on."""
    parsed: list[str] = []
    parse = opened.load_cluster_text

    def counted(text: str, path: str) -> ClusterSpec:
        parsed.append(path)
        return parse(text, path)

    monkeypatch.setattr(opened, "load_cluster_text", counted)
    return parsed


def test_a_job_is_parsed_once_for_every_attempt_and_every_later_record(
        fake: FakeCluster, store: JobStore, tmp_path: Path, parses: list[str]) -> None:  # noqa: F811
    runner = started(fake, store, tmp_path, [])
    runner.close()
    parses.clear()  # the owner's own parse
    record = dataclasses.replace(store.load(JOB), hosts_text=SPARES_TEXT)
    record.attempts.append(AttemptRecord(2, started=1.0, master_port=29500, replaced={"h1": "s0"}))
    record.attempt = 2
    job = Opened(record)
    assert parses == []  # nothing parsed until a spec is asked for
    assert [h.host for h in job.spec().hosts] == ["h0", "s0"]  # the current attempt's spare in its place
    assert [h.host for h in job.spec(1).hosts] == ["h0", "h1"]
    later = job.with_record(dataclasses.replace(record, state="stopped"))
    assert [h.host for h in later.spec().hosts] == ["h0", "s0"] and later.record.state == "stopped"
    assert len(parses) == 1
    other = job.with_record(dataclasses.replace(record, job_id="another"))
    other.spec()
    assert len(parses) == 2  # another job's record is parsed on its own


def test_the_commands_parse_the_hosts_file_at_most_once_each(
        fake: FakeCluster, store: JobStore, tmp_path: Path, parses: list[str]) -> None:  # noqa: F811
    """A job nobody owns (adopted: every command reconciles it with its hosts): ``ps JOB`` reconciles
    and asks the hosts, ``logs`` reconciles, plans and reads every node's log, ``wait`` reconciles
    at every look, ``down`` stops every node; each parses the recorded hosts file once."""
    runner = started(fake, store, tmp_path, [])
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    runner.recorder.flush()
    runner.close()
    store.release(runner.owner_fd)  # type: ignore[arg-type]
    store.update(JOB, lambda r: setattr(r, "adopted", True))
    for args in (["ps", JOB], ["logs", JOB], ["wait", "--timeout", "1", JOB], ["down", JOB]):
        parses.clear()
        result = run(*args)
        assert result.exit_code in (0, 124), (args, result.output)
        assert len(parses) == 1, (args, parses)
