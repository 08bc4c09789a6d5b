"""The agent's ``start`` (``agent/start.py``), called in this process as the agent calls it: the attempt's
directory, spec and cgroup, then the detached supervisor (forked from here, as from the agent) that
runs the job; what it refuses before anything runs. Jobs here are ``sh`` commands in torchrun's place;
end to end, from a zip through a transport with real torchrun: ``tests/test_agent.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent import cgroup as cg
from clusterrun.agent.survivor import Survivor
from tests.agenthost import Attempt, ask, forked
from tests.conftest import stop_all_jobs, wait_for
from tests.simhosts import unavailable


@pytest.fixture
def started(attempt: Attempt) -> Attempt:
    """An attempt whose every node is stopped at the test's end, whatever it left running."""
    yield attempt  # type: ignore[misc]
    stop_all_jobs(attempt.state_dir)


def start(at: Attempt, argv: list[str], **fields: Any) -> dict[str, Any]:
    return ask(at.request("start", argv=argv, **fields))


def ended(at: Attempt) -> dict[str, Any]:
    """The final state, once the monitor has written it (a deadline, not a pause)."""
    return wait_for(lambda: (state := json.loads((at.folder / "state.json").read_text()))["state"] == "exited"
                    and state, timeout=30, what="the attempt to end")  # type: ignore[no-any-return]


def test_a_start_runs_the_job_detached_and_its_exit_and_output_are_recorded(started: Attempt) -> None:
    answer = start(started, ["sh", "-c", 'echo "out $GREETING"; echo err >&2; exit 4'],
                   env={"GREETING": "hello", "API_TOKEN": "canary-secret"}, secret_env=["API_TOKEN"],
                   about={"name": "greet"})
    assert answer["ok"] and answer["dir"] == str(started.folder), answer
    assert answer["state"]["state"] in ("running", "exited") and answer["state"]["torchrun"]["pid"] > 0
    state = ended(started)
    assert state["exit_code"] == 4 and state["signal"] is None and not state["stop_requested"]
    log = (started.folder / "output.log").read_text()
    assert "out hello\n" in log and "err\n" in log
    spec = json.loads((started.folder / "spec.json").read_text())
    assert spec["env"] == {"GREETING": "hello", "API_TOKEN": "****"} and spec["about"] == {"name": "greet"}
    files = [p for p in started.folder.rglob("*") if p.is_file()]
    assert all("canary-secret" not in p.read_text(errors="replace") for p in files)
    assert json.loads((started.folder / "exit").read_text())["exit_code"] == 4
    if spec["cgroup"]:  # made for the attempt, removed by its supervisor once the job was over
        wait_for(lambda: not os.path.exists(spec["cgroup"]), timeout=30, what="the attempt's cgroup to go")
    else:
        assert any(f.startswith("no cgroup: ") for f in spec["fallbacks"])


def test_setup_runs_first_its_output_heads_the_log_and_the_job_gets_its_environment(started: Attempt) -> None:
    answer = start(started, ["sh", "-c", 'echo "job sees $PREPARED"'],
                   setup=["export PREPARED=yes", "echo setting up"], env={"TOKEN": "hidden"}, secret_env=["TOKEN"])
    assert answer["ok"], answer
    ended(started)
    lines = (started.folder / "output.log").read_text().splitlines()
    assert lines[0] == "[setup]: setting up" and "job sees yes" in lines
    assert (started.folder / "output.times").read_text().startswith("0 ")


def test_a_program_that_cannot_run_fails_the_start_and_says_why(started: Attempt) -> None:
    answer = start(started, ["/nonexistent/torchrun"])
    assert not answer["ok"] and answer["error"].startswith("could not start /nonexistent/torchrun: ")
    assert "No such file or directory" in answer["error"] and answer["state"]["state"] == "exited"


def test_what_a_start_refuses_before_anything_runs(started: Attempt, tmp_path: Path) -> None:
    assert start(started, []) == {"ok": False, "error": "argv must be a non-empty list of strings"}
    assert not started.folder.exists()
    started.folder.mkdir(parents=True)
    refused = start(started, ["true"])
    assert refused == {"ok": False, "error": f"{started.folder} already exists: this attempt was started before"}

    blocked = Attempt(tmp_path / "file" / "state", started.job)
    (tmp_path / "file").write_text("")  # the state dir's parent is a file: nothing can be made there
    answer = start(blocked, ["true"])
    assert not answer["ok"] and answer["error"].startswith(f"cannot create the state dir {blocked.folder}: ")
    assert "nothing was started" in answer["error"]


def test_a_failing_setup_starts_nothing(started: Attempt) -> None:
    answer = start(started, ["true"], setup=["echo trying", "false"])
    assert not answer["ok"] and "setup[1] exited with status 1" in answer["error"]
    assert not started.folder.exists()


def test_the_cgroup_is_made_before_the_job_and_holds_it(started: Attempt) -> None:
    where, why = cg.cgroup_parent()
    if where is None:
        unavailable(f"no cgroup for an attempt here: {why}")
    answer = start(started, ["sh", "-c", "cat /proc/self/cgroup; exit 0"])
    assert answer["ok"], answer
    cgroup = json.loads((started.folder / "spec.json").read_text())["cgroup"]
    assert cgroup and answer["state"]["cgroup"] == cgroup
    ended(started)
    assert f"0::{cg.cgroup_path(os.path.join(cgroup, 'job'))}\n" in (started.folder / "output.log").read_text()


def test_the_survivor_starts_the_job_reaps_it_writes_its_exit_first_and_leaves_once_the_monitor_is_done(
        attempt: Attempt) -> None:
    """The survivor forked from this process as ``start`` forks it (here without the detaching
    middle process, so that the test reaps it)."""
    attempt.folder.mkdir(parents=True)
    (attempt.folder / "spec.json").write_text(json.dumps({
        "job": attempt.job, "node": 0, "attempt": 1, "argv": ["sh", "-c", "echo from the job; exit 3"],
        "env": {"CRTEST": "1"}, "cwd": None, "cgroup": None, "fallbacks": ["no cgroup: test"], "first_rank": 0}))
    pid = forked(lambda: Survivor(str(attempt.folder)).run())
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0  # it left once the monitor had finished
    state = json.loads((attempt.folder / "state.json").read_text())
    assert state["state"] == "exited" and state["exit_code"] == 3 and state["survivor"]["pid"] == pid
    assert json.loads((attempt.folder / "exit").read_text())["exit_code"] == 3
    assert "from the job\n" in (attempt.folder / "output.log").read_text()
    assert "no cgroup: test" in state["fallbacks"]


def test_a_survivor_whose_job_cannot_run_says_so_and_starts_nothing(attempt: Attempt) -> None:
    attempt.folder.mkdir(parents=True)
    (attempt.folder / "spec.json").write_text(json.dumps({
        "job": attempt.job, "node": 0, "attempt": 1, "argv": ["/nonexistent/torchrun"], "env": {}, "cgroup": None}))
    ready_r, ready_w = os.pipe()
    pid = forked(lambda: Survivor(str(attempt.folder), ready_fd=ready_w).run())
    os.close(ready_w)
    try:
        said = json.loads(os.read(ready_r, 1 << 16))
    finally:
        os.close(ready_r)
    assert os.WEXITSTATUS(os.waitpid(pid, 0)[1]) == 1
    assert said["state"] == "exited" and said["error"].startswith("could not start /nonexistent/torchrun: ")
