"""A recorded job's logs read from its hosts (``logs``, the web page), and what that and
``lifecycle`` share: a record's transports and its requests to the agents.

Apart from ``lifecycle`` so that ``logs`` of an ended job imports no orchestrator, recorder or
stop: its start-up is most of the time it takes beside ``ssh HOST cat`` (docs/benchmarks.md, "Logs").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from clusterrun.agent.wire import NodeRequest, node_request
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.protocol import End, Eof, LogChunk, decode_follow
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports import Transport, connect_early, transport_for


def transport_factory(record: JobRecord) -> Callable[..., Transport]:
    return partial(transport_for, ssh_config=record.ssh_config)


def request(record: JobRecord, rank: int, op: str, attempt: int | None = None, **extra: Any) -> NodeRequest:
    """The ``op`` request (``wire``) for node ``rank``'s current attempt (or ``attempt``) of the recorded job."""
    return node_request(op, job=record.job_id, node=rank, attempt=attempt or record.attempt,
                        state_dir=record.plan.get("state_dir"), **extra)


def hosts_ahead(job: Opened, ranks: Sequence[int], attempt: int) -> dict[int, Transport]:
    """The transports to the hosts that ran ``ranks`` in ``attempt``, already connecting (and
    starting their agents) in threads while the command goes on (``connect_early``): the
    connection is most of a one-node ``logs``'s start-up beside ``ssh cat``'s. None for Slurm's."""
    if job.record.engine == "slurm":
        return {}
    hosts = job.spec(attempt).hosts  # the hosts that ran the nodes then
    made = {rank: transport_factory(job.record)(hosts[rank]) for rank in ranks}
    connect_early(list(made.values()))
    return made


def read_log(job: Opened, rank: int, attempt: int, tail: int | None = None,
             transport: Transport | None = None) -> Iterator[str]:
    """Node ``rank``'s log of ``attempt`` as written so far (from its last ``tail`` lines if
    given), in chunks of whole lines (the last one may lack its newline)."""
    return (chunk.data for chunk in read_log_chunks(job, rank, attempt, tail, transport))


def read_log_chunks(job: Opened, rank: int, attempt: int, tail: int | None = None,
                    transport: Transport | None = None) -> Iterator[LogChunk]:
    """``read_log``'s chunks as the agent sent them, with when their lines were written (a Slurm
    job's from the files its ``up`` kept on this machine); through ``transport`` if given (``hosts_ahead``'s),
    which it closes."""
    record = job.record
    if record.engine == "slurm":
        from clusterrun.store import slurmlogs

        yield from slurmlogs.read_chunks(JobStore(), record, rank, attempt, tail)
        return
    if transport is None:
        transport = transport_factory(record)(job.spec(attempt).hosts[rank])  # the host that ran the node then
    where: dict[str, Any] = {"offset": 0} if tail is None else {"tail": tail}
    try:
        transport.connect()
        for raw in transport.stream(request(record, rank, "follow", attempt=attempt, once=True, **where)):
            message = decode_follow(transport.name, raw)
            if isinstance(message, LogChunk):
                yield message
            elif isinstance(message, (End, Eof)):
                return
    finally:
        transport.close()


@dataclass
class _Raised:
    exc: BaseException


def read_logs(job: Opened, ranks: Sequence[int], attempt: int, tail: int | None = None,
              budget: int = 64 * 2**20, ahead: dict[int, Transport] | None = None,
              ) -> Iterator[tuple[int, str | ClusterrunError]]:
    """The logs of several nodes, node after node, each read from its host in a thread of its own
    while the nodes before it are printed. Yields ``(rank, chunk)`` (see ``read_log``), or
    ``(rank, error)`` once for a node whose host failed. What is read ahead waits while the chunks
    held for all nodes together exceed ``budget`` characters; the node being printed may always
    hold one chunk, so it never waits for the others (each reader thread also has one in hand).
    ``ahead``: transports of ``hosts_ahead``, by rank."""
    done = object()
    queues: dict[int, deque[tuple[Any, int]]] = {rank: deque() for rank in ranks}
    held = {rank: 0 for rank in ranks}
    total = 0
    current = ranks[0] if ranks else None
    cancelled = False
    changed = threading.Condition()

    def put(rank: int, item: Any, size: int = 0) -> None:
        nonlocal total
        with changed:
            while size and total + size > budget and not (rank == current and not held[rank]) and not cancelled:
                changed.wait()
            queues[rank].append((item, size))
            held[rank] += size
            total += size
            changed.notify_all()

    def read(rank: int) -> None:
        try:
            for lines in read_log(job, rank, attempt, tail, (ahead or {}).get(rank)):
                put(rank, lines, len(lines))
                if cancelled:
                    return
        except ClusterrunError as exc:
            put(rank, exc)
        except BaseException as exc:  # a bug: raised where the nodes are printed, not left to wait there
            put(rank, _Raised(exc))
        put(rank, done)

    threads = [threading.Thread(target=read, args=(rank,), daemon=True, name=f"logs-node{rank}") for rank in ranks]
    for thread in threads:
        thread.start()
    try:
        for rank in ranks:
            with changed:
                current = rank
                changed.notify_all()
            while True:
                with changed:
                    while not queues[rank]:
                        changed.wait()
                    item, size = queues[rank].popleft()
                    held[rank] -= size
                    total -= size
                    changed.notify_all()
                if item is done:
                    break
                if isinstance(item, _Raised):
                    raise item.exc
                yield rank, item
    finally:
        with changed:
            cancelled = True
            changed.notify_all()
