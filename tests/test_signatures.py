"""Known failure signatures on the lines real runs printed (torch 2.13, gloo on the CPU).

``tests/_support/failures/<case>/nodeN.log`` are the nodes' ``output.log`` files of real runs on
this machine (``clusterrun up`` on two local nodes of two processes each), as the agent wrote
them; ``master-unreachable`` is torchrun's own output as node 1 with nothing listening at the
master (``--rdzv-conf timeout=5``); ``script-missing`` is torchrun's output and its rank's stderr
file (``--redirects``) tagged as the agent tags it; ``peer-refused`` is ``up``'s prefixed output
on two simulated hosts (``tests/simhosts.py``, ``GLOO_SOCKET_IFNAME=lo``) with its prefixes
turned back into the agent's tags. CUDA and NCCL cannot run here: their lines are quoted from
reports of real runs, as noted.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from clusterrun.agent.kmsg import KernelLog
from clusterrun.core.events import Explanation, JobResult, NodeResult, NodeState, RootCause
from clusterrun.core.protocol import decode_status
from clusterrun.diagnose.rootcause import NodeLog, find_root_cause
from clusterrun.diagnose.signatures import SIGNATURES, Signature, explain, transient_start
from tests.conftest import ROOT, run_up, wait_for

CAPTURED = Path(__file__).parent / "_support" / "failures"
HOSTS = {0: "local-a", 1: "local-b"}


def diagnose(case: str, ended: Sequence[float], stopped: set[int], died: dict[int, float] | None = None) -> RootCause:
    """The root cause of a captured run: each node's log fed as the controller feeds it, each node
    exited 1 at ``ended[node]`` and its ranks died at ``died[rank]`` (the agents' record),
    ``stopped`` the nodes that fail-fast stopped."""
    logs, states = {}, {}
    for node, when in enumerate(ended):
        log = NodeLog()
        path = CAPTURED / case / f"node{node}.log"
        if path.exists():
            log.feed(path.read_text().splitlines())
        logs[node] = log
        states[node] = decode_status(HOSTS[node], {"state": "exited", "exit_code": 1, "signal": None,
                                                   "workers": [{"pid": 0, "rank": rank, "died": at}
                                                               for rank, at in (died or {}).items()],
                                                   "ended_at": when})
    cause = find_root_cause(HOSTS, logs, states, stopped_by_us=stopped)
    assert cause is not None
    return cause


def explained(cause: RootCause) -> Explanation:
    assert cause.explanation is not None, cause
    return cause.explanation


def test_a_rank_killed_by_sigkill_without_the_kernels_word_is_not_called_an_oom_kill() -> None:
    """Only SIGKILL seen (here no kernel's log recorded: the OOM kills' cases are in test_oom.py)."""
    cause = diagnose("sigkill", ended=[10.0, 11.0], stopped={1}, died={1: 9.0, 0: 9.5})
    assert (cause.node, cause.rank, cause.signal, cause.pid) == (0, 1, 9, 21225)
    why = explained(cause)
    assert why.signature == "killed"
    assert why.cause.startswith("rank 1 on node 0 (local-a) was killed by SIGKILL; the node's supervisor recorded "
                                "nothing of the kernel's log")
    assert "killed by the kernel's OOM killer" not in why.cause
    assert why.fix.startswith("check `dmesg` on local-a (as root) for 'Killed process 21225'")


def test_a_module_missing_on_one_host_only_names_that_host() -> None:
    cause = diagnose("module-one-host", ended=[11.0, 10.0], stopped={0})
    assert cause.node == 1
    why = explained(cause)
    assert why.signature == "module-missing"
    assert why.cause == ("Python module 'crsig_extra_mod' not found on local-b only (local-a did not report it): "
                         "the hosts' Python environments differ")
    assert why.fix.startswith("install it for the interpreter on local-b ")


def test_a_module_missing_everywhere_is_not_called_a_difference() -> None:
    lines = (CAPTURED / "module-one-host" / "node1.log").read_text().splitlines()
    root = RootCause(1, "local-b", 3, 1, 1, None, ("ModuleNotFoundError: No module named 'crsig_extra_mod'",))
    why = explain(root, HOSTS, {0: lines, 1: lines})
    assert why is not None and why.cause == "Python module 'crsig_extra_mod' not found on every host"


def test_two_nodes_on_one_host_are_named_by_node() -> None:
    lines = (CAPTURED / "module-one-host" / "node1.log").read_text().splitlines()
    root = RootCause(1, "h", 3, 1, 1, None, ("ModuleNotFoundError: No module named 'crsig_extra_mod'",))
    why = explain(root, {0: "h", 1: "h"}, {0: [], 1: lines})
    assert why is not None and why.cause.startswith(
        "Python module 'crsig_extra_mod' not found on node1 h only (node0 h did not report it)")


def test_a_gloo_timeout_names_the_ranks_that_did_not_time_out() -> None:
    cause = diagnose("gloo-timeout", ended=[10.0, 11.0], stopped={1}, died={1: 9.0, 0: 9.5})
    assert (cause.node, cause.rank) == (0, 1)
    why = explained(cause)
    assert why.signature == "collective-timeout"
    assert why.cause.startswith("rank 1 on node 0 (local-a) timed out after 5000 ms in a collective (send)")
    # rank 0 slept instead of joining the all-reduce: it is the only one without a time-out
    assert why.cause.endswith("; ranks without a time-out of their own: rank 0 (node 0, local-a)")


def test_the_master_port_in_use_names_the_port_and_the_host() -> None:
    cause = diagnose("port-in-use", ended=[10.0, 11.0], stopped={1})
    assert (cause.node, cause.rank) == (0, None)
    why = explained(cause)
    assert why.signature == "address-in-use"
    assert why.cause == ("torchrun on node 0 (local-a) could not listen on the master port 29655: "
                         "another process on local-a holds it")
    assert "`master: port: auto`" in why.fix and "ss -ltnp 'sport = :29655'" in why.fix


def test_a_node_that_cannot_reach_the_master_says_which_and_where() -> None:
    logs, states = {1: NodeLog()}, {}
    logs[1].feed((CAPTURED / "master-unreachable" / "node1.log").read_text().splitlines())
    states[1] = decode_status("local-b", {"state": "exited", "exit_code": 1, "ended_at": 10.0})
    cause = find_root_cause(HOSTS, logs, states, stopped_by_us=set())
    assert cause is not None
    why = explained(cause)
    assert why.signature == "master-unreachable"
    assert why.cause.startswith("node 1 (local-b) could not connect to the master 127.0.0.1:29677 ")
    assert "127.0.0.1 is a loopback address" in why.cause
    assert "local-b reaches 127.0.0.1:29677" in why.fix


def test_gloo_s_abort_at_exit_asks_for_destroy_process_group() -> None:
    cause = diagnose("gloo-abort-at-exit", ended=[10.0, 11.0], stopped={1}, died={1: 9.0, 0: 9.5})
    assert (cause.node, cause.rank, cause.signal) == (0, 1, 6)
    why = explained(cause)
    assert why.signature == "gloo-abort"
    assert why.cause.startswith("gloo aborted rank 1 on node 0 (local-a) at exit while tearing down its connections")
    assert why.cause.endswith("(SIGABRT; pytorch/pytorch#188266, torch 2.13): a script that ends without "
                              "destroy_process_group() makes it likelier"), why.cause
    assert why.fix == ("call torch.distributed.destroy_process_group() at the end of the script, on every rank, if it "
                       "does not; if it does, run the job again (gloo's teardown fails now and then)")
    # the same abort before the rank printed anything of its own: the transient start-up failure
    early = RootCause(0, "local-a", 1, 1, None, 6, ("terminate called without an active exception",))
    at_start = explain(early, HOSTS, {0: ["[rank1]:terminate called without an active exception"]})
    assert at_start is not None and " at start-up while setting up its connections " in at_start.cause
    assert "`up` retries this once by itself" in at_start.fix


def test_a_peer_refused_over_a_loopback_address_says_why() -> None:
    """Two simulated hosts (own network namespaces) with GLOO_SOCKET_IFNAME=lo: each advertises
    127.0.0.1, which leads to itself."""
    logs, states = {0: NodeLog(), 1: NodeLog()}, {}
    for node in (0, 1):
        logs[node].feed((CAPTURED / "peer-refused" / f"node{node}.log").read_text().splitlines())
        states[node] = decode_status("h", {"state": "exited", "exit_code": 1, "ended_at": 10.0 + node})
    cause = find_root_cause({0: "sim1", 1: "sim2"}, logs, states, stopped_by_us={1})
    assert cause is not None and (cause.node, cause.rank) == (0, 0)
    why = explained(cause)
    assert why.signature == "peer-refused"
    assert why.cause == ("node 0 (sim1) could not connect to a peer at 127.0.0.1: connection refused; 127.0.0.1 is "
                         "a loopback address: a host's own name resolves to it (/etc/hosts), so gloo advertised it")
    assert "GLOO_SOCKET_IFNAME" in why.fix


def test_a_failed_host_allocation_is_host_memory() -> None:
    cause = diagnose("host-alloc", ended=[11.0, 10.0], stopped={0})
    why = explained(cause)
    assert why.signature == "host-out-of-memory"
    assert why.cause == ("rank 2 on node 1 (local-b) could not allocate 100000000000000 bytes of host memory "
                         "(not GPU memory)")


def test_a_missing_script_names_the_hosts_without_it() -> None:
    log = NodeLog()
    log.feed((CAPTURED / "script-missing" / "node0.log").read_text().splitlines())
    state = decode_status("local-a", {"state": "exited", "exit_code": 1, "ended_at": 10.0})
    cause = find_root_cause({0: "local-a"}, {0: log}, {0: state}, stopped_by_us=set())
    assert cause is not None
    why = explained(cause)
    assert why.signature == "script-missing"
    assert why.cause == "the script /tmp/sigs/nosuch.py does not exist on local-a"
    # with a second node that found it
    why = explain(cause, {0: "local-a", 1: "local-b"}, {0: log.lines(), 1: ["[rank1]:step 1"]})
    assert why is not None
    assert why.cause == "the script /tmp/sigs/nosuch.py does not exist on local-a (local-b did not report it)"


def _root(*lines: str, signal: int | None = None, rank: int | None = 0) -> RootCause:
    return RootCause(0, "gpu-a", rank, 0, None if signal else 1, signal, tuple(lines))


@pytest.mark.parametrize(("lines", "signature", "cause"), [
    # torch.cuda's allocator, as reported from real runs (CUDA cannot run here)
    (("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 324.00 MiB. GPU 0 has a total capacity of "
      "7.63 GiB of which 91.25 MiB is free. Including non-PyTorch memory, this process has 7.52 GiB memory in use.",),
     "cuda-out-of-memory", "rank 0 on node 0 (gpu-a) ran out of GPU memory (CUDA out of memory)"),
    # ProcessGroupNCCL's watchdog, as reported from a real run
    (("[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation "
      "timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) "
      "ran for 600081 milliseconds before timing out.",),
     "collective-timeout", "rank 0 on node 0 (gpu-a) timed out after 600000 ms in a collective (BROADCAST)"),
])
def test_gpu_only_signatures(lines: tuple[str, ...], signature: str, cause: str) -> None:
    why = explain(_root(*lines), {0: "gpu-a"}, {0: [f"[rank0]:{line}" for line in lines]})
    assert why is not None and why.signature == signature
    assert why.cause.startswith(cause)


def test_a_template_field_that_no_pattern_filled_reads_empty() -> None:
    odd = Signature("odd", (r"boom",), "{who} failed{nothing}", "fix it{nothing}")
    why = explain(_root("boom"), {0: "gpu-a"}, {}, signatures=[odd])
    assert why == Explanation("odd", "rank 0 on node 0 (gpu-a) failed", "fix it")


def test_a_job_that_printed_nothing_is_not_explained() -> None:
    assert explain(_root("RuntimeError: boom"), {0: "gpu-a"}, {0: ["[rank0]:RuntimeError: boom"]}) is None


@pytest.mark.parametrize(("why", "what", "remedy"), [
    ("no space left on the file system of /s/clusterrun/jobs/j-1/node0/attempt1)", "full", "free space there"),
    ("the file system of /s/clusterrun/jobs/j-1/node0/attempt1 is read-only)", "read-only", "make it writable"),
])
def test_a_full_or_read_only_state_dir_names_its_file_system_and_the_fix(why: str, what: str, remedy: str) -> None:
    lost = f"the job's processes on the host are gone and their end could not be recorded: the supervisor could " \
           f"not write its state ({why}"
    explanation = explain(_root(lost), {0: "gpu-a"}, {})
    assert explanation is not None and explanation.signature == "state-disk-full"
    assert explanation.cause == ("gpu-a could not keep node 0's log and state: the file system of /s/clusterrun is "
                                 + what)
    assert explanation.fix.startswith(f"{remedy} on gpu-a (`df -h /s/clusterrun`)")


def test_every_signature_is_tested() -> None:
    tested = {"killed", "oom-killed", "module-missing", "collective-timeout", "address-in-use", "master-unreachable",
              "cuda-out-of-memory", "gloo-abort", "script-missing", "host-out-of-memory", "peer-refused",
              "state-disk-full"}
    assert {s.name for s in SIGNATURES} == tested


def test_the_transient_start_up_failures_are_marked_in_the_table() -> None:
    """The one place that says which failures the owner retries at start-up (``diagnose``)."""
    marked = {s.name: s.transient_start for s in SIGNATURES if s.transient_start}
    assert set(marked) == {"gloo-abort", "address-in-use"}
    assert transient_start(Explanation("gloo-abort", "c", "f")) == marked["gloo-abort"]
    assert transient_start(Explanation("cuda-out-of-memory", "c", "f")) is None and transient_start(None) is None


def test_the_summary_shows_the_cause_and_the_fix() -> None:
    import io

    from clusterrun.views.printer import Printer

    cause = diagnose("sigkill", ended=[10.0, 11.0], stopped={1}, died={1: 9.0, 0: 9.5})
    err = io.StringIO()
    Printer(out=io.StringIO(), err=err, colour=False).summary(JobResult("j", (
        NodeResult(0, "local-a", NodeState.FAILED, exit_code=1),
        NodeResult(1, "local-b", NodeState.STOPPED, signal=15)), root_cause=cause))
    lines = err.getvalue().splitlines()
    at = lines.index("clusterrun: root cause: rank 1 on node 0 (local-a, local rank 1): killed by SIGKILL")
    assert lines[at + 1] == f"clusterrun: cause: {explained(cause).cause}"
    assert lines[at + 2] == f"clusterrun: fix: {explained(cause).fix}"


def test_the_dashboard_and_the_record_show_the_cause_and_the_fix(tmp_path: Path) -> None:
    from clusterrun.core.events import AttemptStarted, JobFinished, NodeExited
    from clusterrun.life.recorder import Recorder
    from clusterrun.store.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord
    from clusterrun.views.board import Board

    cause = diagnose("module-one-host", ended=[11.0, 10.0], stopped={0})
    why = explained(cause)
    nodes = (NodeResult(0, "local-a", NodeState.STOPPED, exit_code=1),
             NodeResult(1, "local-b", NodeState.FAILED, exit_code=1))
    finished = JobFinished(None, result=JobResult("j-20261123-100000-abcd", nodes, root_cause=cause))
    board = Board(ring=10)
    board.apply(AttemptStarted(None, job_id="j", name="j", attempt=1, master_addr="127.0.0.1", master_port=1,
                               world_size=4, nodes=(("local-a", 2, None), ("local-b", 2, None))))
    for result in nodes:
        board.apply(NodeExited(result.node, result=result))
    board.apply(finished)
    text = board.root_text().splitlines()
    assert text[:3] == [f"root cause: {cause.describe()}", f"cause: {why.cause}", f"fix: {why.fix}"]
    # the record keeps them for `ps JOB` (the monitor and later controllers)
    store = JobStore(tmp_path)
    store.create(JobRecord(
        job_id="j-20261123-100000-abcd", name="j", created=0.0, hosts_file="h.yaml", hosts_text="", script="s.py",
        script_args=[], env_overrides={}, local_cwd="/", grace=1.0, ssh_config=None, plan={}, state="running",
        attempts=[AttemptRecord(1, started=0.0, master_port=1)],
        nodes=[NodeRecord(0, "local-a", state="running"), NodeRecord(1, "local-b", state="running")]))
    recorder = Recorder(store, "j-20261123-100000-abcd", 1)
    recorder(finished)
    attempt = store.load("j-20261123-100000-abcd").attempts[-1]
    assert (attempt.cause, attempt.fix) == (why.cause, why.fix)


# Real torchrun (gloo on the CPU) on local nodes: the failure happens for real, and `up`, the
# monitor and `ps` print the cause line. Few and small: every run costs seconds of shared CPU.

def _clusterrun(*args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _hosts(path: Path, state_dir: Path, *hosts: str, extra: str = "") -> Path:
    path.write_text(f"state_dir: {state_dir}\n{extra}defaults:\n  transport: local\n  nproc: 1\nhosts:\n"
                    + "".join(hosts))
    return path


@pytest.mark.integration
def test_real_a_module_missing_on_one_host_is_named_by_the_monitor_and_ps(tmp_path: Path, state_dir: Path,
                                                                           controller_state: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "crtest_only_on_a.py").write_text("")
    hosts = _hosts(tmp_path / "hosts.yaml", state_dir, f"  - host: local-a\n    env: {{PYTHONPATH: {site}}}\n",
                   "  - host: local-b\n")
    started = _clusterrun("up", "-d", hosts, "tests/_support/import_module.py", "crtest_only_on_a")
    assert started.returncode == 0, started.stderr
    job = started.stdout.strip()
    assert _clusterrun("wait", job).returncode == 1
    cause = ("cause: Python module 'crtest_only_on_a' not found on local-b only (local-a did not report it): "
             "the hosts' Python environments differ")
    shown = _clusterrun("ps", job)
    assert shown.returncode == 0, shown.stderr
    assert cause in shown.stdout.splitlines(), shown.stdout
    assert "fix: install it for the interpreter on local-b " in shown.stdout
    log = controller_state / "clusterrun" / "jobs" / job / "monitor.log"
    monitor_log = wait_for(lambda: "FAILED" in (text := log.read_text()) and text, timeout=30,
                           what="the monitor's summary")
    assert f"clusterrun: {cause}" in monitor_log.splitlines(), monitor_log


@pytest.mark.integration
def test_real_a_rank_killed_by_sigkill(tmp_path: Path, state_dir: Path) -> None:
    hosts = _hosts(tmp_path / "hosts.yaml", state_dir, "  - host: local-a\n    nproc: 2\n")
    proc = run_up(hosts, "tests/_support/fail_rank.py", "1", "kill", "9")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert "clusterrun: root cause: rank 1 on node 0 (local-a, local rank 1): killed by SIGKILL" in lines, proc.stderr
    # a `kill -9`: the kernel's log, read where it can be, names no OOM kill of that process (torchrun, stopped
    # at once after its rank failed, reports nothing: the rank's pid is the one its host recorded)
    log = KernelLog()
    log.close()
    kernel = (re.escape(f"the kernel's log is not readable here: {log.error}; the kernel's OOM killer sends SIGKILL")
              if log.error else r"the kernel's log names no OOM kill of PID \d+ during the attempt")
    cause = next(line for line in lines if line.startswith("clusterrun: cause: "))
    assert re.match(re.escape("clusterrun: cause: rank 1 on node 0 (local-a) was killed by SIGKILL; ") + kernel,
                    cause), cause
    assert "killed by the kernel's OOM killer" not in cause


@pytest.mark.integration
def test_real_the_master_port_taken(tmp_path: Path, state_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        hosts = _hosts(tmp_path / "hosts.yaml", state_dir, "  - host: local-a\n",
                       extra=f"master:\n  port: {port}\n")
        # --no-preflight: the preflight would find the port taken before the start (test_doctor)
        proc = run_up("--no-retry-startup", "--no-preflight", hosts, "tests/_support/import_module.py", "os")
    assert proc.returncode == 1, proc.stderr
    assert (f"clusterrun: cause: torchrun on node 0 (local-a) could not listen on the master port {port}: another "
            "process on local-a holds it") in proc.stderr.splitlines(), proc.stderr
    assert f"`ss -ltnp 'sport = :{port}'`" in proc.stderr


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_real_a_node_that_cannot_reach_the_master(tmp_path: Path, state_dir: Path) -> None:
    """Node 1's torchrun runs in a network namespace of its own (its `python:` is a wrapper; its
    agent does not, so the route to the master looks fine, as behind a firewall): 127.0.0.1 there
    refuses, so it never reaches node 0's store; a short rendezvous timeout for node 1
    (PET_RDZV_CONF is torchrun's --rdzv-conf) makes it give up in seconds."""
    wrapper = tmp_path / "python-in-own-netns"
    wrapper.write_text(f"#!/bin/sh\ncase \"$2\" in torch.distributed.run) exec unshare -n sh -c "
                       f"'{shutil.which('ip') or 'ip'} link set lo up && exec \"$0\" \"$@\"' {sys.executable} \"$@\";; "
                       f"esac\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    hosts = _hosts(tmp_path / "hosts.yaml", state_dir, "  - host: local-a\n",
                   f"  - host: local-b\n    python: {wrapper}\n    env: {{PET_RDZV_CONF: timeout=3}}\n")
    proc = run_up(hosts, "tests/_support/import_module.py", "os")
    assert proc.returncode == 1, proc.stderr
    port = re.search(r"master 127\.0\.0\.1:(\d+)", proc.stderr)
    assert port, proc.stderr
    assert (f"clusterrun: cause: node 1 (local-b) could not connect to the master 127.0.0.1:{port.group(1)} "
            "(torch's rendezvous store); 127.0.0.1 is a loopback address") in proc.stderr, proc.stderr
