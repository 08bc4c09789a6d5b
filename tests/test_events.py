"""The one rule for a job's state from its nodes' states (results, records, the dashboard)."""

from __future__ import annotations

import pytest

from clusterrun.events import JobState, NodeState

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
