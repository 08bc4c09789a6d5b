"""Known failure signatures: what a root cause's last lines mean, in one line, and the fix (pure code).

``SIGNATURES`` is the one table. Each entry has regular expressions searched in the root cause's
last lines, its message and the last lines of its node's torchrun (its failure report), or a
signal; the first entry that matches explains the failure. Its ``cause`` and ``fix`` are
``str.format`` templates filled with the expressions' named groups and ``who``/``node``/``host``/
``rank`` of the root cause; an entry's ``refine`` may add fields from the other nodes' lines (which
hosts show the same error) or decline the match. An entry's ``transient_start`` says why that
failure, when it comes before any rank printed a line of its own, says nothing about the job: the
job's owner then retries it once (``diagnose.transient_start_failure``). The formats were captured
from torch 2.13 with gloo on the CPU (``tests/_support/failures/``); CUDA's and NCCL's are quoted
from reports of real runs. A root cause killed by SIGKILL carries what its host's kernel said of
OOM kills (``RootCause.oom``): ``oom-killed`` explains it only when the kernel's log names its PID
(or the attempt's cgroup counts OOM kills); ``killed`` says what the log said instead, or why it
could not be read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from clusterrun.core.events import Explanation, OomEvidence, RootCause
from clusterrun.core.frozen import frozen

Fields = dict[str, str]


@frozen
class Evidence:
    """What a signature may look at besides its match: the root cause, every node's host and
    every node's last lines (its ranks' and torchrun's)."""

    root: RootCause
    hosts: Mapping[int, str]
    lines: Mapping[int, Sequence[str]]

    def hosts_showing(self, pattern: re.Pattern[str]) -> tuple[list[str], list[str]]:
        """The hosts whose nodes printed a line matching ``pattern``, and those whose did not."""
        showing = {node for node, lines in self.lines.items() if any(pattern.search(line) for line in lines)}
        showing.add(self.root.node)
        unique = len(set(self.hosts.values())) == len(self.hosts)  # else a host runs several nodes: name those
        names = {n: host if unique else f"node{n} {host}" for n, host in self.hosts.items()}
        return ([names[n] for n in sorted(names) if n in showing],
                [names[n] for n in sorted(names) if n not in showing])


@frozen
class Signature:
    """One known failure: patterns (any may match) or a signal, and the one-line cause and fix."""

    name: str
    patterns: tuple[str, ...]
    cause: str
    fix: str
    signal: int | None = None
    refine: Callable[[Fields, Evidence], Fields | None] | None = None
    transient_start: str | None = None  # why it is transient before the job printed anything: retried once


def _names(hosts: Sequence[str]) -> str:
    return ", ".join(hosts)


def _where_module(fields: Fields, evidence: Evidence) -> Fields:
    """Whether the module is missing on some hosts only: then their environments differ."""
    line = re.compile(r"ModuleNotFoundError: No module named '" + re.escape(fields["module"]) + "'")
    missing, others = evidence.hosts_showing(line)
    if others:
        fields["where"] = (f"on {_names(missing)} only ({_names(others)} did not report it): "
                           "the hosts' Python environments differ")
    else:
        fields["where"] = "on " + ("every host" if len(missing) > 1 else missing[0])
    fields["missing"] = _names(missing)
    return fields


def _where_file(fields: Fields, evidence: Evidence) -> Fields:
    missing, others = evidence.hosts_showing(re.compile(r"can't open file '" + re.escape(fields["path"]) + "'"))
    fields["where"] = f"on {_names(missing)}" + (f" ({_names(others)} did not report it)" if others else "")
    fields["missing"] = _names(missing)
    return fields


# torch's own C++ log lines ("[W1123 ...]", "W1123 ..."), warnings and blank lines: not the job's output.
_NOT_THE_JOBS = re.compile(r"^\s*$|^\[?[WIE]\d{4} |Warning|^terminate called", re.IGNORECASE)


def printed_its_own(lines: Iterable[str]) -> bool:
    """Whether a rank's ``lines`` hold output of the job's own (not torch's log lines or warnings)."""
    return any(not _NOT_THE_JOBS.search(line) for line in lines)


def _abort_when(fields: Fields, evidence: Evidence) -> Fields:
    """gloo's abort comes at start-up (the rank printed nothing of its own yet) or at exit."""
    printed = printed_its_own(evidence.root.last_lines)
    fields["when"] = "at exit" if printed else "at start-up"
    fields["why"] = "while tearing down its connections" if printed else "while setting up its connections"
    # A script that calls destroy_process_group() is aborted too, less often (pytorch/examples' FSDP2 here)
    fields["likelier"] = (": a script that ends without destroy_process_group() makes it likelier" if printed
                          else "")
    fields["remedy"] = ("call torch.distributed.destroy_process_group() at the end of the script, on every rank, "
                        "if it does not; if it does, run the job again (gloo's teardown fails now and then)"
                        if printed else "run the job again: `up` retries this once by itself (unless "
                        "--no-retry-startup)")
    return fields


def _peers_not_timed_out(fields: Fields, evidence: Evidence) -> Fields:
    """The ranks that printed no time-out are the ones the others waited for (or were stopped first)."""
    timed_out = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout")
    quiet = []
    for node, lines in sorted(evidence.lines.items()):
        ranks = {int(m.group(1)) for line in lines if (m := re.match(r"\[rank(\d+)\]:", line))}
        for rank in sorted(ranks):
            if not any(line.startswith(f"[rank{rank}]:") and timed_out.search(line) for line in lines):
                quiet.append(f"rank {rank} (node {node}, {evidence.hosts[node]})")
    fields["quiet"] = ("; ranks without a time-out of their own: " + ", ".join(quiet[:4])
                       + (", ..." if len(quiet) > 4 else "")) if quiet else ""
    return fields


def _loopback(why: str) -> Callable[[Fields, Evidence], Fields]:
    """Adds ``loopback``: that the address is one (with ``why`` that matters), or nothing."""
    def refine(fields: Fields, evidence: Evidence) -> Fields:
        addr = fields.get("addr") or ""
        is_loopback = addr.startswith("127.") or addr in ("::1", "localhost")
        fields["loopback"] = f"; {addr} is a loopback address: {why}" if is_loopback else ""
        return fields
    return refine


_LESS_MEMORY = "lower the job's host memory use (batch size, DataLoader workers, pinned memory, data held in RAM)"


def _oom_killed(fields: Fields, evidence: Evidence) -> Fields | None:
    """The kernel's log names the root cause's PID as an OOM kill, or the attempt's cgroup counts
    OOM kills (``memory.events``) where the log could not say: else declined."""
    oom, host = evidence.root.oom, fields["host"]
    if oom is None or not (oom.line or oom.cgroup_kills):
        return None
    if not oom.line:  # counted, not named: which of the attempt's processes is not known
        fields["killed"] = (f"killed by SIGKILL, and the kernel's OOM killer killed {oom.cgroup_kills} process(es) "
                            f"of this attempt on {host} ({oom.cgroup_events}: oom_kill {oom.cgroup_kills}); which ones "
                            f"is not known: {_log_state(oom)}")
        fields["remedy"] = f"{_LESS_MEMORY}, or use a host with more memory"
        return fields
    if oom.memcg:
        where = f" when the memory cgroup {oom.memcg} reached its limit"
        fields["remedy"] = (f"{_LESS_MEMORY}, or raise the memory limit of {oom.memcg} on {host} (memory.max; "
                            "memory.limit_in_bytes in cgroup v1; a container's or a scheduler's limit)")
    else:
        where = f" when {host} ran out of memory" if oom.constraint == "CONSTRAINT_NONE" else ""
        fields["remedy"] = f"{_LESS_MEMORY}, or use a host with more memory"
    fields["killed"] = f"killed by the kernel's OOM killer{where} (PID {oom.pid}); the kernel's log says: {oom.line}"
    return fields


def _log_state(oom: OomEvidence) -> str:
    """Why the kernel's log names no OOM kill of the root cause's PID, in words."""
    if not oom.recorded:
        return ("the node's supervisor recorded nothing of the kernel's log (it did not see torchrun end: it was "
                "killed too, or the host rebooted)")
    if oom.unreadable:
        return f"the kernel's log is not readable here: {oom.unreadable}"
    kills = ", ".join(oom.others[-4:]) + (f" and {len(oom.others) - 4} more" if len(oom.others) > 4 else "")
    if oom.pid_namespace:
        return ("the kernel's log names the host's PIDs, and the job runs in a PID namespace of its own (a "
                "container), so they cannot be matched" + (f" (it names OOM kills at the time: {kills})" * bool(kills)))
    others = f" (it names other OOM kills at the time: {kills})" if kills else ""
    if oom.pid is None:
        return f"the kernel's log was read, but no PID of this process is known{others}"
    lost = ", but some of its records were overwritten before they were read" if oom.overwritten else ""
    return f"the kernel's log names no OOM kill of PID {oom.pid} during the attempt{lost}{others}"


def _killed(fields: Fields, evidence: Evidence) -> Fields:
    """Only SIGKILL was seen: what the kernel's log said (or why it could not), never more."""
    oom, host = evidence.root.oom, fields["host"]
    if oom is None:  # a root cause made without its node's state
        fields["kernel"] = "the kernel's log was not read for it"
        not_oom = False
    else:
        fields["kernel"] = _log_state(oom)
        not_oom = (oom.recorded and not oom.unreadable and not oom.pid_namespace and not oom.overwritten
                   and oom.pid is not None and oom.cgroup_kills in (None, 0))
    if not_oom:
        fields["kernel"] += (": not the kernel's OOM killer (it logs every kill), but a process: a user-space OOM "
                             "killer (systemd-oomd, earlyoom), a scheduler's or a watchdog's limit, a `kill -9`")
        fields["remedy"] = (f"find what sends SIGKILL to the job on {host} (`journalctl` there shows systemd-oomd's "
                            "and earlyoom's kills; a scheduler's limit, a watchdog, a `kill -9`)")
        return fields
    pid = f" {oom.pid}" if oom is not None and oom.pid is not None and not oom.pid_namespace else ""
    fields["kernel"] += "; the kernel's OOM killer sends SIGKILL when memory runs out, and so does a `kill -9`"
    fields["remedy"] = (f"check `dmesg` on {host} (as root) for 'Killed process{pid}'; if it is there, "
                        f"{_LESS_MEMORY}, or use a host with more memory")
    return fields


SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "cuda-out-of-memory",
        (r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory"),
        "{who} ran out of GPU memory (CUDA out of memory)",
        "lower the per-GPU batch size or the memory the model needs (activation checkpointing, mixed "
        "precision); check with nvidia-smi on {host} that no other process holds that GPU"),
    Signature(
        "host-out-of-memory",
        (r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (?P<bytes>\d+) bytes",),
        "{who} could not allocate {bytes} bytes of host memory (not GPU memory)",
        "lower host memory use (batch size, DataLoader workers, data held in RAM) or use a host with more "
        "memory; check `free -g` on {host}"),
    Signature(
        "address-in-use",
        (r"port: (?P<port>\d+),.*(?:EADDRINUSE|address already in use)", r"EADDRINUSE",
         r"[Aa]ddress already in use"),
        "{who} could not listen on the master port{on_port}: another process on {host} holds it",
        "free the port on {host} (`ss -ltnp{ss_filter}` shows who holds it), or let clusterrun choose a free "
        "one at each start (`master: port: auto`, the default, instead of a fixed port)",
        refine=lambda f, e: {**f, "on_port": f" {f['port']}" if f.get("port") else "",
                             "ss_filter": f" 'sport = :{f['port']}'" if f.get("port") else ""},
        transient_start="the master port was taken between the probe and torchrun's bind"),
    Signature(
        "gloo-abort",
        (r"terminate called without an active exception",),
        "gloo aborted {who} {when} {why} (SIGABRT; pytorch/pytorch#188266, torch 2.13){likelier}",
        "{remedy}",
        refine=_abort_when,
        transient_start="gloo aborted a rank while setting up its connections (pytorch/pytorch#188266)"),
    Signature(
        "master-unreachable",
        (r"client socket has timed out after (?P<ms>\d+)ms while trying to connect to "
         r"\((?P<addr>[^,]+), (?P<port>\d+)\)",
         r"client socket has failed to connect to \[(?P<addr>[^\]]+)\]:(?P<port>\d+)"),
        "node {node} ({host}) could not connect to the master {addr}:{port} (torch's rendezvous store)"
        "{loopback}",
        "check that node 0's torchrun is up and that {host} reaches {addr}:{port} (a firewall, or a wrong "
        "address: set `master.addr`, or node 0's `address:`, to one every node can reach)",
        refine=_loopback("it leads to node 0 from node 0 alone")),
    Signature(
        "peer-refused",
        (r"Connection refused, remote=\[(?P<addr>[^\]]+)\](?::(?P<port>\d+))?",
         r"connect(?:ing)? to \[?(?P<addr>[^\]\s]+?)\]?:(?P<port>\d+)[^\n]*Connection refused"),
        "node {node} ({host}) could not connect to a peer at {addr}: connection refused{loopback}",
        "the nodes must reach each other at the address gloo/NCCL advertise: set GLOO_SOCKET_IFNAME "
        "(NCCL_SOCKET_IFNAME for NCCL) in `env:` to the interface that reaches the other nodes, or make each "
        "host's name resolve to that interface's address",
        refine=_loopback("a host's own name resolves to it (/etc/hosts), so gloo advertised it")),
    Signature(
        "collective-timeout",
        (r"Timed out waiting (?P<ms>\d+)ms for (?P<op>send|recv) operation",
         r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=\d+, OpType=(?P<op>\w+).*"
         r"Timeout\(ms\)=(?P<ms>\d+)"),
        "{who} timed out after {ms} ms in a collective ({op}): another rank did not take part — it hung, "
        "is far slower, or could not be reached{quiet}",
        "look at the last lines of the other ranks (`clusterrun logs JOB`); raise the timeout "
        "(init_process_group(timeout=...)) only where one rank is legitimately slow (saving, evaluating)",
        refine=_peers_not_timed_out),
    Signature(
        "state-disk-full",
        (r"could not write its state \(no space left on the file system of (?P<path>/\S*?)/jobs/",
         r"could not write its state \(the file system of (?P<path>/\S*?)/jobs/\S+ is (?P<readonly>read-only)\)"),
        "{host} could not keep node {node}'s log and state: the file system of {path} is {what}",
        "{remedy} on {host} (`df -h {path}`), or set `state_dir:` in the hosts file to a file system with room "
        "for the logs",
        refine=lambda f, e: {**f, "what": "read-only" if f.get("readonly") else "full",
                             "remedy": "make it writable" if f.get("readonly") else "free space there"}),
    Signature(
        "module-missing",
        (r"ModuleNotFoundError: No module named '(?P<module>[^']+)'",),
        "Python module '{module}' not found {where}",
        "install it for the interpreter on {missing} (`python:` in the hosts file names it), or put the "
        "project's code there (`workdir:`, PYTHONPATH in `env:`), so that every host has the same environment",
        refine=_where_module),
    Signature(
        "script-missing",
        (r"can't open file '(?P<path>[^']+)': \[Errno 2\]",),
        "the script {path} does not exist {where}",
        "copy the code to {missing} (SCRIPT is taken relative to each host's `workdir:`), or fix the path",
        refine=_where_file),
    Signature(
        "oom-killed",
        (),
        "{who} was {killed}",
        "{remedy}",
        signal=9,
        refine=_oom_killed),
    Signature(
        "killed",
        (),
        "{who} was killed by SIGKILL; {kernel}",
        "{remedy}",
        signal=9,
        refine=_killed),
)


def _who(root: RootCause) -> str:
    who = f"rank {root.rank}" if root.rank is not None else "torchrun"
    return f"{who} on node {root.node} ({root.host})"


def explain(root: RootCause, hosts: Mapping[int, str], lines: Mapping[int, Sequence[str]],
            signatures: Sequence[Signature] = SIGNATURES) -> Explanation | None:
    """The explanation of the first signature in ``signatures`` that matches ``root``, or None.

    ``lines`` holds per node its last lines, each rank's tagged ``[rankN]:`` as the agent writes
    them, and torchrun's; the root cause's own node supplies its failure report."""
    text = [*root.last_lines, root.message, *(line for line in lines.get(root.node, ())
                                                if not line.startswith("[rank"))]
    evidence = Evidence(root, hosts, lines)
    base = {"who": _who(root), "node": str(root.node), "host": root.host,
            "rank": "" if root.rank is None else str(root.rank)}
    for signature in signatures:
        fields: Fields | None = None
        if signature.signal is not None and root.signal == signature.signal:
            fields = dict(base)
        for pattern in signature.patterns:
            if fields is not None:
                break
            found = next((m for line in text if (m := re.search(pattern, line))), None)
            if found:
                fields = {**base, **{k: v for k, v in found.groupdict().items() if v is not None}}
        if fields is None:
            continue
        if signature.refine is not None:
            fields = signature.refine(fields, evidence)
            if fields is None:
                continue
        blank = _Blank(fields)  # a field no pattern filled reads empty rather than failing the diagnosis
        return Explanation(signature.name, signature.cause.format_map(blank), signature.fix.format_map(blank))
    return None


def transient_start(explanation: Explanation | None) -> str | None:
    """Why the signature that explained a failure is transient at start-up (its ``transient_start``),
    or None: the root cause's explanation decides whether the owner may retry."""
    if explanation is None:
        return None
    return next((s.transient_start for s in SIGNATURES if s.name == explanation.signature), None)


class _Blank(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return ""
