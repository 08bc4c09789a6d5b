"""The guard in tests/conftest.py (``tests/leaks.py``): a local agent a test leaves running is found,
as the test that made it ends, and ended; one closed is not."""

from __future__ import annotations

import gc
import subprocess

import pytest

from clusterrun.config.hostsfile import HostSpec
from clusterrun.transports.local import LocalTransport
from tests.leaks import Snapshot, agents_left, end

pytestmark = pytest.mark.integration


def test_an_agent_left_running_is_found_and_ended_and_a_closed_one_is_not() -> None:
    transport = LocalTransport(HostSpec(host="here", transport="local"))
    before = Snapshot.take()
    closed = transport.session()
    closed.call({"op": "jobs", "state_dir": "/nonexistent"})
    closed.close()
    left = transport.session()
    # An answer first: Popen returns as the exec begins, often before /proc shows its argv (empty under load)
    left.call({"op": "jobs", "state_dir": "/nonexistent"})
    agents = agents_left(before.started_since(), within=0)
    assert [a.pid for a in agents] == [p.pid for p in transport._live] and agents[0].is_agent
    end(agents)
    assert agents_left(before.started_since(), within=0) == []
    procs = [o for o in gc.get_objects() if isinstance(o, subprocess.Popen) and o.pid == agents[0].pid]
    assert [(p.returncode, p.stdin.closed, p.stdout.closed) for p in procs] == [(-9, True, True)]  # type: ignore[union-attr]
    left.close()
