"""What ``ps``, ``ps --json``, ``wait`` and the dashboard say of a job's nodes after a fault: the
same thing, and never ``running`` for a node whose host cannot be reached.

Fast: the jobs run on a ``FakeCluster`` (no processes); the commands run in this process
(click's ``CliRunner``) with the fake as every record's transport.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from clusterrun import cli
from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.events import Event, NodeState
from clusterrun.life import lifecycle, logread
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Runner
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.store.jobs import JobStore
from clusterrun.transports import Transport
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.board import Board
from tests.conftest import wait_for
from tests.test_joblist import documented_schema, violations
from tests.test_orchestrator import JOB, spec_of

HOSTS_TEXT = "hosts:\n  - host: h0\n    nproc: 1\n  - host: h1\n    nproc: 1\n"
SINCE = re.compile(r"unreachable since (\d\d:\d\d:\d\dZ)")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeCluster]:
    cluster = FakeCluster()
    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: cluster.transport)
    monkeypatch.setattr(logread, "transport_factory", lambda record: cluster.transport)  # `logs` reads by it
    monkeypatch.chdir(tmp_path)  # commands move to the job's directory
    yield cluster


@pytest.fixture
def store(controller_state: Path) -> JobStore:
    return JobStore(controller_state / "clusterrun" / "jobs")


def run(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def started(fake: FakeCluster, store: JobStore, tmp_path: Path, events: list[Event]) -> Runner:
    """Job JOB on h0 and h1, owned by a ``Runner`` here (no command reconciles it or starts a monitor)."""
    job = Job(spec_of(2), "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path), reconnect=Reconnect(first=0.01, most=0.02))
    plan = job.prepare()
    (tmp_path / "hosts.yaml").write_text(HOSTS_TEXT)
    record = new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=HOSTS_TEXT, env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None)
    store.create(record)
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, record, job, owner, events.append)
    runner.start()
    return runner


def node_rows(output: str) -> dict[str, str]:
    """``ps JOB``'s node table: each node's STATE cell, by node rank."""
    rows = {}
    for line in output.splitlines():
        found = re.match(r"(\d+)\s+h\d\s+(\S+(?: since \S+)?)", line)
        if found:
            rows[found.group(1)] = found.group(2)
    return rows


def test_an_unreachable_node_is_unreachable_since_the_first_failure_in_ps_json_wait_and_the_dashboard(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    events: list[Event] = []
    runner = started(fake, store, tmp_path, events)
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    wait_for(lambda: all(n.state == NodeState.RUNNING for n in store.load(JOB).nodes), 10, what="both running")
    assert node_rows(run("ps", JOB).output) == {"0": "running", "1": "running"}

    fake.host("h1").drop()  # the owner's follower loses it: the record keeps since when
    since = wait_for(lambda: store.load(JOB).nodes[1].unreachable_since, 10, what="the owner to see h1 unreachable")
    shown = run("ps", JOB)
    assert shown.exit_code == 0, shown.output
    rows = node_rows(shown.output)
    assert rows["0"] == "running" and SINCE.fullmatch(rows["1"]), shown.output
    assert "cannot connect" in shown.output  # the status call's own error
    assert f"job {JOB} (train): running; node 1 {rows['1']}, attempt 1" in shown.output

    listing = run("ps")
    assert f"running; node 1 {rows['1']}" in listing.output, listing.output

    data = json.loads(run("ps", JOB, "--json").stdout)
    assert violations(data, documented_schema("ps")) == []
    node = data["jobs"][0]["nodes"][1]
    assert node["state"] == "unreachable" and node["last_state"] == "running"
    assert node["unreachable_since"].endswith("T" + rows["1"].split()[-1])
    assert data["jobs"][0]["nodes"][0]["unreachable_since"] is None

    waited = run("wait", "--timeout", "0", JOB)
    assert waited.exit_code == 124 and f"is still running; node 1 {rows['1']} after 0 s" in waited.output

    board = Board()
    for event in list(events):
        board.apply(event)
    assert board.nodes[1].status(since + 5) == rows["1"] and board.nodes[0].status(since + 5) == "running"

    assert run("ps", JOB).output == shown.output  # asked again: still since the first failure
    assert store.load(JOB).nodes[1].unreachable_since == since

    fake.host("h1").restore()
    wait_for(lambda: store.load(JOB).nodes[1].unreachable_since is None, 10, what="the owner to reach h1 again")
    assert node_rows(run("ps", JOB).output) == {"0": "running", "1": "running"}
    fake.node(JOB, 0).exit(0)
    fake.node(JOB, 1).exit(0)
    thread.join(10)
    runner.close()
    assert run("wait", JOB).exit_code == 0


def test_a_job_nobody_owns_is_unreachable_since_the_first_ps_that_could_not_reach_it(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = started(fake, store, tmp_path, [])
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    runner.recorder.flush()
    runner.close()
    store.release(runner.owner_fd)  # type: ignore[arg-type]
    store.update(JOB, lambda r: setattr(r, "adopted", True))  # reconciled by each command, never a monitor here
    fake.host("h0").drop()

    first = run("ps", JOB)
    assert first.exit_code == 0, first.output
    rows = node_rows(first.output)
    assert SINCE.fullmatch(rows["0"]) and rows["1"] == "running", first.output
    since = store.load(JOB).nodes[0].unreachable_since
    assert since is not None and run("ps", JOB).output == first.output  # kept from the first failure
    assert store.load(JOB).nodes[0].unreachable_since == since
    real_sleep, paused = time.sleep, []  # the pauses of wait's loop between its looks at the hosts

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_code.co_name == "wait_job":
            paused.append(seconds)
        real_sleep(seconds)

    with monkeypatch.context() as patch:
        patch.setattr(time, "sleep", sleep)
        waited = run("wait", "--timeout", "1", JOB)  # says so while it waits, then when it gives up
    assert paused and sum(paused) <= 1, paused  # gives up when its timeout says, not at its next look after it
    assert waited.exit_code == 124 and waited.output.splitlines() == [
        f"clusterrun: job {JOB} is running; node 0 {rows['0']}",
        f"clusterrun: job {JOB} is still running; node 0 {rows['0']} after 1 s"], waited.output
    downed = run("down", JOB)  # node 1 stops; node 0 cannot be reached, so it may still run
    assert downed.exit_code == 3 and "node 0 (h0) could not be stopped" in downed.output, downed.output
    assert node_rows(run("ps", JOB).output) == {"0": rows["0"], "1": "stopped"}

    fake.host("h0").restore()
    assert node_rows(run("ps", JOB).output) == {"0": "running", "1": "stopped"}
    assert store.load(JOB).nodes[0].unreachable_since is None
    assert run("down", JOB).exit_code == 0 and store.load(JOB).state == "stopped"


@pytest.mark.parametrize("fault", ["processes vanished", "down"])
def test_after_a_fault_ps_json_wait_down_and_the_dashboard_say_the_same(fake: FakeCluster, store: JobStore,
                                                                       tmp_path: Path, fault: str) -> None:
    """Node 1's supervisor and torchrun vanish (killed without a word: the host says lost), or the
    job is stopped with `down`: every consumer names the same end, node by node, and the same root
    cause; a `down` afterwards finds nothing to stop."""
    events: list[Event] = []
    runner = started(fake, store, tmp_path, events)
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(runner.follow()), daemon=True)
    thread.start()
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    wait_for(lambda: all(n.state == NodeState.RUNNING for n in store.load(JOB).nodes), 10, what="both running")
    if fault == "down":
        stopped = run("down", JOB)
        assert stopped.exit_code == 0, stopped.output
        end, nodes = "stopped", ["stopped", "stopped"]
    else:
        fake.node(JOB, 1).vanish()
        end, nodes = "lost", ["stopped", "lost"]  # fail-fast stops node 0
    thread.join(10)
    runner.close()
    assert out and out[0] is not None
    store_record = store.load(JOB)
    cause = store_record.attempts[-1].root_cause
    assert (cause is None) == (fault == "down"), cause

    shown = run("ps", JOB)
    assert f"job {JOB} (train): {end}, attempt 1" in shown.output
    assert list(node_rows(shown.output).values()) == nodes, shown.output
    data = json.loads(run("ps", JOB, "--json").stdout)["jobs"][0]
    assert data["state"] == end and [n["state"] for n in data["nodes"]] == nodes
    assert data["attempts"][-1]["root_cause"] == cause
    waited = run("wait", JOB)
    assert waited.exit_code == 1
    assert waited.output.strip() == f"clusterrun: job {JOB} {end} (attempt 1)" + (f"; root cause: {cause}" if cause
                                                                                   else "")
    board = Board()
    for event in list(events):
        board.apply(event)
    assert board.state == end and [row.status(0) for row in board.nodes] == nodes
    if cause is not None:
        assert shown.output.count(f"root cause: {cause}") == 1
        assert board.root_text().splitlines()[0] == f"root cause: {cause}"
    again = run("down", JOB)
    assert again.exit_code == 0 and f"job {JOB} already finished ({end}); nothing to stop" in again.output


def test_a_started_node_whose_state_on_its_host_is_gone_is_never_shown_pending_or_ended(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    """The hosts' state directory of a running job is deleted: the host answers "absent" for a
    node it started. `ps` keeps what was known of the node (running) and says its state on the
    host is gone, never `pending` (which would make the monitor start it again) nor an end."""
    runner = started(fake, store, tmp_path, [])
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    wait_for(lambda: all(n.state == NodeState.RUNNING for n in store.load(JOB).nodes), 10, what="both running")
    runner.recorder.flush()
    runner.close()
    store.release(runner.owner_fd)  # type: ignore[arg-type]
    store.update(JOB, lambda r: setattr(r, "adopted", True))  # reconciled by each command, never a monitor here
    del fake.nodes[(JOB, 1, 1)]  # its attempt directory is gone: the fake's agent answers absent

    shown = run("ps", JOB)
    assert node_rows(shown.output) == {"0": "running", "1": "running"}, shown.output
    assert "its host has no state of it any more" in shown.output and f"job {JOB} (train): running" in shown.output
    record = store.load(JOB)
    assert record.state == "running" and record.nodes[1].state == NodeState.RUNNING
    waited = run("wait", "--timeout", "0", JOB)
    assert waited.exit_code == 124, waited.output


def test_logs_of_one_node_reads_through_the_connection_it_opened_ahead(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logs JOB --node 0` starts connecting to the node's host before it loads the printer
    (``logread.hosts_ahead``) and reads through that connection: one transport, the one connected early."""
    runner = started(fake, store, tmp_path, [])
    thread = threading.Thread(target=runner.follow, daemon=True)
    thread.start()
    fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    fake.node(JOB, 0).write(b"first\n\xff\x00odd\r50%\nlast")
    fake.node(JOB, 0).exit(0)
    fake.node(JOB, 1).exit(0)
    thread.join(10)
    runner.close()
    made: list[Transport] = []
    early: list[Transport] = []

    def transport(host: HostSpec) -> Transport:
        made.append(fake.transport(host))
        return made[-1]

    monkeypatch.setattr(logread, "transport_factory", lambda record: transport)
    monkeypatch.setattr(logread, "connect_early", early.extend)
    shown = run("logs", JOB, "--node", "0")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout_bytes == b"first\n\xff\x00odd\r50%\nlast"  # as written, byte for byte
    assert len(made) == 1 and early == made
