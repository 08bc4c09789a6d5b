"""The agent's ``follow`` (``agent/follow.py``): a node's log and state as a stream of JSON lines
(a log's bytes raw after its line), resumable by byte offset, from the start, the tail or before an
offset, with or without the log, once or to the job's end. In this process from an attempt's records
(``tests/agenthost.py``); end to end through a real agent and torchrun: ``tests/test_agent.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent import follow as agent_follow
from clusterrun.agent.follow import POLL_INTERVAL, Times, tail_offset
from clusterrun.agent.procs import proc_entry
from clusterrun.agent.records import write_json_atomic
from clusterrun.agent.serve import answer
from clusterrun.transports.base import AgentReader, AgentStream
from tests.agenthost import Attempt, Processes, job_tree
from tests.conftest import wait_for

LOG = b"one\ntwo\nthree\nfour\npartial"


def follow(capsys: pytest.CaptureFixture[bytes], at: Attempt, **fields: Any) -> list[dict[str, Any]]:
    """The messages ``follow`` streams for ``at`` (it answers nothing else: None), as the
    controller reads them (``AgentStream``: a log's ``data`` is its bytes)."""
    assert answer(json.dumps(at.request("follow", **fields)).encode()) is None
    written = [capsys.readouterr().out]
    return list(AgentStream("h", AgentReader(lambda: written.pop() if written else b""), None))


def data(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(m["data"] for m in messages if m["t"] == "log")


def test_an_ended_attempt_streams_its_log_its_state_and_ends_with_the_partial_line(
        capsysbinary: pytest.CaptureFixture[bytes], attempt: Attempt) -> None:
    attempt.make(state="exited", exit_code=0)
    (attempt.folder / "output.log").write_bytes(LOG)
    (attempt.folder / "output.times").write_bytes(b"0 1000\n8 2000\n")
    messages = follow(capsysbinary, attempt)
    assert [m["t"] for m in messages] == ["log", "state", "log", "end"]
    first = messages[0]
    assert (first["offset"], first["next"], first["data"]) == (0, 19, b"one\ntwo\nthree\nfour\n")
    assert first["times"] == [[0, 1000], [8, 2000]]
    assert messages[2]["offset"] == 19 and messages[2]["data"] == b"partial"
    assert messages[3]["state"]["exit_code"] == 0 and messages[1]["state"]["state"] == "exited"


@pytest.mark.parametrize(("fields", "expected"), [
    ({"offset": 8}, b"three\nfour\npartial"),
    ({"tail": 2}, b"three\nfour\npartial"),
    ({"tail": 0}, b"partial"),
    ({"offset": 14, "before": 2}, b"two\nthree\nfour\npartial"),  # a viewer's scrollback before offset 14
    ({"logs": False}, b""),
])
def test_it_starts_where_it_is_asked_and_loses_and_repeats_nothing(
        capsysbinary: pytest.CaptureFixture[bytes], attempt: Attempt, fields: dict[str, Any], expected: bytes) -> None:
    attempt.make(state="exited")
    (attempt.folder / "output.log").write_bytes(LOG)
    messages = follow(capsysbinary, attempt, **fields)
    assert data(messages) == expected and messages[-1]["t"] == "end"


def test_once_ends_at_what_is_written_so_far_while_the_job_runs(capsysbinary: pytest.CaptureFixture[bytes],
                                                                  procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    attempt.make(**tree.state())
    (attempt.folder / "output.log").write_bytes(b"a\nb\npart")
    messages = follow(capsysbinary, attempt, once=True)
    assert [m["t"] for m in messages] == ["log", "state", "eof"]
    assert messages[-1]["next"] == 4 and messages[-1]["state"]["state"] == "running"


def test_following_a_running_job_to_its_end_gets_every_line_once_then_the_final_state(
        capsysbinary: pytest.CaptureFixture[bytes], procs: Processes, attempt: Attempt) -> None:
    tree = job_tree(procs, attempt)
    state = attempt.make(**tree.state())
    log = attempt.folder / "output.log"
    log.write_bytes(b"first\n")

    def the_job_ends() -> None:  # once follow waits for news: it must wake, lose and repeat nothing
        wait_for(lambda: watched(attempt.folder), timeout=30, what="follow to watch the attempt's directory")
        with open(log, "ab") as f:
            f.write(b"second\nthird\n")
        write_json_atomic(str(attempt.folder / "state.json"), dict(state, state="exited", exit_code=0))

    writer = threading.Thread(target=the_job_ends)
    writer.start()
    messages = follow(capsysbinary, attempt)
    writer.join()
    assert data(messages) == b"first\nsecond\nthird\n"
    assert messages[-1] == {"t": "end", "state": dict(state, state="exited", exit_code=0)}


def test_a_flow_is_read_in_batches_of_the_interval_asked_for_and_loses_and_repeats_nothing(
        capsysbinary: pytest.CaptureFixture[bytes], procs: Processes, attempt: Attempt,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tree = job_tree(procs, attempt)
    state = attempt.make(**tree.state())
    log = attempt.folder / "output.log"
    log.write_bytes(b"first\n")
    slept: list[float] = []  # by follow, in this thread (time is the module everybody's)
    real_sleep, here = agent_follow.time.sleep, threading.current_thread()
    monkeypatch.setattr(agent_follow.time, "sleep",
                        lambda s: (slept.append(s) if threading.current_thread() is here else None, real_sleep(s)))
    lines: list[bytes] = []

    def a_flow_then_the_end() -> None:  # a write each: inotify wakes follow at every one
        wait_for(lambda: watched(attempt.folder), timeout=30, what="follow to watch the attempt's directory")
        with open(log, "ab", buffering=0) as f:
            # Until follow has waited in the flow: a new state is read at once, so the end written
            # earlier would leave it nothing to wait for
            for i in range(100_000):
                if i >= 300 and slept:
                    break
                lines.append(f"line {i}\n".encode())
                f.write(lines[-1])
        write_json_atomic(str(attempt.folder / "state.json"), dict(state, state="exited", exit_code=0))

    writer = threading.Thread(target=a_flow_then_the_end)
    writer.start()
    messages = follow(capsysbinary, attempt, interval=0.5)
    writer.join()
    assert data(messages) == b"first\n" + b"".join(lines)
    assert max(slept, default=0.0) > POLL_INTERVAL  # the interval asked for, not the default, batched the reads


def watched(folder: Path) -> bool:
    """Whether an inotify descriptor of this process watches ``folder`` (the agent's ``Waker``)."""
    inode = f"ino:{os.stat(folder).st_ino:x} "
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            if inode in Path(f"/proc/self/fdinfo/{fd}").read_text():
                return True
        except OSError:
            pass
    return False


def test_an_attempt_from_before_a_reboot_is_followed_to_the_end_as_lost(capsysbinary: pytest.CaptureFixture[bytes],
                                                                         attempt: Attempt) -> None:
    attempt.make(boot_id="another boot")
    (attempt.folder / "output.log").write_bytes(b"last words\n")
    messages = follow(capsysbinary, attempt)
    assert data(messages) == b"last words\n" and messages[-1]["state"]["state"] == "lost"


def test_the_tail_offset_counts_complete_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"1\n2\n3\npartial")
    assert [tail_offset(str(path), n) for n in (0, 1, 3, 9)] == [6, 4, 0, 0]
    assert tail_offset(str(path), 1, end=4) == 2
    path.write_bytes(b"x" * 70_000 + b"\n" + b"y\n")  # more than one block read from the end
    assert tail_offset(str(path), 1) == 70_001 and tail_offset(str(path), 2) == 0


def test_times_are_the_entries_that_cover_a_range_as_the_file_grows(tmp_path: Path) -> None:
    path = tmp_path / "output.times"
    times = Times(str(path))
    assert times.covering(0, 10) == []  # none yet
    path.write_bytes(b"0 100\n5 200\n12 300\n20 4")  # the last entry is still being written
    assert times.covering(0, 10) == [[0, 100], [5, 200]]
    assert times.covering(10, 15) == [[5, 200], [12, 300]]
    with open(path, "ab") as f:
        f.write(b"00\n")
    assert times.covering(15, 30) == [[12, 300], [20, 400]]


def test_in_a_flow_the_liveness_checks_run_now_and_then_and_at_once_when_the_job_goes(
        capsysbinary: pytest.CaptureFixture[bytes], procs: Processes, attempt: Attempt,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each line read in its own wake (a flow) does not cost a look at /proc (``CHECK_EVERY``);
    once the job's processes are killed mid-flow (no last state written), it is found lost."""
    tree = job_tree(procs, attempt)
    attempt.make(**tree.state())
    log = attempt.folder / "output.log"
    log.write_bytes(b"first\n")
    emitted: list[dict[str, Any]] = []
    checks: list[bool] = []
    real_emit = agent_follow.emit
    monkeypatch.setattr(agent_follow, "emit", lambda m: (emitted.append(m), real_emit(m)))
    # (the monitor it would start for a job left without one is not started in this process)
    monkeypatch.setattr(agent_follow, "ensure_monitor", lambda folder, state: (checks.append(True), state)[1])
    reads = 60

    def a_flow_then_the_job_killed() -> None:
        try:
            wait_for(lambda: watched(attempt.folder), timeout=30, what="follow to watch the attempt's directory")
            with open(log, "ab", buffering=0) as f:
                for i in range(reads):  # each line once the one before was sent: a wake and a read each
                    f.write(f"line {i}\n".encode())
                    wait_for(lambda i=i: any(f"line {i}\n".encode() in m.get("data", b"") for m in emitted[-3:]),
                             timeout=30, interval=0.002, what=f"line {i} sent")
        finally:  # (also when the flow failed: follow ends only with the job)
            for pid in (tree.survivor.pid, tree.torchrun, *tree.workers):
                os.kill(pid, signal.SIGKILL)

    writer = threading.Thread(target=a_flow_then_the_job_killed)
    writer.start()
    messages = follow(capsysbinary, attempt, interval=0.005)
    writer.join()
    assert data(messages) == b"first\n" + b"".join(f"line {i}\n".encode() for i in range(reads))
    assert messages[-1]["t"] == "end" and messages[-1]["state"]["state"] == "lost"
    assert len(checks) < reads / 4  # at the start, at most twice a second, and at the end (not at every read)


def test_a_monitor_that_cannot_record_the_end_is_started_once_and_the_node_ends_lost_saying_why(
        capsysbinary: pytest.CaptureFixture[bytes], attempt: Attempt, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full state disk: the job's processes are gone and the monitor started for them exits without its
    last state written; following on would start one every check, and the node would never end."""
    attempt.make()  # running, by a state that names no live process
    (attempt.folder / "degraded").write_text("the supervisor could not write its state (no space left on ...)")
    started: list[subprocess.Popen[bytes]] = []

    def monitor_that_exits(folder: str, state: dict[str, Any]) -> dict[str, Any]:
        assert len(started) < 3, "a monitor was started again and again"
        started.append(subprocess.Popen(["sleep", "0.3"]))  # alive at the next look, then gone, its end unrecorded
        return dict(state, supervisor=proc_entry(started[-1].pid))

    monkeypatch.setattr(agent_follow, "ensure_monitor", monitor_that_exits)
    try:
        messages = follow(capsysbinary, attempt)
    finally:
        for monitor in started:
            monitor.wait()
    end = messages[-1]
    assert end["t"] == "end" and end["state"]["state"] == "lost" and len(started) == 1
    assert end["state"]["error"] == ("the job's processes on the host are gone and their end could not be "
                                     "recorded: the supervisor could not write its state (no space left on ...)")
