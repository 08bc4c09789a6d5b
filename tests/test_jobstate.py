"""``jobstate``: every (state, change) pair against a matrix written out here, apart from the table."""

from __future__ import annotations

import pytest

from clusterrun.life.jobstate import TABLE, Change, IllegalTransition, JobState, outcome, transition

CHANGES = ["start", "all-running", "start-failed", "succeeded", "failed", "lost", "stop", "stop-verified",
           "stop-unverified", "retry", "give-up"]
# One row per state, one column per change of CHANGES; "-": illegal.
MATRIX = """
starting   -        running   failed    succeeded failed  lost    stopping stopped  -       restarting -
running    -        -         -         succeeded failed  lost    stopping stopped  -       restarting -
stopping   -        stopping  stopped   stopping  stopping stopping stopping stopped running stopping -
restarting starting restarting restarting restarting restarting restarting stopping stopped restarting restarting failed
succeeded  starting succeeded succeeded succeeded succeeded succeeded succeeded succeeded succeeded succeeded succeeded
failed     starting failed    failed    failed    failed  failed  failed  failed   failed  failed  failed
stopped    starting stopped   stopped   stopped   stopped stopped stopped stopped  stopped stopped stopped
lost       starting lost      lost      lost      lost    lost    lost    lost     lost    lost    lost
"""


def expected() -> dict[tuple[str, str], str | None]:
    cells: dict[tuple[str, str], str | None] = {}
    for row in MATRIX.strip().splitlines():
        state, *targets = row.split()
        assert len(targets) == len(CHANGES), row
        for change, target in zip(CHANGES, targets, strict=True):
            cells[(state, change)] = None if target == "-" else target
    return cells


def test_the_matrix_covers_every_state_and_change() -> None:
    assert {s for s, _ in expected()} == {str(s) for s in JobState}
    assert set(CHANGES) == {c.value for c in Change}


@pytest.mark.parametrize(("state", "change"), [(s, c) for s in JobState for c in Change],
                         ids=lambda v: str(v.value))
def test_every_transition(state: JobState, change: Change) -> None:
    target = expected()[(str(state), change.value)]
    if target is None:
        with pytest.raises(IllegalTransition) as refused:
            transition(state, change)
        assert str(state) in refused.value.render() and change.value in refused.value.render()
    else:
        assert transition(state, change) is JobState(target)


def test_the_table_lists_only_legal_moves() -> None:
    legal = {k for k, v in expected().items() if v is not None}
    assert {(str(s), c.value) for s, c in TABLE} == legal


def test_no_attempt_starts_while_one_may_run() -> None:
    """``start`` is legal exactly from the ends and from ``restarting`` (whose attempt ended): a
    restart goes through a verified stop first, and a stop during the backoff leaves no way back."""
    for state in JobState:
        assert ((state, Change.START) in TABLE) == (state.is_terminal or state is JobState.RESTARTING)
    assert transition(transition(JobState.RESTARTING, Change.STOP), Change.STOP_VERIFIED) is JobState.STOPPED


def test_an_end_is_never_overwritten() -> None:
    """Late news (the follower's, a second stop) leaves an end as it is; only a new attempt leaves it."""
    for end in (s for s in JobState if s.is_terminal):
        for change in Change:
            if change is not Change.START:
                assert TABLE.get((end, change), end) is end


def test_every_state_is_reachable_and_every_live_one_can_end() -> None:
    reached, todo = {JobState.STARTING}, [JobState.STARTING]
    while todo:
        state = todo.pop()
        for (source, _), target in TABLE.items():
            if source is state and target not in reached:
                reached.add(target)
                todo.append(target)
    assert reached == set(JobState)
    for state in JobState:
        assert any(t.is_terminal for (s, _), t in TABLE.items() if s is state)


def test_outcome_names_the_change_of_each_end() -> None:
    assert outcome(JobState.SUCCEEDED) is Change.SUCCEEDED
    assert outcome(JobState.FAILED) is Change.FAILED
    assert outcome(JobState.LOST) is Change.LOST
    assert outcome(JobState.STOPPED) is Change.STOP_VERIFIED


def test_strings_from_a_record_are_states() -> None:
    assert transition("running", Change.STOP) is JobState.STOPPING
