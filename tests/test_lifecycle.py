"""Job lifecycle on local hosts: `up -d`, `ps`, `logs`, `attach`, `down`, `restart`, with real torchrun.

The controller side (``up``, the monitor) is killed with SIGKILL at will; the jobs must not care.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened
from tests.conftest import (
    ROOT,
    SUPPORT,
    alive,
    job_id_of,
    marked,
    monitors,
    run_up,
    start_time,
    unique_job,
    up_argv,
    wait_for,
    write_hosts,
)
from tests.simhosts import unavailable
from tests.simnet import children

pytestmark = pytest.mark.integration


def clusterrun(*args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def up_detached(*args: str | os.PathLike[str]) -> str:
    proc = clusterrun("up", "-d", *args)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    assert f"clusterrun: job {job} started" in proc.stderr
    return job


def ps_json(job: str) -> dict[str, Any]:
    proc = clusterrun("ps", "--json", job)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["jobs"][0]  # type: ignore[no-any-return]


def wait_state(job: str, *states: str, timeout: float = 90) -> dict[str, Any]:
    return wait_for(lambda: (r := ps_json(job))["state"] in states and r, timeout=timeout, interval=0.5,
                    what=f"job {job} to be {'/'.join(states)}")


def attempt_dir(state_dir: Path, job: str, node: int, attempt: int = 1) -> Path:
    return state_dir / "jobs" / job / f"node{node}" / f"attempt{attempt}"


def host_state(state_dir: Path, job: str, node: int, attempt: int = 1) -> dict[str, Any]:
    return json.loads((attempt_dir(state_dir, job, node, attempt) / "state.json").read_text())


def counter_lines(rank: int, count: int) -> list[str]:
    return [f"[rank{rank}]:rank {rank} line {i}" for i in range(count)] + [f"[rank{rank}]:rank {rank} done"]


def rank_lines(log: str, rank: int) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(f"[rank{rank}]:")]


def kill_monitors(home: Path) -> list[int]:
    """Kill the controller's monitors; wait until they and the agents they had started have ended (a
    follow agent that outlived its monitor could start the host's supervisor again as it looks)."""
    pids = monitors(home)
    found = children()
    agents = [(child, start_time(child)) for pid in pids for child in found.get(pid, [])]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not monitors(home), timeout=10, what="the monitors to die")
    wait_for(lambda: not [p for p, began in agents if began is not None and alive(p, began)], timeout=30,
             what="the monitors' agents to end")
    return pids


def test_detached_job_outlives_every_controller_process(tmp_path: Path, state_dir: Path,
                                                        controller_state: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "80", "0.05")
    assert ps_json(job)["state"] in ("starting", "running")
    # `up -d` has returned; its monitor is the only clusterrun process left on the controller.
    assert kill_monitors(controller_state)
    assert marked(job), "the job must still run on its hosts"
    record = ps_json(job)  # nobody owns the job: ps reconciles it with the hosts and starts a monitor
    assert record["state"] == "running" and [n["state"] for n in record["nodes"]] == ["running", "running"]
    wait_for(lambda: monitors(controller_state), timeout=10, what="a new monitor")
    for node in (0, 1):
        proc = subprocess.run([sys.executable, "-m", "clusterrun", "logs", "-f", "--node", str(node), job],
                              capture_output=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        on_host = (attempt_dir(state_dir, job, node) / "output.log").read_bytes()
        assert hashlib.sha256(proc.stdout).hexdigest() == hashlib.sha256(on_host).hexdigest()
        assert rank_lines(on_host.decode(), node) == counter_lines(node, 80)
    record = wait_state(job, "succeeded")
    assert [(n["state"], n["exit_code"]) for n in record["nodes"]] == [("succeeded", 0), ("succeeded", 0)]
    listing = clusterrun("ps")
    assert job in listing.stdout and "succeeded" in listing.stdout
    # The finished job's logs stay readable, whole and with prefixes, from a fresh controller.
    logs = clusterrun("logs", job)
    assert logs.returncode == 0
    assert "node1 local-b rank1 | rank 1 line 79" in logs.stdout.replace("  ", " ")


@pytest.mark.fake_torchrun
def test_controller_sigkilled_at_random_moments(tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}")
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    jobs = []
    for run in range(10):
        proc = subprocess.Popen(up_argv(hosts, SUPPORT / "counter.py", "20", "0.05"), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        job = job_id_of(proc.stderr.readline())  # printed once the job's record exists
        time.sleep(rng.uniform(0, 1.5))  # during the start, the run, or after the end
        proc.kill()
        proc.wait()
        proc.stderr.close()
        jobs.append(job)
        kill_monitors(controller_state)  # up -d's monitor, if `up` had time to hand over to one
        # What a user does on coming back: `logs -f` reconciles, restarts the owner, and follows.
        logs = clusterrun("logs", "-f", job, timeout=120)
        assert logs.returncode == 0, f"run {run} (seed {seed}): {logs.stderr}"
        record = wait_state(job, "succeeded", "failed", "stopped", "lost")
        assert record["state"] == "succeeded", f"run {run} (seed {seed}): {record}"
        attempt = record["attempt"]  # 2 after a start-up retry, whose first attempt printed nothing of its own
        for node in (0, 1):
            log = (attempt_dir(state_dir, job, node, attempt) / "output.log").read_text()
            assert rank_lines(log, node) == counter_lines(node, 20), f"run {run} (seed {seed}) node {node}: {record}"
    assert len(set(jobs)) == 10


def start_hostile(tmp_path: Path, state_dir: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """`up -d` of tests/_support/hostile.py on two local nodes (3 ranks); once every rank has made
    its hostile processes: the job and their (pid, start time) by pid file name."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    job = up_detached("--grace", "2", hosts, SUPPORT / "hostile.py", piddir)
    kinds = ["worker", "setsid", "env-i", "grandchild"]
    expected = {f"rank{r}-{k}.pid" for r in range(3) for k in kinds}
    wait_for(lambda: expected <= {p.name for p in piddir.iterdir()}, timeout=90, what="all hostile processes")
    return job, {name: tuple(map(int, (piddir / name).read_text().split())) for name in expected}  # type: ignore[misc]


@pytest.mark.fake_torchrun
def test_down_stops_everything_even_what_ignores_sigterm(tmp_path: Path, state_dir: Path) -> None:
    job, pids = start_hostile(tmp_path, state_dir)
    assert all(alive(pid, started) for pid, started in pids.values())
    down = clusterrun("down", job)
    assert down.returncode == 0, down.stderr
    assert [name for name, (pid, started) in pids.items() if alive(pid, started)] == []
    assert marked(job) == []
    assert down.stderr.count("nothing left (verified by cgroup)") == 2, down.stderr
    # rank 0 ignores SIGTERM, so node 0's torchrun waits for it: killed only once the grace is over
    assert re.search(r"^clusterrun: node0 local-a: stopped [^;]+; torchrun outlived the 2 s grace after SIGTERM: "
                     r"SIGKILLed; nothing left \(verified by cgroup\)$", down.stderr, re.M), down.stderr
    assert wait_state(job, "stopped")["nodes"][0]["state"] == "stopped"
    again = clusterrun("down", job)  # idempotent
    assert again.returncode == 0, again.stderr
    assert again.stderr == f"clusterrun: job {job} already finished (stopped); nothing to stop\n"


def test_down_of_one_job_leaves_the_other_intact(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    gate = tmp_path / "gate"  # b ends only once the test has seen it run on after a's down
    a = up_detached("--name", "a", hosts, SUPPORT / "counter.py", "1000", "0.05")
    b = up_detached("--name", "b", hosts, SUPPORT / "counter.py", "100", "0.05", gate)
    wait_for(lambda: "line 3" in clusterrun("logs", "--node", "0", b).stdout, timeout=60, what="job b output")
    down = clusterrun("down", "a")  # by name
    assert down.returncode == 0, down.stderr
    assert marked(a) == [] and marked(b)
    gate.touch()
    record = wait_state(b, "succeeded")
    assert record["attempt"] == 1
    for node in (0, 1):
        log = (attempt_dir(state_dir, b, node) / "output.log").read_text()
        assert rank_lines(log, node) == counter_lines(node, 100)
    assert ps_json(a)["state"] == "stopped"


def _attempt_of(pid: int) -> str | None:
    """The attempt directory a process of a job belongs to (torchrun's log dir is in its environment)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"PET_LOG_DIR="):
            return Path(item[len(b"PET_LOG_DIR="):].decode()).parent.name
    return None


@pytest.mark.fake_torchrun
def test_restart_twice_keeps_attempts_apart(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    for attempt in (1, 2):
        wait_for(lambda a=attempt: "line 3" in clusterrun("logs", "--node", "1", "--attempt", str(a), job).stdout,
                 timeout=60, what=f"attempt {attempt} output")
        proc = clusterrun("restart", job)
        assert proc.returncode == 0, proc.stderr
        assert f"restarted as attempt {attempt + 1}" in proc.stderr
        assert {_attempt_of(pid) for pid in marked(job)} == {f"attempt{attempt + 1}"}
    record = ps_json(job)
    assert record["attempt"] == 3 and [a["attempt"] for a in record["attempts"]] == [1, 2, 3]
    assert [a["state"] for a in record["attempts"][:2]] == ["stopped", "stopped"]
    wait_for(lambda: "line 3" in clusterrun("logs", "--node", "0", job).stdout, timeout=60, what="attempt 3")
    for node in (0, 1):
        for attempt in (1, 2):
            old, new = host_state(state_dir, job, node, attempt), host_state(state_dir, job, node, attempt + 1)
            assert old["state"] == "exited" and old["stop_requested"]
            assert old["ended_at"] <= new["started_at"], "two attempts were alive at once"
            assert not alive(old["torchrun"]["pid"], old["torchrun"]["start_time"])
        logs = [clusterrun("logs", "--node", str(node), "--attempt", str(a), job).stdout for a in (1, 2, 3)]
        assert all(f"rank {node} line 3" in log for log in logs)  # each attempt's log is its own, from line 0
        assert all(log.count(f"rank {node} line 0\n") == 1 for log in logs)
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


@pytest.mark.fake_torchrun
def test_a_reused_pid_or_a_reboot_means_lost_and_down_kills_no_stranger(
        tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_state(job, "running")
    kill_monitors(controller_state)
    # What the hosts said while it ran: a monitor an agent starts again between the kills below
    # (its survivor and monitor gone) may record the ranks' deaths before it dies in turn.
    running = [json.loads((attempt_dir(state_dir, job, node) / "state.json").read_text()) for node in (0, 1)]
    assert [state["state"] for state in running] == ["running", "running"]
    # Take the job away behind clusterrun's back, as a crash would: survivors and monitors first, then the rest.
    for node in (0, 1):
        for key in ("survivor", "supervisor"):
            sup = host_state(state_dir, job, node)[key]
            if alive(sup["pid"], sup["start_time"]):
                os.kill(sup["pid"], signal.SIGKILL)
    for pid in marked(job):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not marked(job), timeout=10, what="the job's processes to die")
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        # node 0: its pids now belong to an unrelated process; node 1: the host has rebooted since.
        path0 = attempt_dir(state_dir, job, 0) / "state.json"
        state = running[0]
        for key in ("supervisor", "torchrun"):
            state[key]["pid"] = stranger.pid
        path0.write_text(json.dumps(state))
        path1 = attempt_dir(state_dir, job, 1) / "state.json"
        state = running[1]
        state["boot_id"] = "0" * 32
        path1.write_text(json.dumps(state))
        record = wait_state(job, "lost", timeout=60)
        assert [n["state"] for n in record["nodes"]] == ["lost", "lost"]
        shown = clusterrun("ps", job)
        assert "lost" in shown.stdout and "running" not in shown.stdout, shown.stdout
        down = clusterrun("down", job)
        assert down.returncode == 0, down.stderr
        assert stranger.poll() is None and alive(stranger.pid, start_time(stranger.pid) or -1)
    finally:
        stranger.kill()
        stranger.wait()


def test_unknown_job_is_a_clear_error() -> None:
    for args in (["ps", "nope"], ["logs", "nope"], ["down", "nope"], ["attach", "nope"], ["restart", "nope"]):
        proc = clusterrun(*args)
        assert proc.returncode == 2, proc.stderr
        assert "no job matches 'nope'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def slow_record_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write of a job record by a Recorder's writer thread takes 0.5 s more (in this process)."""
    import threading

    from clusterrun.store.jobs import JobStore

    update = JobStore.update

    def slow_from_the_writer(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("record-"):
            time.sleep(0.5)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(JobStore, "update", slow_from_the_writer)


@pytest.mark.usefixtures("slow_record_writer")
@pytest.mark.fake_torchrun
def test_a_new_attempt_is_read_back_with_its_nodes_started_even_when_the_record_is_slow(
        tmp_path: Path, state_dir: Path) -> None:
    """attempt.restart (restart, and the dashboard's R) returns the record after the start: the
    nodes' pids, written by the Recorder's thread, must be in it however slow that thread is."""
    from clusterrun.life.attempt import restart
    from clusterrun.store.jobs import JobStore

    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "3", "0.01")
    wait_state(job, "succeeded")
    store = JobStore()
    job_id = store.resolve(job)
    owner = store.wait_own(job_id, timeout=30)
    assert owner is not None
    try:
        record = restart(store, store.load(job_id), lambda event: None, owner_fd=owner,
                         recorded=Opened(store.load(job_id)).spec())
        assert record.attempt == 2
        assert all(n.pid for n in record.nodes), record.nodes
    finally:
        os.close(owner)
        wait_state(job, "succeeded", "failed")


@pytest.mark.usefixtures("slow_record_writer")
@pytest.mark.fake_torchrun
def test_the_dashboards_detach_leaves_the_record_written(tmp_path: Path, state_dir: Path) -> None:
    """`up` on a terminal, then the terminal closes (SIGHUP): the dashboard detaches its session and
    the process exits at once (os._exit). What the nodes reported must be in the record by then,
    however slow the Recorder's thread, or the monitor that takes over starts from a stale one."""
    from clusterrun.config.hostsfile import load_cluster
    from clusterrun.core.events import NodeStarted
    from clusterrun.life.recorder import new_record
    from clusterrun.life.runner import Runner
    from clusterrun.life.session import Session
    from clusterrun.run.orchestrator import Job
    from clusterrun.store.jobs import JobStore
    from clusterrun.transports import transport_for

    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job_id = unique_job("detach")  # the agent names machine-wide cgroups after it
    job = Job(load_cluster(str(hosts)), str(SUPPORT / "counter.py"), ["60", "0.05"], job_id=job_id,
              name="detach", emit=lambda event: None, local_cwd=str(tmp_path), transport_factory=transport_for)
    plan = job.prepare()
    store = JobStore()
    record = new_record(plan, hosts_file=str(hosts), hosts_text=hosts.read_text(), env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None)
    store.create(record)
    events: list[object] = []
    owner = store.try_own(job_id)
    assert owner is not None
    runner = Runner(store, record, job, owner)
    session = Session(store, record, events.append, runner=runner)
    try:
        session.begin()
        wait_for(lambda: sum(isinstance(e, NodeStarted) for e in events) == 2, 60, what="both nodes started")
        session.detach()
        assert all(n.pid for n in store.load(job_id).nodes), store.load(job_id).nodes
    finally:
        assert clusterrun("down", job_id).returncode == 0
        # as `up` closes its job however it ends: the agents that followed the nodes to their end
        # are kept idle for a next attempt, and this process does not exit as `up` does after a detach
        runner.close()


def read_slowly(proc: subprocess.Popen[bytes], interrupt_after: int | None, sig: int, pause: float = 0.005) -> bytes:
    """All of ``proc``'s stdout, read 4 KB at a time with ``pause`` seconds between reads (800 KB/s:
    slower than the ranks print, so the pipe fills up and the controller's queue with it); ``sig``
    is sent once ``interrupt_after`` bytes have been read."""
    assert proc.stdout is not None
    data = bytearray()
    sent = False
    while chunk := proc.stdout.read1(4096):
        data += chunk
        if interrupt_after is not None and not sent and len(data) >= interrupt_after:
            proc.send_signal(sig)
            sent = True
        time.sleep(pause)  # rate, not synchronisation
    proc.stdout.close()
    proc.wait(timeout=60)
    return bytes(data)


def lines_by_node(outputs: list[bytes]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {0: [], 1: []}
    for out in outputs:
        for line in out.decode().splitlines():
            m = re.match(r"^node(\d) local-\w +rank(\d) +\| (.*)$", line)
            if m:
                found[int(m.group(1))].append(f"[rank{m.group(2)}]:{m.group(3)}")
    return found


FLOOD = 40_000


@pytest.mark.fake_torchrun
def test_interrupted_attaches_under_a_flood_show_every_line_exactly_once(tmp_path: Path, state_dir: Path) -> None:
    """Ctrl-C on `attach` again and again while the ranks print as fast as they can and the reader
    is slow: across all the attaches every line is shown exactly once (the offset saved is that of
    what was shown, never of what was only read from the host)."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", str(FLOOD), "0")
    outputs = []
    for _ in range(50):
        attach = subprocess.Popen([sys.executable, "-m", "clusterrun", "attach", "--no-tui", job], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        outputs.append(read_slowly(attach, 256 * 1024, signal.SIGINT))
        if attach.returncode == 0:  # the job ended and this attach saw its end
            break
        assert attach.returncode == 130
    assert len(outputs) > 2  # interrupted at least twice
    found = lines_by_node(outputs)
    for node in (0, 1):
        assert found[node] == counter_lines(node, FLOOD)


@pytest.mark.fake_torchrun
def test_a_hand_over_by_sighup_then_attach_shows_every_line_exactly_once(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    up = subprocess.Popen(up_argv(hosts, SUPPORT / "counter.py", str(FLOOD), "0"), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = read_slowly(up, 256 * 1024, signal.SIGHUP)
    assert up.stderr is not None
    err = up.stderr.read().decode()
    up.stderr.close()
    assert up.returncode == 129, err
    job = job_id_of(err)
    attach = subprocess.Popen([sys.executable, "-m", "clusterrun", "attach", "--no-tui", job], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    rest = read_slowly(attach, None, signal.SIGINT)
    assert attach.returncode == 0
    found = lines_by_node([first, rest])
    for node in (0, 1):
        assert found[node] == counter_lines(node, FLOOD)


ESCAPES_PREFIXED = (
    "node0 local-a rank0 | red plain\n"
    "node0 local-a rank0 | clip \\x1b]52;c;aGVsbG8=\\x07 title \\x1b]0;pwned\\x07 clear \\x1b[2J\\x1b[H end\n"
    "node0 local-a rank0 | bell \\x07 cr \n"  # the rank's tagging splits lines at \r
    "node0 local-a rank0 |  back \\x08 c1 \\x9b31m done\n"
)


@pytest.mark.fake_torchrun
def test_escape_sequences_are_shown_escaped_and_the_node_file_stays_byte_exact(tmp_path: Path,
                                                                                state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "escapes.py")
    wait_state(job, "succeeded")
    log = attempt_dir(state_dir, job, 0) / "output.log"
    with log.open("ab") as f:  # a file that does not end with a newline
        f.write(b"partial \x1b]0;t\x07")
    merged = subprocess.run([sys.executable, "-m", "clusterrun", "logs", job], capture_output=True, cwd=ROOT,
                            timeout=120)
    assert merged.returncode == 0, merged.stderr
    mine = [line for line in merged.stdout.decode().splitlines(keepends=True) if line.startswith("node0")]
    assert "".join(mine) == ESCAPES_PREFIXED + "node0 local-a       | partial \\x1b]0;t\\x07\n"
    assert b"\x1b" not in merged.stdout and b"\x07" not in merged.stdout and b"\x9b" not in merged.stdout
    coloured = subprocess.run([sys.executable, "-m", "clusterrun", "logs", "--node", "0", "--prefix", job],
                              capture_output=True, cwd=ROOT, timeout=120)
    assert coloured.stdout.decode().startswith("node0 local-a rank0 | red plain\n")  # not a terminal: no SGR
    exact = subprocess.run([sys.executable, "-m", "clusterrun", "logs", "--node", "0", job], capture_output=True,
                           cwd=ROOT, timeout=120)
    assert exact.returncode == 0, exact.stderr
    assert exact.stdout == log.read_bytes()
    assert exact.stdout.endswith(b"partial \x1b]0;t\x07")


def test_logs_of_a_job_that_has_written_nothing_yet_say_so(tmp_path: Path, state_dir: Path) -> None:
    """`logs JOB --tail 1` on a job that printed nothing printed nothing and exited 0, as if broken."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    gate = tmp_path / "go"
    job = up_detached(hosts, SUPPORT / "quiet.py", gate)
    for args in (("--tail", "1"), ("--node", "1"), ()):
        shown = clusterrun("logs", *args, job)
        assert (shown.returncode, shown.stdout) == (0, ""), shown.stderr
        assert re.fullmatch(r"clusterrun: no output yet \((starting|running) for \d+ s\)\n", shown.stderr), shown.stderr
    gate.touch()
    wait_state(job, "succeeded")
    shown = clusterrun("logs", "--tail", "1", job)
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    # Each node's last line: its rank's, or torch elastic's own after it (node 1's agent may lose
    # node 0's store at the exit: `DistNetworkError`, a line of the node's log all the same).
    assert [line.split(" ", 1)[0] for line in sorted(shown.stdout.splitlines())] == ["node0", "node1"], shown.stdout
    asked_none = clusterrun("logs", "--tail", "0", job)  # no lines asked for: none shown, nothing to explain
    assert (asked_none.returncode, asked_none.stdout, asked_none.stderr) == (0, "", "")
    every = clusterrun("logs", job).stdout.splitlines()
    assert all(f"node{r} local-{'ab'[r]} rank{r} | rank {r} done" in every for r in (0, 1)), every


def test_a_name_another_up_is_preparing_is_refused(tmp_path: Path, state_dir: Path) -> None:
    """Another `up` still checking its hosts has no record yet, only its note (preparing.py)."""
    from clusterrun.store.preparing import Preparing

    other = Preparing("dup-20261126-000000-abcd", "dup", ["local-a"])  # this test's process: alive
    other.say("node 0 (local-a): setup runs for 14 s")
    try:
        again = clusterrun("up", "-d", "--name", "dup", write_hosts(tmp_path, [1], state_dir),
                           SUPPORT / "counter.py", "1", "0.01")
    finally:
        other.close()
    assert again.returncode == 2, again.stderr
    assert ("--name: job dup-20261126-000000-abcd, named 'dup', is being prepared by another `clusterrun up` "
            "(it said: node 0 (local-a): setup runs for 14 s); nothing was started") in again.stderr
    assert not (state_dir / "jobs").exists() or not any((state_dir / "jobs").iterdir())


@pytest.mark.fake_torchrun
def test_a_running_jobs_name_is_refused_and_a_reused_name_means_the_one_not_ended(tmp_path: Path,
                                                                                   state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1], state_dir)
    old = up_detached("--name", "dup", hosts, SUPPORT / "counter.py", "1", "0.01")
    wait_state(old, "succeeded")
    new = up_detached("--name", "dup", hosts, SUPPORT / "counter.py", "10000", "0.05")  # the old one ended
    jobs = sorted(p.name for p in (state_dir / "jobs").iterdir())
    again = clusterrun("up", "-d", "--name", "dup", hosts, SUPPORT / "counter.py", "1", "0.01")
    assert again.returncode == 2, again.stderr
    assert f"--name: job {new}, named 'dup', is running; nothing was started" in again.stderr
    assert f"hint: stop it first (`clusterrun down {new}`), or name this job otherwise with --name" in again.stderr
    default = clusterrun("up", "-d", "--name", "counter", hosts, SUPPORT / "counter.py", "10000", "0.05")
    assert default.returncode == 0, default.stderr
    assert sorted(p.name for p in (state_dir / "jobs").iterdir()) == sorted([*jobs, default.stdout.strip()])
    note = f"'dup' is job {new} (running), the one of 2 jobs of that name that has not ended"
    shown = clusterrun("ps", "dup")
    assert shown.returncode == 0 and note in shown.stderr and new in shown.stdout, shown.stderr
    down = clusterrun("down", "dup")  # the running one, not the ended one
    assert down.returncode == 0 and note in down.stderr, down.stderr
    assert ps_json(new)["state"] == "stopped" and ps_json(old)["state"] == "succeeded"
    newest = clusterrun("ps", "dup")
    assert f"'dup' is job {new} (stopped), the newest of 2 jobs of that name, all ended" in newest.stderr
    assert clusterrun("down", default.stdout.strip()).returncode == 0


@pytest.mark.fake_torchrun
def test_a_second_run_of_a_script_without_a_name_gets_a_free_one(tmp_path: Path, state_dir: Path) -> None:
    """Two learning rates of one script: the second run is `counter-2`, not refused; `--name` still is."""
    hosts = write_hosts(tmp_path, [1], state_dir)
    first = up_detached(hosts, SUPPORT / "counter.py", "10000", "0.05")
    second = clusterrun("up", "-d", hosts, SUPPORT / "counter.py", "10000", "0.05")
    assert second.returncode == 0, second.stderr
    assert f"clusterrun: 'counter' is running (job {first}): this job is named 'counter-2'" in second.stderr
    third = up_detached(hosts, SUPPORT / "counter.py", "10000", "0.05")
    assert [ps_json(j)["name"] for j in (first, second.stdout.strip(), third)] == ["counter", "counter-2", "counter-3"]
    assert second.stdout.strip().startswith("counter-2-") and third.startswith("counter-3-")
    shown = clusterrun("ps", "counter-2")
    assert shown.returncode == 0 and second.stdout.strip() in shown.stdout, shown.stderr
    named = clusterrun("up", "-d", "--name", "counter", hosts, SUPPORT / "counter.py", "1", "0.01")
    assert named.returncode == 2, named.stderr
    assert f"--name: job {first}, named 'counter', is running; nothing was started" in named.stderr
    for job in (first, second.stdout.strip(), third):
        assert clusterrun("down", job).returncode == 0
    again = clusterrun("up", "-d", hosts, SUPPORT / "counter.py", "1", "0.01")  # every name is free again
    assert again.returncode == 0 and ps_json(again.stdout.strip())["name"] == "counter", again.stderr
    assert "this job is named" not in again.stderr


def in_mount_namespace(setup: str, *args: str | os.PathLike[str], after: str = "") -> subprocess.CompletedProcess[str]:
    """``clusterrun ARGS`` in a private mount namespace prepared by the shell commands ``setup``
    (mounts made there vanish with it); ``after`` runs there too, its output after a ``---`` line."""
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode:
        unavailable("no mount namespaces here (unshare -m)")
    script = f'set -e; {setup}; set +e; "$@"; rc=$?; echo ---; {after or "true"}; exit $rc'
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", sys.executable,
                           "-m", "clusterrun", *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_read_only_state_home_starts_nothing(tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    hosts = write_hosts(tmp_path, [1], state_dir)
    ro = f"mount --bind {controller_state} {controller_state}; mount -o remount,bind,ro {controller_state}"
    proc = in_mount_namespace(ro, "up", "-d", hosts, SUPPORT / "counter.py", "3", "0.01")
    assert proc.returncode == 2, proc.stderr
    assert (f"clusterrun: error: cannot create {controller_state}/clusterrun/jobs: Read-only file system; "
            "nothing was started") in proc.stderr, proc.stderr
    assert f"hint: make {controller_state}/clusterrun writable, or set XDG_STATE_HOME" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "---\n"
    assert not (state_dir / "jobs").exists()  # nothing started on the host


def test_a_full_state_home_starts_nothing_and_leaves_no_job_directory(tmp_path: Path, state_dir: Path,
                                                                      controller_state: Path) -> None:
    hosts = write_hosts(tmp_path, [1], state_dir)
    full = (f"mount -t tmpfs -o size=16k tmpfs {controller_state}; "
            f"dd if=/dev/zero of={controller_state}/fill bs=4k 2>/dev/null || true")
    proc = in_mount_namespace(full, "up", "-d", hosts, SUPPORT / "counter.py", "3", "0.01",
                              after=f"ls -A {controller_state}/clusterrun/jobs")
    assert proc.returncode == 2, proc.stderr
    assert re.search(rf"clusterrun: error: cannot write {controller_state}/clusterrun/jobs/counter-\S+/job.json: "
                     r"No space left on device; nothing was started", proc.stderr), proc.stderr
    assert "hint: free some space there, or set XDG_STATE_HOME to a directory with room" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "---\n"  # no job directory left in jobs/
    assert not (state_dir / "jobs").exists()


@pytest.mark.fake_torchrun
def test_down_with_a_read_only_state_home_stops_the_job_and_says_what_it_could_not_record(
        tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "100000", "0.05")
    wait_state(job, "running")
    ro = f"mount --bind {controller_state} {controller_state}; mount -o remount,bind,ro {controller_state}"
    listed = in_mount_namespace(ro, "ps")
    assert listed.returncode == 0 and job in listed.stdout, listed.stderr
    down = in_mount_namespace(ro, "down", job)
    assert down.returncode == 2, down.stderr
    assert down.stderr.count("nothing left (verified by cgroup)") == 2, down.stderr
    assert f"cannot open {controller_state}/clusterrun/jobs/{job}/record.lock: Read-only file system" in down.stderr
    assert f"the stop of job {job} above was NOT recorded" in down.stderr and "Traceback" not in down.stderr
    assert marked(job) == []


def test_wait_blocks_until_the_job_ends_and_exits_with_its_outcome(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "100", "0.02")
    early = clusterrun("wait", "--timeout", "0", job)
    assert early.returncode == 124 and "is still" in early.stderr, early.stderr
    done = clusterrun("wait", job)
    assert done.returncode == 0 and f"job {job} succeeded" in done.stderr, done.stderr
    assert ps_json(job)["state"] == "succeeded"
    failing = tmp_path / "exit3.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    job = up_detached(hosts, failing)
    failed = clusterrun("wait", job)
    assert failed.returncode == 1 and f"job {job} failed" in failed.stderr, failed.stderr
    assert clusterrun("wait", "no-such-job").returncode == 2


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "sweep"])
@pytest.mark.fake_torchrun
def test_dry_run_ps_and_down_say_which_guarantee_holds(tmp_path: Path, state_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch, cgroup: bool) -> None:
    """With a cgroup per attempt the stop is verified; without one (forced off here) every place
    that speaks of the stop says it was a sweep and what a sweep cannot see, never "nothing left"."""
    if not cgroup:
        monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")  # the local agents inherit it
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    dry = clusterrun("up", "--dry-run", hosts, SUPPORT / "counter.py", "10000", "0.05")
    assert dry.returncode == 0, dry.stderr
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_state(job, "running")
    ps = clusterrun("ps", job)
    assert ps.returncode == 0, ps.stderr
    down = clusterrun("down", job)
    assert down.returncode == 0, down.stderr
    assert marked(job) == []
    after = clusterrun("ps", job)  # the exit code torchrun gave in answer to our SIGTERM is not shown as its own
    assert re.findall(r"^\d\s+local-\w\s+(\w+)\s+\d+\s+(\S+)", after.stdout, re.M) == [("stopped", "SIGTERM")] * 2, \
        after.stdout
    if cgroup:
        assert dry.stdout.count("  a stop is verified by the attempt's cgroup") == 2, dry.stdout
        assert ps.stdout.count(": a stop is verified by the attempt's cgroup") == 2, ps.stdout
        assert down.stderr.count("nothing left (verified by cgroup)") == 2, down.stderr
        assert f"job {job} stopped; nothing of it is left on any host (verified by cgroup)" in down.stderr
    else:
        assert dry.stdout.count("  a stop sweeps (no cgroup") == 2, dry.stdout
        assert dry.stdout.count("fallback: no cgroup: cgroups turned off on this host (CLUSTERRUN_NO_CGROUP") == 2
        assert ps.stdout.count(": a stop sweeps (no cgroup") == 2, ps.stdout
        assert "verified" not in down.stderr and "nothing of it is left" not in down.stderr, down.stderr
        # one short line per host; what it means without a cgroup once, not again in the job's line
        assert down.stderr.count("processes that left the job's tree, session and environment could not be seen") == 1
        assert f"job {job} stopped; nothing it could see is left (no cgroup on local-a, local-b)" in down.stderr
        assert len(down.stderr.splitlines()) == 5, down.stderr
        assert re.search(r"node0 local-a: stopped torchrun \(pid \d+\); nothing left\n", down.stderr), down.stderr
        assert "no cgroup on local-a (cgroups turned off on this host (CLUSTERRUN_NO_CGROUP is set)): " in down.stderr


@pytest.mark.fake_torchrun
def test_down_on_a_full_state_dir_stops_everything_and_says_what_it_could_not_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_containment import fill

    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "crtest-small", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    state_dir = disk / "state"
    try:
        job, pids = start_hostile(tmp_path, state_dir)
        fill(disk)
        down = clusterrun("down", job)
        assert down.returncode == 0, down.stderr
        assert "Traceback" not in down.stderr
        assert [name for name, (pid, started) in pids.items() if alive(pid, started)] == []
        assert marked(job) == []
        assert down.stderr.count("could not record the end of the job in state.json: No space left on device") == 2
        assert down.stderr.count(": degraded: ") == 2, down.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_the_monitor_names_the_root_cause_as_up_does(tmp_path: Path, state_dir: Path) -> None:
    """`up -d`: the monitor follows the nodes' states, not their logs, yet `ps JOB` names the
    failed rank, its exit code and its exception as the foreground `up` does. torchrun reaps its ranks
    every 2 s, not 0.1: the host's monitor reads rank 3's exit before that on a loaded machine too
    (DEVELOPERS.md, "A rank's exit missed")."""
    hosts = write_hosts(tmp_path, [2, 2], state_dir, extra="env:\n  PET_MONITOR_INTERVAL: '2'\n")
    job = up_detached("--grace", "3", hosts, "tests/_support/fail_rank.py", "3", "raise", "custom failure 42")
    wait_state(job, "failed")
    shown = clusterrun("ps", job)
    assert shown.returncode == 0, shown.stderr
    assert ("root cause: rank 3 on node 1 (local-b, local rank 1): exit code 1: RuntimeError: custom failure 42"
            in shown.stdout), shown.stdout
    down = clusterrun("down", job)  # it has ended: its hosts confirm that nothing runs, nothing is stopped
    assert down.returncode == 0, down.stderr
    assert down.stderr == f"clusterrun: job {job} already finished (failed); nothing to stop\n", down.stderr


@pytest.mark.fake_torchrun
def test_attach_tail_shows_the_lines_before_where_the_last_viewer_stopped_then_the_rest(tmp_path: Path,
                                                                                        state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "30", "0.01")
    wait_state(job, "succeeded")
    data = (attempt_dir(state_dir, job, 0) / "output.log").read_bytes()
    resume = data.index(b"[rank0]:rank 0 line 20\n")

    def viewed(record: JobRecord) -> None:  # a viewer showed the lines up to line 19
        record.nodes[0].seen = resume

    JobStore().update(job, viewed)
    proc = clusterrun("attach", "--no-tui", "--tail", "3", job)
    assert proc.returncode == 0, proc.stderr
    assert rank_lines(proc.stdout.replace("node0 local-a rank0 | ", "[rank0]:"), 0) == \
        counter_lines(0, 30)[17:]  # 3 lines before, then the rest once
    assert "node0 local-a: resumed here; the lines above were shown before" in proc.stderr
    proc = clusterrun("attach", "--no-tui", job)  # the stream resumes without scrollback by default
    assert proc.returncode == 0 and "rank 0 line" not in proc.stdout and "resumed here" not in proc.stderr


@pytest.mark.fake_torchrun
def test_logs_f_and_attach_end_a_failed_job_with_the_root_cause_ps_shows(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    script = tmp_path / "crash.py"  # rank 1 fails; rank 0, the victim, is stopped by fail-fast
    script.write_text("import os, time\nprint('up', flush=True)\n"
                      "if os.environ['RANK'] == '1':\n    raise ValueError('boom')\ntime.sleep(600)\n")
    up = run_up("--grace", "2", hosts, script)  # shows every line: an attach later resumes at the end
    assert up.returncode == 1, up.stderr
    job = job_id_of(up.stderr)
    cause = "root cause: rank 1 on node 1 (local-b, local rank 0): exit code 1: ValueError: boom"
    assert f"clusterrun: {cause}" in up.stderr, up.stderr
    assert cause in clusterrun("ps", job).stdout
    follow = clusterrun("logs", "-f", job)
    assert follow.returncode == 1, follow.stderr
    assert f"clusterrun: job {job} FAILED\nclusterrun: {cause}\n" in follow.stderr, follow.stderr
    attach = clusterrun("attach", "--no-tui", job)
    assert attach.returncode == 1, attach.stderr
    assert f"clusterrun: {cause}\n" in attach.stderr and "the job keeps running" not in attach.stderr, attach.stderr
    assert "it has ended" in attach.stderr


@pytest.mark.fake_torchrun
def test_logs_interleaves_the_nodes_in_the_order_their_lines_were_written(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    # The ranks take turns, each waiting for the other's file; a turn's file comes 0.2 s after its
    # line, more than the monitors take to note when a line was written (they are woken by it).
    script = tmp_path / "pingpong.py"
    script.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\n"
                      "def wait(name):\n    while not os.path.exists(os.path.join(sys.argv[1], name)):\n"
                      "        time.sleep(0.01)\n"
                      "for turn in range(3):\n    if rank == 1 or turn:\n"
                      "        wait(f'{1 - rank}-{turn - 1 + rank}')\n"
                      "    print(f'rank {rank} turn {turn}', flush=True)\n    time.sleep(0.2)\n"
                      "    open(os.path.join(sys.argv[1], f'{rank}-{turn}'), 'w').close()\n")
    up = run_up(hosts, script, tmp_path)
    assert up.returncode == 0, up.stderr
    job = job_id_of(up.stderr)
    turns = [f"rank {r} turn {t}" for t in range(3) for r in (0, 1)]
    logs = clusterrun("logs", job)
    assert logs.returncode == 0, logs.stderr
    assert [line.split("| ", 1)[1] for line in logs.stdout.splitlines() if " turn " in line] == turns
    by_node = clusterrun("logs", "--by-node", job)
    assert [line.split("| ", 1)[1] for line in by_node.stdout.splitlines() if " turn " in line] == sorted(turns)
