"""`clusterrun up` end to end on local hosts: real torchrun, real gloo, real processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    ROOT,
    SUPPORT,
    alive,
    job_id_of,
    marked,
    run_up,
    up_argv,
    wait_for,
    write_hosts,
)

pytestmark = pytest.mark.integration


def rank_lines(stdout: str) -> dict[int, str]:
    """`node1 local-b rank3 | rank=3 local_rank=1 ...` → {3: 'rank=3 local_rank=1 ...'}."""
    found: dict[int, str] = {}
    for line in stdout.splitlines():
        m = re.match(r"^node(\d+) (\S+) +rank(\d+) +\| (rank=.*)$", line)
        if m:
            rank = int(m.group(3))
            assert rank not in found, f"rank {rank} reported twice"
            found[rank] = f"node{m.group(1)} {m.group(4)}"
    return found


def test_two_nodes_two_procs_ranks_and_allreduce(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [2, 2], state_dir)
    proc = run_up(hosts, "examples/allreduce.py")
    assert proc.returncode == 0, proc.stderr
    ranks = rank_lines(proc.stdout)
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, text in ranks.items():
        node, local = divmod(rank, 2)
        assert text.startswith(f"node{node} rank={rank} local_rank={local} world_size=4 node_rank={node} "), text
    # 1 + 2 + 3 + 4: every rank prints the all-reduced sum
    assert proc.stdout.count("allreduce sum=10 expected=10 OK") == 4
    assert "succeeded" in proc.stderr


def test_uneven_nodes(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 3], state_dir)
    proc = run_up(hosts, "examples/allreduce.py")
    assert proc.returncode == 0, proc.stderr
    ranks = rank_lines(proc.stdout)
    assert sorted(ranks) == [0, 1, 2, 3]
    expected = {0: (0, 0), 1: (1, 0), 2: (1, 1), 3: (1, 2)}  # rank → (node, local rank)
    for rank, (node, local) in expected.items():
        assert ranks[rank].startswith(f"node{node} rank={rank} local_rank={local} world_size=4 node_rank={node}")
    assert proc.stdout.count("allreduce sum=10 expected=10 OK") == 4


def test_demo_training_agrees(tmp_path: Path, state_dir: Path) -> None:
    """gloo itself sometimes aborts a rank while the ranks connect (pytorch/pytorch#188266, about 1 run
    in 10 here): clusterrun retries that once by itself, so the demo must succeed."""
    hosts = write_hosts(tmp_path, [2, 2], state_dir)
    proc = run_up(hosts, "examples/train.py", "--", "--epochs", "2", "--samples", "512")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^node0 local-a +rank0 +\| parameters agree across 4 ranks: checksum=", proc.stdout, re.M)
    for rank in range(4):
        assert re.search(rf"rank{rank} +\| RANK={rank} LOCAL_RANK={rank % 2} WORLD_SIZE=4 NODE_RANK={rank // 2}",
                         proc.stdout)


def test_a_transient_start_up_abort_is_retried_once_visibly(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    proc = run_up("--grace", "3", hosts, SUPPORT / "abort_once.py", tmp_path / "aborted")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "aborted").exists()
    assert "attempt 1 failed at start-up: gloo aborted a rank" in proc.stderr
    assert "retrying once as attempt 2" in proc.stderr
    assert sorted(re.findall(r"rank (\d) sum=2$", proc.stdout, re.M)) == ["0", "1"], proc.stdout
    job = job_id_of(proc.stderr)
    shown = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "--json", job], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    attempts = json.loads(shown.stdout)["jobs"][0]["attempts"]
    assert [a["state"] for a in attempts] == ["failed", "succeeded"], attempts
    assert "terminate called" in (attempts[0]["root_cause"] or "") or "SIGABRT" in (attempts[0]["root_cause"] or "")
    again = run_up("--no-retry-startup", hosts, SUPPORT / "abort_once.py", tmp_path / "aborted-2")
    assert again.returncode == 1 and "retrying" not in again.stderr, again.stderr


def test_failing_rank_fails_fast_and_names_root_cause(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [2, 2], state_dir)
    # Without fail-fast the other ranks would wait in their all-reduce for gloo's 30-minute timeout:
    # run_up's own deadline (120 s) fails the test then.
    proc = run_up("--grace", "3", hosts, "tests/_support/fail_rank.py", "3", "exit", "3")
    assert proc.returncode == 1, proc.stderr
    assert "root cause: rank 3 on node 1 (local-b, local rank 1): exit code 3" in proc.stderr
    assert "last lines of rank 3:\n    rank 3 ready\n    rank 3 is about to fail" in proc.stderr
    assert marked(job_id_of(proc.stderr)) == []


def test_exception_without_record_is_the_root_cause(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 3], state_dir)
    proc = run_up("--grace", "3", hosts, "tests/_support/fail_rank.py", "2", "raise", "custom failure 42")
    assert proc.returncode == 1, proc.stderr
    cause = re.search(r"root cause: (.*)", proc.stderr)
    assert cause and cause.group(1) == "rank 2 on node 1 (local-b, local rank 1): exit code 1: " \
                                       "RuntimeError: custom failure 42", proc.stderr
    assert "last lines of rank 2:" in proc.stderr
    assert "    RuntimeError: custom failure 42" in proc.stderr


def _attempt_dirs(state_dir: Path, job: str) -> list[Path]:
    return sorted((state_dir / "jobs" / job).glob("node*/attempt1"))


@pytest.mark.fake_torchrun
def test_job_survives_sigkill_of_up(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    with subprocess.Popen(up_argv(hosts, SUPPORT / "counter.py", "40", "0.1"), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        job = job_id_of(proc.stderr.readline())
        wait_for(lambda: "line 5" in "".join(p.read_text() for p in _attempt_dirs(state_dir, job)
                                             for p in [p / "output.log"] if p.exists()),
                 timeout=60, what="the job to print")
        proc.kill()
    for attempt in _attempt_dirs(state_dir, job):
        state = wait_for(lambda a=attempt: _final_state(a), timeout=60, what="the job to finish")
        assert state["exit_code"] == 0
        log = (attempt / "output.log").read_text()
        rank = int(attempt.parent.name[4:])  # one process per node: rank == node
        assert [f"[rank{rank}]:rank {rank} line {i}" for i in range(40)] + [f"[rank{rank}]:rank {rank} done"] == [
            line for line in log.splitlines() if line.startswith(f"[rank{rank}]:")]
    assert len(_attempt_dirs(state_dir, job)) == 2
    assert marked(job) == []


def _final_state(attempt: Path) -> dict | None:
    try:
        state = json.loads((attempt / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if state.get("state") == "exited" else None


@pytest.mark.fake_torchrun
def test_sigint_stops_everything(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [2, 2], state_dir)
    proc = subprocess.Popen(up_argv("--grace", "3", hosts, SUPPORT / "counter.py", "1000", "0.1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    wait_for(lambda: "line 3" in proc.stdout.readline(), timeout=60, what="output")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    job = job_id_of(err)
    assert err.count("nothing left (verified by cgroup)") == 2, err
    assert marked(job) == []
    for attempt in _attempt_dirs(state_dir, job):
        state = json.loads((attempt / "state.json").read_text())
        assert state["state"] == "exited" and state["stop_requested"]


@pytest.mark.fake_torchrun
def test_hostile_children_are_all_stopped(tmp_path: Path, state_dir: Path) -> None:
    piddir = tmp_path / "pids"
    piddir.mkdir()
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    proc = subprocess.Popen(up_argv("--grace", "2", hosts, SUPPORT / "hostile.py", piddir), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kinds = ["worker", "setsid", "env-i", "grandchild"]
    expected = {f"rank{r}-{k}.pid" for r in range(3) for k in kinds}
    wait_for(lambda: expected <= {p.name for p in piddir.iterdir()}, timeout=90, what="all hostile processes")
    pids = {name: tuple(map(int, (piddir / name).read_text().split())) for name in expected}
    assert all(alive(pid, started) for pid, started in pids.values())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    survivors = [name for name, (pid, started) in pids.items() if alive(pid, started)]
    assert survivors == []
    assert err.count("nothing left (verified by cgroup)") == 2, err
    assert "STILL RUNNING" not in err


@pytest.mark.fake_torchrun
def test_two_jobs_stopping_one_leaves_the_other(tmp_path: Path, state_dir: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hosts_a = write_hosts(tmp_path / "a", [1, 1], state_dir)
    hosts_b = write_hosts(tmp_path / "b", [1, 1], state_dir)
    # two names: of two `up`s of one name started at once, the later may find the other's record
    # and refuse (a name means at most one unfinished job)
    a = subprocess.Popen(up_argv("--name", "a", "--grace", "2", hosts_a, SUPPORT / "counter.py", "1000", "0.05"),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen(up_argv("--name", "b", "--grace", "2", hosts_b, SUPPORT / "counter.py", "150", "0.05"),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert a.stdout is not None and b.stdout is not None
    wait_for(lambda: "line 2" in a.stdout.readline(), timeout=60, what="job a output")
    wait_for(lambda: "line 2" in b.stdout.readline(), timeout=60, what="job b output")
    a.send_signal(signal.SIGINT)
    _, err_a = a.communicate(timeout=60)
    assert a.returncode == 130, err_a
    job_a = job_id_of(err_a)
    assert marked(job_a) == []
    b_out, err_b = b.communicate(timeout=120)
    assert b.returncode == 0, err_b
    job_b = job_id_of(err_b)
    assert job_b != job_a
    for rank in (0, 1):  # job b ran to its end, untouched: every line is in its log
        assert f"rank {rank} done" in b_out
        log = (state_dir / "jobs" / job_b / f"node{rank}" / "attempt1" / "output.log").read_text()
        assert [f"[rank{rank}]:rank {rank} line {i}" for i in range(150)] + [f"[rank{rank}]:rank {rank} done"] == [
            line for line in log.splitlines() if line.startswith(f"[rank{rank}]:")]

HOSTILE_ARGS = ["--", "a b", "it's", '"quoted"', "x; touch {canary}", "$(touch {canary})", "`touch {canary}`",
                "$HOME", "new\nline", "*", ""]


def test_arguments_and_env_arrive_verbatim(tmp_path: Path, state_dir: Path) -> None:
    canary = tmp_path / "canary"
    args = [a.format(canary=canary) for a in HOSTILE_ARGS]
    value = f"v; touch {canary} $(touch {canary}) 'q' \"d\" $HOME"
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra=f"env:\n  FROM_FILE: {json.dumps(value)}\n")
    proc = run_up("--env", f"FROM_CLI={value}", "--env", "ECHO_ENV=FROM_CLI,FROM_FILE,TORCHELASTIC_RUN_ID", hosts,
                  SUPPORT / "echo_args.py", "--", *args)
    assert proc.returncode == 0, proc.stderr
    echoed = [line.split("ECHO ", 1)[1] for line in proc.stdout.splitlines() if "| ECHO " in line]
    assert len(echoed) == 1
    data = json.loads(echoed[0])
    assert data["argv"] == args
    assert data["env"] == {"FROM_CLI": value, "FROM_FILE": value, "TORCHELASTIC_RUN_ID": job_id_of(proc.stderr)}
    assert not canary.exists()
    assert not os.path.exists("x; touch")


@pytest.mark.fake_torchrun
def test_a_ranks_traceback_comes_after_what_it_printed_before(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1], state_dir)
    script = tmp_path / "crash.py"
    script.write_text("for step in range(3):\n    print(f'step {step}')\nraise ValueError('boom')\n")
    proc = run_up(hosts, script)
    assert proc.returncode == 1, proc.stderr
    lines = [line.split("| ", 1)[1] for line in proc.stdout.splitlines() if "rank0 | " in line]
    assert lines[:4] == ["step 0", "step 1", "step 2", "Traceback (most recent call last):"], lines
    assert lines[-1] == "ValueError: boom", lines


@pytest.mark.fake_torchrun
def test_a_rank_that_alternates_stdout_and_stderr_is_shown_in_the_order_it_wrote(tmp_path: Path,
                                                                                 state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [2], state_dir)
    script = tmp_path / "alternate.py"
    script.write_text("import sys\nfor i in range(300):\n    print(f'out {i}')\n"
                      "    print(f'err {i}', file=sys.stderr)\n")
    proc = run_up(hosts, script)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        lines = [line.split("| ", 1)[1] for line in proc.stdout.splitlines() if f"rank{rank} | " in line]
        assert lines == [f"{stream} {i}" for i in range(300) for stream in ("out", "err")], lines[:10]


@pytest.mark.fake_torchrun
def test_lines_are_never_split_or_mixed_under_a_flood(tmp_path: Path, state_dir: Path) -> None:
    """Workers print as fast as they can; every line arrives whole, in order, once, with its rank."""
    hosts = write_hosts(tmp_path, [2, 2], state_dir)
    proc = run_up(hosts, SUPPORT / "counter.py", "3000", "0")
    assert proc.returncode == 0, proc.stderr
    job = job_id_of(proc.stderr)
    for rank in range(4):
        expected = [f"rank {rank} line {i}" for i in range(3000)] + [f"rank {rank} done"]
        printed = [line.split("| ", 1)[1] for line in proc.stdout.splitlines()
                   if re.match(rf"^node{rank // 2} local-{'ab'[rank // 2]} +rank{rank} +\| ", line)]
        assert printed == expected
        log = (state_dir / "jobs" / job / f"node{rank // 2}" / "attempt1" / "output.log").read_text()
        assert [line for line in log.splitlines() if line.startswith(f"[rank{rank}]:")] == [
            f"[rank{rank}]:{text}" for text in expected]
    assert not re.search(r"\[rank\d\]:.*\[rank\d\]:", proc.stdout)


def interrupted(argv: list[str], stuck: Callable[[], None], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` (with ``env``), Ctrl-C it once ``stuck()`` returned; its exit code and stderr. A
    command still running 30 s later (far below the stalled hosts' ConnectTimeout, 300 s) fails the test."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env=env) as proc:  # its pipes closed, also when it fails: not left to a later test
        try:
            stuck()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, err


def _gone(pid: int) -> bool:
    """``pid`` has exited (a zombie counts: its parent may not have reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.fake_torchrun
def test_ctrl_c_while_connecting_exits_130_and_starts_nothing(tmp_path: Path, state_dir: Path,
                                                              controller_state: Path) -> None:
    """A host that never answers the probe (its `python` sleeps): Ctrl-C ends `up` with 130 at
    once, closes the connection (the silent process is gone) and starts nothing."""
    pid_file = tmp_path / "silent.pid"
    hosts = write_hosts(tmp_path, [1], state_dir, extra=f"    python: {SUPPORT / 'silent_python.sh'}\n")

    def probing() -> None:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=30, what="the probe to start")

    code, err = interrupted(up_argv(hosts, SUPPORT / "counter.py", "3", "0.01"), probing,
                            env=dict(os.environ, SILENT_PID_FILE=str(pid_file)))
    silent = int(pid_file.read_text())
    assert code == 130, err
    assert "interrupted while connecting to the hosts, copying files or checking them; nothing was started" in err
    assert "Traceback" not in err
    wait_for(lambda: _gone(silent), timeout=10, what="the silent interpreter to be gone")
    assert not (state_dir / "jobs").exists() and not (controller_state / "clusterrun" / "jobs").exists()


@contextlib.contextmanager
def stalled_hosts(tmp_path: Path, state_dir: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A hosts file of two hosts that never let an SSH connection finish, with ConnectTimeout 300:
    `silent` accepts the TCP connection and says nothing (paramiko waits for its banner),
    `dropping` drops the SYN (a full accept queue: the TCP connect waits); and a function that
    returns once a command is stuck on both."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.settimeout(60)
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    held = []
    try:
        for _ in range(2):  # never accepted: the queue (backlog 0: one) is full, the next SYN dropped
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(full.getsockname())
            held.append(filler)
        config = tmp_path / "ssh_config"
        config.write_text("".join(f"Host {name}\n  HostName 127.0.0.1\n  Port {sock.getsockname()[1]}\n"
                                  "  ConnectTimeout 300\n  UserKnownHostsFile /dev/null\n"
                                  for name, sock in (("silent", silent), ("dropping", full))))
        hosts = tmp_path / "hosts.yaml"
        hosts.write_text(f"state_dir: {state_dir}\nssh_config: {config}\nhosts:\n  - host: silent\n"
                         "  - host: dropping\n")

        def stuck() -> None:
            held.append(silent.accept()[0])  # a TCP connection that waits for the banner
            wait_for(lambda: _syn_sent_to(full.getsockname()[1]), timeout=60, what="the dropped SYN")

        yield hosts, stuck
    finally:
        for sock in (silent, full, *held):
            sock.close()


def _syn_sent_to(port: int) -> bool:
    """A TCP connect to ``port`` on this machine waits for its SYN's answer (/proc/net/tcp state 02)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "02" and int(fields[2].split(":")[1], 16) == port:
            return True
    return False


def test_ctrl_c_while_ssh_connects_exits_at_once(tmp_path: Path, state_dir: Path) -> None:
    """`up`'s connections to hosts that never let them finish: Ctrl-C ends it with 130 at once."""
    with stalled_hosts(tmp_path, state_dir) as (hosts, stuck):
        code, err = interrupted(up_argv(hosts, SUPPORT / "counter.py", "3", "0.01"), stuck)
    assert code == 130, err
    assert "interrupted while connecting to the hosts, copying files or checking them; nothing was started" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["ps", "--hosts"], ["doctor"]])
def test_ctrl_c_while_a_command_asks_stalled_hosts_exits_at_once(tmp_path: Path, state_dir: Path,
                                                                  command: list[str]) -> None:
    """`ps --hosts` (it asks every host for its jobs) and `doctor` on hosts that never let the SSH
    connection finish: Ctrl-C ends them with 130 at once, one line, no traceback."""
    with stalled_hosts(tmp_path, state_dir) as (hosts, stuck):
        code, err = interrupted([sys.executable, "-m", "clusterrun", *command, str(hosts)], stuck)
    assert code == 130, err
    assert err == "clusterrun: interrupted\n"


def test_setup_runs_after_the_sync_and_sees_its_files(tmp_path: Path, state_dir: Path) -> None:
    """Issue 25: the hosts' `setup:` runs once the project is copied (it may install what was synced)."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("import os\nprint('env', os.environ.get('FROM_SETUP'))\n")
    (project / "requirements.txt").write_text("nothing\n")
    workdir = tmp_path / "work"
    hosts = write_hosts(tmp_path, [1], state_dir, extra=f"    workdir: {workdir}\n    sync: {project}\n"
                        "    setup: test -f requirements.txt && export FROM_SETUP=after-sync\n")
    proc = run_up(hosts, "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "env after-sync" in proc.stdout, proc.stdout
