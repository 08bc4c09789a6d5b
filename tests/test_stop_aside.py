"""A failing attempt's stop sent down the channel of the node's follow (``run.stops.stop_node``
with ``aside``): the agent that already streams the node answers it, no new agent is started;
where the stream has ended, the stop goes to a new agent as before. Real agents through the
local transport, a plain process in torchrun's place."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent.wire import node_request
from clusterrun.config.hostsfile import HostSpec
from clusterrun.run.stops import stop_node
from clusterrun.transports.base import AgentStream, AnyRequest
from clusterrun.transports.local import LocalTransport
from tests.conftest import alive, start_time, unique_job, wait_for

pytestmark = pytest.mark.integration

RUNS = "import sys, time\nprint('ready', flush=True)\nwhile True: time.sleep(1)\n"


class Counted(LocalTransport):
    """The local transport, counting the requests sent to agents of their own."""

    def __init__(self) -> None:
        super().__init__(HostSpec(host="here", transport="local"))
        self.calls: list[str] = []

    def call(self, request: AnyRequest) -> dict[str, Any]:
        self.calls.append(str(request["op"] if isinstance(request, dict) else request.op))
        return super().call(request)


def started(transport: Counted, state_dir: Path, job: str) -> tuple[int, int | None]:
    """Start ``RUNS`` as ``job``'s node 0; its torchrun's pid and start time once it runs."""
    answer = transport.call(node_request("start", job=job, node=0, attempt=1, state_dir=str(state_dir),
                                         argv=[sys.executable, "-c", RUNS], env={}, cwd=str(state_dir.parent)))
    log = Path(answer["dir"]) / "output.log"
    wait_for(lambda: b"ready" in log.read_bytes(), timeout=20, what="the job to run")
    pid = int(answer["state"]["torchrun"]["pid"])
    return pid, start_time(pid)


def followed(transport: Counted, state_dir: Path, job: str) -> tuple[AgentStream, list[dict[str, Any]],
                                                                     threading.Thread]:
    """A follow of node 0 that may be asked a stop, read by a thread of its own (as the job's follower)."""
    stream = transport.stream(node_request("follow", job=job, node=0, attempt=1, state_dir=str(state_dir),
                                           asks=True))
    messages: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: messages.extend(stream), daemon=True)
    reader.start()
    wait_for(lambda: any(m["t"] == "state" for m in messages), timeout=20, what="the follow's first state")
    return stream, messages, reader


def stop(transport: Counted, state_dir: Path, job: str, aside: AgentStream | None) -> Any:
    return stop_node(transport, 0, "here", job_id=job, attempt=1, state_dir=str(state_dir), grace=1.0,
                     by="the test", failing=True, aside=aside)


def test_a_failing_stop_goes_to_the_agent_that_follows_the_node(tmp_path: Path) -> None:
    transport, job, state_dir = Counted(), unique_job("aside"), tmp_path / "state"
    try:
        pid, began = started(transport, state_dir, job)
        stream, messages, reader = followed(transport, state_dir, job)
        report = stop(transport, state_dir, job, stream)
        assert report.ok and report.error is None and report.verified, report
        assert transport.calls == ["start"]  # no agent of its own for the stop
        assert not alive(pid, began)
        reader.join(20)
        assert not reader.is_alive()
        # The stream went on to the node's end, the stop's answer taken out of it
        assert [m["t"] for m in messages if m["t"] not in ("log", "beat")][-1] == "end"
        assert messages[-1]["state"]["state"] == "exited" and messages[-1]["state"]["stop_requested"] is True
        assert not any(m["t"] == "answer" for m in messages)
    finally:
        transport.close()


def test_where_the_follow_has_ended_the_stop_goes_to_a_new_agent(tmp_path: Path) -> None:
    transport, job, state_dir = Counted(), unique_job("aside"), tmp_path / "state"
    try:
        pid, began = started(transport, state_dir, job)
        stream, _messages, reader = followed(transport, state_dir, job)
        stream.close()  # its follower has ended (or lost the connection)
        reader.join(20)
        report = stop(transport, state_dir, job, stream)
        assert report.ok and report.verified, report
        assert transport.calls == ["start", "stop"]
        assert not alive(pid, began)
    finally:
        transport.close()


def test_a_follow_that_may_be_asked_ends_when_its_controller_goes(tmp_path: Path) -> None:
    """Its stdin ended (the controller gone: no transport closes only that side): nobody reads the
    follow, which ends at once rather than go on acting on the host (starting a supervisor again)."""
    transport, job, state_dir = Counted(), unique_job("aside"), tmp_path / "state"
    try:
        pid, began = started(transport, state_dir, job)
        stream, _messages, reader = followed(transport, state_dir, job)
        [agent] = transport._live
        assert agent.stdin is not None
        agent.stdin.close()  # what the controller's end does to it, without reading on
        wait_for(lambda: agent.poll() is not None, timeout=20, what="the follow's agent to end")
        assert agent.returncode == 0 and alive(pid, began)  # the job runs on
        stream.close()
        reader.join(20)
    finally:
        try:
            assert stop(transport, state_dir, job, None).ok
        finally:
            transport.close()
