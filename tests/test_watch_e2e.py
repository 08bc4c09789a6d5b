"""The start-up watch, the hang watch and notifications end to end: `clusterrun up` on local hosts,
real processes: real torchrun and gloo ranks where the watch must see what torch does (its
threads poll, a rank spins), torchrun as the stdlib fake where the process tree and files suffice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, job_id_of, marked, run_up, up_argv, wait_for, write_hosts
from tests.test_stack import needs_py_spy

pytestmark = pytest.mark.integration


def clusterrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def ps_json(job: str) -> dict:  # type: ignore[type-arg]
    done = clusterrun("ps", job, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["jobs"][0]


@pytest.mark.fake_torchrun
def test_a_node_that_never_starts_its_workers_fails_the_job_at_the_start_up_timeout(tmp_path: Path,
                                                                                    state_dir: Path) -> None:
    """Node 1's torchrun never starts (its interpreter sleeps), so node 0's waits in the rendezvous:
    `up` says who waits for what while it lasts (node 1 never joined), `ps` too, and the job fails
    once the timeout has passed, node 1 named with the fix, not after gloo's 30 minutes."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    never = tmp_path / "python"  # the agent runs, torchrun never starts (a node that never joins)
    never.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then exec sleep 600; fi\n'
                     f'exec {sys.executable} "$@"\n')
    never.chmod(0o755)
    hosts.write_text(hosts.read_text() + f"    python: {never}\n")
    # The note comes at half the timeout: the other half leaves `ps` (seconds on a loaded machine) time to run.
    proc = subprocess.Popen(up_argv("--startup-timeout", "30", hosts, SUPPORT / "block.py"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    job = job_id_of(proc.stderr.readline())
    note = wait_for(lambda: next((line for line in [proc.stderr.readline()] if "waits for" in line), None),  # type: ignore[union-attr]
                    timeout=60, what="the start-up note")
    assert note.startswith("clusterrun: node 1 (local-b): torchrun has not joined the rendezvous (no connection to "
                           "the master port) for "), note
    assert "; node 0 (local-a): torchrun joined the rendezvous, waits for the others for " in note
    shown = clusterrun("ps", job)
    assert "start-up: node 1 (local-b): torchrun has not joined the rendezvous" in shown.stdout
    assert [n["waiting"] for n in ps_json(job)["nodes"]] == [
        "torchrun joined the rendezvous, waits for the others",
        "torchrun has not joined the rendezvous (no connection to the master port)"]
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert ("cause: node 1 (local-b) started no workers within 30 s (startup_timeout): torchrun has not joined the "
            "rendezvous (no connection to the master port); node 0 (local-a) joined and waited for it") in err
    assert "`clusterrun doctor HOSTS.yaml`" in err
    record = ps_json(job)
    assert record["state"] == "failed" and [n["state"] for n in record["nodes"]] == ["stopped", "failed"]
    assert "startup_timeout" in record["attempts"][0]["root_cause"]
    assert marked(job) == []


def test_real_torchrun_on_node_0_is_seen_to_have_joined_its_own_rendezvous(tmp_path: Path, state_dir: Path) -> None:
    """What the start-up watch reads of torchrun itself (its connection to its TCPStore on the
    master port), with the real torchrun on node 0 and a node 1 that never starts one."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir, python=sys.executable)
    never = tmp_path / "python"
    never.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then exec sleep 600; fi\n'
                     f'exec {sys.executable} "$@"\n')
    never.chmod(0o755)
    hosts.write_text(hosts.read_text() + f"    python: {never}\n")
    done = run_up("--startup-timeout", "20", hosts, SUPPORT / "block.py")
    assert done.returncode == 1, done.stderr
    assert ("cause: node 1 (local-b) started no workers within 20 s (startup_timeout): torchrun has not joined the "
            "rendezvous (no connection to the master port); node 0 (local-a) joined and waited for it") in done.stderr
    assert marked(job_id_of(done.stderr)) == []


def logs(job: str) -> str:
    return clusterrun("logs", job).stdout


def hang_report(job: str, *wanted: str) -> tuple[dict, str] | None:  # type: ignore[type-arg]
    """The job as ``ps --json`` shows it and its hang report, once every node that runs is hung
    and the report is of this hang, holds every one of ``wanted`` (an earlier hang's, while
    torch was imported on a busy machine, is replaced by the next one's) and is in the record."""
    record = ps_json(job)
    since = {n["hung_since"] for n in record["nodes"] if n["last_state"] == "running"}
    path = Path(os.environ["XDG_STATE_HOME"]) / "clusterrun" / "jobs" / job / "hang-1.txt"
    text = path.read_text() if path.exists() and len(since) == 1 and None not in since else ""
    fits = text.startswith(f"hung since {next(iter(since), None)}: ") and all(w in text for w in wanted)
    # The report's path is recorded after its file is written.
    recorded = all(n.get("hang_report") for n in record["nodes"] if n["last_state"] == "running")
    return (record, text) if fits and recorded else None


@needs_py_spy
def test_a_rank_away_from_the_barrier_leaves_the_job_hung_and_named_in_the_report(tmp_path: Path,
                                                                                   state_dir: Path) -> None:
    """Real gloo: ranks 0-1 (node 0) wait in barrier() while rank 2 (node 1) sleeps before it.
    gloo's loop thread gains CPU ticks in every rank meanwhile, so only the silence can tell: the
    job is hung within hang_after + 30 s of the ranks' last lines, and the report, saved by the
    detached job's monitor, names rank 2 elsewhere and the others idle in the barrier."""
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    done = run_up("--detach", "--hang-after", "12s", hosts, SUPPORT / "barrier_rank.py", "600")
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    wait_for(lambda: all(f"rank {r} {what}" in logs(job) for r, what in ((0, "waits"), (1, "waits"), (2, "lingers"))),
             timeout=180, interval=1, what="every rank at its place")
    record, text = wait_for(lambda: hang_report(job, "linger at"), timeout=12 + 30, interval=1,
                            what="the hang report")
    summary = text.splitlines()[1]
    assert summary == ("each rank looked at twice, 3 s apart: rank 2 elsewhere: linger at barrier_rank.py:12 "
                       "(the others: barrier in wait_for_peers at barrier_rank.py:16) · busy: none · "
                       "stacks unmoved: ranks 0-2"), text
    assert [n["state"] for n in record["nodes"]] == ["hung", "hung"] and record["state"] == "running"
    assert record["nodes"][1]["hang_report"].endswith(f"/{job}/hang-1.txt")
    shown = clusterrun("ps", job).stdout
    assert f"running; hung since {record['nodes'][0]['hung_since'][11:]}" in shown and summary in shown
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


@needs_py_spy
def test_a_rank_that_spins_while_the_others_wait_in_all_reduce_is_named_busy(tmp_path: Path,
                                                                           state_dir: Path) -> None:
    """Real gloo: ranks 0-1 wait in all_reduce while rank 2 spins in Python without a word: the
    job is hung although rank 2 uses a core, and the report names rank 2 busy and elsewhere."""
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    done = run_up("--detach", "--hang-after", "12s", hosts, SUPPORT / "spin_rank.py")
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    wait_for(lambda: all(f"rank {r} {what}" in logs(job) for r, what in ((0, "reduces"), (1, "reduces"), (2, "spins"))),
             timeout=180, interval=1, what="every rank at its place")
    record, text = wait_for(lambda: hang_report(job, "spin at"), timeout=12 + 30, interval=1,
                            what="the hang report")
    summary = text.splitlines()[1]
    assert ("rank 2 elsewhere: spin at spin_rank.py:" in summary and "(the others: all_reduce in main at "
            "spin_rank.py:" in summary and " · busy: rank 2 · " in summary), text
    assert "busy (running or runnable at least 25% of the time between the looks): rank 2; idle: ranks 0-1" in text
    assert [n["state"] for n in record["nodes"]] == ["hung", "hung"]
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


@needs_py_spy
def test_ranks_that_work_without_a_word_are_reported_working_with_no_rank_singled_out(tmp_path: Path,
                                                                                   state_dir: Path) -> None:
    """Real gloo: both ranks compute for a minute without a line, each a step's phases one after
    the other. The job is hung (silence is the signal), and the report says that their stacks
    moved and how to keep such a job from being hung, naming no rank as the one the others wait for."""
    hosts = write_hosts(tmp_path, [2], state_dir)
    done = run_up("--detach", "--hang-after", "8s", hosts, SUPPORT / "silent_steps.py", "60")
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    wait_for(lambda: all(f"rank {r} works" in logs(job) for r in (0, 1)), timeout=180, interval=1,
             what="every rank at work")
    _, text = wait_for(lambda: hang_report(job, "RANK"), timeout=8 + 30, interval=1, what="the hang report")
    summary = text.splitlines()[1]
    assert summary.startswith("each rank looked at twice, 3 s apart: stacks moved: ranks 0-1 (the job may be "
                              "working without writing: print progress more often than hang_after, or raise it)"), text
    assert "elsewhere" not in text
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


@needs_py_spy
def test_on_hang_restart_leaves_ranks_that_work_without_a_word_to_finish(tmp_path: Path, state_dir: Path) -> None:
    """Real gloo: both ranks compute for 30 s without a line, longer than hang_after. The job is hung
    and its report saved, but it is not restarted: the ranks' stacks moved between the looks, and a
    restart would throw their work away. The attempt succeeds."""
    hosts = write_hosts(tmp_path, [2], state_dir)
    done = run_up("--hang-after", "8s", "--on-hang", "restart", "--max-restarts", "1", hosts,
                  SUPPORT / "silent_steps.py", "30", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "not restarting: the stacks of ranks 0-1 moved between the looks" in done.stderr, done.stderr
    assert [a["state"] for a in ps_json(job_id_of(done.stderr))["attempts"]] == ["succeeded"]


@needs_py_spy
def test_on_hang_restart_saves_the_report_then_restarts_the_job_which_succeeds(tmp_path: Path,
                                                                               state_dir: Path) -> None:
    """Real gloo: rank 2 (node 1) stalls before a barrier in attempt 1 while ranks 0-1 wait in it.
    on_hang: restart saves the hang report naming rank 2, then restarts; torchrun's lines as the
    stop shuts it down are not the job running again. In attempt 2 every rank passes the barrier."""
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    done = run_up("--hang-after", "20s", "--on-hang", "restart", "--max-restarts", "1", hosts,
                  SUPPORT / "hang_once.py", tmp_path / "stalled", timeout=300)
    assert done.returncode == 0, done.stderr
    job = job_id_of(done.stderr)
    report = Path(os.environ["XDG_STATE_HOME"]) / "clusterrun" / "jobs" / job / "hang-1.txt"
    assert "rank 2 elsewhere: stall at hang_once.py:" in report.read_text().splitlines()[1], report.read_text()
    assert "restarting the job as attempt 2 (on_hang: restart)" in done.stderr
    assert "the job is running" not in done.stderr, done.stderr
    record = ps_json(job)
    assert [a["state"] for a in record["attempts"]] == ["stopped", "succeeded"]
    assert marked(job) == []


def test_a_job_that_progresses_without_a_word_from_most_nodes_is_never_hung(tmp_path: Path,
                                                                           state_dir: Path) -> None:
    """Real gloo: both ranks compute and all_reduce for 45 s, only rank 0 (node 0) writes, every
    5 s, a progress bar's redrawn line (no newline until the end); node 1 writes nothing at all,
    for far longer than hang_after. The job is never hung (no `hung` notification, no hang line
    from `up`) and succeeds."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    sent = tmp_path / "sent"
    done = run_up("--hang-after", "15s", "--notify", f'echo "$CLUSTERRUN_EVENT" >> {sent}', hosts,
                  SUPPORT / "progress.py", "45", "5", "1", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "node0 local-a rank0 | rank 0 done after " in done.stdout and "node1 " not in done.stdout
    assert "hung" not in done.stderr, done.stderr
    wait_for(lambda: sent.exists() and sent.read_text(), timeout=60, what="the notification")
    assert sent.read_text().splitlines() == ["succeeded"]
    assert [n["hung_since"] for n in ps_json(job_id_of(done.stderr))["nodes"]] == [None, None]


@pytest.mark.fake_torchrun
def test_ranks_that_block_are_hung_after_hang_after_with_their_stacks_saved(tmp_path: Path,
                                                                            state_dir: Path) -> None:
    """Stand-in ranks (no torch) that print a line and sleep: the same silence, quicker."""
    hosts = write_hosts(tmp_path, [2], state_dir)
    done = run_up("--detach", "--hang-after", "3s", hosts, SUPPORT / "block.py")
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    node = wait_for(lambda: next((n for n in ps_json(job)["nodes"] if n["state"] == "hung"), None), timeout=60,
                    what="the node to be hung")
    assert node["hung_since"] and node["last_state"] == "running"
    assert f"hung since {node['hung_since'][11:]}" in clusterrun("ps", job).stdout
    _, text = wait_for(lambda: hang_report(job, "RANK"), timeout=60, what="the hang report")
    assert "each rank looked at twice, 3 s apart: " in text and "\n0     0     local-a  " in text
    assert "\n1     0     local-a  " in text  # py-spy's stacks where the host has it, else how to get it
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


@pytest.mark.fake_torchrun
def test_a_notification_is_sent_once_also_after_the_controller_was_sigkilled(tmp_path: Path,
                                                                             state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    sent, go = tmp_path / "sent", tmp_path / "go"
    job_of_stdin = 'python3 -c "import json, sys; print(json.load(sys.stdin)[\'id\'])"'  # the summary on stdin
    command = f'echo "$CLUSTERRUN_EVENT $CLUSTERRUN_STATE $({job_of_stdin})" >> {sent}'
    proc = subprocess.Popen(up_argv("--notify", command, hosts, SUPPORT / "block.py", go), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    job = job_id_of(proc.stderr.readline())
    wait_for(lambda: "ready" in proc.stdout.readline(), timeout=60, what="the job to run")  # type: ignore[union-attr]
    proc.send_signal(signal.SIGKILL)
    proc.communicate()  # its end, and its pipes closed
    assert ps_json(job)["state"] == "running"  # ps found it unowned: a monitor owns it now
    go.touch()
    wait_for(lambda: sent.exists() and sent.read_text(), timeout=60, what="the notification")
    for _ in range(3):  # whoever looks now finds it sent
        assert clusterrun("ps", job).returncode == 0
    wait_for(lambda: ps_json(job)["state"] == "succeeded", timeout=60, what="the end")
    assert sent.read_text().splitlines() == [f"succeeded succeeded {job}"]
    assert json.loads((Path(os.environ["XDG_STATE_HOME"]) / "clusterrun" / "jobs" / job / "job.json")
                      .read_text())["notified"] == ["1:succeeded"]


@pytest.mark.fake_torchrun
def test_a_setup_that_blocks_is_shown_then_fails_the_start_naming_its_node(tmp_path: Path, state_dir: Path) -> None:
    """Node 1's setup never ends: `up` says it is still in its setup (node 0 ready), then the
    start fails at setup_timeout naming node 1 and its setup's last lines; nothing started and
    the setup's processes are gone."""
    hosts = write_hosts(tmp_path, [1], state_dir, extra=(
        "  - host: local-b\n    nproc: 1\n    setup: echo fetching the data set; sleep 1017\n"))
    done = run_up("--setup-timeout", "12s", hosts, SUPPORT / "counter.py", "3", "0", timeout=120)
    assert done.returncode == 3, done.stderr
    assert "clusterrun: node 1 (local-b): setup runs for 1" in done.stderr, done.stderr  # 10 or 11 s
    assert "(killed at 12 s); node 0 ready" in done.stderr
    assert "local-b: node 1: setup did not finish within 12 s (killed); nothing was started" in done.stderr
    assert "  | fetching the data set" in done.stderr
    assert "started attempt" not in done.stderr
    assert subprocess.run(["pgrep", "-f", "sleep 1017"], capture_output=True).returncode == 1  # killed on its host


def _ps(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "clusterrun", "ps", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60).stdout


def test_ps_lists_a_job_whose_first_setup_runs_and_forgets_it_once_its_up_ends(tmp_path: Path,
                                                                              state_dir: Path) -> None:
    """Before its record exists (the first attempt's setup, in up's checks) the job is in `ps`:
    preparing, with what up said last of the setups; gone from there once up has ended."""
    hosts = write_hosts(tmp_path, [1], state_dir, extra=(
        "  - host: local-b\n    nproc: 1\n    setup: sleep 1018\n"))
    # A setup timeout far away: `ps` (a Python start, seconds on a loaded machine) runs long before it.
    up = subprocess.Popen(up_argv("--setup-timeout", "10m", "--name", "slowsetup", hosts, SUPPORT / "counter.py",
                                  "3", "0"), stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert up.stderr is not None
        for line in up.stderr:
            if "setup runs for" in line:
                break
        listed = _ps()
        assert "preparing" in listed and "slowsetup" in listed, listed
        assert "nothing started yet (its up checks the hosts): node 1 (local-b): setup runs for 1" in listed, listed
        one = _ps("slowsetup")
        assert one.startswith("job slowsetup-") and "preparing for" in one and "setup runs for" in one, one
        up.send_signal(signal.SIGINT)  # Ctrl-C during the setup: nothing started, the setup killed on its host
        assert up.wait(timeout=120) == 130
        wait_for(lambda: subprocess.run(["pgrep", "-f", "sleep 1018"], capture_output=True).returncode == 1, 30,
                 what="the setup killed")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stderr is not None:
            up.stderr.close()
    assert "preparing" not in _ps()
