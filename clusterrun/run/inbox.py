"""The job's inbox: the followers' messages for ``Job.run()``, bounded in log bytes as in count.

A count alone does not bound memory: a follower's log chunk is up to a MB (the agent reads the
log a MB at a time), so 256 queued chunks were 256 MB in flight when the consumer fell behind a
flood. Here a follower's ``put`` of a log chunk waits while the chunks queued hold ``budget``
characters or more; an empty inbox takes any chunk, so a chunk larger than the budget still passes.
Messages without log data (states, links, the end) wait only for the count. Each follower puts
from its own thread in its stream's order, so what waits is never overtaken by its own node's
later messages.

The job's loop sleeps in ``wait()`` until something is queued or ``ring()`` is called (a stop, a
detach), not in timed polls: ``ring()`` only puts on a ``queue.SimpleQueue``, whose ``put`` is
reentrant, so a signal handler may call it even while it interrupted the loop inside the inbox.
In a flow, ``settle()`` lets messages gather for a few milliseconds, cut short by ``ring()``.
"""

from __future__ import annotations

import queue
import time
from typing import Any

# What the followers may hold queued, in characters of log data, all nodes together: a few of
# the agent's MB reads, so a consumer that keeps up never waits on it.
BUDGET = 8 << 20

Item = tuple[int, Any]  # (rank, the follower's message)


def _size(item: Item) -> int:
    """Characters of log data in a ``(rank, message)`` item (0 for a message without)."""
    data = getattr(item[1], "data", None)
    return len(data) if isinstance(data, str) else 0


class Inbox(queue.Queue[Item]):
    """A ``queue.Queue`` of ``(rank, message)`` that also bounds the log data queued (``held``)."""

    def __init__(self, maxsize: int = 256, budget: int = BUDGET) -> None:
        super().__init__(maxsize)
        self.budget = budget
        self.held = 0  # characters of log data queued
        self._budget_waits = 0  # puts of log chunks waiting for the budget (not for a place)
        self._bell: queue.SimpleQueue[None] = queue.SimpleQueue()  # a token per message queued or ring()
        self._rung: queue.SimpleQueue[None] = queue.SimpleQueue()  # a token per ring(): ends a settle()

    def ring(self) -> None:
        """Wake ``wait()`` and end ``settle()`` (safe from any thread and from signal handlers)."""
        self._bell.put(None)
        self._rung.put(None)

    def settle(self, until: float) -> None:
        """Let more messages come until ``until`` (``time.monotonic()``), unless ``ring()`` is or
        was called: the followers then queue without waking the caller."""
        left = until - time.monotonic()
        if left > 0 and self._rung.empty():
            try:
                self._rung.get(timeout=left)
            except queue.Empty:
                pass
        while not self._rung.empty():  # a ring is for now: an earlier one must not end a later settle
            self._rung.get_nowait()

    def wait(self, timeout: float | None) -> None:
        """Return once something is queued or ``ring()`` was called, or after ``timeout`` seconds."""
        if not self.empty():
            return
        try:
            self._bell.get(timeout=timeout)
        except queue.Empty:
            return
        while not self._bell.empty():  # the tokens of what came meanwhile: the caller takes it all now
            self._bell.get_nowait()

    def put(self, item: Item, block: bool = True, timeout: float | None = None) -> None:
        """Queue ``item``; wait while the inbox is full by count, or, for a log chunk, by data."""
        size = _size(item)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.not_full:
            while (by_count := 0 < self.maxsize <= self._qsize()) or self._over_budget(size):
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    raise queue.Full
                self._budget_waits += not by_count
                try:
                    self.not_full.wait(left)
                finally:
                    self._budget_waits -= not by_count
            self._put(item)
            self._bell.put(None)
            self.held += size
            self.unfinished_tasks += 1
            self.not_empty.notify()

    def _over_budget(self, size: int) -> bool:
        return size > 0 and self.held > 0 and self.held + size > self.budget

    def _get(self) -> Item:
        item = super()._get()
        size = _size(item)
        self.held -= size
        # ``get`` wakes one put, which a freed place is enough for. Only the chunks waiting for the
        # budget may all fit once a large one left: waking every put each time (64 followers of a
        # full inbox) left the job's loop waiting for the inbox's lock behind them.
        if size and self._budget_waits:
            self.not_full.notify_all()
        return item
