"""One reader per job attempt, fanned out to every viewer of it.

A ``Feed`` follows each node's log of one attempt with the agent's ``follow`` (the stream ``logs -f``
reads: log chunks, the node's state, a heartbeat), in one thread per node, whatever the number of
viewers. It keeps the last ``RING`` lines of each node for a viewer that comes later ("the last N lines
first") and hands everything new to its viewers' queues on the event loop. A quiet job costs a blocked
read per node (the agent speaks every 5 s); a feed without viewers is closed after ``LINGER`` seconds.

Lifecycle: ``Feeds.join(record, attempt, viewer)`` (starts the feed) → viewer's queue → ``Feeds.leave``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import NodeState
from clusterrun.core.protocol import End, LogChunk, StateUpdate, decode_follow
from clusterrun.core.terminal import safe
from clusterrun.life.logread import request, transport_factory
from clusterrun.run.follower import node_state_of
from clusterrun.store.jobs import JobRecord
from clusterrun.store.opened import Opened
from clusterrun.transports import AgentStream

RING = 2000  # lines of each node kept for a viewer that comes later
LINGER = 30.0  # seconds a feed nobody watches stays open (a reload should not restart the readers)
RETRY = 5.0  # seconds before a node whose host could not be reached is followed again
BACKLOG = 512  # messages a viewer may fall behind before it is dropped (its browser reconnects)


@dataclass(frozen=True)
class Lines:
    """New lines of a node's log (without newlines, made safe to show)."""

    node: int
    lines: tuple[str, ...]
    backlog: bool = False  # lines written before the feed started (its first read): a viewer keeps its last N


@dataclass(frozen=True)
class State:
    """A node's state as its agent reported it, or why its host could not be followed."""

    node: int
    state: str
    problem: str = ""


@dataclass(frozen=True)
class Changed:
    """The job's record changed (``watch.StoreWatch``): its state, its attempt or the training's progress."""


Message = Lines | State | Changed


class Viewer:
    """One browser's stream: messages arrive on ``queue`` (on the event loop); ``dropped`` once it
    fell more than ``BACKLOG`` behind (its stream then ends and the browser reconnects)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self.dropped = False

    def put(self, message: Message) -> None:
        if self.dropped:
            return
        if self.queue.qsize() >= BACKLOG:
            self.dropped = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(message)


@dataclass
class Feed:
    """Every node's log and state of one attempt of a job, read once (see the module docstring)."""

    job: Opened  # the job's hosts file parsed once for the server
    attempt: int
    loop: asyncio.AbstractEventLoop
    rings: dict[int, deque[tuple[int, str]]] = field(default_factory=dict)  # (arrival number, line)
    arrived: int = 0
    states: dict[int, State] = field(default_factory=dict)
    viewers: set[Viewer] = field(default_factory=set)
    closing: threading.Event = field(default_factory=threading.Event)
    streams: dict[int, AgentStream] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    linger: asyncio.TimerHandle | None = None

    @property
    def record(self) -> JobRecord:
        return self.job.record

    def start(self) -> None:
        for node in self.record.nodes:
            self.rings[node.rank] = deque(maxlen=RING)
            self.states[node.rank] = State(node.rank, str(node.state))
            threading.Thread(target=self._follow, args=(node.rank,), daemon=True,
                             name=f"web-{self.record.job_id}-node{node.rank}").start()

    def snapshot(self) -> tuple[dict[int, list[tuple[int, str]]], dict[int, State]]:
        """Each node's kept lines (numbered in the order they arrived) and state, as a viewer that
        joins now starts from."""
        with self.lock:
            return {rank: list(ring) for rank, ring in self.rings.items()}, dict(self.states)

    def close(self) -> None:
        self.closing.set()
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:  # ends the blocked reads: their agents are stopped
            stream.close()

    def _publish(self, message: Lines | State) -> None:
        with self.lock:
            if isinstance(message, Lines):
                self.rings[message.node].extend(enumerate(message.lines, self.arrived))
                self.arrived += len(message.lines)
            elif self.states.get(message.node) == message:
                return  # the agent repeats a state: viewers hear of changes only
            else:
                self.states[message.node] = message
            viewers = list(self.viewers)
        for viewer in viewers:
            self.loop.call_soon_threadsafe(viewer.put, message)

    def _follow(self, rank: int) -> None:
        """Follow node ``rank``'s log from its last ``RING`` lines on, resuming where it stopped after
        a broken connection, until the attempt ends there or the feed closes."""
        where: dict[str, Any] = {"tail": RING}
        while not self.closing.is_set():
            try:
                ended = self._read(rank, where)
            except (ClusterrunError, OSError, ValueError) as exc:
                problem = exc.render() if isinstance(exc, ClusterrunError) else str(exc)
                self._publish(State(rank, str(NodeState.UNREACHABLE), safe(problem, colour=False)))
                ended = False
            if ended:
                return
            self.closing.wait(RETRY)

    def _read(self, rank: int, where: dict[str, Any]) -> bool:
        transport = transport_factory(self.record)(self.job.spec(self.attempt).hosts[rank])
        try:
            transport.connect()
            stream = transport.stream(request(self.record, rank, "follow", attempt=self.attempt, **where))
            with self.lock:
                self.streams[rank] = stream
            if self.closing.is_set():
                stream.close()
            for raw in stream:
                message = decode_follow(transport.name, raw)
                if isinstance(message, LogChunk):
                    backlog = "tail" in where
                    where.clear()
                    where["offset"] = message.next
                    lines = message.data.split("\n")
                    if lines and lines[-1] == "":
                        lines.pop()
                    self._publish(Lines(rank, tuple(safe(line, colour=False) for line in lines), backlog))
                elif isinstance(message, (StateUpdate, End)):
                    self._publish(State(rank, str(node_state_of(message.status))))
                    if isinstance(message, End):
                        return True
            return self.closing.is_set()
        finally:
            with self.lock:
                self.streams.pop(rank, None)
            transport.close()


class Feeds:
    """The feeds of the server, by job and attempt: one each, shared by all its viewers."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.feeds: dict[tuple[str, int], Feed] = {}

    def join(self, job: Opened, attempt: int, viewer: Viewer) -> Feed:
        """The feed of the attempt (started if none runs), with ``viewer`` added; on the event loop."""
        key = (job.job_id, attempt)
        feed = self.feeds.get(key)
        if feed is None:
            feed = self.feeds[key] = Feed(job, attempt, self.loop)
            feed.start()
        if feed.linger is not None:
            feed.linger.cancel()
            feed.linger = None
        with feed.lock:
            feed.viewers.add(viewer)
        return feed

    def leave(self, feed: Feed, viewer: Viewer) -> None:
        with feed.lock:
            feed.viewers.discard(viewer)
            empty = not feed.viewers
        if empty and feed.linger is None:
            feed.linger = self.loop.call_later(LINGER, self._retire, feed)

    def _retire(self, feed: Feed) -> None:
        feed.linger = None
        if not feed.viewers and self.feeds.get((feed.record.job_id, feed.attempt)) is feed:
            del self.feeds[(feed.record.job_id, feed.attempt)]
            feed.close()

    def end_streams(self) -> None:
        """End every viewer's stream (the server is stopping: it waits for open connections); from any thread."""
        for feed in list(self.feeds.values()):
            with feed.lock:
                viewers = list(feed.viewers)
            for viewer in viewers:
                self.loop.call_soon_threadsafe(viewer.queue.put_nowait, None)

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
        self.feeds.clear()
