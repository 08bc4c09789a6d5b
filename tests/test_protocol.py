"""The controller reads the agent's answers in one place: malformed ones are ProtocolErrors naming host and field."""

from __future__ import annotations

import pytest

from clusterrun.core.errors import AgentError
from clusterrun.core.protocol import (
    PROTOCOL,
    Beat,
    End,
    Eof,
    HostState,
    LogChunk,
    ProtocolError,
    StateUpdate,
    decode_follow,
    decode_probe,
    decode_status,
)

PROBE = {"ok": True, "protocol": PROTOCOL, "hostname": "gpu-a", "python": "3.11.7", "torch": "2.13.0",
         "torchrun_flags": ["--signals-to-handle"], "boot_id": "b1", "port": 29500, "state_dir": "/s"}


def test_a_probe_is_decoded() -> None:
    probe = decode_probe("gpu-a", PROBE)
    assert probe.python_version == (3, 11) and probe.torchrun_flags == ("--signals-to-handle",)
    assert probe.port == 29500 and probe.torch == "2.13.0"


@pytest.mark.parametrize(("change", "field"), [
    ({"python": None}, "python"), ({"port": "29500"}, "port"), ({"torchrun_flags": "--x"}, "torchrun_flags"),
    ({"torchrun_flags": [1]}, "torchrun_flags"), ({"boot_id": 7}, "boot_id"),
])
def test_a_malformed_probe_names_the_host_and_the_field(change: dict, field: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode_probe("gpu-a", {**PROBE, **change})
    assert raised.value.render().startswith(f"gpu-a: the agent's probe answer has {field}=")


@pytest.mark.parametrize("version", [None, PROTOCOL + 1])
def test_another_protocol_version_is_refused_with_the_fix(version: int | None) -> None:
    with pytest.raises(ProtocolError, match=f"speaks protocol {version or 0}, this controller {PROTOCOL}") as raised:
        decode_probe("gpu-a", {**PROBE, "protocol": version})
    assert "~/.cache/clusterrun" in raised.value.render()


def test_follow_messages_and_states() -> None:
    state = {"state": "exited", "exit_code": 3, "signal": None, "stop_requested": True, "ended_at": 5,
             "torchrun": {"pid": 42, "start_time": 1},
             "workers": [{"rank": 1, "local_rank": 0, "pid": 43, "died": 4.5}]}
    assert decode_follow("h", {"t": "log", "offset": 0, "next": 4, "data": b"a\nb\n"}) == LogChunk(0, 4, "a\nb\n")
    odd = b"\xff\x00\r\x1b[2J\xe9\n"  # a log's bytes as written: the printer neutralises what it must
    assert decode_follow("h", {"t": "log", "offset": 0, "next": 6, "data": odd}).data.encode(
        "utf-8", "surrogateescape") == odd
    assert decode_follow("h", {"t": "beat"}) == Beat()
    end = decode_follow("h", {"t": "end", "state": state})
    assert isinstance(end, End) and end.status.exit_code == 3 and end.status.stop_requested
    assert end.status.torchrun_pid == 42 and end.status.workers[0].died == 4.5 and end.status.ended
    assert isinstance(decode_follow("h", {"t": "state", "state": {"state": "running"}}), StateUpdate)
    assert decode_follow("h", {"t": "eof", "next": 9, "state": {"state": "running"}}) == Eof(
        9, decode_status("h", {"state": "running"}))
    assert decode_status("h", {"state": "absent"}).state is HostState.ABSENT


@pytest.mark.parametrize(("message", "text"), [
    ({"t": "log", "offset": 0, "data": b"x\n"}, "follow message has next=None"),
    ({"t": "log", "offset": 0, "next": True, "data": b"x\n"}, "has next=True"),
    ({"t": "log", "offset": 0, "next": 2, "data": "x\n"}, "; expected the log's bytes"),  # JSON text
    ({"t": "log", "offset": 0, "next": 2}, "has data=None"),
    ({"t": "end", "state": {"state": "exploded"}}, "state has state='exploded'"),
    ({"t": "end", "state": {"state": "exited", "workers": [{"died": "late"}]}}, "workers[0] has died='late'"),
    ({"t": "gossip"}, "has t='gossip'"),
    (["not", "an", "object"], "is not an object"),
])
def test_malformed_follow_messages_are_protocol_errors(message: object, text: str) -> None:
    with pytest.raises(ProtocolError, match=text.replace("[", r"\[").replace("]", r"\]")):
        decode_follow("h", message)


def test_an_error_answer_is_an_agent_error() -> None:
    with pytest.raises(AgentError, match="no job x") as raised:
        decode_follow("h", {"ok": False, "error": "no job x"})
    assert not isinstance(raised.value, ProtocolError)
