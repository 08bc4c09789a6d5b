"""The agent that followed a node to its end serves the owner's next attempt (``AgentStream.carry_on``,
``transports.lent``'s idle agents): its probe and its start go to that agent, no new one is started;
where it has ended meanwhile, the request goes to a new agent. Real agents through the local
transport, a plain process in torchrun's place."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent.wire import ProbeRequest, node_request
from clusterrun.config.hostsfile import HostSpec
from clusterrun.run.stops import stop_node
from clusterrun.transports.base import AgentSession, AgentStream
from clusterrun.transports.lent import TransportPool
from clusterrun.transports.local import LocalTransport
from tests.conftest import alive, start_time, unique_job, wait_for

pytestmark = pytest.mark.integration

RUNS = "import sys, time\nprint('ready', flush=True)\nwhile True: time.sleep(1)\n"
HOST = HostSpec(host="here", transport="local")


class Counted(LocalTransport):
    """The local transport, counting the agents it starts."""

    def __init__(self) -> None:
        super().__init__(HOST)
        self.sessions = 0

    def session(self) -> AgentSession:
        self.sessions += 1
        return super().session()

    def agent_pids(self) -> list[int]:
        return [proc.pid for proc in self._live]


def start(session: AgentSession, state_dir: Path, job: str, attempt: int) -> tuple[int, int | None]:
    """Start ``RUNS`` as ``job``'s node 0, ``attempt``; its torchrun's pid and start time once it runs."""
    answer = session.call(node_request("start", job=job, node=0, attempt=attempt, state_dir=str(state_dir),
                                       argv=[sys.executable, "-c", RUNS], env={}, cwd=str(state_dir.parent)))
    log = Path(answer["dir"]) / "output.log"
    wait_for(lambda: b"ready" in log.read_bytes(), timeout=20, what=f"attempt {attempt} to run")
    pid = int(answer["state"]["torchrun"]["pid"])
    return pid, start_time(pid)


def read(stream: AgentStream, messages: list[dict[str, Any]], kept: list[AgentSession | None]) -> None:
    """Read ``stream`` as the job's follower does: at its ``end``, its agent carried on (or None)."""
    for message in stream:
        messages.append(message)
        if message["t"] == "end":
            kept.append(stream.carry_on())


def followed_to_its_end(transport: Counted, state_dir: Path, job: str, asks: bool = True) -> AgentSession | None:
    """Attempt 1 started, followed (``asks``: as the owner does), stopped (down the follow's channel
    where it asks: a failing attempt's stop), and the follow read to its ``end``; the agent carried on."""
    first = transport.session()
    try:
        pid, began = start(first, state_dir, job, 1)
    finally:
        first.close()
    stream = transport.stream(node_request("follow", job=job, node=0, attempt=1, state_dir=str(state_dir),
                                           asks=asks))
    messages: list[dict[str, Any]] = []
    kept: list[AgentSession | None] = []
    reader = threading.Thread(target=read, args=(stream, messages, kept), daemon=True)
    reader.start()
    wait_for(lambda: any(m["t"] == "state" for m in messages), timeout=20, what="the follow's first state")
    report = stop_node(transport, 0, "here", job_id=job, attempt=1, state_dir=str(state_dir), grace=1.0,
                       by="the test", failing=True, aside=stream if asks else None)
    assert report.ok and report.verified, report
    reader.join(20)
    assert not reader.is_alive() and [m["t"] for m in messages if m["t"] != "beat"][-1] == "end"
    assert not alive(pid, began)
    assert len(kept) == 1
    return kept[0]


def lent_after(transport: Counted, kept: AgentSession) -> tuple[TransportPool, AgentSession]:
    """The owner's pool once attempt 1 ended, its follow's agent kept idle (``Job.idle_agents``), and
    the next attempt's first session on the host."""
    pool = TransportPool(lambda host: transport)
    pool.adopt([], idle={"here": kept})
    return pool, pool.lend(HOST).session()


def stop_attempt_2(transport: Counted, state_dir: Path, job: str) -> bool:
    return stop_node(transport, 0, "here", job_id=job, attempt=2, state_dir=str(state_dir), grace=1.0,
                     by="the test").ok


def test_the_agent_that_followed_a_node_to_its_end_probes_and_starts_its_next_attempt(tmp_path: Path) -> None:
    transport, job, state_dir = Counted(), unique_job("reuse"), tmp_path / "state"
    try:
        kept = followed_to_its_end(transport, state_dir, job)
        assert transport.sessions == 2 and kept is not None and kept.idle  # attempt 1's start, its follow
        pool, agent = lent_after(transport, kept)
        assert agent.call(ProbeRequest(state_dir=str(state_dir)))["ok"]
        pid, began = start(agent, state_dir, job, 2)
        assert transport.sessions == 2  # the probe and the start went to the agent that followed attempt 1
        assert alive(pid, began)
        other = pool.lend(HOST).session()  # kept for one session only
        assert other is not agent and transport.sessions == 3
        other.close()
        agent.close()
        assert stop_attempt_2(transport, state_dir, job)
        pool.close()
    finally:
        transport.close()


def test_an_agent_kept_idle_that_has_ended_is_replaced_by_a_new_one(tmp_path: Path) -> None:
    transport, job, state_dir = Counted(), unique_job("reuse"), tmp_path / "state"
    try:
        kept = followed_to_its_end(transport, state_dir, job)
        assert kept is not None and kept.idle
        [pid] = transport.agent_pids()  # the follow's agent, still answering
        os.kill(pid, signal.SIGKILL)  # it ends meanwhile (a host's OOM killer, a dropped channel)
        pool, agent = lent_after(transport, kept)
        assert agent.call(ProbeRequest(state_dir=str(state_dir)))["ok"]  # answered by a new agent
        assert transport.sessions == 3 and transport.agent_pids() != [pid]
        pid2, began = start(agent, state_dir, job, 2)  # the new agent goes on with the start
        assert alive(pid2, began) and transport.sessions == 3
        agent.close()
        assert stop_attempt_2(transport, state_dir, job)
        pool.close()
    finally:
        transport.close()


def test_a_follow_without_asks_ends_its_agent_and_leaves_nothing_to_carry_on(tmp_path: Path) -> None:
    """A viewer's follow (``logs -f``) is not the owner's: its agent ends with the stream, as before."""
    transport, job, state_dir = Counted(), unique_job("reuse"), tmp_path / "state"
    try:
        assert followed_to_its_end(transport, state_dir, job, asks=False) is None
        assert transport.agent_pids() == []
    finally:
        transport.close()
