"""Root-cause analysis on torchrun's real output format (captured from torch 2.13)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from clusterrun.core.events import RootCause
from clusterrun.core.protocol import HostState, NodeStatus, decode_status
from clusterrun.diagnose.rootcause import (
    NodeLog,
    RankFailure,
    exception_message,
    find_root_cause,
    split_rank,
    transient_start_failure,
)

REPORT = """\
[rank1]:Traceback (most recent call last):
[rank1]:[rank1]:   File "/tmp/t/s.py", line 5, in <module>
[rank1]:[rank1]: ValueError: boom from rank 1
E1122 14:49:35.111000 2219 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
s.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_14:49:35
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 2262)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_14:49:35
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 2263)
  error_file: <N/A>
============================================================"""


def test_split_rank_drops_torchs_own_repeat() -> None:
    assert split_rank("[rank3]:hello") == (3, "hello")
    assert split_rank("[rank3]:[rank3]: ValueError: x") == (3, "ValueError: x")
    assert split_rank("[rank3]:[rank2]: odd") == (3, "[rank2]: odd")
    assert split_rank("plain line") == (None, "plain line")


def test_report_is_parsed() -> None:
    log = NodeLog()
    log.feed(REPORT.splitlines())
    assert log.failures == {0: RankFailure(local_rank=0, exit_code=-15, pid=2262),
                            1: RankFailure(local_rank=1, exit_code=1, pid=2263)}
    assert list(log.rank_tails[1])[-1] == "ValueError: boom from rank 1"
    assert exception_message(log.rank_tails[1]) == "ValueError: boom from rank 1"


def _state(code: int, workers: list[dict], ended: float) -> NodeStatus:
    """As the agent reports a state file (decoded as the controller decodes it)."""
    return decode_status("h", {"state": "exited", "exit_code": code, "signal": None, "workers": workers,
                               "ended_at": ended})


def test_earliest_worker_death_across_nodes_wins() -> None:
    node0, node1 = NodeLog(), NodeLog()
    node0.feed(["[rank0]:gloo error: connection closed by peer", "  rank      : 0 (local_rank: 0)",
                "  exitcode  : 1 (pid: 100)"])
    node1.feed(["[rank3]:bye", "  rank      : 3 (local_rank: 1)", "  exitcode  : 3 (pid: 200)"])
    states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 50.2}], 51.0),
              1: _state(1, [{"pid": 200, "rank": 3, "died": 50.0}], 51.5)}
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: node1}, states, stopped_by_us=set())
    assert cause is not None
    assert (cause.node, cause.rank, cause.local_rank, cause.exit_code) == (1, 3, 1, 3)
    assert cause.last_lines == ("bye",)
    assert cause.describe() == "rank 3 on node 1 (b, local rank 1): exit code 3"


def test_nodes_we_stopped_are_not_the_root_cause() -> None:
    node0, node1 = NodeLog(), NodeLog()
    node0.feed(["  rank      : 0 (local_rank: 0)", "  exitcode  : -15 (pid: 100)"])
    node1.feed(["  rank      : 1 (local_rank: 0)", "  exitcode  : 1 (pid: 200)"])
    states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 10.0}], 11.0),  # died first, but we stopped it
              1: _state(1, [{"pid": 200, "rank": 1, "died": 20.0}], 21.0)}
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: node1}, states, stopped_by_us={0})
    assert cause is not None and cause.node == 1


def test_a_node_we_stopped_whose_rank_failed_before_the_stop_reached_it_is_the_root_cause() -> None:
    """Node 1's rank raised; node 0's all_reduce then failed on its closed sockets, and its failure
    reached the controller first, which stopped node 1 as healthy: the stop came after rank 1 ended."""
    node0, node1 = NodeLog(), NodeLog()
    node0.feed(["[rank0]:RuntimeError: Connection closed by peer [10.0.0.2]:1234", "  rank      : 0 (local_rank: 0)",
                "  exitcode  : 1 (pid: 100)"])
    node1.feed(["[rank1]:RuntimeError: custom failure 42", "  rank      : 1 (local_rank: 0)",
                "  exitcode  : 1 (pid: 200)"])
    stopped = {"state": "exited", "exit_code": 1, "stop_requested": True,
               "workers": [{"pid": 200, "rank": 1, "died": 50.1, "exit_code": 1}]}
    for stop_at, root in ((50.6, 1), (50.0, 0), (None, 0)):  # after rank 1 ended; before (it killed it); unknown
        states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 50.2, "exit_code": 1}], 51.0),
                  1: decode_status("h", dict(stopped, stop_at=stop_at))}
        cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: node1}, states, stopped_by_us={1})
        assert cause is not None and cause.node == root, stop_at
        if root == 1:
            assert (cause.rank, cause.message) == (1, "RuntimeError: custom failure 42")
    assert cause.node == 0 and cause.message.startswith("RuntimeError: Connection closed by peer")


def test_signals_and_node_level_failures() -> None:
    log = NodeLog()
    log.feed(["  rank      : 2 (local_rank: 0)", "  exitcode  : -9 (pid: 7)"])
    cause = find_root_cause({0: "h"}, {0: log}, {0: _state(1, [], 5.0)}, set())
    assert cause is not None and cause.signal == 9 and cause.exit_code is None
    assert "killed by SIGKILL" in cause.describe()
    # torchrun itself could not start: no worker report, the agent's error is the message
    nothing = find_root_cause({0: "h"}, {0: NodeLog()},
                              {0: NodeStatus(HostState.EXITED, error="could not start python9")}, set())
    assert nothing is not None and nothing.rank is None and nothing.message == "could not start python9"
    assert find_root_cause({0: "h"}, {0: NodeLog()}, {0: _state(0, [], 1.0)}, set()) is None


def _diagnosed(*lines: str) -> tuple[RootCause | None, dict[int, NodeLog]]:
    """One node whose torchrun exited 1 after ``lines`` (the rank's tagged, then its report)."""
    log = NodeLog()
    log.feed(lines)
    return find_root_cause({0: "h"}, {0: log}, {0: _state(1, [], 5.0)}, set()), {0: log}


def test_a_transient_start_up_failure_is_known_by_the_signature_that_explains_it() -> None:
    """The retry follows the signature table (``transient_start``): gloo's abort and the master
    port taken, before any rank printed a line of its own; nothing else."""
    report = ("  rank      : 1 (local_rank: 1)", "  exitcode  : -6 (pid: 7)")
    abort = "[rank1]:terminate called without an active exception"
    root, logs = _diagnosed("[rank0]:[W1123 12:00:00.000 ProcessGroupGloo.cpp:1] Warning: slow", abort, *report)
    assert root is not None and root.explanation is not None and root.explanation.signature == "gloo-abort"
    assert transient_start_failure(root, logs) == ("gloo aborted a rank while setting up its connections "
                                                   "(pytorch/pytorch#188266)")
    port = (Path(__file__).parent / "_support" / "failures" / "port-in-use" / "node0.log").read_text()
    root, logs = _diagnosed(*port.splitlines())
    assert root is not None and root.rank is None
    assert transient_start_failure(root, logs) == "the master port was taken between the probe and torchrun's bind"
    root, logs = _diagnosed("[rank0]:epoch 1 loss 0.5", abort, *report)  # the job had begun: not at start-up
    assert transient_start_failure(root, logs) is None
    root, logs = _diagnosed("[rank1]:ModuleNotFoundError: No module named 'x'", *report)  # another signature
    assert root is not None and root.explanation is not None and transient_start_failure(root, logs) is None
    root, logs = _diagnosed("[rank1]:ValueError: terminate", *report)  # no signature
    assert root is not None and root.explanation is None and transient_start_failure(root, logs) is None
    assert transient_start_failure(None, {}) is None


def test_a_host_gone_for_good_is_the_cause_of_its_peers_gloo_errors() -> None:
    """Node 1's host died at 49.0 and never answered again (counted lost after a wait); node 0's
    rank failed at 50.2 in a collective with it: the host that went away is the cause."""
    node0 = NodeLog()
    node0.feed(["[rank0]:RuntimeError: Connection closed by peer [10.77.3.12]:34508",
                "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 100)"])
    states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 50.2}], 51.0),
              1: NodeStatus(HostState.LOST, error="cannot be reached", away_since=49.0, unanswered=True)}
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: NodeLog()}, states, stopped_by_us={1})
    assert cause is not None and cause.node == 1 and cause.lost  # the fail-fast stop sent to it never reached it
    assert cause.message.endswith("and has not answered since (cannot be reached)"), cause.message


def test_a_node_whose_records_stopped_on_a_full_disk_is_the_cause_of_its_peers_gloo_errors() -> None:
    """Node 1's state disk filled up: its ranks' end was never recorded, and fail-fast stopped it after
    node 0's rank failed in a collective with it. What node 1 did before the stop is unknown: the full
    disk is the cause, with its fix, not node 0's peer-gone error."""
    node0 = NodeLog()
    node0.feed(["[rank0]:RuntimeError: Connection closed by peer [10.77.3.12]:34508",
                "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 100)"])
    full = ("the job's processes on the host are gone and their end could not be recorded: the supervisor could "
            "not write its state (no space left on the file system of /data/state/jobs/j/node1/attempt1)")
    states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 50.2}], 51.0),
              1: NodeStatus(HostState.LOST, error=full, degraded=full.split(": ", 1)[1])}
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: NodeLog()}, states, stopped_by_us={1})
    assert cause is not None and cause.node == 1 and cause.lost and cause.explanation is not None
    assert cause.explanation.cause == "b could not keep node 1's log and state: the file system of /data/state is full"
    assert cause.explanation.fix.startswith("free space there on b (`df -h /data/state`)")
    states[1] = NodeStatus(HostState.LOST, error="gone", ended_at=52.0)  # its records whole: our stop's doing
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: NodeLog()}, states, stopped_by_us={1})
    assert cause is not None and cause.node == 0


@pytest.mark.parametrize("extra", [
    (),  # every line a rank's: only each rank's last lines are read
    ("  rank      : 1 (local_rank: 1)", "  exitcode  : 3 (pid: 77)"),  # torchrun's report among them
    ("[rank_x] not a tag",),  # untagged, though it starts like a tag
])
def test_a_long_batch_keeps_what_line_by_line_feeding_keeps(extra: tuple[str, ...]) -> None:
    # rank 0 floods, rank 1 writes a few lines early, rank 2 as `[rank02]:`, one tag doubled by torch
    flood = [f"[rank0]:seq={i}" for i in range(500)]
    lines = ([f"[rank1]:early {i}" for i in range(3)] + flood[:250] + list(extra) + ["[rank02]:zero-padded"]
             + flood[250:] + ["[rank0]:[rank0]: Traceback doubled"])
    batch, one_by_one = NodeLog(), NodeLog()
    batch.feed(tuple(lines))
    for line in lines:
        one_by_one.feed(iter([line]))  # an iterator: line by line, no batch's shortcut
    assert batch == one_by_one
    assert list(batch.rank_tails[1]) == ["early 0", "early 1", "early 2"]
    assert list(batch.rank_tails[0])[-1] == "Traceback doubled"
    assert batch.failures == ({1: RankFailure(local_rank=1, exit_code=3, pid=77)} if len(extra) == 2 else {})


def test_any_batch_keeps_what_line_by_line_feeding_keeps() -> None:
    """Batches of ranks' lines (tags padded or doubled), torchrun's report and untagged lines, mixed at random."""
    rnd = random.Random(7)
    kinds = ["[rank0]:a", "[rank1]:b", "[rank01]:c", "[rank2]:[rank2]:d", "  rank      : 1 (local_rank: 1)",
             "  exitcode  : 3 (pid: 77)", "[rank_x] no tag", "torchrun's own", "[rank3]:"]
    for _ in range(300):
        mix = rnd.sample(kinds, rnd.choice([1, 2, 3, len(kinds)]))
        lines = tuple(rnd.choice(mix) + str(i) for i in range(rnd.randint(81, 400)))  # past 4 × tail: a batch
        batch, one_by_one = NodeLog(), NodeLog()
        batch.feed(lines)
        for line in lines:
            one_by_one.feed(iter([line]))
        assert batch == one_by_one, mix


def test_a_short_batch_of_one_rank_or_many_keeps_what_line_by_line_feeding_keeps() -> None:
    """A flow's batches: most are one rank's lines (kept without reading each), some mixed."""
    rnd = random.Random(11)
    kinds = ["[rank0]:a", "[rank00]:p", "[rank1]:b", "[rank0]:[rank0]:d", "[rank00]:[rank0]:e", "torchrun's own",
             "  rank      : 1 (local_rank: 1)", "  exitcode  : 3 (pid: 77)", "[rank0]:]:[rank"]
    for _ in range(500):
        batch, one_by_one = NodeLog(), NodeLog()
        for _ in range(rnd.randint(1, 4)):
            mix = rnd.sample(kinds, 1 if rnd.random() < 0.5 else rnd.randint(1, len(kinds)))
            lines = tuple(rnd.choice(mix) + str(i) for i in range(rnd.randint(1, 80)))
            batch.feed(lines)
            for line in lines:
                one_by_one.feed(iter([line]))
            assert batch == one_by_one, lines


def test_a_node_whose_report_was_not_seen_fails_when_its_first_rank_died() -> None:
    """A viewer that attached after node 1's torchrun printed its report (``attach --tail 0``) saw only
    node 0's: node 1's rank still died first, as its host recorded, and torchrun ended after it."""
    node0 = NodeLog()
    node0.feed(["[rank0]:RuntimeError: a failure of its own", "  rank      : 0 (local_rank: 0)",
                "  exitcode  : 1 (pid: 100)"])
    states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 50.2, "exit_code": 1}], 50.4),
              1: _state(1, [{"pid": 200, "rank": 1, "died": 50.0, "exit_code": 1}], 51.5)}
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: NodeLog()}, states, stopped_by_us=set())
    assert cause is not None and cause.node == 1


def test_a_rank_that_failed_because_its_peer_went_away_is_not_the_root_cause_even_when_it_ended_first() -> None:
    """Rank 1 raised; while its interpreter still shut down, its closed sockets failed rank 0's collective
    and rank 0 ended first (torch 2.13 on a loaded host): the rank that raised is the cause."""
    node0, node1 = NodeLog(), NodeLog()
    node0.feed(["[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                "closed by peer [10.77.3.12]:54166. This is typically caused by a remote worker crashing.",
                "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 100)"])
    node1.feed(["[rank1]: RuntimeError: custom failure 42", "  rank      : 1 (local_rank: 0)",
                "  exitcode  : 1 (pid: 200)"])
    states = {0: _state(1, [{"pid": 100, "rank": 0, "died": 50.0}], 50.1),
              1: _state(1, [{"pid": 200, "rank": 1, "died": 50.3}], 50.4)}
    cause = find_root_cause({0: "a", 1: "b"}, {0: node0, 1: node1}, states, stopped_by_us=set())
    assert cause is not None and (cause.node, cause.rank) == (1, 1)
    alone = find_root_cause({0: "a"}, {0: node0}, {0: states[0]}, stopped_by_us=set())
    assert alone is not None and alone.node == 0  # nothing else failed: it is still named
