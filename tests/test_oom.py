"""A rank killed by the OOM killer, told by the kernel's own words (or why they could not be read).

The agent's supervisor reads /dev/kmsg from the attempt's start (``kmsg.KernelLog``) and the
attempt's cgroup's ``memory.events``; the state's ``oom`` is decoded (``protocol.decode_oom``),
matched to the root cause's PID (``diagnose.oom_evidence``) and told by the ``oom-killed`` or
``killed`` signature. ``tests/_support/failures/oom-killed/`` holds what a real run on this
machine left: ``kmsg.txt`` records of a real OOM kill in a cgroup v1 memory cgroup (as /dev/kmsg
returns them, one per read), ``node0.log`` and ``oom.json`` (the ``output.log`` and the state's
``oom`` of ``oom_rank.py`` with rank 1 in a memory cgroup of 64 MiB).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from clusterrun.agent import kmsg
from clusterrun.core.events import OomEvidence, RootCause
from clusterrun.core.protocol import KernelOom, OomKill, ProtocolError, decode_oom, decode_status
from clusterrun.diagnose.rootcause import NodeLog, find_root_cause, oom_evidence
from clusterrun.diagnose.signatures import explain
from tests.conftest import ROOT, run_up, unique_job
from tests.simhosts import unavailable

CAPTURED = Path(__file__).parent / "_support" / "failures" / "oom-killed"
KILLED = ("Memory cgroup out of memory: Killed process 10283 (python3) total-vm:323768kB, anon-rss:72172kB, "
          "file-rss:6700kB, shmem-rss:0kB, UID:0 pgtables:200kB oom_score_adj:0")
SUMMARY = ("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/oomprobe-h-oom,"
           "task_memcg=/oomprobe-h-oom,task=python3,pid=10283,uid=0")


# ------------------------------------------------------------------ the agent: reading the kernel's log


def test_a_record_is_read_only_when_the_kernel_wrote_it() -> None:
    assert kmsg.kmsg_text(b"3,20503,20932441131,-;" + KILLED.encode() + b"\n") == KILLED
    # continuation lines (" SUBSYSTEM=...") are not part of the message
    assert kmsg.kmsg_text(b"6,1,2,-;usb 1-1: new device\n SUBSYSTEM=usb\n DEVICE=c189:1\n") == "usb 1-1: new device"
    # what a process writes to /dev/kmsg gets a facility of its own (LOG_USER: 8 + level): never the kernel's
    assert kmsg.kmsg_text(b"11,20504,20932441200,-;" + KILLED.encode() + b"\n") is None
    assert kmsg.kmsg_text(b"no record at all") is None


def test_the_kernels_oom_lines_name_the_victim() -> None:
    assert kmsg.oom_kill_of(KILLED) == {"pid": 10283, "comm": "python3", "line": KILLED}
    assert kmsg.oom_kill_of(SUMMARY) == {"pid": 10283, "comm": "python3", "summary": SUMMARY,
                                          "constraint": "CONSTRAINT_MEMCG", "oom_memcg": "/oomprobe-h-oom",
                                          "task_memcg": "/oomprobe-h-oom"}
    host = "Out of memory: Killed process 7 (pt main thread) total-vm:1kB, anon-rss:1kB, UID:0 oom_score_adj:0"
    assert kmsg.oom_kill_of(host) == {"pid": 7, "comm": "pt main thread", "line": host}
    allocating = "Out of memory (oom_kill_allocating_task): Killed process 8 (a (b)) total-vm:1kB"
    assert kmsg.oom_kill_of(allocating) == {"pid": 8, "comm": "a (b)", "line": allocating}
    old = "Killed process 9 (python) total-vm:1kB, anon-rss:1kB, file-rss:0kB"  # before Linux 5.1, its own line
    assert kmsg.oom_kill_of(old) == {"pid": 9, "comm": "python", "line": old}
    # nodes written with commas, a command with a comma: the fields are still found
    odd = "oom-kill:constraint=CONSTRAINT_NONE,nodemask=0-1,3,cpuset=/,mems_allowed=0-1,3,task=a,b,pid=12,uid=1000"
    assert kmsg.oom_kill_of(odd) == {"pid": 12, "comm": "a,b", "summary": odd, "constraint": "CONSTRAINT_NONE"}


@pytest.mark.parametrize("line", [
    "python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
    "oom_reaper: reaped process 10283 (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB",
    "Out of memory: Kill process 9 (python) score 912 or sacrifice child",  # chosen, not yet killed
    "my-daemon: Killed process 9 (python) after a timeout",  # not the OOM killer's
    "Killed process x (python)",
    "oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=,uid=0",
])
def test_other_lines_name_no_oom_victim(line: str) -> None:
    assert kmsg.oom_kill_of(line) is None


def test_the_captured_records_make_one_kill_with_both_lines() -> None:
    log = kmsg.KernelLog(path="/nonexistent/kmsg")
    for record in (CAPTURED / "kmsg.txt").read_bytes().splitlines(keepends=True):
        log.feed(record)
    assert list(log.kills.values()) == [{"pid": 10283, "comm": "python3", "summary": SUMMARY, "line": KILLED,
                                         "constraint": "CONSTRAINT_MEMCG", "oom_memcg": "/oomprobe-h-oom",
                                         "task_memcg": "/oomprobe-h-oom"}]


def test_only_the_newest_kills_are_kept_and_the_jobs_last() -> None:
    log = kmsg.KernelLog(path="/nonexistent/kmsg")
    log.keep = {2}  # a PID of the job
    for pid in range(1, kmsg.OOM_KILLS_KEPT + 6):
        log.feed(f"3,{pid},0,-;Out of memory: Killed process {pid} (p) total-vm:1kB".encode())
    assert list(log.kills) == [2, *range(7, kmsg.OOM_KILLS_KEPT + 6)]


def test_a_drain_reads_record_by_record_through_an_overwrite_until_none_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read of /dev/kmsg returns one record; EPIPE: records were overwritten (the next read
    goes on); EAGAIN: none left. Nothing after EAGAIN is read in the same drain."""
    replies: list[bytes | OSError] = [b"3,1,0,-;Out of memory: Killed process 5 (a) total-vm:1kB\n",
                                      BrokenPipeError(errno.EPIPE, "Broken pipe"),
                                      b"3,9,0,-;Out of memory: Killed process 6 (b) total-vm:1kB\n",
                                      BlockingIOError(errno.EAGAIN, "again"),
                                      b"3,10,0,-;Out of memory: Killed process 7 (c) total-vm:1kB\n"]
    log = kmsg.KernelLog(path="/nonexistent/kmsg")
    log.fd, log.error = 1000, None  # read through the fake below only

    def read(fd: int, size: int) -> bytes:
        assert (fd, size) == (1000, kmsg.KMSG_RECORD)
        reply = replies.pop(0)
        if isinstance(reply, OSError):
            raise reply
        return reply

    with monkeypatch.context() as patch:
        patch.setattr(kmsg.os, "read", read)
        log.drain()
    assert (list(log.kills), log.overwritten, log.error) == ([5, 6], True, None)
    assert len(replies) == 1
    log.fd = -1


def test_an_unreadable_log_says_why_and_what_reading_it_needs() -> None:
    log = kmsg.KernelLog(path="/nonexistent/kmsg")
    assert (log.fd, log.error) == (-1, "/nonexistent/kmsg: No such file or directory")
    restrict = Path("/proc/sys/kernel/dmesg_restrict").read_text().strip()
    assert kmsg.kmsg_problem("/dev/kmsg", PermissionError(errno.EPERM, "x")) == (
        f"/dev/kmsg: Operation not permitted (kernel.dmesg_restrict = {restrict}: reading it needs root or CAP_SYSLOG)")


def test_the_attempts_cgroup_counts_its_oom_kills(tmp_path: Path) -> None:
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n")
    assert kmsg.cgroup_oom_kills(str(tmp_path)) == (1, None)
    (tmp_path / "memory.events").unlink()
    count, why = kmsg.cgroup_oom_kills(str(tmp_path))
    assert count is None and why == (f"{tmp_path}/memory.events does not exist: the memory controller is not enabled "
                                     "for that cgroup (it is not in cgroup.subtree_control above it, or is bound to "
                                     "a cgroup v1 hierarchy)")


def test_the_report_is_what_the_state_keeps(tmp_path: Path) -> None:
    (tmp_path / "memory.events").write_text("oom 1\noom_kill 1\n")
    log = kmsg.KernelLog(path="/nonexistent/kmsg")
    log.feed(b"3,1,0,-;" + KILLED.encode())
    report = log.report(str(tmp_path))
    decoded = decode_oom("h", json.loads(json.dumps(report)))
    assert decoded == KernelOom(kills=(OomKill(10283, "python3", line=KILLED),), kmsg="/nonexistent/kmsg",
                                kmsg_error="/nonexistent/kmsg: No such file or directory",
                                cgroup_events=f"{tmp_path}/memory.events", cgroup_oom_kills=1,
                                pid_namespace=os.readlink("/proc/self/ns/pid") != "pid:[4026531836]")
    assert log.report(None)["cgroup_error"] == "no cgroup of its own for this attempt"


def _last_seq() -> int:
    """The sequence number of the newest record in the kernel's log now."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    last = -1
    try:
        while True:
            try:
                last = int(os.read(fd, kmsg.KMSG_RECORD).split(b",", 2)[1])
            except BlockingIOError:
                return last
            except BrokenPipeError:
                continue
    finally:
        os.close(fd)


def test_the_real_kernel_log_is_read_from_where_it_was_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OOM kills of the attempt only: no record older than the open is read (this kernel's
    log holds many, OOM kills of earlier tests among them)."""
    before = _last_seq() if os.access("/dev/kmsg", os.R_OK) else -1
    log = kmsg.KernelLog()
    if log.error is not None or before < 0:
        unavailable(f"the kernel's log is not readable here, or empty: {log.error}")
    read: list[int] = []
    monkeypatch.setattr(log, "feed", lambda record: read.append(int(record.split(b",", 2)[1])))
    try:
        log.drain()  # EAGAIN at once, or after records written since it opened: no error either way
        assert log.error is None and log.fd >= 0
        assert all(seq > before for seq in read), (before, read)
    finally:
        log.close()


def test_the_real_kernel_log_is_not_readable_by_nobody_under_dmesg_restrict(readable_code: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(USER_PYTHON):
        unavailable(f"needs root, setpriv(1) and {USER_PYTHON}")
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        unavailable("kernel.dmesg_restrict is not 1 here: anybody may read the kernel's log")
    code = "from clusterrun.agent.kmsg import KernelLog; print(KernelLog().error)"
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", USER_PYTHON, "-S",
                           "-c", code], capture_output=True, text=True, cwd=readable_code,
                          env={"PYTHONPATH": str(readable_code)}, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("/dev/kmsg: Operation not permitted (kernel.dmesg_restrict = 1: reading it needs "
                                   "root or CAP_SYSLOG)")


def test_a_pid_namespace_of_its_own_is_noticed() -> None:
    """In a PID namespace (a container, a simulated host) the kernel's PIDs are not the job's."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        unavailable("needs root and unshare(1) for a PID namespace")
    code = ("from clusterrun.agent.kmsg import KernelLog; "
            "print(KernelLog('/nonexistent/kmsg').report(None)['pid_namespace'])")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-S", "-c", code],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=60,
                          check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
    assert kmsg.KernelLog("/nonexistent/kmsg").report(None)["pid_namespace"] is (
        os.readlink("/proc/self/ns/pid") != "pid:[4026531836]")


USER_PYTHON = "/usr/bin/python3"  # an interpreter every user may run (this one may live in /root)


@pytest.mark.integration
def test_real_an_unprivileged_supervisor_says_the_kernels_log_is_not_readable() -> None:
    """A node's job run as ``nobody`` (no cgroup of its own) kills itself with SIGKILL: its state
    says why the kernel's log could not be read, and the root cause says so and keeps `dmesg`."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports.local import LocalTransport

    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(USER_PYTHON):
        unavailable(f"needs root, setpriv and {USER_PYTHON}")
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        unavailable("kernel.dmesg_restrict is not 1 here: anybody may read the kernel's log")
    folder = Path(tempfile.mkdtemp(prefix="crtest-oom-"))  # pytest's are private to root
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)
    wrapper = folder / "python"
    # the agent's cache its own (root's ~/.cache is refused), not this process's, where the controller keeps its zip
    wrapper.write_text(f'#!/bin/sh\nXDG_CACHE_HOME={folder / "cache"} exec setpriv --reuid=65534 --regid=65534 '
                       f'--clear-groups {USER_PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    transport = LocalTransport(HostSpec(host="here", transport="local", python=str(wrapper)))
    request = {"job": unique_job("crtest-oom"), "node": 0, "attempt": 1, "state_dir": str(folder / "state")}
    try:
        transport.call({**request, "op": "start", "env": {}, "cwd": str(folder),
                        "argv": [USER_PYTHON, "-c", "import os; os.kill(os.getpid(), 9)"]})
        end = list(transport.stream({**request, "op": "follow", "logs": False}))[-1]
    finally:
        transport.call({**request, "op": "stop", "grace": 1})
        shutil.rmtree(folder, ignore_errors=True)
    status = decode_status("here", end["state"])
    assert (status.signal, status.oom is not None) == (9, True), end
    unreadable = "/dev/kmsg: Operation not permitted (kernel.dmesg_restrict = 1: reading it needs root or CAP_SYSLOG)"
    assert status.oom is not None and status.oom.kmsg_error == unreadable
    cause = find_root_cause({0: "here"}, {0: NodeLog()}, {0: status}, stopped_by_us=set())
    assert cause is not None and cause.explanation is not None
    assert cause.explanation.cause.startswith(f"torchrun on node 0 (here) was killed by SIGKILL; the kernel's log is "
                                              f"not readable here: {unreadable}; "), cause.explanation
    assert cause.explanation.fix.startswith(
        f"check `dmesg` on here (as root) for 'Killed process {status.torchrun_pid}'"), cause.explanation


# ------------------------------------------------------------------ the controller: decoded and matched


def test_the_state_decodes_typed_and_a_wrong_field_names_itself() -> None:
    status = decode_status("gpu-a", {"state": "exited", "exit_code": 1,
                                     "oom": json.loads((CAPTURED / "oom.json").read_text())})
    assert status.oom is not None and status.oom.kills[0].pid == 18071
    assert status.oom.kills[0].constraint == "CONSTRAINT_MEMCG" and status.oom.cgroup_oom_kills is None
    assert decode_status("gpu-a", {"state": "exited", "exit_code": 1}).oom is None  # an agent before this one
    with pytest.raises(ProtocolError, match=r"state\.oom\.kills\[0\] has pid='12'"):
        decode_status("gpu-a", {"state": "exited", "oom": {"kills": [{"pid": "12"}]}})


def _captured_root(oom: dict[str, object] | None) -> RootCause:
    log = NodeLog()
    log.feed((CAPTURED / "node0.log").read_text().splitlines())
    state = {"state": "exited", "exit_code": 1, "ended_at": 10.0, "torchrun": {"pid": 18053},
             "workers": [{"pid": 18065, "rank": 0, "died": 9.5}, {"pid": 18071, "rank": 1, "died": 9.0}]}
    if oom is not None:
        state["oom"] = oom
    cause = find_root_cause({0: "local-a"}, {0: log}, {0: decode_status("local-a", state)}, stopped_by_us=set())
    assert cause is not None
    return cause


def test_the_kernels_line_naming_the_ranks_pid_explains_the_root_cause() -> None:
    cause = _captured_root(json.loads((CAPTURED / "oom.json").read_text()))
    assert (cause.rank, cause.signal, cause.pid) == (1, 9, 18071)  # the pid of torchrun's report
    assert cause.oom is not None and cause.oom.line is not None and cause.oom.memcg == "/crtest-oom-manual"
    assert cause.explanation is not None and cause.explanation.signature == "oom-killed"
    assert cause.explanation.cause == (
        "rank 1 on node 0 (local-a) was killed by the kernel's OOM killer when the memory cgroup /crtest-oom-manual "
        "reached its limit (PID 18071); the kernel's log says: Memory cgroup out of memory: Killed process 18071 "
        "(python) total-vm:818124kB, anon-rss:211708kB, file-rss:79228kB, shmem-rss:0kB, UID:0 pgtables:876kB "
        "oom_score_adj:0")
    assert cause.explanation.fix.endswith(", or raise the memory limit of /crtest-oom-manual on local-a (memory.max; "
                                          "memory.limit_in_bytes in cgroup v1; a container's or a scheduler's limit)")


def test_a_kill_of_another_pid_is_not_the_root_causes() -> None:
    oom = json.loads((CAPTURED / "oom.json").read_text())
    oom["kills"][0]["pid"] = 18072
    cause = _captured_root(oom)
    assert cause.explanation is not None and cause.explanation.signature == "killed"
    assert cause.explanation.cause == (
        "rank 1 on node 0 (local-a) was killed by SIGKILL; the kernel's log names no OOM kill of PID 18071 during the "
        "attempt (it names other OOM kills at the time: 18072 (python)): not the kernel's OOM killer (it logs every "
        "kill), but a process: a user-space OOM killer (systemd-oomd, earlyoom), a scheduler's or a watchdog's limit, "
        "a `kill -9`")
    assert cause.explanation.fix == ("find what sends SIGKILL to the job on local-a (`journalctl` there shows "
                                     "systemd-oomd's and earlyoom's kills; a scheduler's limit, a watchdog, a "
                                     "`kill -9`)")


def test_torchrun_itself_killed_is_matched_by_its_own_pid() -> None:
    kill = {"pid": 700, "comm": "torchrun", "constraint": "CONSTRAINT_NONE",
            "line": "Out of memory: Killed process 700 (torchrun) total-vm:9kB"}
    state = decode_status("gpu-a", {"state": "exited", "exit_code": -9, "signal": 9, "ended_at": 5.0,
                                    "torchrun": {"pid": 700}, "oom": {"kills": [kill]}})
    cause = find_root_cause({0: "gpu-a"}, {0: NodeLog()}, {0: state}, stopped_by_us=set())
    assert cause is not None and (cause.rank, cause.pid) == (None, 700)
    assert cause.explanation is not None and cause.explanation.cause == (
        "torchrun on node 0 (gpu-a) was killed by the kernel's OOM killer when gpu-a ran out of memory (PID 700); "
        "the kernel's log says: Out of memory: Killed process 700 (torchrun) total-vm:9kB")


def test_the_job_tells_the_kill_its_node_reported() -> None:
    """Through the orchestrator on the fake cluster: the node's state carries the kernel's kill,
    fail-fast stops the other node, and the job's root cause quotes the kernel's line."""
    from clusterrun.config.hostsfile import load_cluster_text
    from clusterrun.run.orchestrator import Job, Reconnect
    from clusterrun.transports.fake import FakeCluster
    from tests.test_orchestrator import owned

    fake = FakeCluster()
    spec = load_cluster_text("hosts:\n  - host: h0\n    nproc: 1\n  - host: h1\n    nproc: 1\n", "hosts.yaml")
    job = owned(Job(spec, "train.py", job_id="train-20261123-120000-abcd", name="train", emit=lambda event: None,
                    transport_factory=fake.transport, reconnect=Reconnect(first=0.01, most=0.02)))
    job.prepare()
    job.start()
    node = fake.wait_started("train-20261123-120000-abcd", 1)
    node.write("  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: 4321)\n")  # torchrun's failure report
    line = "Out of memory: Killed process 4321 (python) total-vm:9kB"
    node.exit(1, oom={"kills": [{"pid": 4320, "comm": "java"},
                                {"pid": 4321, "comm": "python", "line": line, "constraint": "CONSTRAINT_NONE"}]})
    try:
        result = job.run()
    finally:
        job.close()
    root = result.root_cause
    assert root is not None and (root.node, root.rank, root.signal, root.pid) == (1, 1, 9, 4321)
    assert root.explanation is not None and root.explanation.cause == (
        f"rank 1 on node 1 (h1) was killed by the kernel's OOM killer when h1 ran out of memory (PID 4321); the "
        f"kernel's log says: {line}")


def test_a_pid_namespace_matches_no_pid() -> None:
    report = KernelOom(kills=(OomKill(18071, "python", line="Out of memory: Killed process 18071 (python)"),),
                       pid_namespace=True)
    evidence = oom_evidence(18071, report)
    assert evidence.line is None and evidence.pid_namespace and evidence.others == ("18071 (python)",)


ROOT_KILLED = RootCause(0, "gpu-a", 1, 1, None, 9, pid=4242)
UNREADABLE = "/dev/kmsg: Operation not permitted (kernel.dmesg_restrict = 1: reading it needs root or CAP_SYSLOG)"
# Evidence that proves nothing: only SIGKILL was seen.
UNPROVEN = {
    "unreadable": OomEvidence(pid=4242, unreadable=UNREADABLE, cgroup_error="no memory.events"),
    "overwritten": OomEvidence(pid=4242, overwritten=True),
    "pid namespace": OomEvidence(pid=4242, pid_namespace=True, others=("99 (python)",)),
    "no pid": OomEvidence(pid=None),
    "not recorded": OomEvidence(pid=4242, recorded=False),
    "no kill of it": OomEvidence(pid=4242, others=("99 (java)",), cgroup_kills=0),
}


def _told(oom: OomEvidence | None) -> tuple[str, str, str]:
    why = explain(replace(ROOT_KILLED, oom=oom), {0: "gpu-a"}, {})
    assert why is not None
    return why.signature, why.cause, why.fix


@pytest.mark.parametrize("case", sorted(UNPROVEN))
def test_only_sigkill_seen_is_never_called_the_oom_killer(case: str) -> None:
    signature, cause, fix = _told(UNPROVEN[case])
    assert signature == "killed"
    assert cause.startswith("rank 1 on node 0 (gpu-a) was killed by SIGKILL; ")
    assert "killed by the kernel's OOM killer" not in cause and "OOM killer killed" not in cause


def test_an_unreadable_log_is_said_so_and_keeps_the_dmesg_fix() -> None:
    assert _told(UNPROVEN["unreadable"]) == (
        "killed",
        f"rank 1 on node 0 (gpu-a) was killed by SIGKILL; the kernel's log is not readable here: {UNREADABLE}; the "
        "kernel's OOM killer sends SIGKILL when memory runs out, and so does a `kill -9`",
        "check `dmesg` on gpu-a (as root) for 'Killed process 4242'; if it is there, lower the job's host memory use "
        "(batch size, DataLoader workers, pinned memory, data held in RAM), or use a host with more memory")
    # the other cases that prove nothing keep the dmesg fix too, but never claim "not the kernel's OOM killer"
    for case in ("overwritten", "pid namespace", "not recorded", "no pid"):
        _, cause, fix = _told(UNPROVEN[case])
        assert "not the kernel's OOM killer" not in cause and fix.startswith("check `dmesg` on gpu-a (as root)"), case
    assert "for 'Killed process';" in _told(UNPROVEN["pid namespace"])[2]  # its PID is not the kernel's


def test_the_attempts_cgroup_count_is_said_without_naming_a_pid() -> None:
    evidence = OomEvidence(pid=4242, unreadable=UNREADABLE, cgroup_kills=2,
                           cgroup_events="/sys/fs/cgroup/clusterrun-j-n0-a1/memory.events")
    assert _told(evidence)[:2] == (
        "oom-killed",
        "rank 1 on node 0 (gpu-a) was killed by SIGKILL, and the kernel's OOM killer killed 2 process(es) of this "
        "attempt on gpu-a (/sys/fs/cgroup/clusterrun-j-n0-a1/memory.events: oom_kill 2); which ones is not known: "
        f"the kernel's log is not readable here: {UNREADABLE}")


def test_many_other_kills_are_named_by_the_newest_four() -> None:
    others = tuple(f"{pid} (java)" for pid in range(1, 8))
    cause = _told(OomEvidence(pid=4242, others=others))[1]
    assert "(it names other OOM kills at the time: 4 (java), 5 (java), 6 (java), 7 (java) and 3 more)" in cause


def test_a_host_out_of_memory_is_told_from_a_cgroups_limit() -> None:
    line = "Out of memory: Killed process 4242 (python) total-vm:1kB"
    signature, cause, fix = _told(OomEvidence(pid=4242, line=line, constraint="CONSTRAINT_NONE"))
    assert signature == "oom-killed"
    assert cause == ("rank 1 on node 0 (gpu-a) was killed by the kernel's OOM killer when gpu-a ran out of memory "
                     f"(PID 4242); the kernel's log says: {line}")
    assert fix.endswith("or use a host with more memory")


# ------------------------------------------------------------------ real torchrun, a real OOM kill


def _memory_v1_mount() -> str | None:
    """Where the cgroup v1 memory controller is mounted (from /proc/mounts), or None."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup" and "memory" in fields[3].split(","):
            return fields[1]
    return None


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup v1 memory cgroup of 64 MiB for one rank, removed after the test."""
    mount = _memory_v1_mount()
    if os.geteuid() != 0 or mount is None:
        unavailable("needs root and a cgroup v1 memory controller (in /proc/mounts) to make a small memory cgroup")
    log = kmsg.KernelLog()
    log.close()
    if log.error is not None:
        unavailable(f"the kernel's log is not readable here: {log.error}")
    cgroup = Path(mount) / f"crtest-oom-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(64 << 20))
        yield cgroup
    finally:
        left = (cgroup / "cgroup.procs").read_text().split()
        for pid in left:  # a rank the kernel did not kill (a broken test): out of the cgroup, so it can go
            (Path(mount) / "cgroup.procs").write_text(pid)
        cgroup.rmdir()


@pytest.mark.integration
def test_real_a_rank_killed_by_the_oom_killer_is_told_with_the_kernels_line(
        tmp_path: Path, state_dir: Path, memory_cgroup: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"state_dir: {state_dir}\ndefaults:\n  transport: local\nhosts:\n  - host: local-a\n"
                     "    nproc: 2\n")
    proc = run_up(hosts, "tests/_support/oom_rank.py", "1", memory_cgroup)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert "clusterrun: root cause: rank 1 on node 0 (local-a, local rank 1): killed by SIGKILL" in lines, proc.stderr
    pid = next(line.split("(pid ")[1].split(")")[0] for line in proc.stdout.splitlines()
               if "rank 1 (pid " in line)
    assert (f"clusterrun: cause: rank 1 on node 0 (local-a) was killed by the kernel's OOM killer when the memory "
            f"cgroup /{memory_cgroup.name} reached its limit (PID {pid}); the kernel's log says: Memory cgroup out of "
            f"memory: Killed process {pid} (") in proc.stderr, proc.stderr
    assert (f"or raise the memory limit of /{memory_cgroup.name} on local-a") in proc.stderr
