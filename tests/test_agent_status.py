"""The agent's ``status``, ``remove`` and ``jobs`` (``agent/status.py``) from an attempt's records and
the processes they name: running, lost once nothing of it runs, the state dir's attempts listed with
what ``start`` was given, a node's directory removed only when nothing of it runs. In this process with
real processes in the job's place (``tests/agenthost.py``)."""

from __future__ import annotations

from pathlib import Path

from tests.agenthost import Attempt, Processes, ask, entry, job_tree


def test_a_running_attempt_is_running_with_what_is_alive_and_its_log_size(procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    monitor = procs.start(["sleep", "600"])
    attempt.make(supervisor=entry(monitor.pid), fallbacks=["no cgroup: x"], **tree.state())
    (attempt.folder / "output.log").write_bytes(b"[rank0]: hello\n")

    answer = ask(attempt.request("status"))
    assert answer["ok"] and answer["state"]["state"] == "running"
    assert answer["alive"] == {"survivor": True, "supervisor": True, "torchrun": True}
    assert answer["log_size"] == 15 and answer["containment"] == "sweep" and answer["fallbacks"] == ["no cgroup: x"]
    assert answer["degraded"] is None

    (attempt.folder / "degraded").write_text("cannot write state.json: No space left on device")
    assert ask(attempt.request("status"))["degraded"] == "cannot write state.json: No space left on device"


def test_an_attempt_whose_processes_are_all_gone_is_lost_unless_it_recorded_its_end(
        procs: Processes, attempt: Attempt) -> None:
    dead = procs.start(["true"])
    dead.wait()
    gone = {"pid": dead.pid, "start_time": 1}  # a pid that no longer runs (or runs another process)
    attempt.make(boot_id="another boot", survivor=gone, torchrun=gone)
    answer = ask(attempt.request("status"))
    assert answer["state"]["state"] == "lost" and not any(answer["alive"].values())
    assert answer["log_size"] == 0

    attempt.make(boot_id="another boot", state="exited", exit_code=3)
    assert ask(attempt.request("status"))["state"]["exit_code"] == 3


def test_a_started_attempt_without_state_json_is_an_error_naming_it(attempt: Attempt) -> None:
    attempt.make()
    (attempt.folder / "state.json").unlink()
    answer = ask(attempt.request("status"))
    assert answer == {"ok": False, "error": f"no job {attempt.job} node 0 attempt 1 in {attempt.folder}"}


def test_jobs_lists_every_attempt_with_its_state_and_what_start_was_given(procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    about = {"name": "train", "script": "train.py"}
    attempt.make(spec={"argv": ["torchrun", "train.py"], "env": {"TOKEN": "****"}, "cwd": "/work", "about": about},
                 **tree.state())
    ended = Attempt(attempt.state_dir, attempt.job, node=1, attempt=2)
    ended.make(state="exited", exit_code=0)
    starting = Attempt(attempt.state_dir, attempt.job, node=2)
    starting.make()
    (starting.folder / "state.json").unlink()  # being started: no state yet
    for junk in ("notanode", "node3/notanattempt"):
        (attempt.state_dir / "jobs" / attempt.job / junk).mkdir(parents=True)

    answer = ask({"op": "jobs", "state_dir": str(attempt.state_dir)})
    assert answer["ok"] and answer["root"] == str(attempt.state_dir / "jobs")
    listed = {(j["node"], j["attempt"]): j for j in answer["jobs"]}
    assert sorted(listed) == [(0, 1), (1, 2), (2, 1)]
    first = listed[(0, 1)]
    assert first["state"]["state"] == "running" and first["argv"] == ["torchrun", "train.py"]
    assert first["env"] == {"TOKEN": "****"} and first["cwd"] == "/work" and first["about"] == about
    assert isinstance(first["started"], float) and first["job"] == attempt.job
    assert listed[(1, 2)]["state"]["exit_code"] == 0 and listed[(2, 1)]["state"] == {"state": "starting"}
    assert ask({"op": "jobs", "state_dir": str(attempt.state_dir / "nowhere")})["jobs"] == []


def test_remove_refuses_while_anything_runs_then_removes_the_node_and_the_job_once_empty(
        procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    attempt.make(**tree.state())
    (attempt.folder / "output.log").write_bytes(b"x" * 1000)
    other = Attempt(attempt.state_dir, attempt.job, node=1)
    other.make(state="exited")
    job_dir = attempt.state_dir / "jobs" / attempt.job

    refused = ask(attempt.request("remove"))
    assert not refused["ok"] and refused["error"].startswith(f"{attempt.folder} still runs; stop the job first")
    assert attempt.folder.exists()

    assert ask(attempt.request("stop", grace=1))["left"] == []
    removed = ask(attempt.request("remove"))
    assert removed["ok"] and removed["removed"] == str(attempt.folder.parent) and removed["bytes"] >= 1000
    assert not attempt.folder.parent.exists() and job_dir.exists()  # node 1 is still there
    assert ask(other.request("remove"))["removed"] == str(other.folder.parent) and not job_dir.exists()
    assert ask(other.request("remove")) == {"ok": True, "removed": None, "bytes": 0}


def test_a_request_for_an_invalid_job_or_node_is_refused_naming_it(tmp_path: Path) -> None:
    for fields, error in (({"job": "../x", "node": 0}, "invalid job id '../x'"),
                          ({"job": "j", "node": -1}, "invalid node -1 or attempt 1")):
        answer = ask({"op": "status", "state_dir": str(tmp_path), **fields})
        assert answer == {"ok": False, "error": error}
