"""``life.launch.first_attempt``: up's new job checked, named, recorded and owned, on the fake
cluster; what it shows goes through a recording view."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import ClusterSpec, load_cluster_text
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import JobState
from clusterrun.life.launch import Checked, Holder, NewJob, first_attempt
from clusterrun.store.jobs import JobStore
from clusterrun.store.preparing import live
from clusterrun.sync.copy import Progress, SyncProgress, SyncReport
from clusterrun.transports.fake import FakeCluster


class Seen:
    """A ``LaunchView`` that keeps what it was told and answers ``holder`` from ``held``."""

    def __init__(self, held: Mapping[str, Holder] | None = None) -> None:
        self.held = dict(held or {})
        self.notes: list[str] = []
        self.asked: list[str] = []
        self.preparing_when_asked: list[list[str]] = []
        self.plans: list[Checked] = []
        self.reports: list[Mapping[int, SyncReport]] = []

    def note(self, text: str) -> None:
        self.notes.append(text)

    @contextmanager
    def syncing(self) -> Iterator[Progress]:
        def progress(p: SyncProgress) -> None:
            pass

        yield progress

    def synced(self, reports: Mapping[int, SyncReport]) -> None:
        self.reports.append(reports)

    def planned(self, checked: Checked) -> None:
        self.plans.append(checked)

    def holder(self, name: str) -> Holder | None:
        self.asked.append(name)
        return self.held.get(name)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobStore:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return JobStore()


def spec_of(tmp_path: Path, hosts: str = "  - host: h0\n    workdir: /proj\n  - host: h1\n    workdir: /proj\n"
            ) -> ClusterSpec:
    return load_cluster_text(f"hosts:\n{hosts}", str(tmp_path / "hosts.yaml"))


def new_job(tmp_path: Path, **options: object) -> NewJob:
    return NewJob(hosts_file=str(tmp_path / "hosts.yaml"), hosts_text="hosts: []\n", script="train.py",
                  script_args=("--lr", "0.1"), overrides={}, local_cwd=str(tmp_path), ssh_config=None,
                  **options)  # type: ignore[arg-type]


def test_a_new_job_is_named_checked_recorded_and_owned_not_started(tmp_path: Path, store: JobStore) -> None:
    """The script's name taken by a running job: the job is named NAME-2 (said once), its hosts
    checked, its record made in ``starting`` and owned by the runner handed back; nothing runs
    yet and the preparing note is gone (the record tells of the job now)."""
    fake, view = FakeCluster(), Seen({"train": Holder("train-20261129-010101-abcd", "running")})
    spec = spec_of(tmp_path)
    launched = first_attempt(new_job(tmp_path), spec, [fake.transport(h) for h in spec.hosts], store, view, None)
    assert launched is not None
    try:
        record = store.load(launched.plan.job_id)
        assert (record.name, record.state, record.script_args) == ("train-2", JobState.STARTING, ["--lr", "0.1"])
        assert launched.runner.record.job_id == record.job_id and store.owned(record.job_id)
        assert view.asked == ["train", "train-2"]
        assert view.notes == ["'train' is running (job train-20261129-010101-abcd): this job is named 'train-2'"]
        assert not fake.nodes and not live()
    finally:
        launched.runner.close()
        if launched.runner.owner_fd is not None:
            store.release(launched.runner.owner_fd)


def test_a_missing_script_is_refused_before_the_name_is_looked_at(tmp_path: Path, store: JobStore) -> None:
    """The script is looked for first (a local host's workdir): a refusal asks nobody about the
    name, leaves no preparing note and records nothing."""
    view = Seen({"train": Holder("train-1", "running")})
    spec = spec_of(tmp_path, f"  - host: localhost\n    transport: local\n    workdir: {tmp_path}\n")
    with pytest.raises(ConfigError, match="train.py does not exist"):
        first_attempt(new_job(tmp_path, name="train"), spec, [], store, view, None)
    assert view.asked == [] and not live() and store.scan() == ([], [])


def test_a_name_given_that_a_job_holds_is_refused_and_nothing_is_made(tmp_path: Path, store: JobStore) -> None:
    fake, view = FakeCluster(), Seen({"train": Holder("train-1", "preparing", "node 1 (h1): setup runs")})
    spec = spec_of(tmp_path)
    with pytest.raises(ConfigError, match=r"job train-1, named 'train', is being prepared by another `clusterrun up` "
                       r"\(it said: node 1 \(h1\): setup runs\); nothing was started"):
        first_attempt(new_job(tmp_path, name="train"), spec, [fake.transport(h) for h in spec.hosts], store, view,
                      None)
    assert not fake.requests and not live() and store.scan() == ([], [])


def test_a_dry_run_shows_the_plan_and_makes_nothing(tmp_path: Path, store: JobStore) -> None:
    """A dry run asks nobody about the name (nothing will hold it), shows the checked plan and
    records nothing."""
    fake, view = FakeCluster(), Seen({"train": Holder("train-1", "running")})
    spec = spec_of(tmp_path)
    assert first_attempt(new_job(tmp_path, dry_run=True), spec, [fake.transport(h) for h in spec.hosts], store, view,
                         None) is None
    (checked,) = view.plans
    assert checked.plan.name == "train" and checked.plan.nnodes == 2 and view.asked == []
    assert not fake.nodes and not live() and store.scan() == ([], [])
