"""Which jobs' records changed, for every page of the server at once: the list's new jobs and states,
a job page's new attempt and progress.

A job's owner rewrites its ``job.json`` (atomically: a new file) at every change of its state, its
attempt or the training's progress. ``StoreWatch`` looks at the store's directory every ``EVERY``
seconds, only while a page listens: one ``stat`` per job, whatever the number of viewers, and nothing
sent while nothing changes. (The stdlib has no inotify; a stat per job a second costs microseconds.)

Lifecycle: ``StoreWatch(store)`` → ``subscribe()`` (starts the look, on the event loop) → the
queue's sets of changed job ids → ``unsubscribe(queue)`` (the last one stops the look).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

from clusterrun.store.jobs import JobStore

EVERY = 1.0  # seconds between two looks at the store
BACKLOG = 64  # changes a listener may fall behind; then the oldest are merged (a set of ids loses nothing)

Signature = dict[str, tuple[int, int, int]]  # job id -> its job.json's (mtime_ns, inode, size)


def signature(store: JobStore) -> Signature:
    """What each job's ``job.json`` is now (a job without one is left out)."""
    found: Signature = {}
    try:
        entries = list(os.scandir(store.root))
    except OSError:  # no store yet: no job
        return found
    for entry in entries:
        try:
            st = os.stat(os.path.join(entry.path, "job.json"))
        except OSError:
            continue
        found[entry.name] = (st.st_mtime_ns, st.st_ino, st.st_size)
    return found


def version(seen: Signature) -> str:
    """A short name of a state of the store: a list page carries the one it read to its stream, which
    tells the page at once if a job changed between the page's reading and the stream's start."""
    return hashlib.sha256(repr(sorted(seen.items())).encode()).hexdigest()[:16]


class StoreWatch:
    """The look at the store shared by every listener (see the module docstring)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.listeners: set[asyncio.Queue[frozenset[str]]] = set()
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.seen: Signature = {}  # the state the look compares the next one with
        self.started: asyncio.Event | None = None  # set once the look has ``seen`` a first state

    def subscribe(self) -> asyncio.Queue[frozenset[str]]:
        """A new listener's queue: sets of the ids of the jobs whose record changed (empty: the server ends)."""
        queue: asyncio.Queue[frozenset[str]] = asyncio.Queue()
        self.listeners.add(queue)
        self.loop = asyncio.get_running_loop()
        if self.task is None or self.task.done():
            self.started = asyncio.Event()
            self.task = self.loop.create_task(self._look(self.started))
        return queue

    async def baseline(self) -> Signature:
        """The state a subscriber's changes are counted from (once subscribed: any later change reaches it)."""
        if self.started is not None:
            await self.started.wait()
        return self.seen

    def end(self) -> None:
        """Tell every listener that the server ends (an empty set); from any thread."""
        if self.loop is not None:
            for queue in list(self.listeners):
                self.loop.call_soon_threadsafe(queue.put_nowait, frozenset())

    def unsubscribe(self, queue: asyncio.Queue[frozenset[str]]) -> None:
        self.listeners.discard(queue)
        if not self.listeners and self.task is not None:
            self.task.cancel()
            self.task = None

    async def close(self) -> None:
        self.listeners.clear()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def _look(self, started: asyncio.Event) -> None:
        self.seen = await asyncio.to_thread(signature, self.store)
        started.set()
        while self.listeners:
            await asyncio.sleep(EVERY)  # the pace of the look, not a wait for an event
            now = await asyncio.to_thread(signature, self.store)
            before, self.seen = self.seen, now
            changed = frozenset(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            if changed:
                for queue in list(self.listeners):
                    _put(queue, changed)


def _put(queue: asyncio.Queue[frozenset[str]], changed: frozenset[str]) -> None:
    if queue.qsize() >= BACKLOG:  # a listener that does not read: merge what it has not read yet
        merged = set(changed)
        while not queue.empty():
            merged |= queue.get_nowait()
        changed = frozenset(merged)
    queue.put_nowait(changed)
