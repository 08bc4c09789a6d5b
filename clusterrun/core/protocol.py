"""The controller's side of the agent protocol: answers decoded once, into frozen dataclasses.

The agent (``clusterrun.agent``, stdlib only; its docstring specifies the protocol) answers with JSON
lines. This module is the only place the controller reads them: a field that is missing or of
the wrong type is a ``ProtocolError`` naming the host, the message and the field, never a
``KeyError`` deep inside a policy. ``PROTOCOL`` is the version this controller speaks; the agent
states its own in every ``probe`` answer, and a mismatch is refused before anything starts.

The requests, and the answers not decoded here, are typed in ``clusterrun.agent.wire`` (shared
with the agent; ``decode`` reads those answers). Decoded here: ``probe`` (``Probe``), ``route``
(``Network``, also ``Probe.network``), a node's state file as ``start``, ``status`` and
``follow`` report it (``NodeStatus``), and the messages of a ``follow`` stream (``LogChunk``,
``StateUpdate``, ``Beat``, ``End``, ``Eof``). ``stop``'s answer (``wire.StopAnswer``) becomes
the node's ``events.StopReport`` (``stop_report``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from enum import Enum
from typing import Any, TypeVar

from clusterrun.agent.wire import Message, StopAnswer, SyncHashes
from clusterrun.core.errors import AgentError
from clusterrun.core.events import StopReport
from clusterrun.core.frozen import frozen
from clusterrun.core.progress import Progress

PROTOCOL = 2  # agent.PROTOCOL: bumped by any change a controller of the previous version would misread


class ProtocolError(AgentError):
    """The agent on ``host`` answered something this controller cannot read (a missing field,
    a wrong type, another protocol version)."""


class HostState(str, Enum):
    """``state.state`` in the agent's answers."""

    ABSENT = "absent"  # never started (no attempt directory)
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"  # neither the supervisor nor torchrun runs any more, and no exit was recorded


@frozen
class Worker:
    """One worker process torchrun started, as the supervisor recorded it."""

    rank: int | None
    local_rank: int | None
    pid: int | None
    died: float | None  # wall-clock time it ended
    exit_code: int | None = None  # as its host's monitor read it (negative: killed by that signal)


@frozen
class OomKill:
    """One OOM kill as the host's kernel logged it (/dev/kmsg): its victim's PID (the kernel's:
    of the host's initial PID namespace) and command, the ``Killed process`` line, and from its
    ``oom-kill:`` line the constraint (``CONSTRAINT_MEMCG``: a cgroup's limit was reached) and
    the memory cgroups, where those lines were read."""

    pid: int
    comm: str = ""
    line: str | None = None  # "Out of memory: Killed process PID (COMM) ..."
    summary: str | None = None  # "oom-kill:constraint=...,pid=PID,uid=U"
    constraint: str | None = None
    oom_memcg: str | None = None
    task_memcg: str | None = None


@frozen
class KernelOom:
    """What the host's kernel said of OOM kills during an attempt that failed (``oom`` in the
    agent's state): the kills its log shows (of any process), or why the log could not be read;
    ``oom_kill`` of the attempt's cgroup's ``memory.events``, or why there is none."""

    kills: tuple[OomKill, ...] = ()
    kmsg: str = "/dev/kmsg"
    kmsg_error: str | None = None
    overwritten: bool = False  # records were lost in the kernel's ring buffer before they were read
    pid_namespace: bool = False  # the job's PIDs are not the kernel's (a container)
    cgroup_events: str | None = None
    cgroup_oom_kills: int | None = None
    cgroup_error: str | None = None
    hardware: tuple[str, ...] = ()  # the kernel's lines of a failing machine: GPU Xids, machine checks, ECC


@frozen
class NodeStatus:
    """A node's state file as the agent reports it."""

    state: HostState
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None
    stop_requested: bool = False
    stopped_by: str | None = None  # with ``stop_requested``: who stopped it, in words (``StopRequest.by``)
    stop_at: float | None = None  # when a stop first reached the host (its clock): what ended earlier, it did not end
    torchrun_pid: int | None = None
    ended_at: float | None = None
    workers: tuple[Worker, ...] = ()
    degraded: str | None = None  # why the supervisor could not write its state (a full or read-only disk)
    oom: KernelOom | None = None  # what the kernel said of OOM kills, once torchrun has exited non-zero
    exit_unknown: bool = False  # torchrun ended after its survivor: nobody reaped it, its status is not known
    quiet_since: float | None = None  # its ranks wrote nothing since, for hang_after at least (the host's watch)
    rdzv_joined: bool | None = None  # before its workers: torchrun is connected to the master port (None: unknown)
    progress: Progress | None = None  # the training's progress, on the node of rank 0 (``agent/progress.py``)
    rebooted: bool = False  # lost: the host's boot id changed since the job started
    exit_learned: str | None = None  # how torchrun's exit code was learned where it was not reaped or was cut short
    failed_rank: int | None = None  # with ``exit_learned``: the rank that failed first, as the host's monitor found it
    # The controller's, not the host's: when contact with the host was lost just before it said
    # ``lost`` (the stream that said so was the first after the outage): when the host went away.
    away_since: float | None = None
    unanswered: bool = False  # the controller's: the host never answered again (lost after a wait for it)
    contained: bool = False  # it ended, and its attempt's cgroup was emptied and removed: nothing of it is left

    @property
    def ended(self) -> bool:
        return self.state in (HostState.EXITED, HostState.LOST)


@frozen
class Route:
    """How a host reaches ``target``: the address it resolves to there, the local source address
    the kernel picks and its interface, or ``error`` (unresolvable, no route)."""

    target: str
    resolved: str | None = None
    source: str | None = None
    interface: str | None = None
    loopback: bool = False
    error: str | None = None
    hosts_line: str | None = None  # "/etc/hosts:2: 127.0.1.1 gpu-a": what maps a name to a loopback ``resolved``


@frozen
class Network:
    """How a host reaches the master (the agent's ``route``): ``peer`` is the first other node it
    reaches through an interface other than loopback, looked for when the master is reached
    through loopback or not at all; ``netns`` identifies its network namespace (equal on one
    machine); ``preset`` the interface variables set in its own environment."""

    netns: str
    master: Route
    peer: Route | None = None
    preset: Mapping[str, str] = field(default_factory=dict)


@frozen
class Probe:
    """What ``probe`` says of a host."""

    hostname: str
    python: str  # "3.11.7"
    torch: str | None
    torchrun_flags: tuple[str, ...]
    boot_id: str
    port: int | None
    state_dir: str
    protocol: int
    containment: str = "sweep"  # what a stop on this host relies on: "cgroup" or "sweep"
    fallbacks: tuple[str, ...] = ()  # what the host lacks, in words (no cgroup and why, no pidfd, ...)
    network: Network | None = None  # how it reaches the master, once asked (``route_to``)

    @property
    def python_version(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.python.split(".")[:2] if p.isdigit())


@frozen
class LogChunk:
    """Complete lines of the log from byte ``offset``; ``next`` is where to resume. ``times``:
    when they were written, ``(byte offset, wall-clock ns)``: the bytes from each offset on,
    up to the next one's, the first at or before ``offset`` (none from an older agent)."""

    offset: int
    next: int
    data: str
    times: tuple[tuple[int, int], ...] = ()

    @property
    def written(self) -> float | None:
        """When its last lines were written (wall clock, s), if the agent said."""
        return self.times[-1][1] / 1e9 if self.times else None

    def timed_runs(self) -> list[tuple[int | None, str]]:
        """The chunk's lines in runs written at one time (ns), if known: each run's text is whole
        lines, each ended by a newline (a last line without one gets one). A line takes the time of
        the last entry at or before its first byte (the first entry's, before it). Cut where
        the entries say, never line by line: ``logs`` of a big job passes millions of lines."""
        raw = self.data.encode("utf-8", "surrogateescape")
        if raw and not raw.endswith(b"\n"):
            raw += b"\n"
        if not self.times:
            return [(None, raw.decode("utf-8", "surrogateescape"))] if raw else []
        runs, start, when = [], 0, self.times[0][1]
        for offset, ns in self.times[1:]:
            at = offset - self.offset
            if at > 0:  # the first line that starts at or after ``at`` (not "\r": a rank's progress bar)
                cut = raw.find(b"\n", at - 1) + 1
                if not cut:
                    break
                if cut > start:
                    runs.append((when, raw[start:cut]))
                    start = cut
            when = ns
        if start < len(raw):
            runs.append((when, raw[start:]))
        return [(ns, text.decode("utf-8", "surrogateescape")) for ns, text in runs]


@frozen
class StateUpdate:
    status: NodeStatus


@frozen
class Beat:
    """Nothing happened for a while; the agent and its connection are alive."""


@frozen
class End:
    """The node's job has ended (``status.ended``); nothing follows."""

    status: NodeStatus


@frozen
class Eof:
    """A ``once`` follow reached the end of what is written while the job runs."""

    next: int
    status: NodeStatus


FollowMessage = LogChunk | StateUpdate | Beat | End | Eof


class _Reader:
    """Typed access to one answer's fields, failing with the host, the message and the field."""

    def __init__(self, host: str, what: str, data: Any) -> None:
        if not isinstance(data, Mapping):
            raise ProtocolError(host, f"the agent's {what} is not an object: {data!r:.200}")
        self.host, self.what, self.data = host, what, data

    def _fail(self, key: str, expected: str) -> ProtocolError:
        return ProtocolError(self.host, f"the agent's {self.what} has {key}={self.data.get(key)!r:.100}; "
                             f"expected {expected}", hint="the agent and this controller differ: are both "
                             "clusterrun of the same version?")

    def integer(self, key: str) -> int | None:
        """The field if it is an integer, None if it is missing or null."""
        value: object = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, "an integer")
        return value

    def need_integer(self, key: str) -> int:
        value: object = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, "an integer")
        return value

    def number(self, key: str) -> float | None:
        value: object = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, "a number")
        return float(value)

    def text(self, key: str) -> str | None:
        """The field if it is a string, None if it is missing or null."""
        value: object = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._fail(key, "a string")
        return value

    def need_text(self, key: str) -> str:
        value: object = self.data.get(key)
        if not isinstance(value, str):
            raise self._fail(key, "a string")
        return value

    def items(self, key: str) -> list[Any]:
        value: object = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._fail(key, "a list")
        return value

    def mapping(self, key: str) -> Mapping[str, Any]:
        value: object = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self._fail(key, "an object")
        return value


def decode_status(host: str, state: Any, what: str = "state") -> NodeStatus:
    """A node's state file as an answer carries it (``answer["state"]``)."""
    r = _Reader(host, what, state)
    raw = r.text("state") or HostState.STARTING.value
    try:
        kind = HostState(raw)
    except ValueError:
        raise r._fail("state", "one of " + ", ".join(s.value for s in HostState)) from None
    torchrun = _Reader(host, f"{what}.torchrun", r.mapping("torchrun"))
    workers = []
    for i, entry in enumerate(r.items("workers")):
        w = _Reader(host, f"{what}.workers[{i}]", entry)
        workers.append(Worker(rank=w.integer("rank"), local_rank=w.integer("local_rank"),
                              pid=w.integer("pid"), died=w.number("died"), exit_code=w.integer("exit_code")))
    return NodeStatus(state=kind, exit_code=r.integer("exit_code"), signal=r.integer("signal"),
                      error=r.text("error"), stop_requested=bool(r.data.get("stop_requested")),
                      stopped_by=r.text("stopped_by") or None, stop_at=r.number("stop_at"),
                      torchrun_pid=torchrun.integer("pid"), ended_at=r.number("ended_at"),
                      workers=tuple(workers), degraded=r.text("degraded") or None,
                      exit_unknown=r.data.get("exit_status") == "unknown", rebooted=r.data.get("rebooted") is True,
                      exit_learned=r.text("exit_learned") or None, failed_rank=r.integer("failed_rank"),
                      contained=r.data.get("cgroup_removed") is True,
                      quiet_since=r.number("quiet_since"),
                      rdzv_joined=r.data.get("rdzv_joined") if isinstance(r.data.get("rdzv_joined"), bool) else None,
                      progress=Progress.from_json(r.data.get("progress")),
                      oom=None if r.data.get("oom") is None else decode_oom(host, r.data["oom"], f"{what}.oom"))


def decode_oom(host: str, data: Any, what: str = "state.oom") -> KernelOom:
    """The ``oom`` of a node's state: what the kernel said of OOM kills during the attempt."""
    r = _Reader(host, what, data)
    kills = []
    for i, entry in enumerate(r.items("kills")):
        k = _Reader(host, f"{what}.kills[{i}]", entry)
        kills.append(OomKill(pid=k.need_integer("pid"), comm=k.text("comm") or "", line=k.text("line"),
                             summary=k.text("summary"), constraint=k.text("constraint"), oom_memcg=k.text("oom_memcg"),
                             task_memcg=k.text("task_memcg")))
    return KernelOom(kills=tuple(kills), kmsg=r.text("kmsg") or "/dev/kmsg", kmsg_error=r.text("kmsg_error"),
                     overwritten=bool(r.data.get("overwritten")), pid_namespace=bool(r.data.get("pid_namespace")),
                     cgroup_events=r.text("cgroup_events"), cgroup_oom_kills=r.integer("cgroup_oom_kills"),
                     cgroup_error=r.text("cgroup_error"),
                     hardware=tuple(str(line) for line in r.items("hardware") if isinstance(line, str)))


def decode_probe(host: str, answer: Any) -> Probe:
    r = _Reader(host, "probe answer", answer)
    protocol = r.integer("protocol") or 0
    if protocol != PROTOCOL:
        raise ProtocolError(host, f"the agent speaks protocol {protocol}, this controller {PROTOCOL}",
                            hint="run the same clusterrun version everywhere; remove ~/.cache/clusterrun on the "
                            "host if an old agent was cached there")
    flags = r.items("torchrun_flags")
    if not all(isinstance(f, str) for f in flags):
        raise r._fail("torchrun_flags", "a list of strings")
    fallbacks = r.items("fallbacks")
    if not all(isinstance(f, str) for f in fallbacks):
        raise r._fail("fallbacks", "a list of strings")
    return Probe(hostname=r.need_text("hostname"), python=r.need_text("python"), torch=r.text("torch"),
                 torchrun_flags=tuple(flags), boot_id=r.need_text("boot_id"), port=r.integer("port"),
                 state_dir=r.need_text("state_dir"), protocol=protocol,
                 containment=r.text("containment") or "sweep", fallbacks=tuple(fallbacks),
                 network=None if r.data.get("network") is None else decode_network(host, r.data["network"]))


def _decode_route(host: str, what: str, data: Any) -> Route:
    r = _Reader(host, what, data)
    loopback: object = r.data.get("loopback", False)
    if not isinstance(loopback, bool):
        raise r._fail("loopback", "true or false")
    return Route(target=r.need_text("target"), resolved=r.text("resolved"), source=r.text("source"),
                 interface=r.text("interface"), loopback=loopback, error=r.text("error"),
                 hosts_line=r.text("hosts_line"))


def decode_network(host: str, data: Any, what: str = "network") -> Network:
    """The ``network`` of a ``route`` or ``probe`` answer."""
    r = _Reader(host, what, data)
    preset = r.mapping("preset")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in preset.items()):
        raise r._fail("preset", "an object of strings")
    peer = r.data.get("peer")
    return Network(netns=r.need_text("netns"), master=_decode_route(host, f"{what}.master", r.data.get("master")),
                   peer=None if peer is None else _decode_route(host, f"{what}.peer", peer), preset=dict(preset))


def decode_follow(host: str, message: Any) -> FollowMessage:
    """One message of a ``follow`` stream; an ``{ok: false, error}`` raises ``AgentError``."""
    r = _Reader(host, "follow message", message)
    if r.data.get("ok") is False:
        raise AgentError(host, r.text("error") or "the agent failed")
    kind = r.data.get("t")
    if kind == "log":
        times = r.data.get("times") or []
        if not isinstance(times, list) or not all(
                isinstance(t, list) and len(t) == 2 and all(type(v) is int for v in t) for t in times):
            raise r._fail("times", "a list of [offset, ns] pairs")
        data = r.data.get("data")
        if not isinstance(data, bytes):  # a log's bytes come raw after its line (``transports.frames``)
            raise r._fail("data", "the log's bytes")
        return LogChunk(offset=r.need_integer("offset"), next=r.need_integer("next"),
                        data=data.decode("utf-8", "surrogateescape"), times=tuple((t[0], t[1]) for t in times))
    if kind == "beat":
        return Beat()
    if kind == "state":
        return StateUpdate(decode_status(host, r.data.get("state")))
    if kind == "end":
        return End(decode_status(host, r.data.get("state")))
    if kind == "eof":
        return Eof(next=r.need_integer("next"), status=decode_status(host, r.data.get("state")))
    raise r._fail("t", "log, state, beat, end or eof")


# ------------------------------------------------------------------------------------------ sync


@frozen
class RemoteEntry:
    """What ``sync_stat`` found at one path below the workdir."""

    kind: str  # f file, d directory, l symlink, o anything else
    size: int
    mtime_ns: int
    mode: int
    target: str | None = None  # a symlink's


@frozen
class SyncStat:
    """The answer to ``sync_stat``: the workdir as the host sees it, and what is at each path asked for."""

    root: str
    exists: bool
    entries: Mapping[str, RemoteEntry]
    dev: int | None = None
    ino: int | None = None
    boot_id: str | None = None
    rsync: str | None = None  # the host's rsync, on the agent's PATH


def decode_sync_stat(host: str, answer: Any) -> SyncStat:
    r = _Reader(host, "sync_stat answer", answer)
    entries: dict[str, RemoteEntry] = {}
    for path, item in r.mapping("entries").items():
        if (not isinstance(item, list) or len(item) != 5 or item[0] not in ("f", "d", "l", "o")
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:4])
                or not (item[4] is None or isinstance(item[4], str))):
            raise r._fail("entries", "[kind, size, mtime_ns, mode, target] for each path")
        entries[str(path)] = RemoteEntry(item[0], item[1], item[2], item[3], item[4])
    return SyncStat(root=r.need_text("root"), exists=bool(r.data.get("exists")), entries=entries,
                    dev=r.integer("dev"), ino=r.integer("ino"), boot_id=r.text("boot_id"),
                    rsync=r.text("rsync"))


def decode_sync_hashes(host: str, answer: Any) -> dict[str, str]:
    return dict(decode(host, SyncHashes, answer, "sync_hash answer").hashes)


M = TypeVar("M", bound=Message)


def decode(host: str, kind: type[M], answer: Any, what: str) -> M:
    """An answer whose type ``clusterrun.agent.wire`` defines, or a ``ProtocolError`` naming the field."""
    try:
        return kind.from_json(answer, f"the agent's {what}")
    except ValueError as exc:
        raise ProtocolError(host, str(exc), hint="the agent and this controller differ: are both clusterrun of "
                                                  "the same version?") from None

def stop_report(host: str, node: int, answer: Any) -> StopReport:
    """Node ``node``'s ``StopReport`` of the agent's answer to ``stop`` (``ProtocolError`` if it is
    not a ``wire.StopAnswer``); the grace ran out when torchrun itself had to be SIGKILLed."""
    stop = decode(host, StopAnswer, answer, "stop answer")
    killed = tuple(stop.killed or ())
    torchrun = stop.state.get("torchrun") if stop.state is not None else None
    pid = torchrun.get("pid") if isinstance(torchrun, dict) else None
    return StopReport(node, host, killed=killed, left=tuple(stop.left or ()), containment=stop.containment,
                      verified=stop.verified, detail=stop.detail or "", fallbacks=tuple(stop.fallbacks or ()),
                      degraded=stop.degraded or None, notes=tuple(stop.notes or ()),
                      grace=float(stop.grace) if stop.grace is not None else None, records_gone=stop.records_gone,
                      found_by=tuple(stop.found_by or ()), looked=tuple(stop.looked or ()),
                      torchrun_pid=pid if isinstance(pid, int) else None, at_once=stop.at_once,
                      grace_ran_out=pid is not None and not stop.at_once
                      and any(k.get("pid") == pid and k.get("signal") == "SIGKILL" for k in killed))


# ------------------------------------------------------------------- doctor (inspect, listen, reach)


@frozen
class DeepTorch:
    """What the host's interpreter says after importing torch (``inspect`` with ``deep``)."""

    version: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    devices: int = 0
    error: str | None = None


@frozen
class Inspection:
    """What ``inspect`` says of a host (the doctor's checks beyond the probe)."""

    cwd: str
    paths: Mapping[str, str]  # path → file, dir, missing, other
    time: float  # the host's clock when the request arrived
    elapsed: float = 0.0  # how long the answer took on the host
    disk_path: str = ""
    disk_free: int | None = None
    disk_error: str | None = None
    disk_writable: bool = True  # this user may write there (no read-only file system, the permissions)
    torch_cuda: str | None = None
    deep: DeepTorch | None = None
    nvidia_smi: str | None = None  # its path, None where it is missing (or not asked)
    gpu_list: str | None = None
    gpu_apps: str | None = None
    logind: str = ""
    logind_scope: bool = False
    imports_missing: tuple[str, ...] | None = None  # the script's top-level imports not found (if asked)
    imports_error: str | None = None  # why they could not be looked for


def decode_inspection(host: str, answer: Any) -> Inspection:
    r = _Reader(host, "inspect answer", answer)
    paths = r.mapping("paths")
    if not all(isinstance(v, str) for v in paths.values()):
        raise r._fail("paths", "an object of strings")
    disk = _Reader(host, "inspect answer's disk", r.mapping("disk"))
    deep = None
    if r.data.get("deep") is not None:
        d = _Reader(host, "inspect answer's deep", r.mapping("deep"))
        deep = DeepTorch(version=d.text("version"), cuda=d.text("cuda"), nccl=d.text("nccl"),
                         devices=d.integer("devices") or 0, error=d.text("error"))
    imports = _Reader(host, "inspect answer's imports", r.data.get("imports") or {})
    missing = imports.data.get("missing")
    if missing is not None and not (isinstance(missing, list) and all(isinstance(m, str) for m in missing)):
        raise imports._fail("missing", "a list of module names")
    return Inspection(cwd=r.need_text("cwd"), paths=dict(paths), time=r.number("time") or 0.0,
                      elapsed=r.number("elapsed") or 0.0,
                      disk_path=disk.text("path") or "", disk_free=disk.integer("free"), disk_error=disk.text("error"),
                      disk_writable=disk.data.get("writable") is not False, torch_cuda=r.text("torch_cuda"),
                      deep=deep, nvidia_smi=r.text("nvidia_smi"),
                      gpu_list=r.text("gpu_list"), gpu_apps=r.text("gpu_apps"), logind=r.text("logind") or "",
                      logind_scope=bool(r.data.get("logind_scope")),
                      imports_missing=None if missing is None else tuple(missing), imports_error=imports.text("error"))


@frozen
class Listening:
    """``listen``'s answer: the port, and whether it could be bound (else ``error`` says why)."""

    port: int
    listening: bool
    error: str | None = None


def decode_listening(host: str, answer: Any) -> Listening:
    r = _Reader(host, "listen answer", answer)
    return Listening(port=r.need_integer("port"), listening=bool(r.data.get("listening")), error=r.text("error"))


@frozen
class Reach:
    """``reach``'s answer: whether node 0's listener answered, else why not."""

    reached: bool
    error: str | None = None
    local: str | None = None  # the address the connection went out from


def decode_reach(host: str, answer: Any) -> Reach:
    r = _Reader(host, "reach answer", answer)
    return Reach(reached=bool(r.data.get("reached")), error=r.text("error"), local=r.text("local"))


# The answers decoded here, by op (a follow's stream: its messages); clusterrun.agent.wire.ANSWERS
# has the others (tests/test_wire.py: every op has both types).
ANSWERS: dict[str, tuple[type, ...]] = {
    "probe": (Probe,), "route": (Network,), "status": (NodeStatus,), "follow": (LogChunk, StateUpdate, Beat, End, Eof),
    "sync_stat": (SyncStat,), "inspect": (Inspection,), "listen": (Listening,), "reach": (Reach,),
}
