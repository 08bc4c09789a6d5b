"""``clusterrun doctor`` and ``up``'s preflight: is every host ready to run the job?

Per host, in parallel over the job's transports: the connection (reachability, host key, auth),
the interpreter, torch and its CUDA and NCCL versions (the same on every host, else a warning
naming the odd ones), the GPUs the hosts file asks for (``nvidia-smi``), the workdir and the
script (SCRIPT is relative to each host's workdir), free disk in the state dir, the master port
free on node 0 and reachable by TCP from every node (node 0's agent listens on it, every node's
agent connects: ``listen`` / ``reach`` in agent/doctorops.py), the host's clock against this one, and
logind. Each finding is a ``Check``: ✓, ✗ (the job cannot run: with a one-line fix) or !
(it may run, badly: a warning with a fix).

The checks are pure functions of the agents' decoded answers (``host_checks``, ``version_checks``,
``port_checks``); ``run_doctor`` and ``preflight`` only gather the answers. ``preflight`` reuses
the agents ``up`` opened to probe the hosts: its cheap part (workdir, script, disk, clock,
logind) is one more request per host and always runs; the rest (GPUs, versions, the TCP test of
the master port) is skipped by ``up --no-preflight``.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

from clusterrun.agent.wire import (
    InspectRequest,
    ListenRequest,
    ProbeRequest,
    ReachRequest,
    Unlistened,
    UnlistenRequest,
)
from clusterrun.config import ClusterSpec, HostSpec
from clusterrun.errors import (
    AgentError,
    AuthError,
    ClusterrunError,
    ConnectError,
    HostError,
    HostKeyError,
    HostsUnavailable,
)
from clusterrun.interfaces import decide_interfaces, master_derived, reached_address, route_request, settle_master
from clusterrun.plan import HostFacts, master_addr, node_env
from clusterrun.protocol import (
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
from clusterrun.transports import AgentSession, Transport

MIN_PYTHON = (3, 8)
DISK_LOW = 1 << 30  # below this, a warning: logs of a long job fill it
DISK_FULL = 1 << 20  # below this, an error: the supervisor may not be able to write its state files
SKEW_WARN = 1.0  # seconds: the root cause is the failure that ended first by the hosts' clocks
REACH_TIMEOUT = 5.0


class Verdict(str, Enum):
    OK = "✓"
    FAIL = "✗"
    WARN = "!"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table: what was checked, the verdict, what was found, the fix."""

    name: str
    verdict: Verdict
    detail: str
    fix: str | None = None


@dataclass
class HostReport:
    """Every check of one host (node ``rank``)."""

    rank: int
    host: str
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.verdict is Verdict.FAIL for c in self.checks)


@dataclass
class Report:
    hosts: list[HostReport]

    @property
    def failed(self) -> bool:
        return any(h.failed for h in self.hosts)

    def count(self, verdict: Verdict) -> int:
        return sum(1 for h in self.hosts for c in h.checks if c.verdict is verdict)

    def render(self) -> str:
        """The table: one block of rows per host, a fix under each ✗ and !, then a summary line."""
        width = max([len(c.name) for h in self.hosts for c in h.checks] + [5])
        head = max([len(f"node{h.rank} {h.host}") for h in self.hosts] + [4])
        lines = []
        for h in self.hosts:
            where = f"node{h.rank} {h.host}"
            for i, c in enumerate(h.checks):
                lines.append(f"{where if i == 0 else '':<{head}}  {c.verdict} {c.name:<{width}}  {c.detail}")
                if c.fix and c.verdict is not Verdict.OK:
                    lines.append(f"{'':<{head}}    {'':<{width}}  fix: {c.fix}")
        fails, warns = self.count(Verdict.FAIL), self.count(Verdict.WARN)
        bad = [h.host for h in self.hosts if h.failed]
        if fails:
            lines.append(f"\n{fails} problem(s) (✗) on {', '.join(bad)}, {warns} warning(s) (!): the job cannot run")
        else:
            lines.append(f"\nno problem found on {len(self.hosts)} host(s)"
                         + (f", {warns} warning(s) (!)" if warns else ""))
        return "\n".join(lines)


# ------------------------------------------------------------------------------ the checks (pure)


def connection_check(transport: Transport, error: ClusterrunError | None) -> Check:
    """Reachability, host key and authentication, from what ``connect()`` raised (the SSH
    transport's translation of paramiko's errors: its message and hint are the detail and fix)."""
    if error is None:
        where = transport.address or transport.name
        if transport.host.transport == "local":
            return Check("connection", Verdict.OK, "this machine")
        return Check("connection", Verdict.OK, f"reached {where}, host key known, logged in")
    what = ("host key" if isinstance(error, HostKeyError) else "authentication" if isinstance(error, AuthError)
            else "unreachable" if isinstance(error, ConnectError) else "connection")
    fix = error.hint or {"unreachable": "check the address, the port and that sshd runs there (`ssh HOST` must work)",
                         "authentication": "load your key (`ssh-add`) or set identity_file: for this host"}.get(what)
    return Check("connection", Verdict.FAIL, f"{what}: {error.message}", fix)


def python_check(python: str, probe: Probe | None, error: ClusterrunError | None) -> Check:
    if probe is None:
        detail = error.message if error is not None else "the agent did not answer"
        return Check("python", Verdict.FAIL, f"cannot run {python}: {detail}",
                     "install Python >= 3.8 there, or set `python:` for this host to an interpreter that exists")
    if probe.python_version < MIN_PYTHON:
        return Check("python", Verdict.FAIL, f"{python} is Python {probe.python}; 3.8 or newer is needed",
                     "set `python:` for this host")
    return Check("python", Verdict.OK, f"{python}: Python {probe.python}")


def torch_check(python: str, probe: Probe, inspection: Inspection | None) -> Check:
    if not probe.torch:
        return Check("torch", Verdict.FAIL, f"torch is not installed for {python}",
                     "install torch on that host, or set `python:` to an interpreter that has it")
    deep = inspection.deep if inspection is not None else None
    if deep is not None and deep.error:
        return Check("torch", Verdict.FAIL, f"{python} -c 'import torch' fails: {deep.error}",
                     f"repair torch for {python} (try the import on the host)")
    version, cuda, nccl = versions(probe, inspection)
    detail = f"{version}, CUDA {cuda or 'none'}" + (f", NCCL {nccl or 'none'}" if deep is not None else "")
    return Check("torch", Verdict.OK, detail)


def versions(probe: Probe, inspection: Inspection | None) -> tuple[str | None, str | None, str | None]:
    """torch, the CUDA it was built for and its NCCL: as the import said where it ran (``deep``),
    else from torch's version.py (no NCCL then)."""
    deep = inspection.deep if inspection is not None else None
    if deep is not None and not deep.error:
        return deep.version, deep.cuda, deep.nccl
    return probe.torch, inspection.torch_cuda if inspection is not None else None, None


def path_checks(host: HostSpec, inspection: Inspection, script: str | None, synced: bool = False) -> list[Check]:
    """The workdir and the script; ``synced``: a dry run of a sync that would make the one and copy
    the other (the script is looked for in the local directory instead)."""
    where = inspection.cwd
    if synced:
        return [Check("workdir", Verdict.OK, f"{where} (the sync makes or updates it)")]
    rows = []
    kind = inspection.paths.get(".")
    if kind == "dir":
        rows.append(Check("workdir", Verdict.OK, where))
    else:
        what = "does not exist" if kind == "missing" else "is no directory"
        rows.append(Check("workdir", Verdict.FAIL, f"{where} {what}",
                          f"create it on {host.host} (and put your code there), add `sync: .` to the hosts file to "
                          "copy the project there before each start, or fix workdir: for this host"))
        return rows
    if script is not None:
        kind = inspection.paths.get(script)
        if kind == "file":
            rows.append(Check("script", Verdict.OK, f"{script} in {where}"))
        else:
            what = "is missing" if kind == "missing" else "is no file"
            rows.append(Check("script", Verdict.FAIL,
                              f"{script} {what} in {where} (SCRIPT is relative to the host's workdir)",
                              f"copy {script} to {where} on {host.host} (`sync: .` in the hosts file copies the "
                              "project before each start), or fix workdir: for this host"))
    return rows


def disk_check(inspection: Inspection) -> Check:
    if inspection.disk_error or inspection.disk_free is None:
        return Check("state disk", Verdict.FAIL, f"cannot read {inspection.disk_path}: {inspection.disk_error}",
                     "make the state dir's file system readable, or set `state_dir:`")
    free = _size(inspection.disk_free)
    if inspection.disk_free < DISK_FULL:  # full: not even the state files fit
        return Check("state disk", Verdict.FAIL, f"only {free} free in {inspection.disk_path}",
                     "free space there, or set `state_dir:` to a file system with room for the logs")
    if inspection.disk_free < DISK_LOW:
        return Check("state disk", Verdict.WARN, f"only {free} free in {inspection.disk_path} (logs go there)",
                     "free space there, or set `state_dir:` to a file system with more room")
    return Check("state disk", Verdict.OK, f"{free} free in {inspection.disk_path}")


def clock_check(inspection: Inspection, sent: float, answered: float) -> Check:
    """The host's clock against this one: ``sent`` and ``answered`` bracket the request."""
    skew = inspection.time - (sent + answered) / 2
    error = (answered - sent) / 2
    text = f"{skew:+.2f} s against this machine (± {error:.2f} s)"
    if abs(skew) - error > SKEW_WARN:
        return Check("clock", Verdict.WARN, text, "synchronise the clocks (chrony or systemd-timesyncd): "
                     "the root cause is the failure that came first by the hosts' clocks")
    return Check("clock", Verdict.OK, text)


def logind_check(inspection: Inspection) -> Check:
    if not inspection.logind:
        return Check("logind", Verdict.OK, "does not kill the job at logout")
    if inspection.logind_scope:
        return Check("logind", Verdict.OK, "KillUserProcesses=yes: jobs start in a scope of your lingering "
                     "systemd user manager")
    text, _, fix = inspection.logind.partition(" Fix: ")
    return Check("logind", Verdict.FAIL, text, fix or None)


_SMI_GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: (\S+)\))?\s*$")


def gpu_check(host: HostSpec, inspection: Inspection) -> Check | None:
    """The GPUs the hosts file asks for against ``nvidia-smi -L`` and its compute apps."""
    if host.gpus is None:
        return None
    asked = ", ".join(host.gpus)
    if inspection.nvidia_smi is None:
        return Check("gpus", Verdict.WARN, f"cannot check GPUs {asked}: no nvidia-smi on PATH",
                     "install the NVIDIA driver's tools, or use nproc: instead of gpus: on a host without GPUs")
    if inspection.gpu_list is None:
        return Check("gpus", Verdict.FAIL, "nvidia-smi -L failed (no driver loaded?)",
                     f"run `nvidia-smi` on {host.host} and repair the driver")
    found: dict[str, str] = {}  # index and uuid → index
    for line in inspection.gpu_list.splitlines():
        m = _SMI_GPU.match(line.strip())
        if m:
            found[m.group(1)] = m.group(1)
            if m.group(3):
                found[m.group(3)] = m.group(1)
    missing = [g for g in host.gpus if g not in found]
    if missing:
        seen = sorted({v for v in found.values()}, key=int)
        return Check("gpus", Verdict.FAIL, f"GPU {', '.join(missing)} asked for; nvidia-smi sees "
                     f"{', '.join(seen) or 'none'}", "fix gpus: for this host")
    if inspection.deep is not None and not inspection.deep.error and inspection.deep.devices < len(host.gpus):
        return Check("gpus", Verdict.FAIL, f"torch sees {inspection.deep.devices} CUDA device(s), the hosts file "
                     f"asks for {len(host.gpus)}", "install a CUDA build of torch matching the driver")
    uuids = {uuid: index for uuid, index in found.items() if not uuid.isdigit()}
    busy: dict[str, list[str]] = {}
    for line in (inspection.gpu_apps or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0] in uuids:
            name = parts[2].rsplit("/", 1)[-1] if len(parts) > 2 else "?"
            busy.setdefault(uuids[parts[0]], []).append(f"pid {parts[1]} {name}")
    taken = [g for g in host.gpus if found[g] in busy]
    if taken:
        return Check("gpus", Verdict.WARN, "busy: " + "; ".join(f"GPU {g}: {', '.join(busy[found[g]])}" for g in taken),
                     f"stop those processes on {host.host} or choose other gpus:")
    return Check("gpus", Verdict.OK, f"{asked} present, none busy")


def imports_check(host: HostSpec, python: str, inspection: Inspection, script: str) -> Check | None:
    """The script's top-level imports against the host's interpreter (found, not imported)."""
    if inspection.imports_missing is None and inspection.imports_error is None:
        return None  # not asked, or the script is missing (its own row says so)
    if inspection.imports_error is not None:
        return Check("imports", Verdict.WARN, f"cannot look for {script}'s imports: {inspection.imports_error}")
    missing = inspection.imports_missing or ()
    if missing:
        return Check("imports", Verdict.FAIL, f"{script} imports {', '.join(missing)}, not found by {python}",
                     f"install {' and '.join(missing)} on {host.host} for {python}, or add the directory that "
                     "holds it to PYTHONPATH in env:")
    return Check("imports", Verdict.OK, f"every top-level import of {script} is found")


def host_checks(host: HostSpec, python: str, probe: Probe, inspection: Inspection, *, script: str | None,
                sent: float, answered: float, full: bool, synced: bool = False) -> list[Check]:
    """Every check of one host that its own probe and ``inspect`` answers decide."""
    rows = [torch_check(python, probe, inspection)] if full else []
    rows += path_checks(host, inspection, script, synced)
    if script is not None and (imports := imports_check(host, python, inspection, script)) is not None:
        rows.append(imports)
    rows.append(disk_check(inspection))
    if full and (gpus := gpu_check(host, inspection)) is not None:
        rows.append(gpus)
    rows += [clock_check(inspection, sent, answered), logind_check(inspection)]
    return rows


def version_checks(found: Mapping[int, tuple[str, Mapping[str, str | None]]]) -> dict[int, Check]:
    """Hosts whose Python (major.minor), torch, CUDA or NCCL differ from the others': a warning for
    each odd host, naming what the rest run. ``found``: rank → (host, {what: version}). The value
    most hosts have is the reference (a tie: node 0's)."""
    if len(found) < 2:
        return {}
    odd: dict[int, list[str]] = {}
    reference: dict[str, str | None] = {}
    for what in ("Python", "torch", "CUDA", "NCCL"):
        values = {rank: v[what] for rank, (_, v) in found.items() if what in v}
        if len(set(values.values())) < 2:
            continue
        counts = Counter(values.values())
        first = values[min(values)]
        ref = max(counts, key=lambda v: (counts[v], v == first))
        reference[what] = ref
        others = [found[r][0] for r, v in values.items() if v == ref]
        for rank, value in values.items():
            if value != ref:
                odd.setdefault(rank, []).append(f"{what} {value or 'none'} here, {ref or 'none'} on "
                                                f"{', '.join(others)}")
    checks = {}
    for rank in found:
        if rank in odd:
            checks[rank] = Check("same versions", Verdict.WARN, "; ".join(odd[rank]),
                                 "install the same versions on every host (mismatches hang or crash collectives)")
        else:
            checks[rank] = Check("same versions", Verdict.OK, "as every other host" if not reference
                                 else "as most hosts (the odd ones warn)")
    return checks


def port_checks(names: Mapping[int, str], addr: str, port: int, listen_error: str | None,
                reached: Mapping[int, tuple[bool, str | None]], fixed: bool) -> dict[int, Check]:
    """Node 0 could (``listen_error`` None) or could not open the master port; every node in
    ``reached`` did or did not get node 0's answer by TCP at ``addr:port``."""
    node0 = names[0]
    checks: dict[int, Check] = {}
    if listen_error is not None:
        fix = ("choose another master.port, or `port: auto`" if fixed
               else f"free a port between 20000 and 32000 on {node0}")
        checks[0] = Check("master port", Verdict.FAIL, f"{port} cannot be opened on {node0}: {listen_error}", fix)
        return checks
    for rank, (ok, error) in sorted(reached.items()):
        if ok:
            checks[rank] = Check("master port", Verdict.OK, f"{addr}:{port} on {node0} reached by TCP"
                                 + (" (free there)" if rank == 0 else ""))
        else:
            checks[rank] = Check("master port", Verdict.FAIL, f"{addr}:{port} on {node0} not reached by TCP: {error}",
                                 f"allow TCP to port {port} on {node0} from {names[rank]} (firewall), or set "
                                 "master.addr (or node 0's address:) to an address every node reaches")
    return checks


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# ------------------------------------------------------------------------------ gathering answers


@dataclass
class _Host:
    """What is known of one host while the doctor runs."""

    rank: int
    transport: Transport
    session: AgentSession | None = None
    probe: Probe | None = None
    inspection: Inspection | None = None
    checks: list[Check] = field(default_factory=list)


def _cwd(host: HostSpec, local_cwd: str | None) -> str | None:
    """Where torchrun will run on the host (as plan.build_plan decides)."""
    return host.workdir or (local_cwd if host.transport == "local" else None)


def _inspect(h: _Host, script: str | None, spec: ClusterSpec, local_cwd: str | None, *, deep: bool,
             full: bool, synced: bool = False, imports: bool = False) -> None:
    """Ask the host's agent ``inspect`` and add the checks its answers decide (``imports``: the
    script's top-level imports too)."""
    if h.session is None or h.probe is None:
        return
    host = h.transport.host
    paths = ["."] + ([script] if script is not None else [])
    request = InspectRequest(cwd=_cwd(host, local_cwd), paths=paths, state_dir=spec.state_dir, deep=deep,
                             gpus=full and host.gpus is not None, imports=script if imports else None,
                             pythonpath=host.env.get("PYTHONPATH"))
    sent = time.time()
    try:
        answer = h.session.call(request)
    except HostError as exc:  # the agent failed, or the connection was lost on the way
        h.checks.append(Check("agent", Verdict.FAIL, exc.message, exc.hint))
        return
    answered = time.time()
    h.inspection = decode_inspection(h.transport.name, answer)
    h.checks += host_checks(host, h.transport.python, h.probe, h.inspection, script=script, sent=sent,
                            answered=max(sent, answered - h.inspection.elapsed), full=full, synced=synced)


def _port_test(hosts: Sequence[_Host], addr: str, port: int | None, pool: ThreadPoolExecutor, *, fixed: bool) -> None:
    """Node 0's agent listens on the master port; every node's agent connects to it at ``addr``."""
    node0 = hosts[0]
    if node0.session is None:
        return
    token = secrets.token_hex(8)
    names = {h.rank: h.transport.name for h in hosts}
    try:
        listening = decode_listening(node0.transport.name,
                                     node0.session.call(ListenRequest(port=port, token=token)))
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
        results = dict(zip([h.rank for h in able], pool.map(reach, able), strict=True))
    finally:
        try:
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
        addr, networks = settle_master(addr, derived, lambda master: list(pool.map(lambda h: route(h, master), hosts)))
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
    pool = ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts))), thread_name_prefix="clusterrun-doctor")

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
        if h.probe is None:
            return
        _inspect(h, script, spec, local_cwd, deep=True, full=True, imports=True)

    try:
        list(pool.map(examine, hosts))
        node0 = hosts[0]
        if node0.session is not None and node0.probe is not None:
            addr = master_addr(spec, HostFacts(python=node0.transport.python, address=node0.transport.address))
            addr = _interfaces(hosts, addr, spec.master_port or 29500, pool,  # any port: the route is what counts
                               derived=master_derived(spec))
            _port_test(hosts, addr, spec.master_port, pool, fixed=spec.master_port is not None)
        _versions(hosts)
    finally:
        for h in hosts:
            if h.session is not None:
                h.session.close()
            h.transport.close()
        pool.shutdown()
    return Report([HostReport(h.rank, h.transport.name, h.checks) for h in hosts])


def preflight(sessions: Sequence[tuple[Transport, AgentSession | None, Probe | None]], spec: ClusterSpec,
              script: str, *, addr: str, port: int, local_cwd: str | None, full: bool,
              synced: Collection[int] = (), test_port: bool = True) -> Report:
    """``up``'s checks on hosts its agents have probed already (``sessions``, by node rank): the
    workdir and the script (not on the nodes in ``synced``: a dry run of a sync that would make and
    copy them), disk, clock and logind always; with ``full`` the GPUs, the versions and the master
    port's TCP test as well (unless ``test_port`` is false: a restart's fixed port, held by the
    attempt it replaces); with ``full``, on hosts that declare ``gpus``, that torch sees as many CUDA
    devices. The sessions stay open (``up`` starts the nodes with them)."""
    hosts = [_Host(rank, t, s, p) for rank, (t, s, p) in enumerate(sessions)]
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts))), thread_name_prefix="clusterrun-preflight") as pool:
        # torch is imported (a few seconds) only where the hosts file declares GPUs: that it sees them all
        list(pool.map(lambda h: _inspect(h, script, spec, local_cwd, deep=full and h.transport.host.gpus is not None,
                                         full=full, synced=h.rank in synced), hosts))
        if full and test_port:
            _port_test(hosts, addr, port, pool, fixed=spec.master_port is not None)
            _versions(hosts)
    return Report([HostReport(h.rank, h.transport.name, h.checks) for h in hosts])


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


__all__ = ["Check", "HostReport", "Report", "Verdict", "preflight", "refusal", "run_doctor"]
