"""Spare hosts: the hosts file's ``spares:``, which spare takes which place, and the owner
replacing a lost host on the fake transport. The real thing (a host's namespace killed under a
gloo job) is tests/test_spares_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterrun.agent import kmsg
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.config.restarts import RestartPolicy
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import Event, JobNote, JobResult, JobState, NodeResult, NodeState
from clusterrun.core.protocol import decode_status
from clusterrun.life import spares
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Runner
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.run.plan import HostFacts, build_plan
from clusterrun.store.jobs import AttemptRecord, JobStore
from clusterrun.transports.fake import FakeCluster
from tests import test_runner
from tests.test_orchestrator import JOB
from tests.test_restarts import FakeClock, run

fake, store = test_runner.fake, test_runner.store  # the fixtures: a FakeCluster, a JobStore in tmp_path

TEXT = "hosts: [h0, h1]\nspares:\n  - s0\n  - host: s1\n    nproc: 2\n  - s2\n"


def test_spares_parse_like_hosts_and_a_spare_is_no_host_twice() -> None:
    spec = load_cluster_text(TEXT, "h.yaml")
    assert [h.host for h in spec.hosts] == ["h0", "h1"]
    assert [(s.host, s.nproc) for s in spec.spares] == [("s0", 1), ("s1", 2), ("s2", 1)]
    assert load_cluster_text("hosts: [a]\n").spares == ()
    with pytest.raises(ConfigError) as bad:
        load_cluster_text("hosts: [a, b]\nspares: [B]\n", "h.yaml")
    assert bad.value.render().startswith("h.yaml:2: spares[0].host: host 'B' is listed twice (also at line 1")
    with pytest.raises(ConfigError) as bad:
        load_cluster_text("hosts: [a]\nspares: []\n", "h.yaml")
    assert bad.value.render().startswith("h.yaml:2: spares: expected a non-empty list of spares")


def test_a_spare_takes_the_rank_of_the_host_it_replaces_and_leaves_the_spares() -> None:
    spec = load_cluster_text(TEXT).with_spares({"h0": "s2"})
    assert [h.host for h in spec.hosts] == ["s2", "h1"] and [s.host for s in spec.spares] == ["s0", "s1"]
    with pytest.raises(KeyError):
        spec.with_spares({"h0": "s0"})  # h0 is no host of this attempt any more


def record_with(*replaced: dict[str, str] | None):  # type: ignore[no-untyped-def]
    record = new_record_of(load_cluster_text(TEXT))
    record.attempts = [AttemptRecord(i + 1, started=0.0, master_port=1, replaced=r) for i, r in enumerate(replaced)]
    record.attempt = len(replaced)
    return record


def new_record_of(spec):  # type: ignore[no-untyped-def]
    plan = build_plan(spec, "train.py", (), job_id=JOB, name="train", master_port=1,
                      facts=[HostFacts("python3")] * len(spec.hosts))
    return new_record(plan, hosts_file="h.yaml", hosts_text=TEXT, env_overrides={}, local_cwd="/", ssh_config=None)


def test_the_swaps_of_each_attempt_compose_and_a_failed_spare_is_not_picked_again() -> None:
    record = record_with(None, {"h1": "s0"}, {"s0": "s2"})
    assert record.swaps(1) == {} and record.swaps(2) == {"h1": "s0"} and record.swaps() == {"h1": "s2"}
    spec = load_cluster_text(TEXT).with_spares(record.swaps())
    assert spares.free_spares(spec, record) == ["s1"]  # s0 failed in attempt 2; s2 is in use
    with pytest.raises(ConfigError) as bad:
        spares.pick(spec, record, ["h0"])  # s1 runs 2 processes, h0 one
    assert bad.value.message == "no spare left for h0 (1 processes); spares: s0, s1"


def test_pick_takes_the_first_free_spare_of_as_many_processes_or_the_chosen_one() -> None:
    record, spec = record_with(None), load_cluster_text(TEXT)
    assert spares.pick(spec, record, ["h1"]) == {"h1": "s0"}
    assert spares.pick(spec, record, ["h0", "h1"]) == {"h0": "s0", "h1": "s2"}
    assert spares.pick(spec, record, [], {"h1": "s2"}) == {"h1": "s2"}
    for out, chosen, message in [(["h9"], {}, "h9 is not a host of job"), ([], {"h0": "s9"}, "s9 is not a free spare"),
                                 ([], {"h0": "s1"}, "s1 runs 2 processes, h0 1")]:
        with pytest.raises(ConfigError) as bad:
            spares.pick(spec, record, out, chosen)
        assert bad.value.message.startswith(message), bad.value.message


def test_only_a_lost_node_is_the_hosts_failure() -> None:
    result = JobResult(JOB, (NodeResult(0, "h0", NodeState.FAILED, exit_code=1), NodeResult(1, "h1", NodeState.LOST),
                             NodeResult(2, "h2", NodeState.UNREACHABLE), NodeResult(3, "h3", NodeState.STOPPED)))
    assert spares.failed_hosts(result) == ["h1", "h2"]


def owned(fake: FakeCluster, store: JobStore, tmp_path: Path, text: str, events: list[Event]) -> Runner:
    spec = load_cluster_text(text, str(tmp_path / "hosts.yaml"))
    (tmp_path / "hosts.yaml").write_text(text)
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path), reconnect=Reconnect(first=0.01, most=0.02, give_up_after=0.05))
    plan = job.prepare()
    record = new_record(plan, hosts_file=str(tmp_path / "hosts.yaml"), hosts_text=text, env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None, max_restarts=2, unreachable_timeout=0.05)
    store.create(record)
    owner = store.try_own(JOB)
    assert owner is not None
    runner = Runner(store, record, job, owner, events.append, policy=RestartPolicy(max=2), clock=FakeClock().clock())
    runner.start()
    return runner


def test_the_owner_runs_the_next_attempt_on_a_spare_in_the_lost_hosts_place(fake: FakeCluster, store: JobStore,
                                                                            tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, "hosts: [h0, h1]\nspares: [s0]\n", events)

    def drive() -> None:
        fake.wait_started(JOB, 1, 1)
        fake.host("h1").drop()  # gone for good: unreachable until the node counts as lost
        fake.wait_started(JOB, 0, 2).exit(0)
        fake.wait_started(JOB, 1, 2).exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok
    record = store.load(JOB)
    assert record.state is JobState.SUCCEEDED and record.hosts == ["h0", "s0"]
    assert [a.replaced for a in record.attempts] == [None, {"h1": "s0"}]
    assert [op["node"] for op in fake.ops("start", "s0")] == [1]
    notes = [e.text for e in events if isinstance(e, JobNote)]
    assert "node 1: the spare s0 takes the place of h1 from attempt 2" in notes
    runner.close()


def test_without_a_spare_the_restarts_end_naming_the_lost_host(fake: FakeCluster, store: JobStore,
                                                              tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, "hosts: [h0, h1]\n", events)

    def drive() -> None:
        fake.wait_started(JOB, 1, 1)
        fake.host("h1").drop()

    result = run(runner, drive)
    assert result is not None and result.failed
    record = store.load(JOB)
    assert record.state in (JobState.FAILED, JobState.LOST) and len(record.attempts) == 1
    notes = [e.text for e in events if isinstance(e, JobNote)]
    assert ("not restarting: the attempt lost h1 (the host went away) and the hosts file lists no spares "
            "(`spares:`)") in notes, notes
    runner.close()


XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4321, name=python, GPU has fallen off the bus."


@pytest.mark.parametrize(("line", "hardware"), [
    (XID, True),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, An uncorrectable double bit error (DBE) has been detected.", True),
    ("NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics SM Warp Exception", False),  # the program's own
    ("mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 5: be00000000800400", True),
    ("EDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#0_DIMM#0", True),
    ("EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#0_DIMM#0", False),  # corrected
    ("Out of memory: Killed process 12 (python3) total-vm:1kB", False),
])
def test_the_kernels_lines_of_a_failing_machine_are_kept(line: str, hardware: bool) -> None:
    log = kmsg.KernelLog(path="/nonexistent/kmsg")
    log.feed(f"3,1,0,-;{line}\n".encode())
    log.feed(f"14,2,0,-;{XID}\n".encode())  # LOG_USER: written by a process, not the kernel
    assert log.report(None)["hardware"] == ([line] if hardware else [])
    state = {"state": "exited", "exit_code": 1, "oom": log.report(None)}
    assert decode_status("h1", state).oom.hardware == ((line,) if hardware else ())  # type: ignore[union-attr]


def test_a_gpu_that_fell_off_the_bus_has_its_host_replaced(fake: FakeCluster, store: JobStore,
                                                           tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, "hosts: [h0, h1]\nspares: [s0]\n", events)

    def drive() -> None:
        fake.wait_started(JOB, 0, 1)
        fake.wait_started(JOB, 1, 1).exit(1, oom={"hardware": [XID]})
        fake.wait_started(JOB, 0, 2).exit(0)
        fake.wait_started(JOB, 1, 2).exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok and store.load(JOB).hosts == ["h0", "s0"]
    notes = [e.text for e in events if isinstance(e, JobNote)]
    assert f"the attempt lost h1 (its kernel logged: {XID})" in notes, notes
    runner.close()


def test_a_node_the_start_up_watch_blamed_is_its_hosts_failure() -> None:
    result = JobResult(JOB, (NodeResult(0, "h0", NodeState.STOPPED), NodeResult(1, "h1", NodeState.FAILED)))
    assert spares.failed_hosts(result) == [] and spares.failed_hosts(result, late=(1,)) == ["h1"]
    assert spares.why(result, ["h1"]) == "h1 (it never joined)"


def test_when_no_peer_of_node_0_joined_no_host_is_blamed_for_it() -> None:
    """Node 0's master port unreachable (a firewall, a wrong master address): every other node
    never joins, and replacing them all would not help."""
    result = JobResult(JOB, tuple(NodeResult(r, f"h{r}", NodeState.FAILED) for r in range(3)))
    assert spares.failed_hosts(result, late=(1, 2)) == []
    assert spares.failed_hosts(result, late=(2,)) == ["h2"]


def test_a_node_that_never_joined_has_its_host_replaced(fake: FakeCluster, store: JobStore, tmp_path: Path) -> None:
    events: list[Event] = []
    runner = owned(fake, store, tmp_path, "hosts: [h0, h1, h2]\nspares: [s0]\nstartup_timeout: 1\n", events)

    def drive() -> None:
        for rank in (0, 2):
            fake.wait_started(JOB, rank, 1).rendezvous(True)
        fake.wait_started(JOB, 1, 1).rendezvous(False)  # its host cannot reach the master port
        for rank in range(3):
            fake.wait_started(JOB, rank, 2).exit(0)

    result = run(runner, drive)
    assert result is not None and result.ok and store.load(JOB).hosts == ["h0", "s0", "h2"]
    notes = [e.text for e in events if isinstance(e, JobNote)]
    assert "the attempt lost h1 (it never joined)" in notes, notes
    runner.close()
