"""The monitor's resume (RankLogs's journal: offsets and the last batch found again in the log)
and the survivor's exit file, as pure file operations: no process is started."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from clusterrun.agent.monitor import EXIT_FILE, read_exit
from clusterrun.agent.ranklogs import RankLogs, resume_offsets
from clusterrun.agent.survivor import exit_record
from tests.conftest import wait_for


def rank_file(root: Path, local: int, name: str = "stdout.log") -> Path:
    path = root / "run" / "attempt_0" / str(local) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def open_log(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)


def test_a_monitor_killed_between_batches_resumes_where_it_stopped(tmp_path: Path) -> None:
    root, log, journal = tmp_path / "torchrun", tmp_path / "output.log", str(tmp_path / "ranklogs.json")
    r0, r1 = rank_file(root, 0), rank_file(root, 1, "stderr.log")
    fd = open_log(log)
    logs = RankLogs(str(root), fd, first_rank=2, journal=journal)
    append(r0, b"a0\na1\npart")
    append(r1, b"b0\n")
    logs.poll()
    logs.close()  # killed here: the partial line was read but not passed on
    append(r0, b"ial\n")
    append(r1, b"b1\n")
    os.write(fd, b"torchrun's own line\n")
    resumed = RankLogs(str(root), fd, first_rank=2, journal=journal)
    resumed.poll(final=True)
    resumed.close()
    os.close(fd)
    assert log.read_bytes() == (b"[rank2]:a0\n[rank2]:a1\n[rank3]:b0\ntorchrun's own line\n"
                                b"[rank2]:partial\n[rank3]:b1\n")


def test_a_ranks_stdout_and_stderr_are_passed_on_in_the_order_it_wrote_them(tmp_path: Path) -> None:
    """Two files per rank: within a batch the one written last goes last, stdout first on a tie."""
    root, log = tmp_path / "torchrun", tmp_path / "output.log"
    out, err = rank_file(root, 0), rank_file(root, 0, "stderr.log")
    fd = open_log(log)
    logs = RankLogs(str(root), fd, first_rank=0)
    append(out, b"epoch 3\n")
    append(err, b"Traceback\n")
    os.utime(out, ns=(1_000, 1_000))
    os.utime(err, ns=(2_000, 2_000))  # the traceback came after the print
    logs.poll()
    append(err, b"warning\n")
    append(out, b"epoch 4\n")
    os.utime(err, ns=(3_000, 3_000))
    os.utime(out, ns=(4_000, 4_000))  # the warning came first
    logs.poll()
    append(out, b"epoch 5\n")
    append(err, b"Error\n")
    os.utime(out, ns=(5_000, 5_000))
    os.utime(err, ns=(5_000, 5_000))  # the same clock tick: stdout first
    logs.poll(final=True)
    logs.close()
    os.close(fd)
    assert log.read_bytes().splitlines() == [b"[rank0]:epoch 3", b"[rank0]:Traceback", b"[rank0]:warning",
                                             b"[rank0]:epoch 4", b"[rank0]:epoch 5", b"[rank0]:Error"]


def test_a_batch_written_but_not_recorded_is_not_written_again(tmp_path: Path) -> None:
    root, log, journal = tmp_path / "torchrun", tmp_path / "output.log", str(tmp_path / "ranklogs.json")
    r0 = rank_file(root, 0)
    fd = open_log(log)
    logs = RankLogs(str(root), fd, first_rank=0, journal=journal)
    append(r0, b"one\n")
    logs.poll()
    append(r0, b"two\nthree\n")
    logs.poll()  # the journal names this batch before it is written; the offsets after it are not recorded
    logs.close()
    os.write(fd, b"torchrun, meanwhile\n")  # the batch need not be the log's last bytes
    assert resume_offsets(journal, str(root), fd, 0) == {"run/attempt_0/0/stdout.log": len(b"one\ntwo\nthree\n")}
    os.close(fd)


def test_a_batch_recorded_but_never_written_is_written_once(tmp_path: Path) -> None:
    root, log, journal = tmp_path / "torchrun", tmp_path / "output.log", str(tmp_path / "ranklogs.json")
    r0 = rank_file(root, 0)
    fd = open_log(log)
    logs = RankLogs(str(root), fd, first_rank=0, journal=journal)
    append(r0, b"one\n")
    logs.poll()
    logs.close()
    append(r0, b"two\n")
    record = json.loads(Path(journal).read_text())  # killed after the journal, before the write:
    record.update(done={"run/attempt_0/0/stdout.log": 4}, batch=[["run/attempt_0/0/stdout.log", 4, 8, False]],
                  log_start=os.fstat(fd).st_size)
    Path(journal).write_text(json.dumps(record))
    resumed = RankLogs(str(root), fd, first_rank=0, journal=journal)
    resumed.poll()
    resumed.close()
    os.close(fd)
    assert log.read_bytes() == b"[rank0]:one\n[rank0]:two\n"


def test_no_journal_or_a_damaged_one_starts_from_the_beginning(tmp_path: Path) -> None:
    fd = open_log(tmp_path / "output.log")
    assert resume_offsets(str(tmp_path / "missing.json"), str(tmp_path), fd, 0) == {}
    (tmp_path / "bad.json").write_text('{"done": {"a": 1}, "batch": [["a"')
    assert resume_offsets(str(tmp_path / "bad.json"), str(tmp_path), fd, 0) == {}
    os.close(fd)


def test_the_exit_file_holds_a_code_or_a_signal_and_nothing_else_counts(tmp_path: Path) -> None:
    assert read_exit(str(tmp_path)) is None
    (tmp_path / EXIT_FILE).write_text(json.dumps(exit_record(3 << 8, 42)))
    assert read_exit(str(tmp_path)) == {"exit_code": 3, "signal": None}
    (tmp_path / EXIT_FILE).write_text(json.dumps(exit_record(signal.SIGKILL, 42)))
    assert read_exit(str(tmp_path)) == {"exit_code": -9, "signal": 9}
    (tmp_path / EXIT_FILE).write_text('{"exit_code": nul')
    assert read_exit(str(tmp_path)) is None
    (tmp_path / EXIT_FILE).write_text('{"exit_code": null}')
    assert read_exit(str(tmp_path)) is None


def test_an_unknown_exit_status_is_a_lost_node_named_as_lost_never_as_a_failure_of_torchrun() -> None:
    from clusterrun.core.events import NodeState
    from clusterrun.core.protocol import decode_status
    from clusterrun.diagnose.rootcause import NodeLog, find_root_cause
    from clusterrun.run.orchestrator import node_state_of

    unknown = decode_status("h", {"state": "exited", "exit_code": None, "exit_status": "unknown",
                                  "error": "torchrun's exit status is unknown: the survivor ... ended first"})
    assert unknown.exit_unknown and node_state_of(unknown) is NodeState.LOST
    known = decode_status("h", {"state": "exited", "exit_code": 0})
    assert node_state_of(known) is NodeState.SUCCEEDED
    root = find_root_cause({0: "a", 1: "b"}, {0: NodeLog(), 1: NodeLog()}, {0: unknown, 1: known}, set())
    assert root is not None and root.lost and root.exit_code is None and root.signal is None
    assert root.describe() == "node 0 (a): torchrun's exit status is unknown: the survivor ... ended first"


def test_without_an_exit_file_torchruns_exit_is_learned_from_its_ranks_ends(tmp_path: Path) -> None:
    from clusterrun.agent.monitor import learned_exit

    unreaped = " (torchrun's own exit was not recorded: its survivor was killed)"
    ended = [{"rank": 0, "pid": 1, "died": 2.0, "exit_code": 0}, {"rank": 1, "pid": 2, "died": 1.0, "exit_code": 0}]
    assert learned_exit(ended, str(tmp_path)) == {"exit_code": 0, "signal": None,
                                                  "exit_learned": "every rank exited 0" + unreaped}
    failed = [dict(ended[0], exit_code=3, died=5.0), dict(ended[1], exit_code=-9, died=4.0)]
    assert learned_exit(failed, str(tmp_path))["exit_learned"] == "rank 1 exited -9" + unreaped  # type: ignore[index]
    partly = [ended[0], {"rank": 1, "pid": 2, "died": 1.0}]  # reaped before its exit was read
    assert learned_exit(partly, str(tmp_path)) is None
    (tmp_path / "output.log").write_text("[rank0]:rank : 7\ntorch...ChildFailedError:\nFailures:\n"
                                         "  <NO_OTHER_FAILURES>\nRoot Cause (first observed failure):\n[0]:\n"
                                         "  rank      : 1 (local_rank: 0)\n  exitcode  : 2 (pid: 4242)\n")
    assert learned_exit(partly, str(tmp_path)) == {
        "exit_code": 1, "signal": None, "exit_learned": "torchrun's failure report: rank 1 exited 2" + unreaped}


def test_the_first_failure_is_the_first_rank_to_end_non_zero_or_unread_before_torchruns_sigterm(
        tmp_path: Path) -> None:
    from clusterrun.agent.monitor import FAILED_STOP, failed_first, first_failure

    def worker(rank: int, died: float, code: int | None) -> dict[str, object]:
        return {"rank": rank, "local_rank": rank, "pid": 100 + rank, "died": died, "exit_code": code}

    done, failed, stopped = worker(0, 1.0, None), worker(1, 5.0, 3), worker(2, 6.0, -signal.SIGTERM)
    assert first_failure([done, failed, stopped]) == failed  # an unread end before a known failure: not it
    unread = worker(1, 5.0, None)  # torchrun reaped it before its exit was read, then SIGTERMed rank 2
    assert first_failure([done, unread, stopped]) == unread  # the last unread end before the SIGTERM
    assert first_failure([done, unread, worker(2, 5.0, -signal.SIGTERM)]) == unread  # seen together
    assert first_failure([done, worker(1, 7.0, None), stopped]) == stopped  # it ended after: torchrun's stop
    assert first_failure([done, unread]) is None  # no failure known at all
    (tmp_path / "stop").write_text(FAILED_STOP)
    assert failed_first([done, unread, stopped], str(tmp_path)) == {
        "exit_code": 1, "signal": None, "failed_rank": 1,
        "exit_learned": "rank 1 ended first, its exit code unread (torchrun reaped it first); "
                        "torchrun was stopped at once after it"}


def test_a_workers_exit_is_read_while_it_is_a_zombie() -> None:
    import subprocess
    import sys

    from clusterrun.agent.procs import ExitReader, PidHandle, zombie_exit

    reader = ExitReader()
    reader.start()
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read(); sys.exit({code})"],
                              stdin=subprocess.PIPE) for code in (0, 3)]
    try:
        for proc in procs:
            reader.watch(proc.pid)
        handles = [PidHandle(proc.pid) for proc in procs]
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()  # it exits; unreaped (we do not wait yet): a zombie
        for handle in handles:
            assert handle.wait(30)
        assert [zombie_exit(p.pid) for p in procs] == [0, 3]
        wait_for(lambda: len(reader.codes) == 2, timeout=10, what="the reader to read both exits")
        assert reader.codes == {procs[0].pid: 0, procs[1].pid: 3}
    finally:
        reader.close()
        for proc in procs:
            proc.wait()
    assert zombie_exit(procs[0].pid) is None  # reaped


def test_a_stop_without_records_says_what_found_the_processes_or_where_it_looked() -> None:
    from clusterrun.core.protocol import stop_report
    from clusterrun.views.printer import stop_text

    found = stop_report("gpu-a", 0, {
        "ok": True, "killed": [{"pid": 7, "name": "torchrun", "signal": "SIGTERM"}], "left": [],
        "containment": "cgroup", "verified": True, "records_gone": True,
        "found_by": ["cgroup /sys/fs/cgroup/clusterrun-j-n0-a1 found by name"]})
    text = stop_text(found)
    assert "records on the host were gone" in text and "found by name" in text and "verified" in text
    nothing = stop_report("gpu-a", 0, {"ok": True, "killed": [], "left": [], "records_gone": True, "found_by": [],
                                                  "looked": ["cgroups named x", "processes carrying M"]})
    assert "nothing was running" not in stop_text(nothing)
    assert "looked for cgroups named x and processes carrying M" in stop_text(nothing)


def test_the_journal_is_rewritten_in_place_and_a_shorter_record_still_resumes(tmp_path: Path) -> None:
    """Written for every batch: the same file (not a new one renamed over it, which ext4 writes out
    at once); a record shorter than the one before is read without the rest of the longer one."""
    root, log, journal = tmp_path / "torchrun", tmp_path / "output.log", str(tmp_path / "ranklogs.json")
    ranks = [rank_file(root, local) for local in range(4)]
    fd = open_log(log)
    logs = RankLogs(str(root), fd, first_rank=0, journal=journal)
    for path in ranks:  # a long record: a batch of four files
        append(path, b"first\n")
    logs.poll()
    inode = os.stat(journal).st_ino
    append(ranks[0], b"second\n")  # a short one: a batch of one file
    logs.poll()
    logs.close()
    assert os.stat(journal).st_ino == inode
    done = {f"run/attempt_0/{local}/stdout.log": len(b"first\n") for local in range(4)}
    assert resume_offsets(journal, str(root), fd, 0) == {**done, "run/attempt_0/0/stdout.log": len(b"first\nsecond\n")}
    os.close(fd)


def test_a_journal_record_longer_than_a_page_is_renamed_into_place(tmp_path: Path) -> None:
    """A kill between two pages of a write in place would leave a torn record (every line merged
    again on resume): more than a page goes to a new file renamed over the old."""
    root, log, journal = tmp_path / "torchrun", tmp_path / "output.log", str(tmp_path / "ranklogs.json")
    ranks = [rank_file(root, local) for local in range(128)]
    fd = open_log(log)
    logs = RankLogs(str(root), fd, first_rank=0, journal=journal)
    append(ranks[0], b"first\n")
    logs.poll()
    inode = os.stat(journal).st_ino
    for path in ranks:
        append(path, b"more\n")
    logs.poll()
    logs.close()
    assert os.path.getsize(journal) > 4096 and os.stat(journal).st_ino != inode
    done = {f"run/attempt_0/{local}/stdout.log": len(b"more\n") for local in range(1, 128)}
    assert resume_offsets(journal, str(root), fd, 0) == {**done, "run/attempt_0/0/stdout.log": len(b"first\nmore\n")}
    os.close(fd)


def test_a_rank_file_made_while_the_monitor_sleeps_is_found_by_its_waker(tmp_path: Path) -> None:
    """With every directory watched, the tree is listed again only when inotify says something was
    made in it: the new rank's lines come through all the same."""
    from clusterrun.agent.waker import Waker

    root, log = tmp_path / "torchrun", tmp_path / "output.log"
    r0 = rank_file(root, 0)
    fd = open_log(log)
    waker = Waker()
    logs = RankLogs(str(root), fd, first_rank=0, waker=waker)
    append(r0, b"zero\n")
    logs.poll()
    assert waker.reliable and not waker.created
    r1 = rank_file(root, 1)  # a new directory and file, below watched ones
    append(r1, b"one\n")
    waker.wait(5.0)
    logs.poll()
    logs.close()
    waker.close()
    os.close(fd)
    assert log.read_bytes() == b"[rank0]:zero\n[rank1]:one\n"
