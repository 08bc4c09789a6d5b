"""Every operation's request, and the answers ``protocol.py`` does not decode, as frozen dataclasses
shared by both sides: the controller builds requests with them (``to_json``), the agent decodes
each request line into its type (``REQUESTS[op].from_json``: a missing or mistyped field is a bad
request naming it). Stdlib only and shipped in the zip; the package docstring says what each
field means. The answers of probe, route, status, follow, sync_stat, inspect, listen and reach are
decoded by ``protocol.py`` on the controller.

At the agent's start ``dataclasses`` would import ``inspect`` and ``re`` (docs/benchmarks.md): at run
time ``dataclass`` is ``_frozen`` below, which makes the same ``__init__``, ``__eq__`` and
``__repr__`` of a frozen dataclass from the class's annotations; type checkers see the real one.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import dataclass
    from typing import Any, ClassVar, TypeVar

    T = TypeVar("T", bound="Message")
else:
    def dataclass(frozen: bool = True) -> Any:
        return _frozen

_MISSING = object()

# A ``follow`` or ``run`` stream says something at least this often (seconds), so a reader can
# tell a dead connection from a quiet job: no message for a few heartbeats means the link is gone.
HEARTBEAT = 5.0


def _frozen(cls: type) -> type:
    """A frozen dataclass made without ``dataclasses`` (see the module docstring)."""
    names = tuple(n for n, a in cls.__dict__.get("__annotations__", {}).items() if not a.startswith("ClassVar"))
    inherited = tuple(n for base in reversed(cls.__mro__[1:]) for n in getattr(base, "FIELDS", ()))
    names = inherited + tuple(n for n in names if n not in inherited)
    defaults = {n: k.__dict__[n] for n in names for k in reversed(cls.__mro__) if n in k.__dict__}

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__} takes {len(names)} fields")
        values = dict(zip(names, args))  # noqa: B905 - hosts may run Python 3.8 (no strict=)
        for name, value in kwargs.items():
            if name not in names or name in values:
                raise TypeError(f"{cls.__name__}: unexpected or repeated field {name!r}")
            values[name] = value
        for name in names:
            value = values.get(name, defaults.get(name, _MISSING))
            if value is _MISSING:
                raise TypeError(f"{cls.__name__} needs {name!r}")
            object.__setattr__(self, name, value)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise AttributeError(f"{cls.__name__} is frozen")

    def __eq__(self: Any, other: Any) -> bool:
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in names)

    def __repr__(self: Any) -> str:
        return "{}({})".format(cls.__name__, ", ".join(f"{n}={getattr(self, n)!r}" for n in names))

    for name, value in (("__init__", __init__), ("__setattr__", __setattr__), ("__eq__", __eq__),
                        ("__repr__", __repr__), ("__hash__", None), ("FIELDS", names)):
        setattr(cls, name, value)
    return cls


def _fits(value: Any, annotation: str) -> bool:
    """Whether a JSON value fits the annotation (the few forms used here)."""
    if " | " in annotation:
        return any(_fits(value, part) for part in annotation.split(" | "))
    if annotation in ("Any", "object"):
        return True
    if annotation == "None":
        return value is None
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation == "str":
        return isinstance(value, str)
    if annotation.startswith("list[") and annotation.endswith("]"):
        return isinstance(value, list) and all(_fits(v, annotation[5:-1]) for v in value)
    if annotation.startswith("dict[str, ") and annotation.endswith("]"):
        return isinstance(value, dict) and all(isinstance(k, str) and _fits(v, annotation[10:-1])
                                               for k, v in value.items())
    nested = _NESTED.get(annotation)
    return nested is not None and isinstance(value, dict)


class Message:
    """What every request and answer has: its fields (``FIELDS``) and their JSON form."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        return {name: _plain(getattr(self, name)) for name in self.FIELDS}

    @classmethod
    def from_json(cls: type[T], data: Any, what: str = "") -> T:
        """The message ``data`` holds; ``ValueError`` naming the field that is missing or mistyped."""
        what = what or cls.__name__
        if not isinstance(data, dict):
            raise ValueError(f"{what} is not an object")
        annotations: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            annotations.update(klass.__dict__.get("__annotations__", {}))
        values = {}
        for name in cls.FIELDS:
            annotation = annotations[name]
            if name not in data or data[name] is None and "None" not in annotation:
                if getattr(cls, name, _MISSING) is _MISSING:
                    raise ValueError(f"{what}: {name} is missing")
                continue  # its default
            value = data[name]
            if not _fits(value, annotation):
                raise ValueError(f"{what}: {name} must be {annotation}, not {type(value).__name__}")
            kind = annotation.split(" | ")[0]
            nested = _NESTED.get(kind[5:-1] if kind.startswith("list[") else kind)
            if nested is not None and isinstance(value, dict):
                value = nested.from_json(value, f"{what}.{name}")
            elif nested is not None and isinstance(value, list):
                value = [nested.from_json(v, f"{what}.{name}[{i}]") for i, v in enumerate(value)]
            values[name] = value
        return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class Request(Message):
    """A request: its ``op`` travels with its fields."""

    op: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **super().to_json()}


# ------------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class RouteTarget(Message):
    addr: str
    port: int = 9
    peers: list[str] | None = None
    always_peers: bool = False


@dataclass(frozen=True)
class ProbeRequest(Request):
    op: ClassVar[str] = "probe"
    state_dir: str | None = None
    free_port: bool = False
    route_to: RouteTarget | None = None
    # the preflight's requests answered in the probe's exchange (a round trip fewer each): ``listen``
    # is node 0's listener on the master port, kept open until its start's ``unlisten``
    inspect: InspectRequest | None = None
    listen: ListenRequest | None = None


@dataclass(frozen=True)
class RouteRequest(Request):
    op: ClassVar[str] = "route"
    route_to: RouteTarget | None = None


@dataclass(frozen=True)
class NodeRequest(Request):
    """What names one node's attempt (``remove`` ignores ``attempt``: every attempt of the node)."""

    job: str
    node: int
    attempt: int = 1
    state_dir: str | None = None


@dataclass(frozen=True)
class SetupRequest(NodeRequest):
    op: ClassVar[str] = "setup"
    setup: list[str] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    setup_timeout: float | None = None
    python: str | None = None  # the job's interpreter (torchrun's argv[0]): how it runs after setup
    if_cwd: bool = False  # a dry run whose sync would make cwd: nothing runs while it is missing


@dataclass(frozen=True)
class StartRequest(NodeRequest):
    op: ClassVar[str] = "start"
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    first_rank: int = 0
    secret_env: list[str] | None = None
    setup: list[str] | None = None
    setup_timeout: float | None = None
    about: dict[str, Any] | None = None
    hang_after: float | None = None  # seconds without output after which the node is quiet (None: never)
    progress: str | None = None  # the hosts file's pattern of rank 0's progress lines (None: the known formats)
    unlisten: int | None = None  # the preflight's listener on this port closed first (torchrun binds it)


@dataclass(frozen=True)
class FollowRequest(NodeRequest):
    op: ClassVar[str] = "follow"
    offset: int = 0
    tail: int | None = None
    before: int | None = None
    logs: bool = True
    once: bool = False
    interval: float | None = None  # the least time between two reads of the log (None: follow.POLL_INTERVAL)
    asks: bool = False  # a stop may come on stdin while it streams (``serve.answer_aside``): the job's own follower


@dataclass(frozen=True)
class StopRequest(NodeRequest):
    op: ClassVar[str] = "stop"
    grace: float = 10.0
    by: str | None = None  # who stops it, for the mark in its log (``restart``, ``down``, ...; None: clusterrun)
    # The attempt fails anyway (fail-fast, the start-up watch): where it has a cgroup, torchrun is
    # SIGKILLed and the cgroup killed at once, without torchrun's own SIGTERM shutdown (``grace``).
    failing: bool = False
    # This node failed first (its host saw a rank exit non-zero): the stop only cuts torchrun's
    # teardown short; its end stays that rank's failure (``monitor.FAILED_STOP``), not a stop.
    failed: bool = False


@dataclass(frozen=True)
class StatusRequest(NodeRequest):
    op: ClassVar[str] = "status"


@dataclass(frozen=True)
class RemoveRequest(NodeRequest):
    op: ClassVar[str] = "remove"


@dataclass(frozen=True)
class StackRequest(NodeRequest):
    """The Python stacks of the attempt's live ranks (``ranks``: only these global ranks); with
    ``looks`` 2, twice, ``apart`` seconds apart, with what each rank did meanwhile."""

    op: ClassVar[str] = "stack"
    ranks: list[int] | None = None
    native: bool = False
    timeout: float = 10.0
    looks: int = 1
    apart: float = 3.0


NODE_REQUESTS: dict[str, type[NodeRequest]] = {
    c.op: c for c in (SetupRequest, StartRequest, FollowRequest, StopRequest, StatusRequest, RemoveRequest,
                      StackRequest)}


def node_request(op: str, **fields: Any) -> NodeRequest:
    """The request ``op`` for one node's attempt, from its fields (a field it does not have is a TypeError)."""
    return NODE_REQUESTS[op](**fields)


@dataclass(frozen=True)
class JobsRequest(Request):
    op: ClassVar[str] = "jobs"
    state_dir: str | None = None


@dataclass(frozen=True)
class SyncStatRequest(Request):
    op: ClassVar[str] = "sync_stat"
    root: str
    paths: list[str] | None = None


@dataclass(frozen=True)
class SyncHashRequest(Request):
    op: ClassVar[str] = "sync_hash"
    root: str
    paths: list[str] | None = None


@dataclass(frozen=True)
class SyncPutRequest(Request):
    """Its entries' data follows the request line on stdin (see ``sync_put``)."""

    op: ClassVar[str] = "sync_put"
    root: str
    entries: list[dict[str, Any]] | None = None
    root_mode: int | None = None


@dataclass(frozen=True)
class InspectRequest(Request):
    op: ClassVar[str] = "inspect"
    cwd: str | None = None
    paths: list[str] | None = None
    state_dir: str | None = None
    deep: bool = False
    gpus: bool = False
    timeout: float | None = None
    imports: str | None = None  # a script (relative to cwd) whose top-level imports are looked for
    pythonpath: str | None = None  # the job's PYTHONPATH, for that search
    # the node whose setup ran in this agent: the python checks run in the environment it made
    job: str | None = None
    node: int = 0
    attempt: int = 0


@dataclass(frozen=True)
class ListenRequest(Request):
    op: ClassVar[str] = "listen"
    port: int | None = None
    token: str = ""


@dataclass(frozen=True)
class UnlistenRequest(Request):
    op: ClassVar[str] = "unlisten"
    port: int


@dataclass(frozen=True)
class ReachRequest(Request):
    op: ClassVar[str] = "reach"
    addr: str
    port: int
    token: str = ""
    timeout: float = 5.0


@dataclass(frozen=True)
class GpusRequest(Request):
    """Each GPU's use now, from ``nvidia-smi`` (killed after ``timeout`` seconds)."""

    op: ClassVar[str] = "gpus"
    timeout: float = 5.0


@dataclass(frozen=True)
class RunRequest(Request):
    """One command run as a node's job would run (``exec --job-env``): in ``cwd``, with ``env``, after
    ``setup``; its output streams as ``RunMessage``s."""

    op: ClassVar[str] = "run"
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    setup: list[str] | None = None
    setup_timeout: float | None = None


# --------------------------------------------------- answers protocol.py does not decode


@dataclass(frozen=True)
class RunMessage(Message):
    """One message of ``run``'s stream: ``t`` is ``out`` (``data``: output, decoded as UTF-8 with
    surrogateescape), ``beat`` (nothing said for a while) or ``end`` (``status``: the exit status)."""

    t: str
    data: str = ""
    status: int | None = None


@dataclass(frozen=True)
class JobPython(Message):
    """The job's interpreter as it runs after setup (found on the PATH setup leaves, ``site`` on):
    its path, its Python, torch's version and CUDA (None: no torch) and the optional torchrun
    flags it has; or ``error`` (it is not found or does not run)."""

    executable: str = ""
    python: str = ""
    torch: str | None = None
    torch_cuda: str | None = None
    torchrun_flags: list[str] | None = None
    error: str | None = None


@dataclass(frozen=True)
class SetupAnswer(Message):
    """``setup`` ran every command (a failure is ``{ok: false, error}``, an ``AgentError``);
    ``python``: the job's interpreter there, when asked; ``skipped``: why nothing ran (``if_cwd``)."""

    ok: bool
    python: JobPython | None = None
    skipped: str | None = None


@dataclass(frozen=True)
class Started(Message):
    """``start``'s answer: the attempt's directory and its first state (``protocol.decode_status``);
    ``setup_log``: the head of output.log that setup's output made (up to 1 MiB), shown before the start."""

    ok: bool
    dir: str
    state: dict[str, Any]
    setup_log: str | None = None


@dataclass(frozen=True)
class StopAnswer(Message):
    """``stop``'s answer (the package docstring says what each field means): the processes it
    ``killed`` and those ``left``, the node's final ``state``, and which guarantee held
    (``containment``, ``verified``); ``records_gone``, ``found_by``, ``looked`` for a node whose
    records were gone. ``protocol.stop_report`` makes the controller's ``StopReport`` of it."""

    ok: bool
    killed: list[dict[str, Any]] | None = None
    left: list[dict[str, Any]] | None = None
    state: dict[str, Any] | None = None
    containment: str | None = None
    verified: bool = False
    detail: str | None = None
    fallbacks: list[str] | None = None
    degraded: str | None = None
    notes: list[str] | None = None
    grace: float | None = None
    records_gone: bool = False
    found_by: list[str] | None = None
    looked: list[str] | None = None
    at_once: bool = False  # a failing attempt's cgroup was killed without torchrun's shutdown (``failing``)


@dataclass(frozen=True)
class Removed(Message):
    ok: bool
    removed: str | None
    bytes: int = 0


@dataclass(frozen=True)
class JobEntry(Message):
    """One node attempt found under a state dir, with what ``start`` was given."""

    job: str
    node: int
    attempt: int
    state: dict[str, Any] | None = None
    state_dir: str | None = None
    started: float | None = None
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    first_rank: int | None = None
    about: dict[str, Any] | None = None


@dataclass(frozen=True)
class JobsAnswer(Message):
    ok: bool
    root: str
    jobs: list[JobEntry]


@dataclass(frozen=True)
class SyncHashes(Message):
    ok: bool
    hashes: dict[str, str]


@dataclass(frozen=True)
class Written(Message):
    """``sync_put``'s answer: how many files it wrote."""

    ok: bool
    written: int


@dataclass(frozen=True)
class Unlistened(Message):
    ok: bool


@dataclass(frozen=True)
class Frame(Message):
    """One frame of a stack, innermost first: the function, its file (as py-spy shortens it), its
    line, and whether the file is a library's (the standard library, site- or dist-packages)."""

    name: str
    file: str
    line: int | None = None
    lib: bool = False


@dataclass(frozen=True)
class ThreadStack(Message):
    name: str | None
    frames: list[Frame]
    active: bool = False


STOPPED = ("T", "t")  # process states: stopped by a signal, stopped by a debugger (``RankStack.state``)


@dataclass(frozen=True)
class RankStack(Message):
    """One rank's stacks, or why they could not be taken (``error``, and ``fix`` where there is one).
    Looked at twice: ``moved``, whether its main thread's stack differs between the looks (None: not compared),
    ``cpu``, the share of one core it used between them (every thread), ``runnable``, the share of
    that time its main thread ran or waited for a core, ``state``, its process's at the last look
    (``R`` running, ``S`` sleeping, ``D`` waiting in the kernel; ``T``/``t`` stopped, said with one look too)."""

    rank: int
    pid: int
    threads: list[ThreadStack]
    local_rank: int | None = None
    error: str | None = None
    fix: str | None = None
    moved: bool | None = None
    cpu: float | None = None
    runnable: float | None = None
    state: str | None = None


@dataclass(frozen=True)
class StackAnswer(Message):
    """``stack``'s answer: the node's state, then its ranks' stacks; ``error``/``fix`` when the node
    could not be looked at (py-spy missing: the install command for this host)."""

    ok: bool
    state: str
    ranks: list[RankStack]
    tool: str | None = None
    error: str | None = None
    fix: str | None = None


@dataclass(frozen=True)
class GpuUse(Message):
    """One GPU as ``nvidia-smi`` sees it: utilisation in percent, memory in MiB (None: ``[N/A]``)."""

    index: int
    util: int | None = None
    mem_used: int | None = None
    mem_total: int | None = None


@dataclass(frozen=True)
class GpusAnswer(Message):
    """``gpus``'s answer. ``found``: nvidia-smi is on the host's PATH; ``problem``: why there are no
    readings although it is (it failed, timed out or printed something else): data, not a failure."""

    ok: bool
    found: bool
    gpus: list[GpuUse]
    problem: str = ""


_NESTED: dict[str, type[Message]] = {"RouteTarget": RouteTarget, "JobEntry": JobEntry, "GpuUse": GpuUse,
                                     "Frame": Frame, "ThreadStack": ThreadStack, "RankStack": RankStack,
                                     "JobPython": JobPython, "InspectRequest": InspectRequest,
                                     "ListenRequest": ListenRequest}

# Every operation's request type, by ``op``; serve.OPS must have the same keys (tests/test_wire.py).
REQUESTS: dict[str, type[Request]] = {
    r.op: r for r in (ProbeRequest, RouteRequest, SetupRequest, StartRequest, FollowRequest, StopRequest,
                      StatusRequest, RemoveRequest, JobsRequest, SyncStatRequest, SyncHashRequest, SyncPutRequest,
                      InspectRequest, ListenRequest, UnlistenRequest, ReachRequest, GpusRequest,
                      StackRequest, RunRequest)
}
# The answer types defined here; protocol.ANSWERS names the others.
ANSWERS: dict[str, type[Message]] = {
    "setup": SetupAnswer, "start": Started, "stop": StopAnswer, "remove": Removed, "jobs": JobsAnswer,
    "sync_hash": SyncHashes, "sync_put": Written, "unlisten": Unlistened, "stack": StackAnswer, "gpus": GpusAnswer,
    "run": RunMessage,
}
