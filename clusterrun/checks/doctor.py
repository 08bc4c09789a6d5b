"""``clusterrun doctor`` and ``up``'s preflight: is every host ready to run the job?

Per host, in parallel over the job's transports: the connection (reachability, host key, auth),
the interpreter, torch and its CUDA and NCCL versions (the same on every host, else a warning
naming the odd ones), the GPUs the hosts file asks for (``nvidia-smi``), the workdir and the
script (SCRIPT is relative to each host's workdir), free disk in the state dir, the master port
free on node 0 and reachable by TCP from every node (node 0's agent listens on it, every node's
agent connects: ``listen`` / ``reach`` in agent/doctorops.py), the host's clock against this one, and
logind. Each finding is a ``Check``: ✓, ✗ (the job cannot run: with a one-line fix) or !
(it may run, badly: a warning with a fix).

The checks are pure functions of the agents' decoded answers (hostchecks.py: ``host_checks``,
``version_checks``, ``port_checks``); ``run_doctor`` and ``Preflight`` here only gather the
answers. ``Preflight`` reuses the agents ``up`` opened to probe the hosts: its cheap part
(workdir, script, disk, clock, logind) always runs; the rest (GPUs, versions, the TCP test of
the master port) is skipped by ``up --no-preflight``. What nothing before the preflight changes
goes in the probe's request (``Preflight.ahead``: ``inspect`` where no setup or sync comes first,
node 0's listener, which its start closes), so ``up`` adds one request per host: ``reach``.
"""

from __future__ import annotations

import difflib
import os
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from clusterrun.agent.wire import (
    InspectRequest,
    ListenRequest,
    ProbeRequest,
    ReachRequest,
    SetupAnswer,
    SetupRequest,
    Unlistened,
    UnlistenRequest,
)
from clusterrun.config.environment import redact
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.config.nodesets import hosts_alike
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, ClusterrunError, ConnectError, HostError, HostsUnavailable
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import (
    Inspection,
    Network,
    Probe,
    decode,
    decode_inspection,
    decode_listening,
    decode_network,
    decode_probe,
    decode_reach,
)
from clusterrun.run.hostchecks import (  # re-exported: the checks are the doctor's vocabulary
    Check,
    HostReport,
    Report,
    Verdict,
    after_setup,
    clock_check,
    connection_check,
    disk_check,
    gpu_check,
    host_checks,
    port_checks,
    python_check,
    version_checks,
    versions,
)
from clusterrun.run.interfaces import decide_interfaces, master_derived, reached_address, route_request, settle_master
from clusterrun.run.plan import HostFacts, master_addr, node_env
from clusterrun.run.probing import Ahead, Early
from clusterrun.sync.copy import source_of
from clusterrun.transports import AgentSession, Transport

REACH_TIMEOUT = 5.0
DOCTOR_JOB = "doctor"  # the job id of the doctor's setup, in its own agent's memory only


@dataclass
class _Host:
    """What is known of one host while the doctor runs."""

    rank: int
    transport: Transport
    session: AgentSession | None = None
    probe: Probe | None = None
    inspection: Inspection | None = None
    checks: list[Check] = field(default_factory=list)
    # (job, attempt) whose setup ran on this host in its agent: the python checks see its
    # environment, and the job's interpreter there as named in the rows
    setup_of: tuple[str, int] | None = None
    python: str = ""


def close_script(script: str | None, cwd: str | None) -> str | None:
    """A file beside ``script`` in ``cwd`` (this machine's directory) whose name is close to it
    (``trian.py``: ``train.py``), as the path was given; None when the script is there or none is close."""
    if not script or not cwd or os.path.isfile(os.path.join(cwd, script)):
        return None
    folder = os.path.join(cwd, os.path.dirname(script))
    try:
        names = [e.name for e in os.scandir(folder) if e.is_file()]
    except OSError:
        return None
    close = difflib.get_close_matches(os.path.basename(script), names, n=1, cutoff=0.75)
    return os.path.join(os.path.dirname(script), close[0]) if close else None


def _cwd(host: HostSpec, local_cwd: str | None) -> str | None:
    """Where torchrun will run on the host (as plan.build_plan decides)."""
    return host.workdir or (local_cwd if host.transport == "local" else None)


def inspect_request(host: HostSpec, rank: int, script: str | None, spec: ClusterSpec, local_cwd: str | None, *,
                    deep: bool, full: bool, imports: bool = False,
                    setup_of: tuple[str, int] | None = None) -> InspectRequest:
    """The host's ``inspect`` (``imports``: the script's top-level imports too; ``setup_of``: the
    (job, attempt) whose setup ran in its agent, whose environment the python checks see)."""
    paths = ["."] + ([script] if script is not None else [])
    job, attempt = setup_of or (None, 0)
    return InspectRequest(cwd=_cwd(host, local_cwd), paths=paths, state_dir=spec.state_dir, deep=deep,
                          gpus=full and host.gpus is not None, imports=script if imports else None,
                          pythonpath=host.env.get("PYTHONPATH"), job=job, node=rank, attempt=attempt)


def _inspect(h: _Host, script: str | None, spec: ClusterSpec, local_cwd: str | None, *, deep: bool,
             full: bool, close: str | None, synced: bool = False, imports: bool = False) -> None:
    """Ask the host's agent ``inspect`` and add the checks its answers decide (``imports``: the
    script's top-level imports too; ``close``: ``close_script``'s, for every host)."""
    if h.session is None or h.probe is None:
        return
    request = inspect_request(h.transport.host, h.rank, script, spec, local_cwd, deep=deep, full=full,
                              imports=imports, setup_of=h.setup_of)
    sent = time.time()
    try:
        answer = h.session.call(request)
    except HostError as exc:  # the agent failed, or the connection was lost on the way
        h.checks.append(Check("agent", Verdict.FAIL, exc.message, exc.hint))
        return
    _inspected(h, decode_inspection(h.transport.name, answer), script, sent, time.time(), full=full, synced=synced,
               close=close)


def _inspected(h: _Host, inspection: Inspection, script: str | None, sent: float, answered: float, *,
               full: bool, synced: bool, close: str | None) -> None:
    """The checks the host's ``inspect`` answer decides (``sent`` and ``answered`` bracket it;
    ``close``: a name of this directory close to a missing script's)."""
    assert h.probe is not None
    h.inspection = inspection
    h.checks += host_checks(h.transport.host, h.python or h.transport.python, h.probe, inspection, script=script,
                            sent=sent, answered=max(sent, answered - inspection.elapsed), full=full, synced=synced,
                            setup=h.setup_of is not None, close=close)


def _setup(h: _Host, spec: ClusterSpec, local_cwd: str | None, synced: bool = False) -> bool:
    """The host's ``setup`` run as ``up`` runs it, so that the python checks see the environment it
    makes (under a job id of the doctor's: nothing starts, the agent forgets it when it ends);
    its row. False when the job cannot run there (the row says why)."""
    assert h.session is not None and h.probe is not None
    host, python = h.transport.host, h.transport.python
    env = node_env(host, {})
    request = SetupRequest(job=DOCTOR_JOB, node=h.rank, attempt=0, setup=list(host.setup), env=env,
                           cwd=_cwd(host, local_cwd), python=python, if_cwd=True)
    try:
        answer = decode(h.transport.name, SetupAnswer, h.session.call(request), "setup answer")
    except HostError as exc:
        h.checks.append(Check("setup", Verdict.FAIL, redact(exc.message, env, spec.secret_env),
                              exc.hint or "fix the setup: commands of this host (run them there in bash)"))
        return False
    if answer.skipped or answer.python is None:
        h.checks.append(Check("setup", Verdict.WARN, f"not run: {answer.skipped or 'no answer'}; the checks "
                              f"below are of {python} without it",
                              "`up` syncs first, then runs setup and checks after it" if synced
                              else "create the workdir (or let `up`'s sync make it)"))
        return True
    h.python, h.probe, refused = after_setup(python, h.probe, answer.python)
    if refused is not None and answer.python.error:
        h.checks.append(refused)
        return False
    h.setup_of = (DOCTOR_JOB, 0)
    h.checks.append(Check("setup", Verdict.OK, f"{len(host.setup)} command(s) ran; the job runs {h.python}: "
                          f"Python {h.probe.python}"))
    return True


def _port_test(hosts: Sequence[_Host], addr: str, port: int | None, pool: ThreadPoolExecutor, *, fixed: bool,
               early: Early | None = None) -> None:
    """Node 0's agent listens on the master port; every node's agent connects to it at ``addr``.
    With ``early`` (its probe opened the listener: ``Preflight.ahead``) node 0's start closes it."""
    node0 = hosts[0]
    if node0.session is None:
        return
    token = early.token if early is not None else secrets.token_hex(8)
    names = {h.rank: h.transport.name for h in hosts}
    try:
        if early is not None and early.listen_error is not None:
            raise AgentError(node0.transport.name, early.listen_error)
        listening = early.listening if early is not None and early.listening is not None else decode_listening(
            node0.transport.name, node0.session.call(ListenRequest(port=port, token=token)))
    except HostError as exc:
        node0.checks.append(Check("master port", Verdict.FAIL, exc.message, exc.hint))
        return
    if not listening.listening:
        rows = port_checks(names, addr, listening.port, listening.error, {}, fixed=fixed)
        node0.checks.append(rows[0])
        return

    def reach(h: _Host) -> tuple[bool, str | None]:
        assert h.session is not None
        try:
            answer = decode_reach(h.transport.name, h.session.call(
                ReachRequest(addr=addr, port=listening.port, token=token, timeout=REACH_TIMEOUT)))
        except AgentError as exc:
            return False, exc.message
        except ClusterrunError as exc:  # the transport gave up waiting (its read timeout) or lost the host
            return False, f"the test got no answer from this host ({exc.message})"
        return answer.reached, answer.error

    able = [h for h in hosts if h.session is not None and h.probe is not None]  # an agent that answers
    try:
        results = dict(zip([h.rank for h in able], parallel.map_all(pool, reach, able), strict=True))
    finally:
        try:
            if early is None:
                decode(node0.transport.name, Unlistened, node0.session.call(UnlistenRequest(port=listening.port)),
                       "unlisten answer")
        except HostError:
            pass  # the listener ends with the agent anyway
    rows = port_checks(names, addr, listening.port, None, results, fixed=fixed)
    for h in able:
        h.checks.append(rows[h.rank])


def _interfaces(hosts: Sequence[_Host], addr: str, port: int, pool: ThreadPoolExecutor, *, derived: bool) -> str:
    """The network interface each node's ranks would use, as ``up`` chooses it (``interfaces``):
    every host's agent asks its kernel how it reaches the master; a node that cannot (loopback
    from another machine, no route) gets a ✗ with the fix. Returns the master address ``up``
    would use: ``addr``, or node 0's address towards the others for a ``derived`` one that
    another machine cannot use (``settle_master``)."""
    if any(h.session is None or h.probe is None for h in hosts):
        return addr  # the choice needs every node's route; the rows above say which host failed
    reached = [reached_address(h.transport.host, h.transport.address) for h in hosts]

    def route(h: _Host, master: str) -> Network:
        assert h.session is not None
        answer = h.session.call(route_request(h.rank, master, port, reached))
        return decode_network(h.transport.name, answer.get("network"), "route answer's network")

    try:
        addr, networks = settle_master(addr, derived,
                                       lambda master: parallel.map_all(pool, lambda h: route(h, master), hosts))
    except HostError as exc:
        next(h for h in hosts if h.transport.name == exc.host).checks.append(
            Check("interface", Verdict.FAIL, exc.message, exc.hint))
        return addr
    names = [h.transport.name for h in hosts]
    # each node's environment as the plan sets it (``node_env``, on the hosts' env completed by
    # ``environment.resolve``, which the caller did as ``up`` does): the variables the user set win
    chosen, errors = decide_interfaces(addr, names, networks, [node_env(h.transport.host, {}) for h in hosts])
    failed = {e.host: e for e in errors}
    for h, interface in zip(hosts, chosen, strict=True):
        error = failed.get(h.transport.name)
        h.checks.append(Check("interface", Verdict.FAIL, error.message, error.hint) if error is not None
                        else Check("interface", Verdict.OK, interface.describe()))
    return addr


def _versions(hosts: Sequence[_Host]) -> None:
    found: dict[int, tuple[str, dict[str, str | None]]] = {}
    for h in hosts:
        if h.probe is None or not h.probe.torch:
            continue
        torch, cuda, nccl = versions(h.probe, h.inspection)
        values: dict[str, str | None] = {"Python": ".".join(h.probe.python.split(".")[:2]), "torch": torch,
                                         "CUDA": cuda}
        if h.inspection is not None and h.inspection.deep is not None:
            values["NCCL"] = nccl
        found[h.rank] = (h.transport.name, values)
    for rank, check in version_checks(found).items():
        hosts[rank].checks.append(check)


def run_doctor(spec: ClusterSpec, script: str | None, factory: Callable[[HostSpec], Transport], *,
               local_cwd: str | None = None) -> Report:
    """Every check on every host of ``spec``, in parallel; nothing is started."""
    hosts = [_Host(rank, factory(h)) for rank, h in enumerate(spec.hosts)]
    synced = {rank for rank, h in enumerate(spec.hosts) if h.sync is not None}  # up's sync makes the workdir first
    close = close_script(script, local_cwd)

    def examine(h: _Host) -> None:
        error: ClusterrunError | None = None
        try:
            h.transport.connect()
        except ClusterrunError as exc:
            error = exc
        except OSError as exc:
            error = ConnectError(h.transport.name, str(exc))
        h.checks.append(connection_check(h.transport, error))
        if error is not None:
            return
        try:
            h.session = h.transport.session()
            h.probe = decode_probe(h.transport.name, h.session.call(ProbeRequest(state_dir=spec.state_dir)))
        except ClusterrunError as exc:
            error = exc
        h.checks.append(python_check(h.transport.python, h.probe, error))
        if h.probe is None or h.transport.host.setup and not _setup(h, spec, local_cwd, h.rank in synced):
            return
        _inspect(h, script, spec, local_cwd, deep=True, full=True, close=close, imports=True, synced=h.rank in synced)

    try:
        with parallel.threads(min(32, len(hosts)), "clusterrun-doctor") as pool:
            _examine_all(hosts, spec, examine, pool)
    finally:
        for h in hosts:
            if h.session is not None:
                h.session.close()
            h.transport.close()
    return Report([HostReport(h.rank, h.transport.name, h.checks) for h in hosts])


def _examine_all(hosts: Sequence[_Host], spec: ClusterSpec, examine: Callable[[_Host], None],
                 pool: ThreadPoolExecutor) -> None:
    """``examine`` every host, then the checks between them: the interfaces, the master port, the versions."""
    parallel.map_all(pool, examine, hosts)
    node0 = hosts[0]
    if node0.session is not None and node0.probe is not None:
        addr = master_addr(spec, HostFacts(python=node0.transport.python, address=node0.transport.address))
        addr = _interfaces(hosts, addr, spec.master_port or 29500, pool,  # any port: the route is what counts
                           derived=master_derived(spec))
        _port_test(hosts, addr, spec.master_port, pool, fixed=spec.master_port is not None)
    _versions(hosts)


@frozen
class Preflight:
    """``up``'s checks of one attempt, asked once and run in two parts: the requests that can go with
    the probes (``ahead``), then the rest on the probed hosts (``run``). Always the workdir and the
    script, disk, clock and logind; with ``full`` the GPUs, the versions and the master port's TCP
    test as well (unless ``test_port`` is false: a restart's fixed port, held by the attempt it
    replaces), and on hosts that declare ``gpus``, that torch sees as many CUDA devices. ``recheck``:
    an automatic restart's hosts, checked minutes ago and just probed (reachable): without ``full``,
    the master port's TCP test too (unless ``test_port`` is false); not the GPUs and the versions.
    ``sync_dir`` and ``copies`` (not a dry run): the sync that fills hosts before their inspection."""

    spec: ClusterSpec
    script: str
    local_cwd: str | None
    full: bool
    test_port: bool = True
    recheck: bool = False
    sync_dir: str | None = None
    copies: bool = True

    def ahead(self) -> Ahead:
        """The requests that can go with the probes (``Job.prepare(ahead=)``): the ``inspect`` of each
        host whose answer nothing before ``run`` changes (no ``setup:``; no sync copies to it first: its
        ``sync:`` or ``sync_dir``, where the sync ``copies``), and node 0's listener on the master port
        when ``run`` tests it (``full`` or ``recheck``, and ``test_port``)."""
        spec = self.spec
        inspect = {rank: inspect_request(host, rank, self.script, spec, self.local_cwd,
                                         deep=self.full and host.gpus is not None, full=self.full)
                   for rank, host in enumerate(spec.hosts)
                   if not host.setup and not (self.copies and source_of(spec, host, self.sync_dir))}
        listen = (ListenRequest(port=spec.master_port, token=secrets.token_hex(8))
                  if self._tests_port() else None)
        return Ahead(inspect=inspect, listen=listen)

    def run(self, sessions: Sequence[tuple[Transport, AgentSession | None, Probe | None]], *, addr: str,
            port: int, synced: Collection[int] = (), set_up: Mapping[int, str] | None = None,
            setup_of: tuple[str, int] | None = None, early: Mapping[int, Early] | None = None) -> Report:
        """The checks on hosts whose agents have probed them already (``sessions``, by node rank; they
        stay open: ``up`` starts the nodes with them), not the workdir and the script on the nodes in
        ``synced`` (a dry run of a sync that would make and copy them). On the nodes of ``set_up``
        (rank → the job's interpreter there, in words), whose setup for ``setup_of`` (job, attempt)
        ran in these agents, the python checks run in its environment. ``early``: by rank, what the
        probes answered of ``ahead``'s requests, which are not asked again."""
        script, local_cwd, full = self.script, self.local_cwd, self.full
        close = close_script(script, local_cwd)
        hosts = [_Host(rank, t, s, p) for rank, (t, s, p) in enumerate(sessions)]
        early = early or {}
        for h in hosts:
            if set_up and h.rank in set_up and setup_of is not None:
                h.setup_of, h.python = setup_of, set_up[h.rank]

        def inspect(h: _Host) -> None:
            came = early.get(h.rank)
            if came is not None and came.inspect_error is not None and h.probe is not None:
                h.checks.append(Check("agent", Verdict.FAIL, came.inspect_error))
            elif came is not None and came.inspection is not None and h.probe is not None:
                _inspected(h, came.inspection, script, came.sent, came.answered, full=full, synced=h.rank in synced,
                           close=close)
            else:  # torch is imported (a few seconds) only where the hosts file declares GPUs: that it sees them all
                _inspect(h, script, self.spec, local_cwd, deep=full and h.transport.host.gpus is not None, full=full,
                         close=close, synced=h.rank in synced)

        with parallel.threads(min(32, len(hosts)), "clusterrun-preflight") as pool:
            parallel.map_all(pool, inspect, hosts)
            if self._tests_port():
                came = early.get(0)
                _port_test(hosts, addr, port, pool, fixed=self.spec.master_port is not None,
                           early=came if came is not None and (came.listening or came.listen_error) else None)
                if not self.recheck:
                    _versions(hosts)
        return Report([HostReport(h.rank, h.transport.name, h.checks) for h in hosts])

    def _tests_port(self) -> bool:
        return (self.full or self.recheck) and self.test_port


def warnings(report: Report) -> list[str]:
    """The preflight's warnings, a line each: ``host: check: detail (fix: ...)``; past ``FOLD_PAST``
    hosts, the hosts of one warning on one line (``64 hosts gpu[01-64]: ...``)."""
    warned = [(h.host, f"{c.name}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else ""))
              for h in report.hosts for c in h.checks if c.verdict is Verdict.WARN]
    return hosts_alike(warned, len(report.hosts))


def refusal(report: Report) -> HostsUnavailable | None:
    """The error ``up`` stops with when the preflight found a ✗: one line per problem, with its fix."""
    errors: list[ClusterrunError] = [AgentError(h.host, f"{c.name}: {c.detail}", hint=c.fix)
                                     for h in report.hosts for c in h.checks if c.verdict is Verdict.FAIL]
    if not errors:
        return None
    refused = HostsUnavailable(errors)
    refused.message = (f"{sum(1 for h in report.hosts if h.failed)} host(s) cannot run the job (preflight); "
                       "nothing was started")
    return refused


__all__ = ["Check", "HostReport", "Report", "Verdict", "clock_check", "connection_check", "disk_check", "gpu_check",
           "Preflight", "inspect_request", "refusal", "run_doctor", "version_checks", "warnings"]
