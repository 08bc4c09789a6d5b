"""The controller's side of the agent protocol: answers decoded once, into frozen dataclasses.

The agent (``agent.py``, stdlib only; its docstring specifies the protocol) answers with JSON
lines. This module is the only place the controller reads them: a field that is missing or of
the wrong type is a ``ProtocolError`` naming the host, the message and the field, never a
``KeyError`` deep inside a policy. ``PROTOCOL`` is the version this controller speaks; the agent
states its own in every ``probe`` answer, and a mismatch is refused before anything starts.

Decoded here: ``probe`` (``Probe``), a node's state file as ``start``, ``status`` and ``follow``
report it (``NodeStatus``), and the messages of a ``follow`` stream (``LogChunk``,
``StateUpdate``, ``Beat``, ``End``, ``Eof``). ``stop``'s answer becomes a ``StopReport``
(``StopReport.from_answer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from clusterrun.errors import AgentError

PROTOCOL = 1  # agent.PROTOCOL: bumped by any change a controller of the previous version would misread


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


@dataclass(frozen=True)
class Worker:
    """One worker process torchrun started, as the supervisor recorded it."""

    rank: int | None
    local_rank: int | None
    pid: int | None
    died: float | None  # wall-clock time it ended


@dataclass(frozen=True)
class NodeStatus:
    """A node's state file as the agent reports it."""

    state: HostState
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None
    stop_requested: bool = False
    torchrun_pid: int | None = None
    ended_at: float | None = None
    workers: tuple[Worker, ...] = ()
    degraded: str | None = None  # why the supervisor could not write its state (a full or read-only disk)

    @property
    def ended(self) -> bool:
        return self.state in (HostState.EXITED, HostState.LOST)


@dataclass(frozen=True)
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

    @property
    def python_version(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.python.split(".")[:2] if p.isdigit())


@dataclass(frozen=True)
class LogChunk:
    """Complete lines of the log from byte ``offset``; ``next`` is where to resume."""

    offset: int
    next: int
    data: str


@dataclass(frozen=True)
class StateUpdate:
    status: NodeStatus


@dataclass(frozen=True)
class Beat:
    """Nothing happened for a while; the agent and its connection are alive."""


@dataclass(frozen=True)
class End:
    """The node's job has ended (``status.ended``); nothing follows."""

    status: NodeStatus


@dataclass(frozen=True)
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
                              pid=w.integer("pid"), died=w.number("died")))
    return NodeStatus(state=kind, exit_code=r.integer("exit_code"), signal=r.integer("signal"),
                      error=r.text("error"), stop_requested=bool(r.data.get("stop_requested")),
                      torchrun_pid=torchrun.integer("pid"), ended_at=r.number("ended_at"),
                      workers=tuple(workers), degraded=r.text("degraded") or None)


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
                 containment=r.text("containment") or "sweep", fallbacks=tuple(fallbacks))


def decode_follow(host: str, message: Any) -> FollowMessage:
    """One message of a ``follow`` stream; an ``{ok: false, error}`` raises ``AgentError``."""
    r = _Reader(host, "follow message", message)
    if r.data.get("ok") is False:
        raise AgentError(host, r.text("error") or "the agent failed")
    kind = r.data.get("t")
    if kind == "log":
        return LogChunk(offset=r.need_integer("offset"), next=r.need_integer("next"), data=r.need_text("data"))
    if kind == "beat":
        return Beat()
    if kind == "state":
        return StateUpdate(decode_status(host, r.data.get("state")))
    if kind == "end":
        return End(decode_status(host, r.data.get("state")))
    if kind == "eof":
        return Eof(next=r.need_integer("next"), status=decode_status(host, r.data.get("state")))
    raise r._fail("t", "log, state, beat, end or eof")
