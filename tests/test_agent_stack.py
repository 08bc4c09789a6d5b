"""The agent's ``stack`` (``agent/stackops.py``) in this process, over an attempt's records and live
ranks (``sleep``s carrying its marker) with a stand-in py-spy beside the job's interpreter that answers as
py-spy does (its JSON, a refusal, a timeout): which ranks are looked at, and every answer that is not a
stack said with its fix. A real py-spy on real torch ranks: ``tests/test_stack.py`` (integration)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent.procs import proc_info
from clusterrun.agent.stackops import _frames
from clusterrun.agent.wire import Frame, ThreadStack
from tests.agenthost import Attempt, Processes, ask, job_tree
from tests.conftest import wait_for

DUMP = [{"thread_name": "MainThread", "active": True,
         "frames": [{"name": "wait", "filename": "/usr/lib/python3.11/threading.py", "short_filename": "threading.py",
                     "line": 320},
                    {"name": "<module>", "filename": "/job/train.py", "short_filename": "train.py", "line": 7}]}]

# What the stand-in says, by $CRTEST_PY_SPY: py-spy's answers as the agent meets them.
PY_SPY = """#!/bin/sh
case "$CRTEST_PY_SPY" in
  json) cat "$CRTEST_DUMP" ;;
  args) echo "$@" > "$CRTEST_ARGS"; cat "$CRTEST_DUMP" ;;
  garbage) echo 'not json' ;;
  old) echo "error: Found argument '--json' which wasn't expected" >&2; exit 2 ;;
  starting) echo 'Error: Failed to find python version from target process' >&2; exit 1 ;;
  refused) echo 'Error: Permission Denied (os error 13)' >&2; exit 1 ;;
  slow) exec sleep 30 ;;
  *) echo 'Error: something else' >&2; exit 1 ;;
esac
"""


@pytest.fixture
def ranks(procs: Processes, attempt: Attempt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A running attempt with two live ranks, its interpreter in a bin/ that holds the stand-in py-spy."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "py-spy").write_text(PY_SPY)
    (bin_dir / "py-spy").chmod(0o755)
    (tmp_path / "dump.json").write_text(json.dumps(DUMP))
    monkeypatch.setenv("CRTEST_DUMP", str(tmp_path / "dump.json"))
    tree = job_tree(procs, attempt, workers=2)
    attempt.make(spec={"argv": [str(bin_dir / "python"), "-m", "torch.distributed.run"]}, **tree.state())
    return tree.workers


def stacks(at: Attempt, monkeypatch: pytest.MonkeyPatch, answer: str, **fields: Any) -> dict[str, Any]:
    monkeypatch.setenv("CRTEST_PY_SPY", answer)
    return ask(at.request("stack", **fields))


def test_every_live_rank_is_dumped_and_read_innermost_first(attempt: Attempt, ranks: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    answer = stacks(attempt, monkeypatch, "json")
    assert answer["ok"] and answer["state"] == "running" and answer["tool"].endswith("/venv/bin/py-spy")
    assert [(r["rank"], r["pid"], r["local_rank"], r["error"]) for r in answer["ranks"]] == [
        (0, ranks[0], 0, None), (1, ranks[1], 1, None)]
    frames = answer["ranks"][0]["threads"][0]["frames"]
    assert [(f["name"], f["file"], f["line"], f["lib"]) for f in frames] == [
        ("wait", "threading.py", 320, True), ("<module>", "train.py", 7, False)]
    assert [r["rank"] for r in stacks(attempt, monkeypatch, "json", ranks=[1])["ranks"]] == [1]


@pytest.mark.parametrize(("said", "error", "fix"), [
    ("garbage", "py-spy answered something unexpected: ", None),
    ("old", "is too old to answer in JSON", "pip install -U 'py-spy>=0.4'"),
    ("starting", "py-spy: Error: Failed to find python version from target process (is the rank still starting?)",
     "try again in a moment"),
    ("refused", "ptrace of pid ", None),
    ("other", "py-spy: Error: something else", None),
])
def test_what_py_spy_could_not_do_is_said_per_rank(attempt: Attempt, ranks: list[int], monkeypatch: pytest.MonkeyPatch,
                                                    said: str, error: str, fix: str | None) -> None:
    answer = stacks(attempt, monkeypatch, said, ranks=[0])
    (rank,) = answer["ranks"]
    assert error in rank["error"] and rank["threads"] == []
    if fix is not None:
        assert fix in rank["fix"]


def test_a_stopped_rank_is_read_without_pausing_it_and_said_stopped(
        attempt: Attempt, ranks: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """py-spy pauses a rank to read it, which a stopped process (SIGSTOP, Ctrl-Z) refuses: it is read
    as it is (``--nonblocking``: its memory holds still), and said stopped."""
    monkeypatch.setenv("CRTEST_ARGS", str(tmp_path / "args"))
    os.kill(ranks[0], signal.SIGSTOP)
    try:
        wait_for(lambda: proc_info(ranks[0]).state == "T", timeout=10, what="the rank to stop")  # type: ignore[union-attr]
        (rank,) = stacks(attempt, monkeypatch, "args", ranks=[0])["ranks"]
        assert (rank["error"], rank["state"], len(rank["threads"])) == (None, "T", 1)
        assert "--nonblocking" in (tmp_path / "args").read_text().split()
    finally:
        os.kill(ranks[0], signal.SIGCONT)
    (rank,) = stacks(attempt, monkeypatch, "args", ranks=[0])["ranks"]  # running: paused to be read, as always
    assert rank["state"] is None and "--nonblocking" not in (tmp_path / "args").read_text().split()


def test_a_py_spy_that_does_not_answer_in_time_is_given_up_with_the_ranks_state(
        attempt: Attempt, ranks: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    (rank,) = stacks(attempt, monkeypatch, "slow", ranks=[1], timeout=0.3)["ranks"]
    assert rank["error"].startswith("py-spy did not answer within 0.3 s (the process is in state S")
    assert rank["fix"] == "try again, or give py-spy longer: clusterrun stack --timeout 60"


def test_a_rank_that_ended_or_whose_pid_is_reused_is_not_looked_at(
        procs: Processes, attempt: Attempt, ranks: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    state = attempt.state()
    dead = procs.start(["true"])
    dead.wait()
    stranger = procs.start(["sleep", "600"])  # alive, without the attempt's marker
    state["workers"] = [{"pid": dead.pid, "rank": 0, "local_rank": 0, "died": None},
                        {"pid": stranger.pid, "rank": 1, "local_rank": 1, "died": None},
                        {"pid": ranks[0], "rank": 2, "local_rank": 0, "died": 1.0}]  # died: left out
    attempt.write_state(state)
    answer = stacks(attempt, monkeypatch, "json")
    assert [(r["rank"], r["error"]) for r in answer["ranks"]] == [
        (0, "its process has ended"), (1, "its process has ended (the pid is another process's now)")]


def test_without_py_spy_the_answer_names_the_install_for_the_jobs_interpreter(
        attempt: Attempt, ranks: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "venv" / "bin" / "py-spy").unlink()
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("HOME", str(tmp_path))
    # the ranks' PATH (the agent looks there too) is this process's: a py-spy may be on it
    state = attempt.state()
    state["workers"] = []
    attempt.write_state(state)
    answer = stacks(attempt, monkeypatch, "json")
    assert answer["ranks"] == [] and answer["error"].startswith("py-spy is not installed on this host")
    assert answer["fix"].startswith(f"{tmp_path / 'venv' / 'bin' / 'python'} -m pip install py-spy")


def test_only_a_starting_or_running_attempt_has_stacks(attempt: Attempt) -> None:
    assert ask(attempt.request("stack")) == {"ok": True, "state": "absent", "ranks": [], "tool": None,
                                             "error": None, "fix": None}
    attempt.make(state="exited")
    assert ask(attempt.request("stack"))["state"] == "exited"
    attempt.make(boot_id="another boot")
    assert ask(attempt.request("stack"))["state"] == "lost"


def test_a_rank_s_stacks_moved_when_its_main_thread_s_did() -> None:
    """A data loader's or a logger's thread moves in a rank that waits for ever: only the main
    thread's frames (else the first thread's) say whether the rank moved."""
    def threads(main_line: int, loader_line: int, main: str = "MainThread") -> list[ThreadStack]:
        return [ThreadStack("pin_memory", [Frame("get", "queue.py", loader_line)]),
                ThreadStack(main, [Frame("barrier", "distributed_c10d.py", main_line)])]

    assert _frames(threads(4500, 180)) == _frames(threads(4500, 199))
    assert _frames(threads(4500, 180)) != _frames(threads(4510, 180))
    assert _frames(threads(4500, 180, main="Thread-1")) != _frames(threads(4500, 199, main="Thread-1"))  # the first

