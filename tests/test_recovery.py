"""Recovery after a failure against the fake transport: the failure seen at a rank's exit, the other
nodes stopped at once, no second stop after a verified one, a restart's checks limited to the probe
and the master port, and its phases in the attempt's record (``ps JOB``, ``up --timings``).

Fast (no processes); end to end, with real torchrun and gloo: ``tests/test_recovery_e2e.py``.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import HostSpec, load_cluster_text
from clusterrun.config.restarts import RestartPolicy
from clusterrun.core import timings
from clusterrun.core.events import AttemptTimed, Event, NodeState, NodeStateChanged, RankFailed
from clusterrun.life import lifecycle
from clusterrun.life.runner import Clock, Runner
from clusterrun.store.jobs import JobStore
from clusterrun.transports import Transport
from clusterrun.transports.fake import FakeCluster, FakeTransport
from clusterrun.transports.fakehosts import FakeNode
from clusterrun.views.joblist import phase_lines
from clusterrun.views.printer import Printer
from tests.test_orchestrator import JOB
from tests.test_runner import fake, follow_in_thread, owned_job, store  # noqa: F401 - fixtures

GPU_HOSTS = "hosts:\n  - host: h0\n    nproc: 1\n    gpus: 1\n  - host: h1\n    nproc: 1\n    gpus: 1\n"


class Skipping:
    """Wall-clock time that a backoff's wait moves forward instead of sleeping."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def wait(self, event: threading.Event, seconds: float) -> bool:
        self.ahead += seconds
        return event.is_set()

    def clock(self) -> Clock:
        return Clock(now=lambda: time.time() + self.ahead, wait=self.wait, poll=60.0, show=120.0)


def running_pair(fake: FakeCluster, store: JobStore, tmp_path: Path, events: list[Event], *,  # noqa: F811
                 restarts: int = 0, backoff: float = 0.0) -> tuple[Runner, FakeNode, FakeNode]:
    """Both nodes of a two-node job started their workers, in cgroups; followed by its owner. A
    ``backoff`` is waited out on a clock that moves on at once (``Skipping``)."""
    runner = owned_job(fake, store, tmp_path, events)
    runner._spec = load_cluster_text(GPU_HOSTS, "hosts.yaml")  # as if the hosts file declared GPUs
    runner.policy = RestartPolicy(max=restarts, backoff_first=backoff, backoff_most=backoff)
    if backoff:
        runner.clock = Skipping().clock()
    a0, a1 = fake.wait_started(JOB, 0), fake.wait_started(JOB, 1)
    for rank, node in enumerate((a0, a1)):
        node.contained = True
        node.start_workers(rank)
    return runner, a0, a1


def test_a_ranks_failure_stops_every_node_at_once_its_own_too_and_it_stays_the_failure(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:  # noqa: F811
    events: list[Event] = []
    runner, a0, a1 = running_pair(fake, store, tmp_path, events)
    thread, out = follow_in_thread(runner)
    a1.fail_rank(1, 3)
    thread.join(10)  # node 1's torchrun never ends by itself here: its stop ends it
    stop = fake.ops("stop", "h0")[0]
    assert stop["failing"] is True and stop["by"] == "fail-fast after node 1 failed" and not stop["failed"]
    own = fake.ops("stop", "h1")
    assert len(own) == 1 and own[0]["failing"] is True and own[0]["failed"] is True
    assert [(e.node, e.rank, e.exit_code) for e in events if isinstance(e, RankFailed)] == [(1, 1, 3)]
    result = out[0]
    assert [n.state for n in result.nodes] == [NodeState.STOPPED, NodeState.FAILED]  # type: ignore[attr-defined]
    assert result.nodes[1].exit_code == 1  # type: ignore[attr-defined]
    root = result.root_cause  # type: ignore[attr-defined]
    assert (root.node, root.rank, root.exit_code) == (1, 1, 3)
    assert store.load(JOB).attempts[0].root_cause.startswith("rank 1 on node 1 (h1, local rank 0): exit code 3")
    runner.close()


def test_a_failed_node_without_a_cgroup_ends_on_its_own(
        fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:  # noqa: F811
    runner, a0, a1 = running_pair(fake, store, tmp_path, [])
    a1.contained = False
    thread, out = follow_in_thread(runner)
    a1.fail_rank(1, 3)
    fake.wait(lambda: a0.stops == 1 and a1.stops == 1, what="both stops sent")
    assert a1.state.get("state") != "exited"  # its kill could not be verified: not killed
    a1.exit(1)
    thread.join(10)
    assert [n.state for n in out[0].nodes] == [NodeState.STOPPED, NodeState.FAILED]  # type: ignore[attr-defined]
    runner.close()


@pytest.mark.parametrize("backoff", [0.0, 30.0])
def test_a_restart_after_a_verified_stop_stops_nothing_again_and_checks_only_reach_and_port(
        fake: FakeCluster, store: JobStore, tmp_path: Path, backoff: float) -> None:  # noqa: F811
    events: list[Event] = []
    timed = threading.Event()
    runner, a0, a1 = running_pair(fake, store, tmp_path, events, restarts=1, backoff=backoff)
    runner.subscribe(lambda e: timed.set() if isinstance(e, AttemptTimed) and e.attempt == 2 else None)
    thread, _ = follow_in_thread(runner)
    a1.fail_rank(1)
    b0, b1 = fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    assert a0.stops == 1 and a1.stops == 1  # verified by their cgroups: no second stop
    assert len(fake.ops("stop")) == 2
    restart_probes = fake.ops("probe")[-2:]  # the preflight's inspection goes with the probe
    assert [(p["inspect"]["gpus"], p["inspect"]["deep"]) for p in restart_probes] == [(False, False)] * 2
    assert len(fake.ops("reach")) == 2  # their reach of the new master port is tested
    b0.start_workers(0)
    b1.start_workers(1)
    assert timed.wait(10), "attempt 2's phases were never all known"
    runner.request_stop("done")
    thread.join(10)
    phases = store.load(JOB).attempts[1].phases or {}
    expected = [p for p in timings.ATTEMPT_PHASES if backoff or p != "waited"]  # a backoff's end, once it waited
    assert set(phases) == set(expected) and sorted(phases.values()) == [phases[p] for p in expected]
    lines = phase_lines(store.load(JOB))
    assert lines[-1].startswith("attempt 2: failure seen → stopped ") and "every node joined" in lines[-1]
    assert (" → backoff over " in lines[-1]) == bool(backoff)  # else the checks' phase would hold the wait
    runner.close()


def test_a_restart_uses_the_connections_its_owner_holds_and_closes_them_at_its_end(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    made: list[Transport] = []

    def counted(host: HostSpec) -> Transport:
        made.append(fake.transport(host))
        return made[-1]

    monkeypatch.setattr(lifecycle, "transport_factory", lambda record: counted)
    runner, a0, a1 = running_pair(fake, store, tmp_path, [], restarts=1)
    closed: list[str] = []
    monkeypatch.setattr(FakeTransport, "close", lambda self: closed.append(self.name))
    thread, _ = follow_in_thread(runner)
    a1.fail_rank(1)
    b0, b1 = fake.wait_started(JOB, 0, 2), fake.wait_started(JOB, 1, 2)
    assert made == [] and closed == []  # attempt 2's checks, start and follower: attempt 1's follower's transports
    b0.start_workers(0)
    b1.start_workers(1)
    runner.request_stop("done")
    thread.join(10)
    assert closed == []  # lent to every attempt: kept open until the owner's end
    runner.close()
    assert sorted(closed) == ["h0", "h1"]


def test_a_failure_is_printed_at_once_past_the_folded_nodes() -> None:
    err = io.StringIO()
    printer = Printer(out=io.StringIO(), err=err, colour=False, hold=3600, nnodes=16)
    printer(NodeStateChanged(3, host="h3", state=NodeState.STOPPING, detail="x"))
    assert err.getvalue() == ""  # held for the rest of the nodes
    printer(RankFailed(5, host="h5", rank=5, exit_code=-9))
    printer(NodeStateChanged(5, host="h5", state=NodeState.FAILED, detail="exit code 1"))
    assert err.getvalue().splitlines()[-2:] == [
        "clusterrun: node5 h5: failing (rank 5: killed by SIGKILL); torchrun ends",
        "clusterrun: node5 h5: failed (exit code 1)"]


def test_a_failing_stop_is_handed_the_nodes_follow_stream_and_goes_elsewhere_where_that_cannot_carry_it(
        fake: FakeCluster, store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Each node's stop is given its follower's live stream (the agent there answers it: see
    tests/test_stop_aside.py); the fake's streams carry no request after the first, so the stop
    goes to an agent of its own, as where a follow has ended."""
    from clusterrun.run import orchestrator
    from clusterrun.transports.base import AgentStream

    given: dict[int, object] = {}
    real = orchestrator.stop_node

    def recorded(*args: object, **kwargs: object) -> object:
        given[int(args[1])] = kwargs.get("aside")  # type: ignore[call-overload]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(orchestrator, "stop_node", recorded)
    runner, a0, a1 = running_pair(fake, store, tmp_path, [])
    thread, out = follow_in_thread(runner)
    a1.fail_rank(1, 3)
    thread.join(10)
    assert sorted(given) == [0, 1] and all(isinstance(s, AgentStream) for s in given.values()), given
    assert len(fake.ops("stop", "h0")) == 1 and len(fake.ops("stop", "h1")) == 1  # each once, elsewhere
    assert [n.state for n in out[0].nodes] == [NodeState.STOPPED, NodeState.FAILED]  # type: ignore[attr-defined]
    runner.close()
