"""The transport interface: run the node agent on a host and talk to it in JSON lines.

Lifecycle: create → ``connect()`` → any number of ``session()`` / ``call()`` / ``stream()`` →
``close()``. A session is one agent process (over SSH: one channel, one interpreter start) that
answers requests in turn, so a node is probed, started and followed by the same agent. A
transport only moves bytes (``frames.AgentReader`` reads what it receives): what the agent does
is the agent's business (``clusterrun.agent``), and requests always travel on the agent's stdin,
never on a command line. A session of a real transport starts with the agent's loader and the
sha256 of its zip (``bundle``); the zip itself is sent only when the host's cache lacks it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from clusterrun.agent import BOOTSTRAP
from clusterrun.agent.wire import Request
from clusterrun.config.hostsfile import HostSpec
from clusterrun.core import timings
from clusterrun.core.errors import AgentError, ClusterrunError
from clusterrun.transports.bundle import AgentBundle, agent_bundle
from clusterrun.transports.frames import AgentReader

__all__ = ["AgentBundle", "AgentReader", "AnyRequest", "AgentSession", "AgentStream", "Transport", "agent_bundle",
           "agent_command", "request_line", "read_timeout"]

# How long a follow may stay silent before its connection is taken for dead even if TCP has not
# noticed: the agent speaks at least every 5 s (wire.HEARTBEAT).
FOLLOW_TIMEOUT = 20.0


# A request: one of clusterrun.agent.wire's types, or a dict where that has not been done yet.
AnyRequest = dict[str, Any] | Request


def request_line(request: AnyRequest) -> bytes:
    return json.dumps(as_json(request)).encode() + b"\n"


def as_json(request: AnyRequest) -> dict[str, Any]:
    """A request as the agent reads it."""
    return request.to_json() if isinstance(request, Request) else request


def agent_command(python: str) -> list[str]:
    """The constant argv that runs the agent: no job data in it (``-S``: see ``clusterrun.agent``)."""
    return [python, "-S", "-c", BOOTSTRAP]


def read_timeout(request: dict[str, Any]) -> float:
    """How long the answer to ``request`` may take before the connection is taken for dead."""
    if request.get("op") in ("setup", "start", "run") and request.get("setup"):
        return float(request.get("setup_timeout") or 600) + 60  # the host's setup commands first (agent.SETUP_TIMEOUT)
    if request.get("op") in ("follow", "run"):  # streams that say something every HEARTBEAT
        return FOLLOW_TIMEOUT
    if request.get("op") == "stack":
        looks = int(request.get("looks") or 1)  # py-spy's timeout per look (all ranks at once), and the pauses
        return (float(request.get("timeout") or 0) + float(request.get("apart") or 0)) * looks + 60
    if request.get("op") == "stop":
        return float(request.get("grace") or 0) + 60  # torchrun's grace, then the sweep
    return 60.0


class AgentStream:
    """The agent's answer lines as they arrive: iterate for dicts, ``close()`` to stop early.

    While one thread iterates, another may ``ask`` the agent a one-answer request (a ``follow``
    sent with ``asks``: the owner's stop) down the same channel: its answer comes among the
    stream's messages (``{"t": "answer"}``), and the iterating thread hands it over. Once the
    stream has ended, ``carry_on`` gives its agent back as a session for more requests."""

    def __init__(self, host: str, reader: AgentReader, closer: Any, *, send: Callable[[bytes], None] | None = None,
                 set_timeout: Callable[[float], None] | None = None, session: AgentSession | None = None) -> None:
        self._host = host
        self._reader = reader
        self._closer = closer
        self._send = send  # None: this transport's streams carry no request after the first
        self._set_timeout = set_timeout
        self._session = session  # the session it came from, which ``carry_on`` hands the channel back to
        self._asking = threading.Lock()  # one request at a time
        self._answered = threading.Event()
        self._answer: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The messages; the stream closes itself when they end (or iteration fails)."""
        try:
            while raw := self._reader.message_line():
                message = _parse(self._host, raw, self._reader)
                if message.get("t") == "answer":  # to ``ask``'s request, not one of the stream's
                    self._answer = message.get("answer") if isinstance(message.get("answer"), dict) else None
                    self._answered.set()
                    continue
                yield message
                if self._session is not None and message.get("t") == "end":
                    return  # its agent answers on: taken by ``carry_on`` at the end, else closed
        finally:
            self.close()

    def ask(self, request: AnyRequest) -> dict[str, Any] | None:
        """Send ``request`` to the streaming agent and wait for its answer; None where it cannot
        come this way (the transport's streams take no request, or the stream ended first): send
        it to an agent of its own. Raises ``AgentError`` if the agent answered a failure."""
        data = as_json(request)
        if self._send is None:
            return None
        with self._asking:
            self._answer = None
            self._answered.clear()
            if self._closer is None:
                return None
            if self._set_timeout is not None:  # the agent answers it before streaming on
                self._set_timeout(max(FOLLOW_TIMEOUT, read_timeout(data)))
            try:
                self._send(request_line(data))
            except ClusterrunError:
                return None
            self._answered.wait(read_timeout(data))
            answer = self._answer
            if self._set_timeout is not None and self._closer is not None:  # the stream goes on as before
                self._set_timeout(FOLLOW_TIMEOUT)
        if answer is not None and not answer.get("ok"):
            raise AgentError(self._host, str(answer.get("error") or "the agent failed"))
        return answer

    def carry_on(self) -> AgentSession | None:
        """After the stream's last message (a ``follow`` sent with ``asks``: its ``end``), its agent
        as a session that answers more requests, the channel handed over to it (``close`` no longer
        closes it); None where it cannot (the transport's streams take no request, the stream was
        closed, or an ``ask`` waits for an answer that would come after the end: closing the stream
        sends it elsewhere)."""
        if self._session is None:
            return None
        # An ask whose answer came (the stop that led to this end) is about to return: waited for
        if not self._asking.acquire(blocking=False) and not (self._answered.is_set()
                                                             and self._asking.acquire(timeout=5)):
            return None
        try:
            closer, self._closer = self._closer, None
        finally:
            self._asking.release()
        return self._session.resumed(closer) if closer is not None else None

    def close(self) -> None:
        """Stop the agent if it is still answering and release the channel (idempotent)."""
        closer, self._closer = self._closer, None
        self._answered.set()  # an ``ask`` still waiting has no answer
        if closer is not None:
            closer()


def _parse(host: str, raw: bytes, reader: AgentReader) -> dict[str, Any]:
    """The message of the line ``raw``, with the raw bytes after it (``raw: N``) as its ``data``."""
    try:
        message = json.loads(raw)
    except ValueError:
        raise AgentError(host, f"the agent answered something that is not JSON: {raw[:200]!r}") from None
    if not isinstance(message, dict):
        raise AgentError(host, f"the agent answered {message!r}")
    if "raw" in message:
        size = message.pop("raw")
        if type(size) is not int or size < 0:
            raise AgentError(host, f"the agent's message says raw={size!r}, not a length: {raw[:200]!r}")
        message["data"] = data = reader.read(size)
        if len(data) < size:  # the stream was cut: a reader resumes from the last whole message
            raise AgentError(host, f"the agent's output ended after {len(data)} of the {size} bytes of a message")
    return message


class AgentSession:
    """One running agent: ``call()`` as often as needed, then ``close()`` — or hand it to one
    ``stream()`` (a follow), which ends the session when the stream is closed.

    With ``bundle`` (the real transports), the session sends the loader and the zip's sha256 at
    once, and before its first request reads whether the host has the zip, sending it if not.
    ``sent`` counts the bytes written to the agent."""

    def __init__(self, host: str, send: Callable[[bytes], None], reader: AgentReader, closer: Callable[[], None],
                 *, set_timeout: Callable[[float], None] | None = None,
                 last_words: Callable[[], str] = lambda: "", bundle: AgentBundle | None = None,
                 opened: float | None = None, asides: bool = False) -> None:
        self.host = host
        self._asides = asides  # its stream may carry a request after the first (``AgentStream.ask``)
        self.sent = 0
        self._opened = time.monotonic() if opened is None else opened  # for the timeline (clusterrun.core.timings)
        self._asked = self._opened
        self._write = send
        self._reader = reader
        self._closer: Callable[[], None] | None = closer
        self._set_timeout = set_timeout
        self._last_words = last_words
        self._bundle = bundle  # its preamble goes with the first request (see _ask)
        self._waiting = False  # a request was sent and its answer not read yet
        self._heard = 0  # answers read: a request that got none found the agent gone
        self._renew: Callable[[], AgentSession] | None = None  # see ``renewable``

    def _send(self, data: bytes) -> None:
        self.sent += len(data)
        self._write(data)

    def _ask(self, request: AnyRequest, with_data: bool = False) -> dict[str, Any]:
        data = as_json(request)
        if self._closer is None:
            raise RuntimeError("the agent session was closed")
        if self._set_timeout is not None:
            self._set_timeout(read_timeout(data))
        bundle, self._bundle = self._bundle, None
        if bundle is not None and not with_data:  # the request rides with the preamble, before any zip
            self._send(bundle.preamble(ahead=True) + request_line(data))
            self._handshake(bundle, data)
            self._asked = time.monotonic()  # the timeline's agent phase ends at the loader's word
            timings.record(self.host, "agent", self._opened, self._asked)
            return data
        if bundle is not None:
            self._send(bundle.preamble())
            self._handshake(bundle, data)
            timings.record(self.host, "agent", self._opened)
        self._asked = time.monotonic()
        self._waiting = True
        self._send(request_line(data))
        return data

    def _handshake(self, bundle: AgentBundle, request: dict[str, Any]) -> None:
        """The loader's first word: ``have`` (the host's cache holds this zip) or ``need`` (send it)."""
        if raw := self._reader.message_line():
            word = _parse(self.host, raw, self._reader).get("agent")
            if word == "need":
                self._send(bundle.zip)
            elif word != "have":
                raise AgentError(self.host, f"the agent's loader answered {raw[:200]!r}")
            return
        raise AgentError(self.host, f"the agent ended without an answer to {request.get('op')!r}"
                         + self._last_words())

    def call(self, request: AnyRequest) -> dict[str, Any]:
        """Send a one-answer request; raise ``AgentError`` if the agent reports a failure."""
        renew, self._renew = self._renew, None
        heard = self._heard
        try:
            return self._answer(self._ask(request))
        except ClusterrunError:
            if renew is None or self._heard != heard:  # it answered: its failure stands
                raise
        # A kept agent that had ended meanwhile: the request goes to a new one (it was not answered)
        self.close()
        vars(self).update(vars(renew()))
        return self.call(request)

    @property
    def idle(self) -> bool:
        """Open, and no request waits for its answer: another may be sent (``transports.lent`` keeps it)."""
        return self._closer is not None and not self._waiting

    def renewable(self, renew: Callable[[], AgentSession]) -> AgentSession:
        """This session, kept idle for a while (its agent may have ended meanwhile): where its next
        ``call`` gets no answer at all, the request goes to the session ``renew`` makes, which this
        one becomes."""
        self._renew = renew
        return self

    def resumed(self, closer: Callable[[], None]) -> AgentSession:
        """This session again, its stream ended (``AgentStream.carry_on``): ``closer`` releases its channel."""
        self._closer, self._waiting = closer, False
        return self

    def call_with_data(self, request: AnyRequest, data: Iterable[bytes]) -> dict[str, Any]:
        """``call`` with raw bytes after the request line, as ``sync_put`` reads its files' contents."""
        sent = self._ask(request, with_data=True)
        for chunk in data:
            self._send(chunk)
        return self._answer(sent)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = str(request.get("op"))
        try:
            return self._read_answer(request)
        finally:
            timings.record(self.host, timings.PHASE_OF.get(op, op), self._asked)

    def _read_answer(self, request: dict[str, Any]) -> dict[str, Any]:
        if raw := self._reader.message_line():
            message = _parse(self.host, raw, self._reader)
            self._heard += 1
            self._waiting = False
            if not message.get("ok"):
                raise AgentError(self.host, str(message.get("error") or "the agent failed"))
            return message
        raise AgentError(self.host, f"the agent ended without an answer to {request.get('op')!r}"
                         + self._last_words())

    def stream(self, request: AnyRequest) -> AgentStream:
        """Send a streaming request (``follow``); the session belongs to the stream from now on."""
        self._renew = None
        asks = bool(self._ask(request).get("asks"))  # its agent answers on after its end (``carry_on``)
        closer, self._closer = self._closer, None
        return AgentStream(self.host, self._reader, closer, send=self._send if self._asides else None,
                           set_timeout=self._set_timeout, session=self if self._asides and asks else None)

    def close(self) -> None:
        """End the agent and release its channel (idempotent)."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()


class Transport(ABC):
    """One host's way of running the agent."""

    def __init__(self, host: HostSpec) -> None:
        self.host = host

    @property
    def name(self) -> str:
        return self.host.host

    @property
    def address(self) -> str | None:
        """The address the host is reached at, once resolved (None where that means nothing)."""
        return None

    def resolve(self) -> None:
        """Find where the host is (``address``) without connecting; ``connect`` does it if not done.
        Raises a ``TransportError`` subclass for a host that cannot be found. Nothing to find here."""
        return None

    @property
    @abstractmethod
    def python(self) -> str:
        """The interpreter that runs the agent and torchrun on the host."""

    @abstractmethod
    def connect(self) -> None:
        """Make the host reachable; raise a ``TransportError`` subclass if it is not."""

    def expect_ahead(self) -> bool:
        """Whether ``connect_ahead`` has anything to do here (``connect_early``), now expected: the
        next ``connect()`` and ``session()`` wait for it. Nothing for a host without a connection."""
        return False

    def connect_ahead(self) -> None:
        """``connect()`` and the agent's ``session()`` opened ahead, from ``connect_early``'s thread."""
        return None

    @abstractmethod
    def session(self) -> AgentSession:
        """Start an agent on the host, ready for requests."""

    def stream(self, request: AnyRequest) -> AgentStream:
        """Start an agent with a streaming request; its answer lines arrive on the returned stream."""
        session = self.session()
        try:
            return session.stream(request)
        except BaseException:
            session.close()
            raise

    def call(self, request: AnyRequest) -> dict[str, Any]:
        """Run a one-answer request in an agent of its own; raise ``AgentError`` on failure."""
        session = self.session()
        try:
            return session.call(request)
        finally:
            session.close()

    # How a sync may reach the host's files besides the agent's ``sync_put`` (clusterrun.sync.copy):
    # ``local`` (the host's file system is this machine's), ``ssh`` (``pipe()`` over the connection)
    # or None (only the agent).
    files: str | None = None

    def pipe(self, command: str, peer: socket.socket) -> tuple[int, str]:
        """Run ``command`` (its words safe for any login shell) on the host, with ``peer`` as its
        stdin and stdout, until it ends: its exit status and the end of its stderr."""
        raise NotImplementedError(f"{type(self).__name__} runs only the agent")

    def close(self) -> None:  # noqa: B027 - optional hook: a local host has nothing to release
        """Release the connection (nothing to do for a local host)."""
