"""The agent's stdout as the controller reads it: JSON lines, each maybe followed by raw bytes.

A line whose message has ``raw: N`` is followed by N bytes that are not JSON (a log's bytes, as
written on the host: ``clusterrun.agent.codec.encode``); they become the message's ``data``.
``AgentReader`` reads both from any ``recv`` (a channel's, a pipe's), keeping what it received in
one buffer it walks through: a line or a payload costs a slice, never a copy of what is left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

__all__ = ["AgentReader"]


class AgentReader:
    """Lines and payloads from ``recv``, which returns what arrived (at least one byte) or b"" at
    the end. An end is not final: the fake transport's next request makes more to read."""

    def __init__(self, recv: Callable[[], bytes]) -> None:
        self._recv = recv
        self._buffer = b""
        self._at = 0  # where in ``_buffer`` the next read begins
        self._greeted = False

    def message_line(self) -> bytes:
        """The next line that holds a message, b"" at the end: blank lines are skipped, and so is
        what a login shell's start-up files print before the agent runs (a banner, conda's or a
        module system's notes), up to the agent's first message, even without a newline before it."""
        while line := self.readline():
            if not self._greeted:
                start = line.find(b'{"')
                if start < 0:
                    continue
                line, self._greeted = line[start:], True
            if line.strip():
                return line
        return b""

    def readline(self) -> bytes:
        """The next line with its newline; a last one without it; b"" at the end."""
        pieces: list[bytes] = []  # a line longer than one receive: the newline is looked for in new bytes only
        while True:
            buffer, at = self._buffer, self._at
            end = buffer.find(b"\n", at) + 1
            if end:
                self._at = end
                return b"".join((*pieces, buffer[at:end])) if pieces else buffer[at:end]
            if at < len(buffer):
                pieces.append(buffer[at:])
            self._buffer, self._at = self._recv(), 0
            if not self._buffer:
                return b"".join(pieces)

    def read(self, size: int) -> bytes:
        """The next ``size`` bytes; fewer only at the end."""
        buffer, at = self._buffer, self._at
        if at + size <= len(buffer):
            self._at = at + size
            return buffer[at:at + size]
        pieces, got = [buffer[at:]], len(buffer) - at
        self._buffer, self._at = b"", 0
        while got < size:
            data = self._recv()
            if not data:
                break
            if len(data) > size - got:
                self._buffer, self._at = data, size - got
                data = data[:size - got]
            pieces.append(data)
            got += len(data)
        return b"".join(pieces)

    def __iter__(self) -> Iterator[bytes]:
        """The lines, to the end."""
        while line := self.readline():
            yield line
