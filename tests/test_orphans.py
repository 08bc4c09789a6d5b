"""The agent's look for an attempt whose records are gone (``agent/orphans.py``): its processes are
found by the marker they carry and by the cgroup named after the attempt, never another attempt's or
another state dir's, and ``stop`` ends them as the verified stop does. In this process, with real
``sh`` and ``sleep`` children in the job's place (``tests/test_stop_paths.py`` runs it end to end)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from clusterrun.agent import orphans
from clusterrun.agent.wire import StatusRequest
from tests.agenthost import Attempt, Processes, ask, carrying, gone, pids_from
from tests.conftest import start_time, wait_for


def marked_tree(procs: Processes, at: Attempt, children: int = 1, ignore_term: bool = False,
                log_dir: str | None = None) -> list[int]:
    """torchrun's place: an ``sh`` carrying ``at``'s marker (its first pid) with ``children`` sleeps
    (the rest), under an unmarked ``sh`` that ends with it, as a survivor does; ``log_dir`` in place
    of the attempt's own ``PET_LOG_DIR`` (another state dir's attempt of the same job)."""
    name, _, value = at.marker.partition("=")
    inner = ('trap "" TERM; ' if ignore_term else "") + "echo $$; " + "sleep 600 & echo $!; " * children + "wait"
    survivor = procs.start(["sh", "-c", 'env "$@"; exit 0', "sh", f"{name}={value}",
                            f"PET_LOG_DIR={log_dir or at.folder / 'torchrun'}", "sh", "-c", inner],
                           stdout=subprocess.PIPE)
    root, *sleeps = pids_from(survivor, 1 + children)
    procs.adopt([root, *sleeps])
    wait_for(lambda: all(Path(f"/proc/{pid}/comm").read_text().strip() == "sleep" for pid in sleeps),
             timeout=30, what="the sleeps to run")  # `$!` is the forked shell's pid, before its exec
    return [root, *sleeps]


def test_status_without_records_finds_the_attempts_processes_by_marker_and_no_other_attempts(
        procs: Processes, attempt: Attempt, tmp_path: Path) -> None:
    mine = marked_tree(procs, attempt, children=2)
    marked_tree(procs, Attempt(attempt.state_dir, attempt.job, attempt=2))  # the next attempt
    marked_tree(procs, attempt, log_dir=str(tmp_path / "other-state" / "torchrun"))  # the same job, another state dir

    found = orphans.census(StatusRequest(job=attempt.job, node=0, attempt=1, state_dir=str(attempt.state_dir)))
    assert found["marked"] == sorted(mine) and found["cgroups"] == []

    answer = ask(attempt.request("status"))
    assert answer["ok"] and answer["records_gone"] and answer["state"]["state"] == "lost"
    assert answer["alive"]["torchrun"] and answer["containment"] == "sweep"
    assert answer["found_by"] == [f"3 processes carrying {attempt.marker} found by a marker scan"]
    assert "`clusterrun down` stops them" in answer["state"]["error"]
    assert any(attempt.marker in where for where in answer["looked"])


def test_stop_without_records_kills_what_outlives_the_grace_and_leaves_the_other_attempt(
        procs: Processes, attempt: Attempt) -> None:
    root, child = marked_tree(procs, attempt, ignore_term=True)
    other = Attempt(attempt.state_dir, attempt.job, attempt=2)
    other_root, other_child = marked_tree(procs, other)
    started = {pid: start_time(pid) for pid in (root, child)}

    answer = ask(attempt.request("stop", grace=0.2))
    assert answer["ok"] and answer["records_gone"] and answer["left"] == []
    assert {(k["pid"], k["signal"]) for k in answer["killed"]} == {(root, "SIGKILL"), (child, "SIGKILL")}
    assert answer["containment"] == "sweep" and not answer["verified"]
    assert answer["detail"].startswith("no cgroup of the attempt: the marker scan finds no process carrying")
    assert answer["state"]["state"] == "exited" and answer["state"]["stop_requested"]
    assert all(gone(pid, started[pid]) for pid in (root, child)) and carrying(attempt.marker) == []
    assert carrying(other.marker) == sorted([other_root, other_child])  # untouched


def test_stop_without_records_sends_sigterm_first_and_a_root_that_obeys_is_not_killed(
        procs: Processes, attempt: Attempt) -> None:
    root, child = marked_tree(procs, attempt)  # sh dies of SIGTERM; its sleep, orphaned, carries the marker
    answer = ask(attempt.request("stop", grace=5))
    signals = {k["pid"]: k["signal"] for k in answer["killed"]}
    assert signals[root] == "SIGTERM" and signals.get(child) == "SIGKILL", answer["killed"]
    assert answer["left"] == [] and carrying(attempt.marker) == []


def test_an_attempt_never_started_is_absent_and_says_where_it_looked(attempt: Attempt) -> None:
    for op in ("status", "stop"):
        answer = ask(attempt.request(op, **({"grace": 1} if op == "stop" else {})))
        assert answer["ok"] and answer["state"] == {"state": "absent"}, answer
    stopped = ask(attempt.request("stop", grace=1))
    assert stopped["records_gone"] and stopped["found_by"] == [] and stopped["notes"] == []
    assert stopped["looked"][1] == f"processes carrying {attempt.marker} (a scan of /proc)"


def test_found_by_names_each_mechanism_in_words() -> None:
    found = {"cgroups": ["/cg/a", "/cg/b"], "populated": ["/cg/a"], "marked": [7], "marker": "CLUSTERRUN_JOB=j.0.1"}
    assert orphans.found_by(found) == ["cgroup /cg/a found by name", "cgroup /cg/b found by name (empty)",
                                       "1 process carrying CLUSTERRUN_JOB=j.0.1 found by a marker scan"]


def test_a_marker_scan_leaves_out_a_zombie(procs: Processes, attempt: Attempt) -> None:
    """A process that ended but was not reaped yet still shows its environment: it is not running."""
    zombie = procs.start(["sh", "-c", "exit 0"], env=attempt.env())
    wait_for(lambda: _state(zombie.pid) == "Z", timeout=10, what="the child to exit")
    assert orphans.marked(attempt.marker) == []
    assert ask(attempt.request("status"))["state"] == {"state": "absent"}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_stop_of_a_root_that_died_leaves_no_marked_process(procs: Processes, attempt: Attempt) -> None:
    root, child = marked_tree(procs, attempt)
    os.kill(root, signal.SIGKILL)  # torchrun gone already: its worker runs on, orphaned
    wait_for(lambda: carrying(attempt.marker) == [child], timeout=10, what="the root to end")
    answer = ask(attempt.request("stop", grace=1))
    assert [k["pid"] for k in answer["killed"]] == [child] and answer["left"] == []
