"""The dashboard's model (clusterrun/views/board.py): pure logic, fed events by hand; and the session's
report of a job it cannot follow."""

from __future__ import annotations

from pathlib import Path

from clusterrun.core.errors import JobNotFound
from clusterrun.core.events import (
    AttemptStarted,
    GpuReading,
    LogLines,
    NodeExited,
    NodeGpus,
    NodeLink,
    NodeResult,
    NodeState,
    NodeStateChanged,
)
from clusterrun.life.session import Session
from clusterrun.store.jobs import JobRecord, JobStore, NodeRecord
from clusterrun.views.board import Board, Ring


def attempt(n: int, k: int = 1) -> AttemptStarted:
    return AttemptStarted(None, job_id="j", name="j", attempt=k, master_addr="10.0.0.1", master_port=29500,
                          world_size=2 * n, nodes=tuple((f"h{i}", 2, None) for i in range(n)))


def test_a_ring_keeps_its_last_lines_and_counts_and_measures_all_it_was_given() -> None:
    ring = Ring(5)
    ring.extend(["a", "bbb", "c"])
    assert list(ring.lines) == ["a", "bbb", "c"] and (ring.count, ring.first, ring.width) == (3, 0, 3)
    ring.extend([])
    ring.extend([str(i) for i in range(10)])
    assert list(ring.lines) == ["5", "6", "7", "8", "9"]
    assert (ring.count, ring.first) == (13, 8)
    assert ring.width == 3  # the longest line ever added: a view's scroll width never shrinks under it


def test_every_ring_of_a_board_holds_the_lines_it_was_sized_for() -> None:
    board = Board(ring=3)
    board.apply(attempt(2))
    board.apply(LogLines(1, host="h1", lines=tuple(f"line {i}" for i in range(5))))
    assert list(board.nodes[1].log.lines) == ["line 2", "line 3", "line 4"]
    assert list(board.merged.lines) == ["node1 | line 2", "node1 | line 3", "node1 | line 4"]


def test_torchs_own_rank_tag_after_ours_is_shown_once() -> None:
    board = Board(ring=10)
    board.apply(attempt(1))
    board.apply(LogLines(0, host="h0", lines=("[rank1]:[rank1]: Traceback (most recent call last):",
                                              "[rank1]:plain", "[rank0]:[rank0]:x", "torchrun's own")))
    assert list(board.nodes[0].log.lines) == ["[rank1]:Traceback (most recent call last):", "[rank1]:plain",
                                              "[rank0]:x", "torchrun's own"]


NOON = 1_795_608_000.0  # 2026-11-25T12:00:00Z


def test_last_output_counts_from_when_the_rank_wrote_the_line_not_when_it_came() -> None:
    board = Board(ring=10, clock=lambda: 1000.0, wall=lambda: NOON)
    board.apply(attempt(2))
    board.apply(LogLines(0, host="h0", lines=("old",), written=NOON - 600))  # a backlog read just now
    board.apply(LogLines(1, host="h1", lines=("new",), ts=999.0))  # an older agent's: when it came
    assert (board.nodes[0].last_output, board.nodes[1].last_output) == (400.0, 999.0)


def test_a_node_whose_host_cannot_be_reached_shows_unreachable_since_its_first_failure_until_it_is_back() -> None:
    now = [NOON + 60]
    board = Board(ring=10, clock=lambda: now[0] - NOON, wall=lambda: now[0])
    board.apply(attempt(2))
    board.apply(NodeStateChanged(1, host="h1", state=NodeState.RUNNING))
    board.apply(NodeLink(1, host="h1", up=False, detail="timed out", ts=30.0))  # its own time: 12:00:30
    assert board.nodes[1].status(now[0]) == "unreachable since 12:00:30Z"
    assert "1 unreachable" in board.summary()
    assert board.notes[-1] == "node1 h1: unreachable since 12:00:30Z (timed out)"
    board.apply(NodeLink(1, host="h1", up=False, detail="again", ts=50.0))  # still the first failure
    assert board.nodes[1].status(now[0]) == "unreachable since 12:00:30Z"
    assert board.nodes[1].status(now[0] + 86400) == "unreachable since 2026-11-25T12:00:30Z"  # not today
    board.apply(NodeLink(1, host="h1", up=True))
    assert board.nodes[1].status(now[0]) == "running" and board.nodes[1].unreachable_since is None
    board.apply(NodeLink(0, host="h0", up=False, since=NOON - 3600))  # a viewer's: the record knew it earlier
    assert board.nodes[0].status(now[0]) == "unreachable since 11:00:00Z"


def test_the_first_failure_is_the_root_cause_with_its_last_lines() -> None:
    board = Board(ring=10)
    board.apply(attempt(2))
    board.apply(LogLines(1, host="h1", lines=tuple(f"[rank3]:line {i}" for i in range(20))))
    board.apply(NodeExited(1, result=NodeResult(1, "h1", NodeState.FAILED, exit_code=3)))
    board.apply(NodeExited(0, result=NodeResult(0, "h0", NodeState.FAILED, exit_code=1)))
    assert board.root_rank() == 1
    assert board.nodes[1].status(0) == "failed (exit 3)"
    text = board.root_text().splitlines()
    assert text[0] == "first failure: node 1 (h1): failed (exit 3)"
    assert text[1:] == [f"  [rank3]:line {i}" for i in range(12, 20)]  # the ring kept the last 10


def test_a_new_attempt_keeps_the_old_lines_above_a_marker() -> None:
    board = Board(ring=100)
    board.apply(attempt(1))
    board.apply(LogLines(0, host="h0", lines=("old",)))
    board.apply(attempt(1, k=2))
    assert board.attempt == 2 and list(board.nodes[0].log.lines) == ["old", "---- attempt 2 ----"]
    assert board.state == "starting" and board.first_failure is None
    board.apply(attempt(1, k=2))  # announced again by the follower of the new attempt: one marker
    assert list(board.nodes[0].log.lines) == ["old", "---- attempt 2 ----"]
    assert list(board.merged.lines) == ["node0 | old", "---- attempt 2 ----"]


def test_a_session_that_cannot_build_its_follower_reports_it_instead_of_dying(tmp_path: Path) -> None:
    """attach on a job whose record went away meanwhile: session.error (the dashboard shows it),
    not an exception lost with the session's thread."""
    record = JobRecord(job_id="gone-1", name="gone", created=0.0, hosts_file="hosts.yaml", hosts_text="",
                       script="train.py", script_args=[], env_overrides={}, local_cwd=str(tmp_path), grace=1.0,
                       ssh_config=None, plan={})
    events: list[object] = []
    session = Session(JobStore(tmp_path / "jobs"), record, events.append)
    session.begin()
    session.wait(10)
    assert not session.running
    assert isinstance(session.error, JobNotFound) and "gone-1" in session.error.message
    assert events == []


def test_a_new_attempt_replaces_the_notices_of_the_restart() -> None:
    board = Board()
    board.apply(attempt(2))
    board.note("restarting: stopping attempt 1, then starting a new one")
    board.apply(NodeStateChanged(0, host="h0", state=NodeState.STOPPED))
    board.apply(attempt(2, 2))
    assert board.notes[-1] == "attempt 2 started" and board.attempt == 2
    board.apply(attempt(2, 2))  # followed again (attach): nothing new started
    assert list(board.notes).count("attempt 2 started") == 1


def test_a_viewer_shows_an_unreachable_node_since_the_first_failure_its_record_knew(tmp_path: Path) -> None:
    """attach while the owner already sees h1 unreachable: the viewer's dashboard says since when
    the record says (as ps does), not since its own first failure; once it has reached h1, a
    new failure is its own."""
    record = JobRecord(job_id="j-1", name="j", created=0.0, hosts_file="hosts.yaml", hosts_text="",
                       script="train.py", script_args=[], env_overrides={}, local_cwd=str(tmp_path), grace=1.0,
                       ssh_config=None, plan={},
                       nodes=[NodeRecord(0, "h0"), NodeRecord(1, "h1", unreachable_since=NOON)])
    board = Board(wall=lambda: NOON + 60)
    session = Session(JobStore(tmp_path / "jobs"), record, board.apply)
    board.apply(attempt(2))
    session.emit(NodeLink(1, host="h1", up=False, detail="timed out", since=NOON + 30))
    assert board.nodes[1].status(NOON + 60) == "unreachable since 12:00:00Z"
    session.emit(NodeLink(1, host="h1", up=True))
    session.emit(NodeLink(1, host="h1", up=False, detail="again", since=NOON + 50))
    assert board.nodes[1].status(NOON + 60) == "unreachable since 12:00:50Z"
    session.emit(NodeLink(0, host="h0", up=False, detail="timed out", since=NOON + 40))  # the record knew nothing
    assert board.nodes[0].status(NOON + 60) == "unreachable since 12:00:40Z"


def test_the_summary_counts_the_state_most_nodes_are_in_and_names_the_others_as_node_sets() -> None:
    board = Board(ring=10)
    board.apply(attempt(64))
    for rank in range(64):
        board.apply(NodeStateChanged(rank, host=f"h{rank}", state=NodeState.RUNNING))
    assert board.summary() == "64 running" and board.state == "running"
    for rank in (62, 63, 7):
        board.apply(NodeExited(rank, result=NodeResult(rank, f"h{rank}", NodeState.FAILED, exit_code=1)))
    board.apply(NodeLink(5, host="h5", up=False, detail="timed out"))
    assert board.summary() == "60 running · 1 unreachable: node 5 · 3 failed: nodes 7,62-63"  # by first node
    assert board.state == "failing"  # fail-fast stops the others (a viewer sees their stop later)


def test_gpu_readings_mark_a_row_only_when_they_change_and_a_host_with_nvidia_smi_adds_the_column() -> None:
    board = Board(ring=10)
    board.apply(attempt(2))
    board.changed.clear()
    board.apply(NodeGpus(0, host="h0", missing=True))
    assert board.changed == {0} and not board.gpus_shown  # no host has nvidia-smi: no column
    reading = (GpuReading(0, 50, 1024, 8192),)
    board.apply(NodeGpus(1, host="h1", gpus=reading, ts=1.0))
    assert board.gpus_shown and board.nodes[1].gpus is not None and board.nodes[1].gpus.gpus == reading
    board.changed.clear()
    board.header_changed = False
    board.apply(NodeGpus(1, host="h1", gpus=reading, ts=2.0))  # the same reading, later
    assert not board.changed and not board.header_changed
