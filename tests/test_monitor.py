"""The monitor of one attempt (``agent/monitor.py``), run in this process as the survivor's fork runs
it, over a real torchrun in its place (``tests/_support/fake_torchrun.py``: the same process tree and
per-rank files) whose ranks are ``sh``: it finds the workers, merges their lines, takes torchrun's
exit from the exit file, sweeps what the job left and writes the final state. A thread plays the
survivor's part (it reaps torchrun and writes the exit file) and opens the ranks' gate once the
monitor has recorded what the test waits for. End to end, from a zip on a host: ``tests/test_agent.py``."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent import hangwatch, monitor
from clusterrun.agent.monitor import EXIT_FILE, Monitor
from clusterrun.agent.records import write_atomic
from clusterrun.agent.survivor import exit_record
from tests.agenthost import Attempt, Processes, carrying, entry
from tests.conftest import SUPPORT, wait_for

# Each rank: a line on stdout and one on stderr, an orphan in a session of its own that keeps the
# job's marker (only the final sweep finds it), then it waits for the gate (a FIFO) and exits
# with its rank's code from $CODES (rank 1's non-zero makes torchrun stop the others and fail).
RANK = ('echo "rank $RANK says hello"; echo "rank $RANK warns" >&2; '
        'setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $! > "$PIDS/orphan$RANK"; '
        'read go < "$GATE"; set -- $CODES; shift "$RANK"; exit "$1"')


@pytest.fixture
def own_signals() -> Iterator[None]:
    """``Monitor.run`` takes SIGHUP, SIGINT, SIGTERM and the wake-up fd as its process would: restored after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    yield
    old = signal.set_wakeup_fd(-1)
    if old >= 0:
        os.close(old)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """fake torchrun with ``nproc`` ``sh`` ranks, started as the survivor starts it, and the survivor's part."""

    def __init__(self, procs: Processes, at: Attempt, tmp_path: Path, codes: str = "0 0", nproc: int = 2,
                 survivor: bool = True, monitor_interval: float = 0.1, rank: str = RANK,
                 spawn_gate: Path | None = None, **spec: Any) -> None:
        self.at, self.gate, self.pids, self.nproc = at, tmp_path / "gate", tmp_path / "pids", nproc
        os.mkfifo(self.gate)
        # Held open here (read-write: no wait for a reader): a rank's open never waits, and what is
        # written stays in the pipe for a rank that opens it later.
        self.gate_fd = os.open(self.gate, os.O_RDWR)
        self.pids.mkdir()
        port = free_port()
        argv = [sys.executable, str(SUPPORT / "fake_torchrun.py"), f"--nproc-per-node={nproc}", "--redirects=3",
                f"--master-port={port}", "--rdzv-id=mon", f"--monitor-interval={monitor_interval}", "--no-python",
                "sh", "-c", rank]
        at.make()
        log = os.open(at.folder / "output.log", os.O_WRONLY | os.O_APPEND)
        try:
            gated = {"FAKE_TORCHRUN_SPAWN_GATE": str(spawn_gate)} if spawn_gate is not None else {}
            self.torchrun = procs.start(argv, env=at.env(GATE=str(self.gate), PIDS=str(self.pids), CODES=codes,
                                                         **gated), stdout=log, stderr=log, start_new_session=True)
        finally:
            os.close(log)
        self.survivor = procs.start(["sleep", "600"]) if survivor else None  # only its pid counts
        self.state = at.make(spec={"argv": argv, **spec}, torchrun=entry(self.torchrun.pid),
                             survivor=entry(self.survivor.pid) if self.survivor else None,
                             sessions=[self.torchrun.pid])
        self.status: int | None = None
        self.seen: dict[str, Any] | None = None  # the state.json that the survivor's part waited for

    def survive(self, until: Callable[[dict[str, Any]], bool],
                then: Callable[[], None] | None = None) -> threading.Thread:
        """The survivor's part, in a thread: once state.json shows ``until``, ``then`` (else open the
        gate); reap torchrun, write the exit file (if there is a survivor), end the survivor."""
        def run() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = _read(self.at.folder / "state.json")
                if until(state):
                    self.seen = state
                    break
                time.sleep(0.02)
            (then or self.open_gate)()
            _, self.status = os.waitpid(self.torchrun.pid, 0)
            self.torchrun.returncode = os.waitstatus_to_exitcode(self.status)
            os.close(self.gate_fd)
            if self.survivor is not None:
                # atomically, as the survivor writes it: a monitor never reads half of it
                write_atomic(str(self.at.folder / EXIT_FILE), json.dumps(exit_record(self.status,
                                                                                   self.torchrun.pid)).encode())
                self.survivor.kill()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def open_gate(self) -> None:
        os.write(self.gate_fd, b"go\n" * self.nproc)  # one line each: sh reads a line byte by byte

    def orphans(self) -> list[int]:
        return [int(p.read_text()) for p in sorted(self.pids.glob("orphan*"))]


def run_monitor(folder: Path, state: dict[str, Any] | None = None) -> int:
    """``Monitor(folder, state).run()``, then the descriptors its process would have left to its exit closed."""
    watcher = Monitor(str(folder), state)
    code = watcher.run()
    if hasattr(watcher, "wakeup"):
        os.close(watcher.wakeup)
        watcher.waker.close()
    return code


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def _workers(count: int) -> Callable[[dict[str, Any]], bool]:
    return lambda state: len(state.get("workers") or []) >= count


def test_the_monitor_records_the_workers_merges_their_lines_and_writes_torchruns_exit(
        procs: Processes, attempt: Attempt, tmp_path: Path, own_signals: None) -> None:
    job = Job(procs, attempt, tmp_path, codes="0 3")
    survivor = job.survive(until=_workers(2))
    assert run_monitor(attempt.folder, job.state) == 0
    survivor.join(30)

    state = attempt.state()
    assert state["state"] == "exited" and state["exit_code"] == 1 and state["signal"] is None
    assert state["supervisor"] == entry(os.getpid()) and not state["stop_requested"]
    assert sorted((w["rank"], w["local_rank"]) for w in state["workers"]) == [(0, 0), (1, 1)]
    assert all(w["died"] is not None for w in state["workers"])
    log = (attempt.folder / "output.log").read_text()
    for rank in (0, 1):
        assert f"[rank{rank}]:rank {rank} says hello\n" in log and f"[rank{rank}]:rank {rank} warns\n" in log
    assert "rank      : 1 (local_rank: 1)" in log  # torchrun's own failure report, in the same log
    assert (attempt.folder / "output.times").read_text().strip() and (attempt.folder / "ranklogs.json").exists()
    orphans = job.orphans()
    assert len(orphans) == 2 and carrying(attempt.marker) == []  # the final sweep found them by the marker
    assert "oom" in state  # torchrun failed: what the kernel said of OOM kills, looked for
    assert job.seen is not None


def test_a_sigterm_is_passed_on_to_torchrun_and_without_a_survivor_or_the_ranks_exits_the_exit_is_unknown(
        procs: Processes, attempt: Attempt, tmp_path: Path, own_signals: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' exits not read (torchrun reaped them first) and no failure report: nothing tells torchrun's."""
    monkeypatch.setattr(monitor, "zombie_exit", lambda pid: None)
    monkeypatch.setattr(monitor.ExitReader, "start", lambda self: None)
    job = Job(procs, attempt, tmp_path, survivor=False)
    job.survive(until=_workers(2), then=lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert run_monitor(attempt.folder, job.state) == 0

    state = attempt.state()
    assert state["state"] == "exited" and state["stop_requested"] and state["exit_status"] == "unknown"
    assert state["exit_code"] is None and "survivor that waited for it ended first" in state["error"]
    assert job.status is not None and os.WIFEXITED(job.status) and os.WEXITSTATUS(job.status) == 1
    assert "received SIGTERM, stopping the workers" in (attempt.folder / "output.log").read_text()
    # no survivor: the sessions are looked for below the monitor, which is this process here
    assert len(state["workers"]) == 2 and {w["pid"] for w in state["workers"]} <= set(state["sessions"])
    assert carrying(attempt.marker) == []


def test_without_a_survivor_torchruns_exit_is_learned_from_its_ranks_exits(
        procs: Processes, attempt: Attempt, tmp_path: Path, own_signals: None) -> None:
    """Nobody reaps torchrun, but the monitor read each rank's exit as it ended (torchrun polls
    its workers every 0.1 s): torchrun's exit follows from them, and the state says how."""
    job = Job(procs, attempt, tmp_path, codes="0 0", survivor=False, monitor_interval=1.0)  # a loaded machine's slack
    job.survive(until=_workers(2))
    assert run_monitor(attempt.folder, job.state) == 0

    state = attempt.state()
    assert job.status is not None and os.WIFEXITED(job.status) and os.WEXITSTATUS(job.status) == 0
    assert [w["exit_code"] for w in state["workers"]] == [0, 0]
    assert state["exit_code"] == 0 and "exit_status" not in state and not state["error"]
    assert state["exit_learned"] == ("every rank exited 0 (torchrun's own exit was not recorded: its survivor "
                                     "was killed)")


def test_a_failed_rank_that_torchrun_reaped_before_its_exit_was_read_stays_the_first_failure(
        procs: Processes, attempt: Attempt, tmp_path: Path, own_signals: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 exits 1; torchrun reaps it and SIGTERMs rank 0. On a loaded machine torchrun can reap
    rank 1 before the monitor reads its exit (here it never can): the node's failure is still rank
    1's, not that of rank 0, which torchrun stopped because of it."""
    from clusterrun.agent import procs as agent_procs
    from clusterrun.core.protocol import decode_status
    from clusterrun.diagnose.rootcause import NodeLog, find_root_cause

    def read_late(pid: int, real: Callable[[int], int | None] = agent_procs.zombie_exit) -> int | None:
        code = real(pid)
        return None if code == 1 else code  # rank 1's: reaped before it was read

    monkeypatch.setattr(agent_procs, "zombie_exit", read_late)
    monkeypatch.setattr(monitor, "zombie_exit", read_late)
    # Rank 0 ends on torchrun's SIGTERM 0.3 s after it, and torchrun reaps it a second later: its exit
    # is read also on a loaded machine (a rank killed at once is reaped at once, read or not).
    rank = ('if [ "$RANK" = 1 ]; then read go < "$GATE"; exit 1; fi; '
            "trap 'sleep 0.3; trap - TERM; kill -TERM $$' TERM; sleep 600 & wait")
    job = Job(procs, attempt, tmp_path, survivor=False, rank=rank, monitor_interval=1.0)  # torchrun: nobody reaps it
    job.survive(until=_workers(2))
    run_monitor(attempt.folder, job.state)

    state = attempt.state()
    assert {w["rank"]: w.get("exit_code") for w in state["workers"]} == {0: -signal.SIGTERM, 1: None}
    assert state["exit_code"] == 1 and state["failed_rank"] == 1
    assert state["exit_learned"].startswith("rank 1 ended first, its exit code unread"), state["exit_learned"]
    root = find_root_cause({0: "h"}, {0: NodeLog()}, {0: decode_status("h", state)}, set())
    assert root is not None and root.describe() == "rank 1 on node 0 (h, local rank 1): failed"


def test_ranks_quiet_for_hang_after_make_the_node_quiet_since_their_last_output(
        procs: Processes, attempt: Attempt, tmp_path: Path, own_signals: None) -> None:
    job = Job(procs, attempt, tmp_path, nproc=1, codes="0", hang_after=0.3)
    written = time.time()
    job.survive(until=lambda state: _workers(1)(state) and state.get("quiet_since") is not None)
    run_monitor(attempt.folder, job.state)

    assert job.seen is not None, "the ranks' silence was never recorded"
    assert written <= job.seen["quiet_since"] <= time.time()
    state = attempt.state()
    assert state["exit_code"] == 0 and state["state"] == "exited"
    assert state["quiet_since"] is None  # no rank runs: an ended node is not quiet (its owner may still look)


def test_a_monitor_resumes_from_state_json_and_a_finished_attempt_is_left_alone(
        procs: Processes, attempt: Attempt, tmp_path: Path, own_signals: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A monitor started by an agent (no state handed over) reads state.json; the start-up watch
    sees torchrun in the rendezvous (checked at once here: RDZV_CHECK 0)."""
    monkeypatch.setattr(monitor, "RDZV_CHECK", 0.0)
    spawn = tmp_path / "spawn"
    job = Job(procs, attempt, tmp_path, spawn_gate=spawn)

    def spawned() -> None:  # the workers once the watch saw the rendezvous: it looks only while there are none
        spawn.touch()
        wait_for(lambda: _workers(2)(_read(attempt.folder / "state.json")), timeout=30, what="the workers")
        job.open_gate()

    job.survive(until=lambda state: "rdzv_joined" in state, then=spawned)
    assert run_monitor(attempt.folder) == 0
    state = attempt.state()
    assert state["state"] == "exited" and state["exit_code"] == 0 and len(state["workers"]) == 2
    assert "rdzv_joined" in state

    before = (attempt.folder / "state.json").read_bytes()
    assert run_monitor(attempt.folder) == 0  # exited already: nothing to do
    assert (attempt.folder / "state.json").read_bytes() == before


def test_torchrun_joined_the_rendezvous_once_it_holds_a_connection_to_the_master_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert not hangwatch.joined_store(os.getpid(), port)
        with socket.create_connection(("127.0.0.1", port)), server.accept()[0]:
            assert hangwatch.joined_store(os.getpid(), port)
            assert not hangwatch.joined_store(os.getpid(), free_port())
    assert not hangwatch.joined_store(2**22 + 1, port)  # no such process
    assert hangwatch.master_port(["--nnodes=2", "--master-port=29500"]) == 29500
    assert hangwatch.master_port(["--master-port=x"]) is None


def test_an_unwritable_state_is_kept_in_memory_and_marked_degraded(tmp_path: Path) -> None:
    folder = tmp_path / "attempt1"
    folder.mkdir()
    (folder / "state.json").mkdir()  # a rename over a directory fails, as on a read-only or full disk
    state: dict[str, Any] = {"state": "running"}
    assert not monitor.save_state(str(folder), state)
    assert state["degraded"].startswith("cannot write state.json: ")
    assert (folder / "degraded").read_text() == state["degraded"]
    monitor._degrade(str(folder), state, "a second reason")  # the first reason stays
    assert (folder / "degraded").read_text() == state["degraded"] != "a second reason"


def test_ensure_monitor_starts_none_for_an_ended_or_watched_attempt(procs: Processes, attempt: Attempt) -> None:
    """(A monitor it does start is a fork of this process: tests/test_agent.py runs that case end to end.)"""
    watched = procs.start(["sleep", "600"])
    for state in ({"state": "exited"}, {"state": "running", "boot_id": "another boot"},
                  {"state": "running", "boot_id": attempt.make()["boot_id"], "supervisor": entry(watched.pid)}):
        assert monitor.ensure_monitor(str(attempt.folder), state) is state
    assert not (attempt.folder / "supervisor.log").exists()
    assert monitor.ensure_monitor(str(attempt.folder / "gone"), {"state": "running", "boot_id": state["boot_id"]})[
        "state"] == "running"
