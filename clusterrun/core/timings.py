"""The start-up timeline of ``up --timings``: how long each host spent in each phase, and what
the start waited for.

Lifecycle: ``enable()`` (at ``up``'s start; until then ``span`` records nothing) → the transports
and the agent sessions record spans from any thread (``span``, ``record``) → ``render()``
once every node started. A leaf: it imports nothing of the package.

Phases, in the order a host goes through them: ``resolve`` (``ssh -G``), ``connect`` (TCP, the
SSH version exchange and key exchange), ``authenticate``, ``agent`` (the session channel, the
remote shell and Python, until the agent's loader answers), then one per agent request, named
by ``PHASE_OF`` (``probe``, ``route``, ``preflight``, ``sync``, ``setup``, ``start``). The start
waits at barriers: every host found (``ssh -G``: every node's address goes into each probe, which
also asks the host's route to the master, the preflight's inspect and node 0's listener), every
host connected and probed, each on its own (node 0's port goes into every node's plan), then
routed again where the master address had to be settled again, checked (the TCP test of node 0's
listener), synced and set up; so the critical path runs through the last host of each barrier.

An attempt's own phases, as its record keeps them (``AttemptRecord.phases``, wall-clock times) and
``ps JOB`` and ``up --timings`` show them (``phases_text``), are ``ATTEMPT_PHASES``: every attempt's
``started`` (every node's torchrun started) and ``joined`` (every node started its workers:
torchrun's rendezvous completed); a restart of a failed attempt's also ``failed`` (its owner saw a
node of the last attempt fail), ``stopped`` (every node of it ended or was stopped, verified),
``waited`` (its backoff was over; only after a backoff that waited) and ``checked`` (the next attempt's
checks passed). A restart's are counted from ``failed``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from clusterrun.core.frozen import frozen

# What each agent request is part of: the timeline's phase.
PHASE_OF = {"probe": "probe", "route": "route", "inspect": "preflight", "listen": "preflight",
            "reach": "preflight", "unlisten": "preflight", "sync_stat": "sync", "sync_hash": "sync",
            "sync_put": "sync", "setup": "setup", "start": "start"}
CONNECTING = ("resolve", "connect", "authenticate", "agent")
PHASES = ("resolve", "connect", "authenticate", "agent", "probe", "route", "preflight", "sync", "setup", "start")
# The barriers of the start, in order: each waits for every host to finish these phases.
BARRIERS = (("resolve", ("resolve",)), ("connect and probe", ("connect", "authenticate", "agent", "probe")),
            ("route", ("route",)),
            ("preflight", ("preflight",)), ("sync", ("sync",)), ("setup", ("setup",)), ("start", ("start",)))
ATTEMPT_PHASES = ("failed", "stopped", "waited", "checked", "started", "joined")
_WORDS = {"stopped": "stopped", "waited": "backoff over", "checked": "checked", "started": "started",
          "joined": "every node joined"}
SHOWN_HOSTS = 5  # the slowest hosts shown row by row; the spread covers all


@frozen
class Span:
    """``host`` spent ``began``..``ended`` (time.monotonic) in ``phase``."""

    host: str
    phase: str
    began: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.began


class Timeline:
    """The spans of one run: ``record`` from any thread, ``spans`` to read them."""

    def __init__(self, origin: float) -> None:
        self.origin = origin  # when `up` began, on time.monotonic's clock
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def record(self, host: str, phase: str, began: float, ended: float) -> None:
        with self._lock:
            self._spans.append(Span(host, phase, began, ended))

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)


_current: Timeline | None = None


def enable(origin: float | None = None) -> Timeline:
    """Record spans from now on (for this process), into the timeline returned."""
    global _current
    _current = Timeline(time.monotonic() if origin is None else origin)
    return _current


def enabled() -> bool:
    """Whether this process records its timeline (``up --timings``)."""
    return _current is not None


def begin(note: Callable[[str], None]) -> Callable[[], None]:
    """Record from now on; the function returned gives the timeline to ``note``, line by line, once."""
    before = startup_seconds()
    timeline = enable()
    shown: list[bool] = []

    def show() -> None:
        if not shown:
            shown.append(True)
            for line in render(timeline, before):
                note(line)

    return show


def record(host: str, phase: str, began: float, ended: float | None = None) -> None:
    """Note that ``host`` spent ``began``..``ended`` (default: now) in ``phase``, when enabled."""
    if _current is not None:
        _current.record(host, phase, began, time.monotonic() if ended is None else ended)


@contextmanager
def span(host: str, phase: str) -> Iterator[None]:
    """Record the block as ``host``'s ``phase`` (also when it raises), when enabled."""
    began = time.monotonic()
    try:
        yield
    finally:
        record(host, phase, began)


def mark(phases: dict[str, float], name: str, at: float | None = None) -> None:
    """Note in an attempt's ``phases`` that ``name`` is over now (or ``at``); the first time counts."""
    phases.setdefault(name, time.time() if at is None else at)


def phases_text(phases: dict[str, float] | None, began: float) -> str | None:
    """``failure seen → stopped 0.21 s → checked 0.43 s → started 0.61 s → every node joined 9.80 s``
    (from the failure, else from ``began``, the attempt's start; after a backoff that waited,
    ``backoff over 30.02 s`` comes before ``checked``); None without phases."""
    if not phases:
        return None
    origin = phases.get("failed", began)
    parts = ["failure seen"] if "failed" in phases else []
    parts += [f"{_WORDS[p]} {phases[p] - origin:.2f} s" for p in ATTEMPT_PHASES[1:] if p in phases]
    return " → ".join(parts)


def startup_seconds() -> float | None:
    """How long this process ran before now (Python's start and imports included), from
    /proc; None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


def _by_host(spans: list[Span]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for s in spans:
        phases = table.setdefault(s.host, {})
        phases[s.phase] = phases.get(s.phase, 0.0) + s.seconds
    return table


def render(timeline: Timeline, before: float | None = None) -> list[str]:
    """The timeline as lines of text: the total, the slowest hosts phase by phase, each phase's
    spread with its slowest host, the critical path through the barriers, and the agent's round
    trips per host. ``before``: seconds the process ran before ``timeline.origin``."""
    spans = timeline.spans
    if not spans:
        return ["timings: nothing was recorded"]
    origin = timeline.origin
    hosts = _by_host(spans)
    total = {h: sum(phases.values()) for h, phases in hosts.items()}  # its own phases, not its waits for others
    shown = [p for p in PHASES if any(p in phases for phases in hosts.values())]
    shown += sorted({s.phase for s in spans} - set(PHASES))
    lines = [f"timings: every node started {max(s.ended for s in spans) - origin:.3f} s after `up` began"
             + (f" ({before:.3f} s of Python start-up and imports before that)" if before is not None else ""),
             f"  before the first host: {min(s.began for s in spans) - origin:.3f} s (the hosts file, the SSH "
             "library's import)"]
    slowest = sorted(hosts, key=lambda h: -total[h])
    width = max(len("host"), *(len(h) for h in hosts))
    lines.append(f"  {'host':<{width}} " + " ".join(f"{p:>12}" for p in shown) + f" {'total':>12}")
    for h in slowest[:SHOWN_HOSTS]:
        lines.append(f"  {h:<{width}} " + " ".join(
            f"{hosts[h][p]:>12.3f}" if p in hosts[h] else f"{'':>12}" for p in shown) + f" {total[h]:>12.3f}")
    if len(hosts) > SHOWN_HOSTS:
        lines.append(f"  ... {len(hosts) - SHOWN_HOSTS} more hosts (the {SHOWN_HOSTS} slowest shown)")
    h = slowest[0]
    worst = max(hosts[h], key=lambda p: hosts[h][p])
    lines.append(f"  slowest host: {h}: {worst} {hosts[h][worst]:.3f} s of {total[h]:.3f} s")
    from statistics import median  # statistics imports fractions and decimal: only for --timings

    spread = []
    for p in shown:
        values = {host: phases[p] for host, phases in hosts.items() if p in phases}
        top = max(values, key=lambda x: values[x])
        spread.append(f"{p} {min(values.values()):.3f}/{median(values.values()):.3f}/"
                      f"{values[top]:.3f} ({top})")
    lines.append("  spread, min/median/max (slowest host): " + ", ".join(spread))
    path = []
    for name, phases in BARRIERS:
        ends: dict[str, float] = {}
        for s in spans:
            if s.phase in phases:
                ends[s.host] = max(ends.get(s.host, s.ended), s.ended)
        if ends:
            top = max(ends, key=lambda x: ends[x])
            path.append(f"{name} done at {ends[top] - origin:.3f} s (last: {top})")
    lines.append("  critical path: " + " → ".join(path))
    requests = sorted({sum(1 for s in spans if s.host == host and s.phase not in CONNECTING) for host in hosts})
    counted = str(requests[0]) if len(requests) == 1 else f"{requests[0]}-{requests[-1]}"
    lines.append(f"  agent requests per host: {counted}, each one round trip (see docs/benchmarks.md)")
    return lines
