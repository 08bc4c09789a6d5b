"""Several nodes' logs as one, line by line in the order they were written (``logs JOB``).

Each node's log is read by a thread of its own into a small bounded queue (back-pressure: a fast
host waits for the slowest), and the lines are merged by when the agent recorded them
(``LogChunk.times``); a line of unknown time (an older agent) takes its node's last known time,
so such logs come node after node, as before.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from clusterrun.core.errors import ClusterrunError
from clusterrun.core.protocol import LogChunk

Reader = Callable[[int], Iterator[LogChunk]]
_DONE = object()


def interleaved(ranks: Sequence[int], read: Reader, depth: int = 8) -> Iterator[tuple[int, str | ClusterrunError]]:
    """``(rank, text)``: consecutive lines of one node (each ended by a newline) in the order they
    were written across nodes, ties by rank; ``(rank, error)`` once for a node whose host failed."""
    queues: dict[int, queue.Queue[object]] = {rank: queue.Queue(maxsize=depth) for rank in ranks}
    cancelled = threading.Event()

    def pump(rank: int) -> None:
        def put(item: object) -> None:
            while not cancelled.is_set():
                try:
                    queues[rank].put(item, timeout=0.5)
                    return
                except queue.Full:
                    continue

        try:
            for chunk in read(rank):
                put(chunk)
                if cancelled.is_set():
                    return
        except ClusterrunError as exc:
            put(exc)
        put(_DONE)

    for rank in ranks:
        threading.Thread(target=pump, args=(rank,), daemon=True, name=f"logs-node{rank}").start()
    heads: dict[int, list[tuple[int, str]]] = {}  # per node: its runs of lines not yet shown, with their times
    known: dict[int, int] = {}  # per node: the last time known
    try:
        live = list(ranks)
        while live:
            for rank in list(live):  # every node still reading has a line in hand, or is done
                while not heads.get(rank):
                    item = queues[rank].get()
                    if item is _DONE:
                        live.remove(rank)
                        break
                    if isinstance(item, ClusterrunError):
                        yield rank, item
                    if not isinstance(item, LogChunk):
                        continue
                    runs = []
                    for ns, text in item.timed_runs():
                        known[rank] = ns if ns is not None else known.get(rank, 0)
                        runs.append((known[rank], text))
                    runs.reverse()  # taken from the end
                    heads[rank] = runs
            if not live:
                break
            first = min(live, key=lambda r: (heads[r][-1][0], r))
            others = [(heads[r][-1][0], r) for r in live if r != first]
            bound = min(others) if others else None
            taken, runs = [], heads[first]
            while runs and (bound is None or (runs[-1][0], first) < bound):
                taken.append(runs.pop()[1])
            yield first, "".join(taken)
    finally:
        cancelled.set()
