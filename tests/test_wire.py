"""``clusterrun.agent.wire``: every operation's request and answer typed, shared by both sides."""

from __future__ import annotations

import inspect
import json

import pytest

from clusterrun.agent import serve, status, wire
from clusterrun.core import protocol


def test_every_operation_has_a_request_type_and_an_answer_type() -> None:
    ops = set(serve.OPS)
    assert set(wire.REQUESTS) == ops
    answered = {**wire.ANSWERS, **protocol.ANSWERS}
    assert set(answered) == ops, sorted(ops ^ set(answered))
    assert not set(wire.ANSWERS) & set(protocol.ANSWERS)  # one place decodes each


@pytest.mark.parametrize("op", sorted(serve.OPS))
def test_every_handler_takes_its_decoded_request_type(op: str) -> None:
    """serve.answer decodes a request once; the handler is declared to take that type, never a dict."""
    parameters = list(inspect.signature(serve.handler(op)).parameters.values())
    assert len(parameters) == 1, f"{op}: {parameters}"
    assert parameters[0].annotation == wire.REQUESTS[op].__name__


def test_a_handler_receives_the_request_object(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    monkeypatch.setattr(status, "op_status", lambda request: seen.append(request) or {"ok": True})
    assert serve.answer(b'{"op": "status", "job": "j", "node": 2}') == {"ok": True}
    assert seen == [wire.StatusRequest(job="j", node=2)]


def test_a_request_survives_json_both_ways_with_its_defaults() -> None:
    request = wire.ProbeRequest(state_dir="/s", route_to=wire.RouteTarget(addr="10.0.0.1", peers=["a"]))
    data = json.loads(json.dumps(request.to_json()))
    assert data["op"] == "probe" and data["route_to"]["port"] == 9
    assert wire.ProbeRequest.from_json(data) == request
    assert wire.StopRequest.from_json({"op": "stop", "job": "j", "node": 0}).grace == 10.0
    with pytest.raises(AttributeError):
        request.state_dir = "/other"  # type: ignore[misc]


@pytest.mark.parametrize(("line", "error"), [
    ({"op": "stop", "node": 0}, "bad request: ValueError: stop request: job is missing"),
    ({"op": "stop", "job": "j", "node": "0"}, "bad request: ValueError: stop request: node must be int, not str"),
    ({"op": "follow", "job": "j", "node": 0, "offset": 1.5}, "follow request: offset must be int, not float"),
    ({"op": "reach", "addr": "h", "port": 1, "timeout": "soon"}, "reach request: timeout must be float, not str"),
    ({"op": "nope"}, "unknown op 'nope'"),
    ([1, 2], "unknown op None"),
])
def test_the_agent_names_the_field_of_a_bad_request(line: object, error: str) -> None:
    answer = serve.answer(json.dumps(line).encode())
    assert answer is not None and answer["ok"] is False and error in answer["error"]


def test_answers_decode_with_their_nested_types() -> None:
    answer = wire.JobsAnswer.from_json({"ok": True, "root": "/r", "jobs": [{"job": "a", "node": 0, "attempt": 2}]})
    assert answer.jobs == [wire.JobEntry(job="a", node=0, attempt=2)]
    with pytest.raises(ValueError, match=r"jobs\[0\]: node is missing"):
        wire.JobsAnswer.from_json({"ok": True, "root": "/r", "jobs": [{"job": "a", "attempt": 2}]}, "jobs answer")


def test_a_stop_answer_the_controller_cannot_read_is_the_nodes_stop_error() -> None:
    """The one stop request (``stop_node``) decodes its answer as ``wire.StopAnswer``: a mistyped
    field is that node's failed stop (it may still run), named, never a crash of the stop."""
    from clusterrun.run.stops import stop_node

    class Answers:
        name = "gpu-a"

        def __init__(self, answer: dict) -> None:
            self.answer = answer
            self.sent: list[dict] = []

        def call(self, request: wire.NodeRequest) -> dict:
            self.sent.append(request.to_json())
            return self.answer

    bad = Answers({"ok": True, "killed": "everything", "left": []})
    report = stop_node(bad, 2, "gpu-a", job_id="j", attempt=3, state_dir="/s", grace=4.0)  # type: ignore[arg-type]
    assert not report.ok and "killed" in (report.error or "")
    assert bad.sent == [{"op": "stop", "job": "j", "node": 2, "attempt": 3, "state_dir": "/s", "grace": 4.0,
                         "by": None, "failing": False, "failed": False}]
    good = Answers({"ok": True, "killed": [{"pid": 5, "name": "torchrun", "signal": "SIGTERM"}], "left": [],
                    "containment": "cgroup", "verified": True})
    assert stop_node(good, 0, "gpu-a", job_id="j", attempt=1, state_dir=None, grace=1.0).complete  # type: ignore[arg-type]
