"""The doctor's verdicts: each finding on a host is a ``Check`` (✓, ✗ with a fix, ! with a fix),
decided by pure functions of the agents' decoded answers (``host_checks``, ``version_checks``,
``port_checks``); doctor.py gathers the answers and ``Report.render`` draws the table."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from clusterrun.agent.wire import JobPython
from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import AuthError, ClusterrunError, ConnectError, HostKeyError
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import Inspection, Probe
from clusterrun.transports import Transport

MIN_PYTHON = (3, 8)
DISK_LOW = 1 << 30  # below this, a warning: logs of a long job fill it
DISK_FULL = 1 << 20  # below this, an error: the supervisor may not be able to write its state files
SKEW_WARN = 1.0  # seconds: the root cause is the failure that ended first by the hosts' clocks


class Verdict(str, Enum):
    OK = "✓"
    FAIL = "✗"
    WARN = "!"

    def __str__(self) -> str:
        return self.value


@frozen
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


def after_setup(python: str, probe: Probe, seen: JobPython) -> tuple[str, Probe, Check | None]:
    """The job's interpreter as the host's setup leaves it (``seen``): its name in messages, the
    probe as it sees it (its Python, torch, torchrun's flags) and the refusal when it cannot run
    the job (not found, or no torch)."""
    if seen.error:
        return python, probe, Check("python", Verdict.FAIL, f"after setup: {seen.error}",
                                    f"have setup put {python} on the PATH (activate the environment), or set "
                                    "`python:` for this host to the interpreter's full path")
    label = f"{python} ({seen.executable}, after setup)" if seen.executable != python else f"{python} (after setup)"
    probe = dataclasses.replace(probe, python=seen.python or probe.python, torch=seen.torch,
                                torchrun_flags=tuple(seen.torchrun_flags or ()))
    return label, probe, None if seen.torch else torch_check(label, probe, None, setup=True)


def torch_check(python: str, probe: Probe, inspection: Inspection | None, *, setup: bool = False) -> Check:
    """``setup``: ``python`` is the job's interpreter in the environment the host's setup made."""
    if not probe.torch:
        where = "there, have setup: activate an environment that has it" if setup else "on that host"
        return Check("torch", Verdict.FAIL, f"torch is not installed for {python}",
                     f"install torch {where}, or set `python:` to an interpreter that has it")
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


def path_checks(host: HostSpec, inspection: Inspection, script: str | None, synced: bool = False,
                close: str | None = None) -> list[Check]:
    """The workdir and the script; ``synced``: a dry run of a sync that would make the one and copy
    the other (the script is looked for in the local directory instead); ``close``: a file of this
    directory whose name is close to a missing script's (``doctor.close_script``)."""
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
                              (f"did you mean {close}? else " if close else "")
                              + f"copy {script} to {where} on {host.host} (`sync: .` in the hosts file copies the "
                              "project before each start), or fix workdir: for this host"))
    return rows


def disk_check(inspection: Inspection) -> Check:
    if inspection.disk_error or inspection.disk_free is None:
        return Check("state disk", Verdict.FAIL, f"cannot read {inspection.disk_path}: {inspection.disk_error}",
                     "make the state dir's file system readable, or set `state_dir:`")
    free = _size(inspection.disk_free)
    if not inspection.disk_writable:
        return Check("state disk", Verdict.FAIL, f"{inspection.disk_path} is not writable (a read-only file system, "
                     "or its permissions)", "make it writable for this user, or set `state_dir:` in the hosts file")
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
    deep = inspection.deep if inspection.deep is not None and not inspection.deep.error else None
    if inspection.nvidia_smi is None and (deep.cuda if deep is not None else inspection.torch_cuda) is None:
        return Check("gpus", Verdict.FAIL, f"GPU {asked} asked for; no nvidia-smi on PATH and torch is built "
                     "without CUDA: the job would run on the CPU",
                     f"install the NVIDIA driver and a CUDA build of torch on {host.host}, or use nproc: instead of "
                     "gpus: on a host without GPUs")
    if inspection.nvidia_smi is None and deep is not None and deep.devices < len(host.gpus):
        return Check("gpus", Verdict.FAIL, f"GPU {asked} asked for; no nvidia-smi on PATH and torch sees "
                     f"{deep.devices} CUDA device(s)", f"install the NVIDIA driver on {host.host}, or use nproc: "
                     "instead of gpus: on a host without GPUs")
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
                sent: float, answered: float, full: bool, synced: bool = False, setup: bool = False,
                close: str | None = None) -> list[Check]:
    """Every check of one host that its own probe and ``inspect`` answers decide (``setup``: both
    as the job's interpreter sees them in the environment of the host's setup; ``close``: see ``path_checks``)."""
    rows = [torch_check(python, probe, inspection, setup=setup)] if full else []
    rows += path_checks(host, inspection, script, synced, close)
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


__all__ = ["Check", "HostReport", "MIN_PYTHON", "Report", "Verdict", "after_setup", "clock_check", "connection_check",
           "disk_check", "gpu_check", "host_checks", "imports_check", "path_checks", "port_checks", "python_check",
           "torch_check", "version_checks", "versions"]
