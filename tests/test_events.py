"""The one rule for a job's state from its nodes' states (results, records, the dashboard)."""

from __future__ import annotations

import pytest

from clusterrun.core.events import JobState, NodeState
from clusterrun.views.printer import stop_text

S, F, X, L, R, U, P = (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.STOPPED, NodeState.LOST, NodeState.RUNNING,
                       NodeState.UNREACHABLE, NodeState.PENDING)


@pytest.mark.parametrize(("nodes", "job"), [
    ([S, S], JobState.SUCCEEDED),
    ([S, F], JobState.FAILED),
    ([X, F, L], JobState.FAILED),  # a failure beats the loss and the stops it caused
    ([X, L], JobState.LOST),
    ([X, S], JobState.STOPPED),
    ([X, X], JobState.STOPPED),
    ([R, S], JobState.RUNNING),
    ([R, P], None),  # still starting
    ([X, U], None),  # may still run where it could not be reached: not finished
    ([R, U], None),
    ([], None),
])
def test_a_jobs_state_from_its_nodes(nodes: list[NodeState], job: JobState | None) -> None:
    assert JobState.of_nodes(nodes) is job
    assert JobState.of_nodes(n.value for n in nodes) is job  # records keep the values


def test_records_keep_the_states_as_json_strings() -> None:
    import json

    assert json.dumps({"state": JobState.RUNNING, "node": NodeState.LOST}) == '{"state": "running", "node": "lost"}'


def test_a_stop_report_says_when_torchrun_outlived_the_grace() -> None:
    """Only torchrun's own SIGKILL counts: the cgroup kill or the sweep SIGKILL what is left of the
    job after torchrun ended within the grace (processes that ignore SIGTERM), which says nothing
    of the grace."""
    from clusterrun.core.protocol import stop_report

    state = {"state": "exited", "torchrun": {"pid": 10, "start_time": 1}}
    answer = {"ok": True, "state": state, "containment": "cgroup", "verified": True, "grace": 2.5, "left": [],
              "killed": [{"pid": 10, "name": "python3", "signal": "SIGTERM"},
                         {"pid": 12, "name": "python3", "signal": "SIGKILL"}]}
    within = stop_report("gpu-a", 0, answer)
    assert not within.grace_ran_out and "grace" not in stop_text(within)
    answer["killed"][0]["signal"] = "SIGKILL"  # type: ignore[index]
    outlived = stop_report("gpu-a", 0, answer)
    assert outlived.grace_ran_out and stop_text(outlived) == (
        "node0 gpu-a: stopped torchrun (pid 10) and 1 other process; torchrun outlived the 2.5 s grace after "
        "SIGTERM: SIGKILLed; nothing left (verified by cgroup)")
    assert "outlived the grace after" in stop_text(stop_report("gpu-a", 0, dict(answer, grace=None)))
    assert not stop_report("gpu-a", 0, dict(answer, state={"state": "exited"})).grace_ran_out
