"""The agent's stdout read on the controller (``transports/frames.py``, ``base.AgentStream``): JSON
lines, a log's bytes raw after its line, however the transport cuts what it receives."""

from __future__ import annotations

import pytest

from clusterrun.agent.codec import encode
from clusterrun.core.errors import AgentError
from clusterrun.transports.base import AgentReader, AgentStream

ODD = b"\xff\x00bad\r50%\r\x1b]0;title\x07\x1b[2Jline\n" + b"z" * 5000 + b"\n{\"t\": \"beat\"}\npartial"
MESSAGES = [
    {"t": "state", "state": {"state": "running"}},
    {"t": "log", "offset": 0, "next": len(ODD), "times": [[0, 7]], "data": ODD},
    {"t": "beat"},
    {"t": "log", "offset": len(ODD), "next": len(ODD), "times": [], "data": b""},
    {"t": "end", "state": {"state": "exited", "exit_code": 0}},
]


def pieces(data: bytes, size: int) -> AgentReader:
    """A reader receiving ``data`` ``size`` bytes at a time."""
    parts = [data[at:at + size] for at in range(0, len(data), size)]
    parts.reverse()
    return AgentReader(lambda: parts.pop() if parts else b"")


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 4999, 5001, 1 << 20])
def test_every_message_and_every_byte_arrives_however_the_stream_is_cut(size: int) -> None:
    wire = b"".join(encode(m) for m in MESSAGES)
    assert list(AgentStream("h", pieces(wire, size), None)) == MESSAGES


def test_a_login_shells_greeting_and_blank_lines_are_not_the_agents() -> None:
    wire = b"Welcome to gpu-a\n\nconda: base" + encode({"ok": True}) + b"\n" + encode({"t": "log", "data": b"\n\n"})
    assert list(AgentStream("h", pieces(wire, 5), None)) == [{"ok": True}, {"t": "log", "data": b"\n\n"}]


def test_a_reader_reads_on_after_an_end_as_a_session_of_the_fake_does() -> None:
    parts = [b"", b'{"a": 1}\n', b"", b"xy"]
    reader = AgentReader(lambda: parts.pop(0) if parts else b"")
    assert (reader.readline(), reader.readline(), reader.readline(), reader.read(5)) == (b"", b'{"a": 1}\n', b"", b"xy")


@pytest.mark.parametrize(("wire", "text"), [
    (encode({"t": "log", "data": b"0123456789"})[:-3], "ended after 7 of the 10 bytes"),
    (b'{"t": "log", "raw": -1}\n', "raw=-1, not a length"),
    (b'{"t": "log", "raw": "10"}\n0123456789', "raw='10', not a length"),
])
def test_a_cut_or_malformed_payload_is_an_agent_error(wire: bytes, text: str) -> None:
    with pytest.raises(AgentError, match=text):
        list(AgentStream("h", pieces(wire, 4), None))
