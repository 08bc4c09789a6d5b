"""The GPU view: each host's GPUs as its agent's ``gpus`` reads them from ``nvidia-smi``.

``ask`` reads them once (``ps JOB``); a ``GpuPoller`` reads them every few seconds for the
dashboard, one agent session per node's host kept open on the connection the job already has,
and emits ``NodeGpus``. A host without nvidia-smi, or whose nvidia-smi is broken, gives that
node a mark (``cell``), never an error for the others; one that cannot be reached keeps its
last reading (its node's state says it is unreachable).
``cell`` and ``per_gpu`` are the words both show.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

from clusterrun.agent.wire import GpusAnswer, GpusRequest
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import GpuReading, NodeGpus
from clusterrun.transports import AgentSession, Transport

INTERVAL = 3.0  # seconds between two readings of a host
TIMEOUT = 5.0  # nvidia-smi is killed after this long (a hung driver)
MISSING = "-"  # the cell of a node whose host has no nvidia-smi
BROKEN = "⚠ nvidia-smi"  # ... whose nvidia-smi failed, hung or printed something else


def decode(rank: int, host: str, answer: dict[str, object]) -> NodeGpus:
    """The ``gpus`` answer of node ``rank``'s host as an event."""
    got = GpusAnswer.from_json(answer, f"{host}: gpus answer")
    readings = tuple(GpuReading(g.index, g.util, g.mem_used, g.mem_total) for g in got.gpus)
    return NodeGpus(rank, host=host, gpus=readings, missing=not got.found, problem=got.problem)


def ask(session: AgentSession, rank: int) -> NodeGpus:
    """Node ``rank``'s GPUs through an open agent ``session`` (a broken nvidia-smi is the
    reading's ``problem``); ``ClusterrunError`` or ``ValueError`` when the agent cannot be asked."""
    return decode(rank, session.host, session.call(GpusRequest(timeout=TIMEOUT)))


def only(reading: NodeGpus, visible: Sequence[str] | None) -> NodeGpus:
    """``reading`` with only the node's own GPUs (its ``gpus:``, CUDA_VISIBLE_DEVICES) where they
    are indices; all of the host's where they are not given or are UUIDs."""
    if not visible or not all(v.strip().isdigit() for v in visible):
        return reading
    wanted = {int(v) for v in visible}
    return dataclasses.replace(reading, gpus=tuple(g for g in reading.gpus if g.index in wanted))


class GpuPoller:
    """Reads every node's host's GPUs every ``interval`` seconds and emits ``NodeGpus``.

    Create (with a function giving the nodes' transports by rank: the job's, which a start-up
    retry replaces) → ``start()`` → ``stop()``. One thread and one agent session per node (a
    host holds one node of a job); a session that fails is closed and opened again at the next
    reading, and the node keeps its last reading meanwhile (an unreachable host is the follower's
    news, not a GPU problem). A host without nvidia-smi is asked once."""

    def __init__(self, transports: Callable[[], Sequence[Transport]], emit: Callable[[NodeGpus], None],
                 interval: float = INTERVAL) -> None:
        self._transports = transports
        self._emit = emit
        self._interval = interval
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for rank in range(len(self._transports())):
            thread = threading.Thread(target=self._poll, args=(rank,), daemon=True, name=f"gpus-node{rank}")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop reading (each thread closes its session as it leaves; none is waited for)."""
        self._stopped.set()

    def _poll(self, rank: int) -> None:
        session: AgentSession | None = None
        held: Transport | None = None  # the transport ``session`` runs on
        try:
            while not self._stopped.is_set():
                transports = self._transports()
                if rank >= len(transports):
                    return
                transport = transports[rank]
                if held is not transport and session is not None:
                    session.close()  # the job's transports were replaced: never reopen a closed one
                    session = None
                try:
                    if session is None:
                        held, session = transport, transport.session()
                    reading = ask(session, rank)
                except (ClusterrunError, OSError, ValueError):
                    if session is not None:
                        session.close()  # the agent may be gone with its connection: a new one next time
                        session = None
                    self._stopped.wait(self._interval)
                    continue
                self._emit(reading)
                if reading.missing:
                    return  # no nvidia-smi there: it will not appear during the job
                self._stopped.wait(self._interval)
        finally:
            if session is not None:
                session.close()


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.0f}" if mib >= 10 * 1024 else f"{mib / 1024:.1f}"


def _percent(value: int | None) -> str:
    return "?" if value is None else f"{value}%"


def cell(reading: NodeGpus | None) -> str:
    """The node table's cell: ``4× 87% 61/320G`` (mean utilisation, memory used of total, GiB),
    ``-`` without nvidia-smi, ``⚠ nvidia-smi`` when it failed, empty before the first reading."""
    if reading is None:
        return ""
    if reading.missing:
        return MISSING
    if reading.problem or not reading.gpus:
        return BROKEN
    gpus = reading.gpus
    utils = [g.util for g in gpus if g.util is not None]
    util = _percent(round(sum(utils) / len(utils)) if utils else None)
    used = None if any(g.mem_used is None for g in gpus) else sum(g.mem_used or 0 for g in gpus)
    total = None if any(g.mem_total is None for g in gpus) else sum(g.mem_total or 0 for g in gpus)
    return f"{len(gpus)}× {util} {_gib(used)}/{_gib(total)}G"


def per_gpu(reading: NodeGpus | None) -> list[str]:
    """One short entry per GPU (``gpu0 87% 30/80G``), or the reason there is none."""
    if reading is None:
        return []
    if reading.missing:
        return ["no nvidia-smi on this host"]
    if reading.problem or not reading.gpus:
        return [reading.problem or "nvidia-smi lists no GPU"]  # the agent's words name nvidia-smi
    return [f"gpu{g.index} {_percent(g.util)} {_gib(g.mem_used)}/{_gib(g.mem_total)}G" for g in reading.gpus]


__all__ = ["BROKEN", "INTERVAL", "MISSING", "GpuPoller", "ask", "cell", "decode", "only", "per_gpu"]
