"""``up --from-slurm`` and ``export --sbatch`` against a real Slurm: slurmctld and two slurmd on
simulated hosts (``tests/slurmsim.py``), jobs submitted with salloc and sbatch from the test."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_for
from tests.simhosts import SimHost
from tests.slurmsim import SlurmCluster

pytestmark = pytest.mark.integration

RANKS = """\
import os, signal, socket, sys, time
sys.stdout.write(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} on {socket.gethostname()} "
                 f"node {os.environ['GROUP_RANK']} args {sys.argv[1:]}\\n")  # one write: python -u splits a print
sys.stdout.flush()
if sys.argv[1:2] == ["fail"] and os.environ["RANK"] == sys.argv[2]:
    sys.exit(7)
if sys.argv[1:2] == ["env"]:
    sys.stdout.write(f"env {os.environ.get('CRTEST_MARK')} {os.environ.get('CRTEST_TOKEN')}\\n")
if sys.argv[1:2] == ["ignore"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1:2] in (["sleep"], ["ignore"]):
    time.sleep(600)
"""


def _files(tmp_path: Path, python: str | Path) -> tuple[Path, Path]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"defaults:\n  nproc: 2\n  python: {python}\n  env:\n    CRTEST_MARK: slurm\n"
                     "hosts:\n  - host: sim[1-2]\n")
    return script, hosts


def _env(slurm: SlurmCluster) -> dict[str, str]:
    return {**slurm.client_env(), "PYTHONPATH": str(ROOT)}


def _up(hosts: Path, *args: str) -> list[str]:
    return ["salloc", "-N2", sys.executable, "-m", "clusterrun", "up", "--from-slurm", "--slurm-hosts", str(hosts),
            *args]


def _run_up(slurm: SlurmCluster, tmp_path: Path, hosts: Path, *args: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``up --from-slurm`` under ``salloc -N2``, to its end (``env``: added to the Slurm client's)."""
    return subprocess.run(_up(hosts, *args), capture_output=True, text=True, env={**_env(slurm), **(env or {})},
                          cwd=tmp_path, timeout=300)


def _census(host: SimHost, marker: str) -> list[str]:
    """The processes on ``host`` whose command line holds ``marker``."""
    done = host.run("ps", "-ww", "-eo", "pid,args")  # -ww: whole command lines, not cut at 80 columns
    return [line for line in done.stdout.splitlines() if marker in line]


@pytest.mark.fake_torchrun
def test_up_from_slurm_runs_one_torchrun_per_node(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                  fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    done = _run_up(slurm_cluster, tmp_path, hosts, str(script), "--", "a b")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for rank in range(4):
        node = rank // 2
        expected = f"rank {rank} of 4 on sim{node + 1} node {node} args ['a b']"
        assert f"node{node} sim{node + 1} rank{rank} | {expected}" in lines, done.stdout
    assert "master sim1:" in done.stderr
    assert "job ranks-" in done.stderr and "succeeded" in done.stderr


@pytest.mark.fake_torchrun
def test_a_failing_rank_fails_the_job_and_srun_ends_the_other_node(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                   fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    done = _run_up(slurm_cluster, tmp_path, hosts, str(script), "fail", "3")
    assert done.returncode == 1, done.stderr
    assert "node1 sim2: failed (exit code 1)" in done.stderr
    assert "FAILED" in done.stderr
    assert "root cause: rank 3 on node 1 (sim2, local rank 1): exit code 7" in done.stderr


@pytest.mark.fake_torchrun
@pytest.mark.parametrize(("mode", "said"), [
    ("sleep", r"scancel --signal=TERM \d+\.\d+: the step ended within the grace"),
    ("ignore", r"scancel \d+\.\d+: the step is cancelled on every node"),  # SIGTERM ignored: SIGKILL after 1 s
])
def test_sigterm_cancels_the_step_and_leaves_nothing(slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path,
                                                     mode: str, said: str) -> None:
    script, hosts = _files(tmp_path, fake_python)
    proc = subprocess.Popen(_up(hosts, "--grace=1", str(script), mode), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(slurm_cluster), cwd=tmp_path,
                            start_new_session=True)
    try:
        seen = _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        censuses = [_census(h, str(script)) for h in slurm_cluster.sim.hosts]
        assert [len(c) for c in censuses] == [4, 4], (censuses, seen)  # the task's shell, torchrun, its 2 workers
        controller = wait_for(lambda: _clusterrun_under(proc.pid), 10, what="clusterrun under salloc")
        os.kill(controller, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == 143, err
    assert re.search(said, err), err
    assert "stopped (SIGTERM)" in err
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name


@pytest.mark.fake_torchrun
def test_the_step_ends_with_its_controller(slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    """clusterrun SIGKILLed: srun gets SIGTERM (its parent-death signal) and ends the step; nothing is left."""
    script, hosts = _files(tmp_path, fake_python)
    proc = subprocess.Popen(_up(hosts, str(script), "sleep"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(slurm_cluster), cwd=tmp_path,
                            start_new_session=True)
    try:
        _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        controller = wait_for(lambda: _clusterrun_under(proc.pid), 10, what="clusterrun under salloc")
        os.kill(controller, signal.SIGKILL)
        proc.communicate(timeout=60)  # salloc ends once its command and the step have
        for host in slurm_cluster.sim.hosts:
            wait_for(lambda h=host: _census(h, str(script)) == [], 30, what=f"nothing left on {host.name}")
    finally:
        _end(proc)


@pytest.mark.fake_torchrun
def test_ps_lists_the_step_and_down_stops_it(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                       fake_python: Path) -> None:
    """`ps` where the job has no record (another machine's state dir) lists the running step; `down JOB` from
    there: the step found by its name, SIGTERM, nothing left; `up` says stopped."""
    script, hosts = _files(tmp_path, fake_python)
    proc = subprocess.Popen(_up(hosts, str(script), "sleep"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(slurm_cluster), cwd=tmp_path, start_new_session=True)
    try:
        seen = _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        job_id = next(m.group(1) for line in seen if (m := re.match(r"clusterrun: job (\S+): 2 nodes", line)))
        elsewhere = {**_env(slurm_cluster), "XDG_STATE_HOME": str(tmp_path / "elsewhere")}
        ps = subprocess.run([sys.executable, "-m", "clusterrun", "ps"], capture_output=True, text=True,
                            env=elsewhere, timeout=60)
        assert re.search(rf"^{job_id}\s+ranks\s+sim\[1-2\]\s+running \(Slurm step \d+\.\d+\)\s+1\s+\S+$",
                         ps.stdout, re.MULTILINE), ps.stdout + ps.stderr
        down = subprocess.run([sys.executable, "-m", "clusterrun", "down", job_id[:-3]], capture_output=True,
                              text=True, env=elsewhere, timeout=60)
        out, _ = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert down.returncode == 0, down.stderr
    assert re.search(rf"stopping job {job_id}: Slurm step \d+\.\d+\n.*: the step ended within the grace\n"
                     rf".*job {job_id} stopped; Slurm ended every process", down.stderr), down.stderr
    assert proc.returncode == 1, out
    assert f"job {job_id} stopped (clusterrun down)" in out and "node0 sim1: stopped" in out
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name


def _end(proc: subprocess.Popen[str]) -> None:
    """salloc and what it started (clusterrun, srun: process groups of their own), if still there."""
    if proc.poll() is None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    if proc.stdout is not None:  # a test that failed before reading it leaves it open: a later test's gc would say so
        proc.stdout.close()


def _read_lines(proc: subprocess.Popen[str], enough: Callable[[list[str]], bool], timeout: float) -> list[str]:
    """Lines of ``proc``'s stdout until ``enough`` of them came; fail after ``timeout`` seconds without. Read
    from the pipe itself: a line left in the text wrapper's buffer would wait for data that never comes."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + timeout
    while not enough(lines):
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            pytest.fail(f"not seen within {timeout} s; stdout so far: {lines}")
        chunk = os.read(fd, 65536)
        if not chunk:
            pytest.fail(f"the job ended first; stdout: {lines}")
        *whole, pending = (pending + chunk).split(b"\n")
        lines += [line.decode() + "\n" for line in whole]
    return lines


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        with contextlib.suppress(OSError):
            todo += [int(c) for c in Path(f"/proc/{todo[0]}/task/{todo[0]}/children").read_text().split()]
        found.append(todo.pop(0))
    return found[1:]


def _clusterrun_under(pid: int) -> int | None:
    """The pid of ``python -m clusterrun`` that salloc ``pid`` started."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if b"clusterrun" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    return None


@pytest.mark.fake_torchrun
def test_the_exported_batch_script_runs_under_sbatch(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                     fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    batch = tmp_path / "job.sbatch"
    export = subprocess.run([sys.executable, "-m", "clusterrun", "export", "--sbatch", "-o", str(batch),
                             "--env", "CRTEST_TOKEN=v4lue", str(hosts), str(script), "env"],
                            capture_output=True, text=True, env=_env(slurm_cluster), cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    assert "v4lue" not in batch.read_text()  # a secret: the script takes it from sbatch's environment
    out = tmp_path / "job.out"
    done = subprocess.run(["sbatch", "--wait", f"--output={out}", str(batch)], capture_output=True, text=True,
                          env={**_env(slurm_cluster), "CRTEST_TOKEN": "from-sbatch"}, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr + out.read_text()
    lines = out.read_text().splitlines()
    for rank in range(4):
        node = rank // 2
        assert f"{node}: [rank{rank}]:rank {rank} of 4 on sim{node + 1} node {node} args ['env']" in lines, lines
        assert f"{node}: [rank{rank}]:env slurm from-sbatch" in lines, lines
    unset = subprocess.run(["sbatch", "--wait", f"--output={out}", str(batch)], capture_output=True, text=True,
                           env=_env(slurm_cluster), cwd=tmp_path, timeout=120)
    assert unset.returncode != 0
    assert "CRTEST_TOKEN: set CRTEST_TOKEN in the environment you run sbatch from" in out.read_text()


@pytest.mark.fake_torchrun
def test_up_from_slurm_in_a_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    """The batch step (on the first node, with SLURM_PROCID but no step id of its own) runs clusterrun, whose srun
    starts the job step."""
    script, hosts = _files(tmp_path, fake_python)
    batch = tmp_path / "up.sbatch"
    batch.write_text(f"#!/bin/sh\nexec {shlex.join(_up(hosts, str(script), 'batch')[2:])}\n")
    out = tmp_path / "up.out"
    done = subprocess.run(["sbatch", "--wait", "-N2", f"--output={out}", str(batch)], capture_output=True, text=True,
                          env=_env(slurm_cluster), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr + out.read_text()
    lines = out.read_text().splitlines()
    for rank in range(4):
        node = rank // 2
        assert f"node{node} sim{node + 1} rank{rank} | rank {rank} of 4 on sim{node + 1} node {node} args ['batch']" \
            in lines, lines


def test_real_torchrun_allreduces_over_gloo_through_srun(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The real torchrun (no stand-in): the static rendezvous on the allocation's first node, gloo between
    nodes; torchrun's per-rank files in the task's directory under TMPDIR, removed at its end."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"defaults:\n  nproc: 2\n  python: {sys.executable}\nhosts:\n  - host: sim[1-2]\n")
    (tmp_path / "tmp").mkdir()
    done = _run_up(slurm_cluster, tmp_path, hosts, str(ROOT / "tests" / "_support" / "allreduce_net.py"),
                   env={"TMPDIR": str(tmp_path / "tmp")})
    assert done.returncode == 0, done.stdout + done.stderr
    # torchrun alone leaves a torchelastic_* on every node; torch's compile cache, made by an import of
    # torch._dynamo now and then, is torch's to keep there
    assert not [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")]
    sums = re.findall(r"^node(\d) sim(\d) rank\d \| NET rank=(\d) host=(sim\d) .* sum=(\d+) expected=(\d+)$",
                      done.stdout, re.MULTILINE)
    assert sorted(sums) == [("0", "1", "0", "sim1", "10", "10"), ("0", "1", "1", "sim1", "10", "10"),
                            ("1", "2", "2", "sim2", "10", "10"), ("1", "2", "3", "sim2", "10", "10")], done.stdout


def _allreduce_sums(stdout: str) -> list[tuple[str, str, str, str]]:
    """(node, host, rank, sum == expected) of each rank's line of ``allreduce_net.py``."""
    return sorted((node, host, rank, str(s == e)) for node, host, rank, s, e in re.findall(
        r"^node(\d) (sim\d) rank\d \| NET rank=(\d) host=sim\d .* sum=(\d+) expected=(\d+)$", stdout, re.MULTILINE))


def test_nodes_of_different_nproc_from_the_hosts_file_make_one_world(slurm_cluster: SlurmCluster,
                                                                     tmp_path: Path) -> None:
    """sim1 runs 2 ranks, sim2 one: torchrun's static rendezvous packs them 0-1 and 2; gloo's all_reduce agrees."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"defaults:\n  python: {sys.executable}\nhosts:\n  - host: sim1\n    nproc: 2\n"
                     "  - host: sim2\n    nproc: 1\n")
    script = str(ROOT / "tests" / "_support" / "allreduce_net.py")
    dry = _run_up(slurm_cluster, tmp_path, hosts, "--dry-run", script)
    assert "world size 3" in dry.stdout and "processes per node (the hosts file's nproc): sim1 2, sim2 1" in dry.stdout
    done = _run_up(slurm_cluster, tmp_path, hosts, script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "world size 3" in done.stderr
    assert _allreduce_sums(done.stdout) == [("0", "sim1", "0", "True"), ("0", "sim1", "1", "True"),
                                            ("1", "sim2", "2", "True")], done.stdout
    assert "sum=6 expected=6" in done.stdout


def test_the_tasks_per_node_asked_of_slurm_set_each_nodes_nproc(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """`salloc -N2 -n3` on nodes of 2 CPUs: SLURM_TASKS_PER_NODE=2,1, so 2 ranks on sim1 and 1 on sim2 (no hosts
    file: this Python, this directory)."""
    script = str(ROOT / "tests" / "_support" / "allreduce_net.py")
    done = subprocess.run(["salloc", "-N2", "-n3", sys.executable, "-m", "clusterrun", "up", "--from-slurm", script],
                          capture_output=True, text=True, env=_env(slurm_cluster), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _allreduce_sums(done.stdout) == [("0", "sim1", "0", "True"), ("0", "sim1", "1", "True"),
                                            ("1", "sim2", "2", "True")], done.stdout


@pytest.mark.fake_torchrun
def test_setup_runs_in_the_task_before_torchrun_and_its_failure_fails_that_node(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    """The hosts file's setup, in the step on each node: what it sources holds for the ranks, its output is the
    node's; a failing setup on sim2 fails node 1 with its status and last lines, and nothing starts there."""
    script, hosts = _files(tmp_path, fake_python)
    (tmp_path / "venv.sh").write_text("CRTEST_TOKEN=sourced-$(hostname); export CRTEST_TOKEN\n")
    hosts.write_text(hosts.read_text().replace("hosts:\n", f"  workdir: {tmp_path}\n  setup:\n"
                                                           "    - echo preparing on $(hostname)\n"
                                                           "    - source venv.sh\nhosts:\n"))
    done = _run_up(slurm_cluster, tmp_path, hosts, str(script), "env")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [re.sub(r" +\|", " |", line) for line in done.stdout.splitlines()]  # the prefix's padding
    for node, host in enumerate(("sim1", "sim2")):
        assert f"node{node} {host} | preparing on {host}" in lines, done.stdout
        for rank in (2 * node, 2 * node + 1):
            assert f"node{node} {host} rank{rank} | env slurm sourced-{host}" in lines, done.stdout
    hosts.write_text(hosts.read_text().replace("    - source venv.sh\n", "    - source venv.sh\n"
                                               "    - '[ $(hostname) = sim1 ] || { echo no venv here; exit 4; }'\n"))
    failed = _run_up(slurm_cluster, tmp_path, hosts, str(script), "env")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert re.search(r"^node1 sim2 +\| no venv here$", failed.stdout, re.MULTILINE), failed.stdout
    assert "node1 sim2: failed (exit code 4)" in failed.stderr, failed.stderr
    assert re.search(r"^node1 sim2 +\| clusterrun: node sim2: setup ended the shell \(exit\?\) with status 4$",
                     failed.stdout, re.MULTILINE), failed.stdout
    assert "root cause: torchrun on node 1 (sim2): exit code 4: setup ended the shell (exit?) with status 4" \
        in failed.stderr, failed.stderr
    assert "sim2 rank" not in failed.stdout  # no rank started on sim2


@pytest.mark.fake_torchrun
def test_the_preflight_in_the_step_names_the_node_and_the_missing_script(slurm_cluster: SlurmCluster,
                                                                         tmp_path: Path, fake_python: Path) -> None:
    _script, hosts = _files(tmp_path, fake_python)
    done = _run_up(slurm_cluster, tmp_path, hosts, "trian.py")
    assert done.returncode == 1, done.stdout + done.stderr
    said = f"the script trian.py does not exist in {tmp_path}"
    cause = re.search(rf"root cause: torchrun on node (\d) \((sim\d)\): exit code 2: {re.escape(said)}$", done.stderr,
                      re.MULTILINE)
    assert cause is not None, done.stderr
    node, host = cause.groups()
    assert re.search(rf"^node{node} {host} +\| clusterrun: node {host}: {re.escape(said)}$", done.stdout,
                     re.MULTILINE), done.stdout
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.fake_torchrun
def test_the_exported_batch_script_gives_each_host_its_nproc(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                             fake_python: Path) -> None:
    """sim1 nproc 1, sim2 nproc 2: the script asks for exactly those nodes, each task finds its count by name
    after the setup."""
    script, hosts = _files(tmp_path, fake_python)
    hosts.write_text(hosts.read_text().replace("hosts:\n  - host: sim[1-2]\n",
                                               "  setup: ['echo set up on $(hostname)']\nhosts:\n"
                                               "  - host: sim1\n    nproc: 1\n  - host: sim2\n    nproc: 2\n"))
    batch, out = tmp_path / "job.sbatch", tmp_path / "job.out"
    export = subprocess.run([sys.executable, "-m", "clusterrun", "export", "--sbatch", "-o", str(batch), str(hosts),
                             str(script)], capture_output=True, text=True, env=_env(slurm_cluster), cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    done = subprocess.run(["sbatch", "--wait", f"--output={out}", str(batch)], capture_output=True, text=True,
                          env=_env(slurm_cluster), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr + out.read_text()
    ranks = sorted(re.findall(r"^\d: \[rank(\d)\]:rank \d of (\d) on (sim\d) node (\d)", out.read_text(), re.MULTILINE))
    assert ranks == [("0", "3", "sim1", "0"), ("1", "3", "sim2", "1"), ("2", "3", "sim2", "1")], out.read_text()
    assert {"0: set up on sim1", "1: set up on sim2"} <= set(out.read_text().splitlines()), out.read_text()


@pytest.mark.fake_torchrun
@pytest.mark.parametrize(("ask", "nodes"), [("--gpus=3", [("sim1", 2), ("sim2", 1)]),
                                             ("--gres=gpu:1", [("sim1", 1), ("sim2", 1)])])
def test_each_node_runs_one_process_per_gpu_slurm_gave_it(slurm_gpu_cluster: SlurmCluster, tmp_path: Path,
                                                          fake_python: Path, ask: str,
                                                          nodes: list[tuple[str, int]]) -> None:
    """sim1 has 2 GPUs, sim2 one; `--gpus=3` gives each all of its own, `--gres=gpu:1` one each (neither says
    so in salloc's variables: scontrol does). The GPU counts win over the hosts file's nproc 2."""
    script, hosts = _files(tmp_path, fake_python)
    argv = ["salloc", "-N2", ask, *_up(hosts, str(script))[2:]]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(slurm_gpu_cluster), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    world = sum(n for _, n in nodes)
    expected, rank = [], 0
    for node, (host, count) in enumerate(nodes):
        for _ in range(count):
            expected.append(f"node{node} {host} rank{rank} | rank {rank} of {world} on {host} node {node} args []")
            rank += 1
    assert sorted(re.sub(r" +\|", " |", line) for line in done.stdout.splitlines() if " | rank " in line) == \
        sorted(expected), done.stdout
