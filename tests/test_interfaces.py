"""The network interface chosen for each node: the policy (pure) and its wiring in ``Job.prepare`` (fake hosts).

The real thing, on simulated machines with Debian's 127.0.1.1 and with two networks, is in
tests/test_network_sim.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import HostsUnavailable
from clusterrun.core.protocol import Network, Route
from clusterrun.run.interfaces import better_master, choose_interfaces
from clusterrun.run.orchestrator import Job
from clusterrun.transports.fake import FakeCluster

BOTH = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}


def net(netns: str, *, interface: str = "eth0", source: str = "10.0.0.2", resolved: str = "10.0.0.1",
        loopback: bool = False, error: str | None = None, peer: Route | None = None,
        preset: dict[str, str] | None = None) -> Network:
    master = Route("10.0.0.1", resolved=None if error else resolved, source=None if error else source,
                   interface=None if error else interface, loopback=loopback, error=error)
    return Network(netns=netns, master=master, peer=peer, preset=preset or {})


LOOP = {"interface": "lo", "source": "127.0.0.1", "loopback": True}


def test_each_node_gets_the_interface_that_routes_to_the_master() -> None:
    chosen = choose_interfaces("10.0.0.1", ["a", "b"], [net("A", interface="eth1", source="10.0.0.1"),
                                                        net("B", interface="ens5")], [{}, {}])
    assert [c.name for c in chosen] == ["eth1", "ens5"]
    assert chosen[1].env == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens5"}
    assert chosen[1].describe() == ("ens5 10.0.0.2 (routes to the master 10.0.0.1; "
                                    "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME set)")


def test_what_the_user_set_wins_in_the_hosts_file_or_the_host_s_environment() -> None:
    chosen = choose_interfaces("10.0.0.1", ["a", "b"], [
        net("A"), net("B", preset={"NCCL_SOCKET_IFNAME": "ib0"})], [{"GLOO_SOCKET_IFNAME": "eth9", "X": "1"}, {}])
    assert chosen[0].env == {"NCCL_SOCKET_IFNAME": "eth0"} and chosen[0].user_set == {"GLOO_SOCKET_IFNAME": "eth9"}
    assert chosen[1].env == {"GLOO_SOCKET_IFNAME": "eth0"} and chosen[1].user_set == {"NCCL_SOCKET_IFNAME": "ib0"}
    assert "NCCL_SOCKET_IFNAME=ib0 yours" in chosen[1].describe()


def test_loopback_on_one_machine_sets_nothing() -> None:
    chosen = choose_interfaces("127.0.0.1", ["a", "b"], [net("A", **LOOP), net("A", **LOOP)], [{}, {}])  # type: ignore[arg-type]
    assert [c.name for c in chosen] == [None, None] and all(not c.env for c in chosen)
    assert chosen[0].describe() == "loopback (every node is on this machine)"


def test_another_machine_reaching_the_master_through_loopback_is_refused_with_the_fix() -> None:
    line = "/etc/hosts:2: 127.0.1.1 gpu-b node0"
    b = Network("B", Route("node0", resolved="127.0.1.1", source="127.0.0.1", interface="lo", loopback=True,
                           hosts_line=line))
    with pytest.raises(HostsUnavailable) as caught:
        choose_interfaces("node0", ["node0", "gpu-b"], [net("A"), b], [{}, BOTH])
    [error] = caught.value.errors
    text = error.render()
    assert text.startswith("gpu-b: the master node0 resolves to 127.0.1.1 on this host, its own loopback")
    assert f"hint: {line} maps node0 to 127.0.1.1; set `master: addr:`" in text
    assert "or fix /etc/hosts on gpu-b" in text
    # resolved so elsewhere (DNS): the hint does not blame /etc/hosts
    with pytest.raises(HostsUnavailable) as caught:
        choose_interfaces("node0", ["node0", "gpu-b"], [net("A"), net("B", resolved="127.0.1.1", **LOOP)],  # type: ignore[arg-type]
                          [{}, {}])
    assert "or make node0 resolve to node 0's address on gpu-b (DNS, /etc/hosts)" in caught.value.render()
    # setting the interface variables does not help: the master itself is out of reach
    with pytest.raises(HostsUnavailable, match="1 host"):
        choose_interfaces("127.0.0.1", ["a", "b"], [net("A", **LOOP), net("B", resolved="127.0.0.1", **LOOP)],  # type: ignore[arg-type]
                          [BOTH, BOTH])


def test_no_route_or_no_name_is_refused_for_every_host_it_concerns() -> None:
    with pytest.raises(HostsUnavailable) as caught:
        choose_interfaces("10.0.0.1", ["a", "b", "c"], [
            net("A"), net("B", error="no route to 10.0.0.1 (10.0.0.1): Network is unreachable"),
            net("C", error="cannot resolve 10.0.0.1: Name or service not known")], [{}, {}, {}])
    assert [e.render().split("\n")[0] for e in caught.value.errors] == [
        "b: cannot reach the master 10.0.0.1: no route to 10.0.0.1 (10.0.0.1): Network is unreachable",
        "c: cannot reach the master 10.0.0.1: cannot resolve 10.0.0.1: Name or service not known"]


def test_the_master_s_machine_on_loopback_takes_the_interface_that_reaches_another_node() -> None:
    peer = Route("10.0.0.2", resolved="10.0.0.2", source="10.0.0.1", interface="eth1")
    chosen = choose_interfaces("node0", ["a", "b"], [net("A", peer=peer, **LOOP), net("B")], [{}, {}])  # type: ignore[arg-type]
    assert chosen[0].name == "eth1" and chosen[0].env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "reaches 10.0.0.2; the master node0 is this machine" in chosen[0].describe()
    # no such peer: refused, unless the user named both interfaces
    with pytest.raises(HostsUnavailable) as caught:
        choose_interfaces("node0", ["a", "b"], [net("A", **LOOP), net("B")], [{}, {}])  # type: ignore[arg-type]
    assert "a: reaches the master node0 through loopback, and no other node" in caught.value.render()
    assert "hint: set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for this host in `env:`" in caught.value.render()
    chosen = choose_interfaces("node0", ["a", "b"], [net("A", **LOOP), net("B")], [BOTH, {}])  # type: ignore[arg-type]
    assert chosen[0].env == {} and chosen[0].user_set == BOTH


def test_a_derived_master_on_loopback_is_replaced_by_node_0_s_address_towards_the_others() -> None:
    peer = Route("10.0.0.2", resolved="10.0.0.2", source="10.0.0.1", interface="eth1")
    broken = net("B", resolved="127.0.0.1", **LOOP)  # type: ignore[arg-type]
    assert better_master("127.0.0.1", [net("A", peer=peer, **LOOP), broken]) == "10.0.0.1"  # type: ignore[arg-type]
    assert better_master("127.0.0.1", [net("A", **LOOP), broken]) is None  # type: ignore[arg-type]
    assert better_master("10.0.0.1", [net("A", peer=peer), net("B")]) is None  # nothing broken
    assert better_master("127.0.0.1", [net("A", peer=peer, **LOOP), net("A", **LOOP)]) is None  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ wired into prepare()

def job_on(fake: FakeCluster, text: str) -> Job:
    return Job(load_cluster_text(text, "hosts.yaml"), "train.py", job_id="t-20261123-120000-abcd", name="t",
               emit=None, transport_factory=fake.transport)


def test_prepare_sets_the_interface_variables_except_those_the_user_set() -> None:
    fake = FakeCluster()
    fake.host("b").network = {"netns": "B", "peer": None, "preset": {"NCCL_SOCKET_IFNAME": "ib0"},
                              "master": {"target": "a", "resolved": "10.0.0.1", "source": "10.0.0.2",
                                         "interface": "eth1", "loopback": False, "error": None}}
    job = job_on(fake, "hosts:\n  - host: a\n    env:\n      GLOO_SOCKET_IFNAME: eth7\n  - host: b\n")
    try:
        plan = job.prepare()
    finally:
        job.close()
    assert plan.nodes[0].env["GLOO_SOCKET_IFNAME"] == "eth7" and plan.nodes[0].env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert plan.nodes[1].env["GLOO_SOCKET_IFNAME"] == "eth1" and "NCCL_SOCKET_IFNAME" not in plan.nodes[1].env
    assert [i.name for i in job.interfaces] == ["eth0", "eth1"]
    # the route to the master went with each host's probe: no request of its own (one round trip fewer)
    assert sorted((h, r["op"], r["route_to"]["addr"], r["route_to"]["peers"], r["route_to"]["always_peers"])
                  for h, r in fake.requests) == [("a", "probe", "a", ["b"], True), ("b", "probe", "a", ["a"], False)]
    assert job._nodes[1].probe is not None and job._nodes[1].probe.network is not None  # the doctor's field
    assert job._nodes[1].probe.network.master.interface == "eth1"


def test_prepare_refuses_a_node_that_reaches_the_master_through_loopback_and_starts_nothing() -> None:
    fake = FakeCluster()
    fake.host("b").network = {"netns": "B", "peer": None, "preset": {},
                              "master": {"target": "a", "resolved": "127.0.1.1", "source": "127.0.0.1",
                                         "interface": "lo", "loopback": True, "error": None}}
    job = job_on(fake, "master:\n  addr: a\nhosts:\n  - host: a\n  - host: b\n")
    try:
        with pytest.raises(HostsUnavailable) as caught:
            job.prepare()
    finally:
        job.close()
    assert caught.value.render().startswith("1 host(s) cannot run the job; nothing was started\n"
                                            "b: the master a resolves to 127.0.1.1 on this host")
    assert not any(r["op"] == "start" for _, r in fake.requests)


def routes_of_two_machines(source: str, netns: str, node0: bool = False) -> Callable[[str], dict[str, Any]]:
    """A fake host's ``route`` answers on one of two machines (node 0 ``here``, 10.0.0.1, and
    ``b``, 10.0.0.2, on eth1): loopback to 127.0.0.1, eth1 to anything else."""
    def answer(target: str) -> dict[str, Any]:
        loop = target == "127.0.0.1"
        peer = ({"target": "b", "resolved": "10.0.0.2", "source": "10.0.0.1", "interface": "eth1",
                 "loopback": False, "error": None} if node0 else None)
        return {"netns": netns, "preset": {}, "peer": peer,
                "master": {"target": target, "resolved": target, "source": "127.0.0.1" if loop else source,
                           "interface": "lo" if loop else "eth1", "loopback": loop, "error": None}}
    return answer


def test_prepare_replaces_a_derived_master_that_other_machines_reach_through_loopback() -> None:
    """Node 0 on this machine (``transport: local``, master 127.0.0.1) and a remote node: the
    master becomes node 0's address towards the remote one, and every node is routed to it."""
    fake = FakeCluster()
    fake.host("here").network = routes_of_two_machines("10.0.0.1", "A", node0=True)
    fake.host("b").network = routes_of_two_machines("10.0.0.2", "B")
    job = job_on(fake, "hosts:\n  - host: here\n    transport: local\n  - host: b\n")
    try:
        plan = job.prepare()
    finally:
        job.close()
    assert plan.master_addr == "10.0.0.1" and "--master-addr=10.0.0.1" in plan.nodes[1].argv
    assert [i.name for i in job.interfaces] == ["eth1", "eth1"]
    # the probes were routed to 127.0.0.1; the master settled again is routed by requests of their own
    assert sorted((h, r["op"], r["route_to"]["addr"]) for h, r in fake.requests) == [
        ("b", "probe", "127.0.0.1"), ("b", "route", "10.0.0.1"), ("here", "probe", "127.0.0.1"),
        ("here", "route", "10.0.0.1")]
    # a master the user set is never replaced
    job = job_on(fake, "master:\n  addr: 127.0.0.1\nhosts:\n  - host: here\n    transport: local\n  - host: b\n")
    try:
        with pytest.raises(HostsUnavailable) as caught:
            job.prepare()
    finally:
        job.close()
    assert "\nb: the master 127.0.0.1 is a loopback address" in caught.value.render()


# ------------------------------------------------------------------------------ the agent's side

def test_the_agent_finds_the_route_and_the_interface_of_its_source_address(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import subprocess

    from clusterrun.agent import network

    local = network._route("127.0.0.1", 9)
    assert (local["interface"], local["loopback"], local["error"]) == ("lo", True, None)
    assert network._route("localhost", 9)["hosts_line"].startswith("/etc/hosts:")  # a name mapped to loopback there
    assert network._route("no-such-host.invalid", 9)["error"].startswith("cannot resolve no-such-host.invalid: ")
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    # (not the simulated hosts' links and bridges, `cr…`: other tests add and delete them meanwhile)
    pairs = [(f[1], f[3].split("/")[0]) for f in map(str.split, listed.splitlines()) if not f[1].startswith("cr")]
    with monkeypatch.context() as patched:  # the ioctls alone
        patched.setattr(network, "capture", lambda argv, timeout=5.0: None)
        assert pairs and all(network._interface_of(address) == name for name, address in pairs)

    def refused() -> list[tuple[int, str]]:
        raise OSError("no if_nameindex")

    monkeypatch.setattr(socket, "if_nameindex", refused)  # the `ip -o addr` fallback alone
    assert all(network._interface_of(address) == name for name, address in pairs)
