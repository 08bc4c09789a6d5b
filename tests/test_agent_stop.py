"""The agent's verified stop of one attempt (``agent/stop.py``) from its records: torchrun first (SIGTERM,
SIGKILL once the grace is over), then the attempt's cgroup or the sweep, the final state written; a
host rebooted since, an attempt ended already and one whose supervisor never wrote its state. In this
process with real processes in the job's place (``tests/agenthost.py``); end to end, with real
torchrun, on local and simulated hosts: ``tests/test_stop_paths.py``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator

import pytest

from clusterrun.agent import cgroup as cg
from clusterrun.agent.procs import proc_info
from tests.agenthost import Attempt, Processes, ask, carrying, gone, job_tree, pids_from
from tests.conftest import start_time, wait_for
from tests.simhosts import unavailable


def test_a_stopped_worker_is_continued_so_that_it_ends_on_its_sigterm(procs: Processes, attempt: Attempt) -> None:
    """A rank stopped by SIGSTOP (Ctrl-Z) acts on no SIGTERM until it is continued: the stop
    continues it, as systemd does, so that it ends on SIGTERM, not at the SIGKILL after the wait."""
    tree = job_tree(procs, attempt, workers=2)
    attempt.make(**tree.state())
    os.kill(tree.workers[0], signal.SIGSTOP)
    wait_for(lambda: proc_info(tree.workers[0]).state == "T", timeout=10, what="the worker to stop")  # type: ignore[union-attr]
    answer = ask(attempt.request("stop", grace=0.2))
    assert answer["ok"] and answer["left"] == []
    assert {k["pid"]: k["signal"] for k in answer["killed"]}[tree.workers[0]] == "SIGTERM"


def test_a_torchrun_that_ignores_sigterm_is_killed_after_the_grace_and_its_workers_are_swept(
        procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt, workers=2, ignore_term=True)
    attempt.make(**tree.state())
    started = {pid: start_time(pid) for pid in (tree.torchrun, *tree.workers)}

    answer = ask(attempt.request("stop", grace=0.2))
    assert answer["ok"] and answer["left"] == [] and answer["grace"] == 0.2
    signals = {k["pid"]: k["signal"] for k in answer["killed"]}
    assert signals == {tree.torchrun: "SIGKILL", tree.workers[0]: "SIGTERM", tree.workers[1]: "SIGTERM"}
    assert answer["containment"] == "sweep" and not answer["verified"]
    assert answer["detail"].startswith("swept 2 processes besides torchrun; ")
    assert all(gone(pid, started[pid]) for pid in started) and carrying(attempt.marker) == []
    state = attempt.state()
    assert answer["state"] == state and state["state"] == "exited" and state["stop_requested"]
    assert state["error"] == "the supervisor ended without recording an exit" and state["stopped_by"] == "clusterrun"
    assert (attempt.folder / "stop").exists()  # the monitor's sign that the end was asked for


def test_the_stop_marks_the_log_before_torchrun_is_signalled(procs: Processes, attempt: Attempt) -> None:
    """Who stopped the attempt is written into its log before torchrun hears of it: torchrun's
    shutdown output (here a line written in its SIGTERM handler) comes after the mark, and a line
    torchrun left unended is ended first. An attempt that had ended gets no mark."""
    attempt.make()
    log = attempt.folder / "output.log"
    on_term = f'echo "SignalException: got signal: 15" >> {log}; exit 1'
    torchrun = procs.start(["sh", "-c", f"trap '{on_term}' TERM; printf 'half a line' >> {log}; echo $$; "
                            "while :; do sleep 0.05; done"], stdout=subprocess.PIPE, start_new_session=True)
    pid = pids_from(torchrun, 1)[0]
    attempt.make(torchrun={"pid": pid, "start_time": start_time(pid)}, sessions=[pid])
    answer = ask(attempt.request("stop", grace=5, by="restart"))
    assert answer["ok"] and answer["left"] == [], answer
    assert re.fullmatch(rb"half a line\n---- stopped by restart at \d\d:\d\d:\d\dZ ----\n"
                        rb"SignalException: got signal: 15\n", log.read_bytes()), log.read_bytes()
    before = log.read_bytes()
    assert ask(attempt.request("stop", grace=5, by="down"))["ok"] and log.read_bytes() == before  # ended: no mark


def test_a_worker_that_dropped_the_marker_is_found_by_its_session(procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt, workers=1, unmarked=1)
    attempt.make(**tree.state())
    hidden = tree.workers[1]
    started = start_time(hidden)
    answer = ask(attempt.request("stop", grace=1))
    assert hidden in {k["pid"] for k in answer["killed"]} and answer["left"] == []
    assert gone(hidden, started)


def test_a_stop_touches_nothing_of_another_attempt_of_the_same_node(procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    attempt.make(**tree.state())
    other = Attempt(attempt.state_dir, attempt.job, attempt=2)
    other_tree = job_tree(procs, other)
    other.make(**other_tree.state())
    assert ask(attempt.request("stop", grace=1))["left"] == []
    assert carrying(other.marker) == sorted([other_tree.torchrun, *other_tree.workers])
    assert other.state()["state"] == "running" and not (other.folder / "stop").exists()


def test_a_stop_of_an_ended_attempt_finds_nothing_and_changes_nothing(procs: Processes, attempt: Attempt) -> None:
    attempt.make(state="exited", exit_code=0)
    before = (attempt.folder / "state.json").read_bytes()
    for _ in range(2):  # idempotent
        answer = ask(attempt.request("stop", grace=1))
        assert answer["ok"] and answer["killed"] == [] and answer["left"] == [] and answer["state"]["exit_code"] == 0
    assert (attempt.folder / "state.json").read_bytes() == before and not (attempt.folder / "stop").exists()
    assert answer["detail"].startswith("swept 0 processes; ")


def test_a_host_rebooted_since_the_start_runs_nothing_of_it(attempt: Attempt) -> None:
    attempt.make(boot_id="another boot", torchrun={"pid": os.getpid(), "start_time": start_time(os.getpid())})
    answer = ask(attempt.request("stop", grace=1))
    assert answer["containment"] == "reboot" and answer["verified"] and answer["killed"] == []
    assert "rebooted" in answer["detail"]
    status = ask(attempt.request("status"))
    assert status["state"]["state"] == "lost" and status["alive"] == {"survivor": False, "supervisor": False,
                                                                     "torchrun": False}


def test_without_state_json_the_stop_sweeps_by_marker_and_records_the_end(procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    attempt.make()
    (attempt.folder / "state.json").unlink()  # the supervisor died before it wrote anything
    answer = ask(attempt.request("stop", grace=1))
    assert answer["notes"] == ["no state.json: the supervisor never recorded the job's pids"]
    assert sorted(k["pid"] for k in answer["killed"]) == sorted([tree.torchrun, *tree.workers])
    assert answer["left"] == [] and attempt.state()["state"] == "exited"


def test_a_state_dir_that_cannot_be_written_is_said_in_the_notes(procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    attempt.make(**tree.state())
    (attempt.folder / "stop").mkdir()
    (attempt.folder / "stop" / "x").touch()  # neither the stop marker nor (below) state.json can be written
    os.chmod(attempt.folder, 0o500)
    try:
        answer = ask(attempt.request("stop", grace=1))
    finally:
        os.chmod(attempt.folder, 0o700)
    if os.geteuid() != 0:  # root writes into a 0500 directory all the same
        assert any(note.startswith("could not record the end of the job in state.json: ") for note in answer["notes"])
    assert any(note.startswith("could not record the stop request: ") for note in answer["notes"])
    assert answer["left"] == [] and carrying(attempt.marker) == []


@pytest.fixture
def cgroup(attempt: Attempt) -> Iterator[str]:
    """The attempt's cgroup, made as ``start`` makes it (with its ``job`` child)."""
    path, why = cg.make_cgroup(attempt.job, attempt.node, attempt.attempt)
    if path is None:
        unavailable(f"no cgroup for an attempt here: {why}")
    assert path is not None
    yield path
    if os.path.isdir(path):
        cg.cg_kill(path, {})
        cg.cg_remove(path)


def test_with_a_cgroup_the_stop_kills_the_job_cgroup_and_verifies_the_attempts_is_empty_and_gone(
        procs: Processes, attempt: Attempt, cgroup: str) -> None:
    tree = job_tree(procs, attempt, workers=2)
    for pid in (tree.torchrun, *tree.workers):  # torchrun and what it starts: in the job cgroup
        cg.cg_write(os.path.join(cgroup, "job", "cgroup.procs"), str(pid).encode())
    cg.cg_write(os.path.join(cgroup, "cgroup.procs"), str(tree.survivor.pid).encode())
    escaped = procs.start(["sleep", "600"])  # no marker, no session of the job: only the cgroup knows it
    cg.cg_write(os.path.join(cgroup, "job", "cgroup.procs"), str(escaped.pid).encode())
    attempt.make(spec={"cgroup": cgroup}, cgroup=cgroup, **tree.state())

    answer = ask(attempt.request("stop", grace=5))
    assert answer["containment"] == "cgroup" and answer["verified"], answer
    assert answer["detail"] == f"cgroup {cgroup} is empty and removed (cgroup.kill)"
    signals = {k["pid"]: k["signal"] for k in answer["killed"]}
    assert signals[tree.torchrun] == "SIGTERM" and signals[escaped.pid] == "SIGKILL"
    assert not os.path.exists(cgroup) and escaped.wait(10) == -9 and carrying(attempt.marker) == []


def test_a_cgroup_the_supervisor_could_not_record_is_taken_from_the_spec(procs: Processes, attempt: Attempt,
                                                                         cgroup: str) -> None:
    sleep = procs.start(["sleep", "600"])
    cg.cg_write(os.path.join(cgroup, "job", "cgroup.procs"), str(sleep.pid).encode())
    attempt.make(spec={"cgroup": cgroup}, state="starting")  # a full disk: the state never named it
    answer = ask(attempt.request("stop", grace=1))
    assert answer["containment"] == "cgroup" and answer["verified"] and not os.path.exists(cgroup)
    assert sleep.wait(10) == -9



def test_a_failing_attempts_cgroup_is_killed_at_once_torchrun_first_without_its_shutdown(
        procs: Processes, attempt: Attempt, cgroup: str) -> None:
    """Fail-fast's stop (``failing``): torchrun is SIGKILLed first, no SIGTERM and no grace, then the
    cgroup is killed and verified empty; without a cgroup the same request keeps torchrun's shutdown."""
    tree = job_tree(procs, attempt, workers=2)
    for pid in (tree.torchrun, *tree.workers):
        cg.cg_write(os.path.join(cgroup, "job", "cgroup.procs"), str(pid).encode())
    cg.cg_write(os.path.join(cgroup, "cgroup.procs"), str(tree.survivor.pid).encode())
    attempt.make(spec={"cgroup": cgroup}, cgroup=cgroup, **tree.state())

    answer = ask(attempt.request("stop", grace=600, failing=True))
    assert answer["containment"] == "cgroup" and answer["verified"] and answer["at_once"], answer
    signals = {k["pid"]: k["signal"] for k in answer["killed"]}
    assert signals[tree.torchrun] == "SIGKILL" and set(signals) == {tree.torchrun, *tree.workers}
    assert not os.path.exists(cgroup) and carrying(attempt.marker) == []


def test_a_failing_attempt_without_a_cgroup_still_gives_torchrun_its_sigterm(procs: Processes,
                                                                            attempt: Attempt) -> None:
    tree = job_tree(procs, attempt, workers=1)
    attempt.make(**tree.state())
    answer = ask(attempt.request("stop", grace=5, failing=True))
    signals = {k["pid"]: k["signal"] for k in answer["killed"]}
    assert signals[tree.torchrun] == "SIGTERM" and not answer["at_once"] and answer["containment"] == "sweep"
