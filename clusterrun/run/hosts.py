"""A job's nodes on their hosts up to their start: connect, probe, plan, set up (``JobHosts``).

``JobHosts`` is the first half of ``orchestrator.Job``, its base: the nodes with their transports,
agents and states, the listeners every event goes to, and ``prepare()`` (connect and probe every
host in parallel, build the plan, choose each node's network interface: ``interfaces``; all or
nothing) or ``resume(plan)`` for a job started earlier. ``setups`` runs the hosts' ``setup``
commands on it. ``Job`` adds the start, the following and the stop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, HostsUnavailable
from clusterrun.core.events import Event, NodeState, NodeStateChanged
from clusterrun.core.protocol import Network, Probe
from clusterrun.diagnose.rootcause import NodeLog
from clusterrun.run import setups
from clusterrun.run.follower import Node
from clusterrun.run.interfaces import Interface, choose_interfaces, master_derived, settle_master
from clusterrun.run.plan import HostFacts, LaunchPlan, NodeLaunch, build_plan
from clusterrun.run.probing import Ahead, Early, probe_all, reached, route
from clusterrun.transports import AgentSession, Transport

Emit = Callable[[Event], None]
T = TypeVar("T")


class JobHosts:
    """A job's nodes up to their start (see the module docstring): ``Job``'s base, whose
    ``__init__`` sets the fields declared here. Lifecycle: ``prepare()`` (or ``resume(plan)``),
    then ``Job.start()``."""

    spec: ClusterSpec
    script: str
    script_args: tuple[str, ...]
    job_id: str
    name: str
    attempt: int
    env_overrides: dict[str, str]
    local_cwd: str | None
    grace: float
    plan: LaunchPlan | None
    interfaces: list[Interface]  # per node, once prepared: the network interface its ranks use
    set_up: dict[int, str]  # nodes whose setup ran: the job's interpreter there, in words
    setup_skipped: dict[int, str]  # nodes whose setup did not run (a dry run's missing workdir): why
    early: dict[int, Early]  # by rank: what the probes answered of the preflight's requests
    _listeners: list[Emit]
    _nodes: list[Node]
    _pool: ThreadPoolExecutor
    _routed_to: str | None  # the master the probes were routed to
    _listening: int | None  # node 0's preflight listener on the master port, until its start

    def subscribe(self, listener: Emit) -> None:
        """Also hand every event from now on to ``listener`` (after the earlier ones)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Emit) -> None:
        self._listeners.remove(listener)

    def emit(self, event: Event) -> None:
        for listener in self._listeners:
            listener(event)

    @property
    def logs(self) -> dict[int, NodeLog]:
        """What each node printed, as far as a diagnosis needs it."""
        return {rank: node.log for rank, node in enumerate(self._nodes)}

    # ------------------------------------------------------------------------------ prepare

    def _set_state(self, rank: int, state: NodeState, detail: str = "") -> None:
        node = self._nodes[rank]
        if node.state is not state:
            node.state = state
            self.emit(NodeStateChanged(rank, host=node.host, state=state, detail=detail))

    def probed(self, rank: int) -> tuple[Transport, AgentSession | None, Probe | None]:
        """Node ``rank``'s transport, the agent that probed it (kept open to start the node) and
        what it said: for ``up``'s preflight (doctor.py), between ``prepare()`` and ``start()``."""
        node = self._nodes[rank]
        return node.transport, node.agent, node.probe

    @property
    def agents(self) -> list[tuple[Transport, AgentSession | None]]:
        """Each node's transport and the agent that probed it (once ``prepare()`` ran), by rank: for
        work on the same connections before the start, such as ``clusterrun.sync.copy``."""
        return [(node.transport, node.agent) for node in self._nodes]

    @property
    def host_fallbacks(self) -> dict[int, list[str]]:
        """What each probed host lacks, by node rank (no cgroup and why, no pidfd, ...): see the agent's probe."""
        return {rank: list(node.probe.fallbacks if node.probe is not None else ())
                for rank, node in enumerate(self._nodes)}

    def prepare(self, *, run_setup: bool = True, ahead: Ahead | None = None) -> LaunchPlan:
        """Connect to and probe every host in parallel, then build the plan, then run the hosts'
        ``setup`` commands where there are some (unless ``run_setup`` is false: the checks run
        ``setups.run`` after the sync). ``ahead``: the preflight's requests that go with the
        probes (their answers in ``early``; node 0's listener, if any, gives the master port and
        is closed by node 0's start). Raises ``HostsUnavailable`` listing every host that
        failed; then nothing has started."""
        for rank in range(len(self._nodes)):
            self._set_state(rank, NodeState.CONNECTING)
        answers, self._routed_to, self.early = probe_all(self._pool, self._nodes, self.spec, ahead)
        listening = self.early[0].listening if 0 in self.early else None
        self._listening = listening.port if listening is not None and listening.listening else None
        port = self.spec.master_port or (listening.port if listening is not None else answers[0].port)
        if port is None:
            why = self.early[0].listen_error if 0 in self.early else None
            why = why or "the agent found no free port for the master"
            raise HostsUnavailable([AgentError(self._nodes[0].host, why)])
        facts = [HostFacts(python=n.transport.python, torchrun_flags=a.torchrun_flags,
                           address=n.transport.address)
                 for n, a in zip(self._nodes, answers, strict=True)]
        self.plan = self._with_interfaces(lambda spec: build_plan(
            spec, self.script, self.script_args, job_id=self.job_id, name=self.name, facts=facts, master_port=port,
            env_overrides=self.env_overrides, local_cwd=self.local_cwd, grace=self.grace))
        for node, launch in zip(self._nodes, self.plan.nodes, strict=True):
            node.launch = launch
        if run_setup:
            setups.run(self, self.emit)
        return self.plan

    def set_up_node(self, rank: int, probe: Probe, launch: NodeLaunch) -> None:
        """Node ``rank`` as its setup left it (``setups.py``): the probe of the job's interpreter
        there and the launch whose torchrun argv suits it."""
        self._nodes[rank].probe, self._nodes[rank].launch = probe, launch

    def all_or_none(self, call: Callable[[int], T], ranks: Iterable[int]) -> list[T]:
        """``call(rank)`` for each of ``ranks``, in parallel: their results in order, or, when any
        failed, ``HostsUnavailable`` naming every host that did, with the agents closed (nothing
        of the job starts: the probe, the route and setup are all or nothing)."""
        results, errors = parallel.gather(self._pool, call, ranks, lambda rank: self._nodes[rank].host)
        if errors:
            for node in self._nodes:
                node.close_agent()
            raise HostsUnavailable(errors)
        return results

    def _route(self, rank: int, master: str, port: int) -> Network:
        """How node ``rank``'s host reaches ``master`` (the agent's ``route``), kept in its probe."""
        node = self._nodes[rank]
        if node.agent is None or node.probe is None:
            raise RuntimeError("_route() before _probe()")
        network = route(node.agent, node.host, rank, master, port,
                        reached(self.spec.hosts, [n.transport for n in self._nodes]))
        node.probe = dataclasses.replace(node.probe, network=network)
        return network

    def _route_all(self, master: str, port: int) -> list[Network]:
        """Every node's route to ``master``: as their probes said, if they were asked for it."""
        networks = [n.probe.network for n in self._nodes if n.probe is not None]
        if master == self._routed_to and all(n is not None for n in networks) and len(networks) == len(self._nodes):
            return [n for n in networks if n is not None]
        return self.all_or_none(lambda rank: self._route(rank, master, port), range(len(self._nodes)))

    def _with_interfaces(self, build: Callable[[ClusterSpec], LaunchPlan]) -> LaunchPlan:
        """The plan ``build`` makes, with ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` set per
        node to the interface that reaches the master, where the user set neither (see
        ``interfaces``). A master address clusterrun derived (not ``master.addr`` or node 0's
        ``address:``) that another machine cannot use is replaced by node 0's address towards the
        others. Raises ``HostsUnavailable`` (the agents closed) when a node cannot take part."""
        plan = build(self.spec)
        try:
            master, networks = settle_master(plan.master_addr, master_derived(self.spec),
                                             lambda addr: self._route_all(addr, plan.master_port))
            if master != plan.master_addr:
                plan = build(dataclasses.replace(self.spec, master_addr=master))
            self.interfaces = choose_interfaces(plan.master_addr, [n.host for n in self._nodes], networks,
                                                [launch.env for launch in plan.nodes])
        except HostsUnavailable:
            for node in self._nodes:
                node.close_agent()
            raise
        nodes = tuple(dataclasses.replace(launch, env={**launch.env, **chosen.env})
                      for launch, chosen in zip(plan.nodes, self.interfaces, strict=True))
        return dataclasses.replace(plan, nodes=nodes)

    def resume(self, plan: LaunchPlan) -> None:
        """Follow a job that was started earlier (by this or another controller) with ``plan``."""
        self.plan = plan
        for node, launch in zip(self._nodes, plan.nodes, strict=True):
            node.launch = launch
            node.state = NodeState.RUNNING


__all__ = ["Emit", "JobHosts"]
