"""The hosts' setup, watched: which nodes are still in it and for how long, and a setup that
never ends failing the start with the node and its last lines (fake hosts; no sleeps: the
watch's clock and waits are the test's)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.config.environment import resolve
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.config.watch import Watch
from clusterrun.core.errors import HostsUnavailable
from clusterrun.core.events import Event, JobNote
from clusterrun.life.attempt import restart
from clusterrun.life.recorder import new_record
from clusterrun.run import setups
from clusterrun.run.orchestrator import Job
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster
from tests import test_runner
from tests.test_orchestrator import JOB

fake, store = test_runner.fake, test_runner.store  # the fixtures: a FakeCluster, a JobStore in tmp_path


def test_the_note_names_the_nodes_still_in_their_setup_and_those_ready() -> None:
    hosts = {0: "gpu01", 1: "gpu02", 2: "gpu03", 3: "gpu04"}
    assert setups.progress_text(hosts, {3}, 45, 600) == \
        "node 3 (gpu04): setup runs for 45 s (killed at 10 min 0 s); nodes 0-2 ready"
    assert setups.progress_text(hosts, {0, 1, 2, 3}, 130, 600).startswith(
        "nodes 0 (gpu01), 1 (gpu02), 2 (gpu03), 3 (gpu04): setup runs for 2 min 10 s")


def _job(fake: FakeCluster, setup_timeout: float) -> Job:
    spec = load_cluster_text("setup_timeout: 10m\ndefaults:\n  setup: ./fetch-data.sh\nhosts: [h0, h1, h2]\n")
    assert spec.watch.setup_timeout == 600
    spec, _ = resolve(spec, {})
    spec = spec.__class__(**{**vars(spec), "watch": Watch(setup_timeout=setup_timeout)})
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    job.prepare(run_setup=False)
    return job


class Ticks:
    """The watch's clock: 45 s pass at its first wait, which returns at once; at the second,
    ``then`` runs and the wait lasts until the setups ended (the test's bound, not a pace)."""

    def __init__(self, then: Callable[[], None] | None = None) -> None:
        self.clock = itertools.count(1000, 45)
        self.then = then
        self.waits = 0

    def now(self) -> float:
        return float(next(self.clock))

    def wait(self, ended: threading.Event, seconds: float) -> bool:
        self.waits += 1
        if self.waits == 1:
            return ended.is_set()
        if self.then is not None:
            self.then()
        return ended.wait(30)


def test_a_setup_that_never_ends_fails_the_start_naming_the_node_and_its_last_lines() -> None:
    fake = FakeCluster()
    fake.host("h1").setup_blocks = True
    job = _job(fake, setup_timeout=0.5)
    notes: list[Event] = []
    ticks = Ticks()
    try:
        with pytest.raises(HostsUnavailable) as info:
            setups.run(job, notes.append, now=ticks.now, wait=ticks.wait)
    finally:
        job.close()
    text = info.value.render()
    assert "h1: node 1: setup did not finish within 0.5 s (killed); nothing was started" in text, text
    assert "  | waiting for the data set" in text and "h0" not in text.split("\n", 1)[1]
    assert fake.ops("setup", "h1")[0]["setup_timeout"] == 0.5 and fake.ops("start") == []
    shown = [e.text for e in notes if isinstance(e, JobNote)]
    assert shown and "1 (h1)" in shown[0] and ": setup runs for 45 s (killed at 0 s)" in shown[0], shown


def test_a_slow_setup_is_shown_while_it_runs_and_the_start_goes_on_once_it_ends() -> None:
    fake = FakeCluster()
    fake.host("h1").setup_blocks = True

    def release() -> None:
        with fake.changed:
            fake.host("h1").setup_blocks = False
            fake.changed.notify_all()

    job = _job(fake, setup_timeout=600)
    notes: list[Event] = []
    ticks = Ticks(release)
    try:
        setups.run(job, notes.append, now=ticks.now, wait=ticks.wait)
        job.start()
    finally:
        job.close()
    shown = [e.text for e in notes if isinstance(e, JobNote)]
    assert len(shown) == 1 and "1 (h1)" in shown[0] and "setup runs for 45 s (killed at 10 min 0 s)" in shown[0]
    assert len(fake.ops("setup")) == 3 and len(fake.ops("start")) == 3


def test_a_restarts_setup_runs_before_its_stop_and_says_which_nodes_are_still_in_it(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next attempt's setup runs in its checks, while attempt 1 runs on; the restart's
    consumer hears which nodes are still in it (the note releases the blocked setup)."""
    # setup_timeout: a restart whose note never comes fails in 30 s instead of hanging
    text = "setup_timeout: 30s\ndefaults:\n  setup: ./fetch-data.sh\nhosts: [h0, h1]\n"
    (tmp_path / "hosts.yaml").write_text(text)
    (tmp_path / "train.py").write_text("")
    spec, _ = resolve(load_cluster_text(text, str(tmp_path / "hosts.yaml")), {})
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path))
    try:
        plan = job.prepare()
        job.start()
    finally:
        job.close()
    store.create(new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=text, env_overrides={},
                            local_cwd=str(tmp_path), ssh_config=None, watch=spec.watch))
    monkeypatch.setattr(setups, "FIRST", 0.0)
    fake.host("h1").setup_blocks = True
    seen: list[tuple[str, bool]] = []

    def emit(event: Event) -> None:
        if isinstance(event, JobNote) and "setup runs for" in event.text:
            seen.append((event.text, fake.node(JOB, 1, 1).running))
            with fake.changed:
                fake.host("h1").setup_blocks = False
                fake.changed.notify_all()

    restart(store, store.load(JOB), emit, recorded=Opened(store.load(JOB)).spec())
    assert seen and "1 (h1)" in seen[0][0] and seen[0][1], seen  # attempt 1 still ran then
    assert fake.wait_started(JOB, 1, 2).running and not fake.node(JOB, 1, 1).running
    assert [op["attempt"] for op in fake.ops("setup", "h1")] == [1, 2]  # once per attempt
