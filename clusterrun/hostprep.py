"""The preparation of an attempt's hosts, all or nothing, before anything starts: connect to and
probe every host in parallel, build the plan, choose each node's network interface
(``interfaces``), run the hosts' ``setup``. ``Preparation`` is the part of ``orchestrator.Job``
that does it (create → ``prepare()`` → ``setup()`` where asked apart; then ``Job.start()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from clusterrun.agent.wire import NodeRequest, ProbeRequest, SetupAnswer
from clusterrun.config import ClusterSpec
from clusterrun.environment import redact
from clusterrun.errors import AgentError, ClusterrunError, HostsUnavailable, TransportError
from clusterrun.events import NodeState
from clusterrun.follower import Node
from clusterrun.hostchecks import MIN_PYTHON, after_setup
from clusterrun.interfaces import (
    Interface,
    choose_interfaces,
    master_derived,
    reached_address,
    route_request,
    settle_master,
)
from clusterrun.plan import HostFacts, LaunchPlan, NodeLaunch, build_plan, with_flags
from clusterrun.protocol import Network, Probe, decode, decode_network, decode_probe
from clusterrun.transports import AgentSession, Transport

T = TypeVar("T")


class Preparation:
    """The hosts' preparation (see the module docstring); ``orchestrator.Job`` holds the state."""

    spec: ClusterSpec
    script: str
    script_args: tuple[str, ...]
    job_id: str
    name: str
    env_overrides: dict[str, str]
    local_cwd: str | None
    grace: float
    plan: LaunchPlan | None
    interfaces: list[Interface]
    set_up: dict[int, str]  # nodes whose setup ran: the job's interpreter there, in words
    setup_skipped: dict[int, str]  # nodes whose setup did not run (a dry run's missing workdir): why
    _nodes: list[Node]
    _pool: ThreadPoolExecutor

    def _set_state(self, rank: int, state: NodeState, detail: str = "") -> None:
        raise NotImplementedError

    def _request(self, rank: int, op: str, **extra: Any) -> NodeRequest:
        raise NotImplementedError

    def _probe(self, rank: int) -> Probe:
        node = self._nodes[rank]
        node.transport.connect()
        node.agent = node.transport.session()
        answer = decode_probe(node.host, node.agent.call(ProbeRequest(
            state_dir=self.spec.state_dir, free_port=rank == 0 and self.spec.master_port is None)))
        if answer.python_version < MIN_PYTHON:
            raise AgentError(node.host, f"{node.transport.python} is Python {answer.python}; "
                             "the agent needs 3.8 or newer", hint="set `python:` for this host")
        if not answer.torch and not self.spec.hosts[rank].setup:  # else the interpreter after setup counts
            raise AgentError(node.host, f"torch is not installed for {node.transport.python}",
                             hint="install torch on that host, or set `python:` to an interpreter that has it")
        node.probe = answer
        return answer

    def probed(self, rank: int) -> tuple[Transport, AgentSession | None, Probe | None]:
        """Node ``rank``'s transport, the agent that probed it (kept open to start the node) and
        what it said: for ``up``'s preflight (doctor.py), between ``prepare()`` and ``start()``."""
        node = self._nodes[rank]
        return node.transport, node.agent, node.probe

    @property
    def agents(self) -> list[tuple[Transport, AgentSession | None]]:
        """Each node's transport and the agent that probed it (once ``prepare()`` ran), by rank: for
        work on the same connections before the start, such as ``clusterrun.sync``."""
        return [(node.transport, node.agent) for node in self._nodes]

    @property
    def host_fallbacks(self) -> dict[int, list[str]]:
        """What each probed host lacks, by node rank (no cgroup and why, no pidfd, ...): see the agent's probe."""
        return {rank: list(node.probe.fallbacks if node.probe is not None else ())
                for rank, node in enumerate(self._nodes)}

    def prepare(self, *, run_setup: bool = True) -> LaunchPlan:
        """Connect to and probe every host in parallel, then build the plan, then run the hosts'
        ``setup`` commands where there are some (unless ``run_setup`` is false: the checks run
        ``setup()`` after the sync).
        Raises ``HostsUnavailable`` listing every host that failed; then nothing has started."""
        for rank in range(len(self._nodes)):
            self._set_state(rank, NodeState.CONNECTING)
        answers = self._all_or_none(self._probe, range(len(self._nodes)))
        port = self.spec.master_port or answers[0].port
        if port is None:
            raise HostsUnavailable([AgentError(self._nodes[0].host, "the agent found no free port for the master")])
        facts = [HostFacts(python=n.transport.python, torchrun_flags=a.torchrun_flags,
                           address=n.transport.address)
                 for n, a in zip(self._nodes, answers, strict=True)]
        self.plan = self._with_interfaces(lambda spec: build_plan(
            spec, self.script, self.script_args, job_id=self.job_id, name=self.name, facts=facts, master_port=port,
            env_overrides=self.env_overrides, local_cwd=self.local_cwd, grace=self.grace))
        for node, launch in zip(self._nodes, self.plan.nodes, strict=True):
            node.launch = launch
        if run_setup:
            self._setup_all()
        return self.plan

    def _setup(self, rank: int, if_cwd: bool = False) -> None:
        """Node ``rank``'s setup, then its probe and torchrun's argv as the job's interpreter is
        there (``hostchecks.after_setup``: ``AgentError`` when it cannot run the job)."""
        node, launch = self._nodes[rank], self._nodes[rank].launch
        if launch is None or node.agent is None or node.probe is None:
            raise RuntimeError("setup before the probe")
        try:
            answer = decode(node.host, SetupAnswer, node.agent.call(self._request(
                rank, "setup", setup=list(launch.host.setup), env=dict(launch.env), cwd=launch.cwd,
                python=launch.argv[0], if_cwd=if_cwd)), "setup answer")
        except AgentError as exc:
            raise self._redacted(exc, launch) from None
        if answer.skipped:
            self.setup_skipped[rank] = answer.skipped
        if answer.python is None:
            return
        label, node.probe, refused = after_setup(launch.argv[0], node.probe, answer.python)
        if refused is not None:
            raise AgentError(node.host, refused.detail, hint=refused.fix)
        self.set_up[rank] = label
        if self.plan is not None:
            node.launch = with_flags(self.plan, rank, node.probe.torchrun_flags)

    def _redacted(self, exc: AgentError, launch: NodeLaunch) -> AgentError:
        """``exc`` without the job's secret values: a failing setup's output may quote them."""
        message = redact(exc.message, launch.env, self.spec.secret_env)
        return exc if message == exc.message else AgentError(exc.host, message, hint=exc.hint)

    def setup(self, if_cwd: Collection[int] = ()) -> None:
        """Run ``setup`` on every host that has some, in parallel, in the agent that probed it
        (which keeps the environment it made and its output for the start), all or nothing, as
        the probe; for a job prepared with ``run_setup=False``. On the nodes in ``if_cwd`` (a dry
        run whose sync would make the directory) not while the directory is missing
        (``setup_skipped``). ``set_up``: the nodes whose checks now see setup's environment."""
        self._setup_all(if_cwd)

    def _setup_all(self, if_cwd: Collection[int] = ()) -> None:
        self._all_or_none(lambda rank: self._setup(rank, rank in if_cwd),
                          [rank for rank, node in enumerate(self._nodes)
                           if node.launch is not None and node.launch.host.setup])
        if self.plan is not None:  # torchrun's argv as setup's interpreter takes it
            self.plan = dataclasses.replace(self.plan, nodes=tuple(n.launch or p for n, p in zip(
                self._nodes, self.plan.nodes, strict=True)))

    def _all_or_none(self, call: Callable[[int], T], ranks: Iterable[int]) -> list[T]:
        """``call(rank)`` for each of ``ranks``, in parallel: their results in order, or, when any
        failed, ``HostsUnavailable`` naming every host that did, with the agents closed (nothing
        of the job starts: the probe, the route and setup are all or nothing)."""
        futures = [(rank, self._pool.submit(call, rank)) for rank in ranks]
        results: list[T] = []
        errors: list[ClusterrunError] = []
        for rank, future in futures:
            try:
                results.append(future.result())
            except ClusterrunError as exc:
                errors.append(exc)
            except OSError as exc:  # a transport that did not translate its error
                errors.append(TransportError(self._nodes[rank].host, str(exc)))
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
        reached = [reached_address(h, n.transport.address) for h, n in zip(self.spec.hosts, self._nodes, strict=True)]
        answer = node.agent.call(route_request(rank, master, port, reached))
        if answer.get("ok") is False:
            raise AgentError(node.host, str(answer.get("error")))
        network = decode_network(node.host, answer.get("network"), "route answer's network")
        node.probe = dataclasses.replace(node.probe, network=network)
        return network

    def _route_all(self, master: str, port: int) -> list[Network]:
        return self._all_or_none(lambda rank: self._route(rank, master, port), range(len(self._nodes)))

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


__all__ = ["Preparation"]
