"""The Slurm launcher's pure parts (``clusterrun.slurm.step``: the allocation, srun's argv, the batch
script) and its runner on a stand-in for srun (``clusterrun.slurm.run``); a real Slurm is in
``tests/test_slurm_cluster.py``."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import Event, JobFinished, LogLines, NodeState
from clusterrun.slurm.run import SlurmRun, SlurmStep, parse_task_end, step_of
from clusterrun.slurm.step import (
    TASK_SCRIPT,
    Allocation,
    allocation_from_env,
    build_step,
    gpus_by_node,
    launch_plan,
    sbatch_script,
    slurm_counts,
)
from tests import clirun

ROOT = Path(__file__).resolve().parent.parent


def test_the_allocation_comes_from_slurms_variables_in_its_order() -> None:
    alloc = allocation_from_env({"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[09-10],cpu-a7",
                                 "SLURM_GPUS_PER_NODE": "a100:4"})
    assert alloc == Allocation(job_id="4242", nodes=("gpu09", "gpu10", "cpu-a7"), gpus_per_node=4)
    cpus = allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_PER_TASK": "16"})
    assert cpus.cpus_per_task == 16
    assert "--cpus-per-task=16" in build_step(cpus, None, "t.py", [], name="t", python="p", env_overrides={},
                                              cwd=None).argv
    on_node = allocation_from_env({"SLURM_JOBID": "1", "SLURM_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "2"})
    assert on_node.gpus_per_node == 2
    assert allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}).gpus_per_node is None


@pytest.mark.parametrize(("env", "message"), [
    ({}, "not inside a Slurm allocation: SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "7"}, "not inside a Slurm allocation: SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST: missing bracket at position"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a", "SLURM_STEP_ID": "0"}, "inside job step 7.0: run `up "
     "--from-slurm` once, in the allocation itself"),
])
def test_outside_an_allocation_the_error_says_how_to_get_one(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        allocation_from_env(env)
    assert message in err.value.render()
    if not env:
        assert "salloc" in (err.value.hint or "")


def test_the_master_port_follows_the_job_id() -> None:
    assert Allocation("123", ("a",)).master_port == 20123
    assert Allocation("20001", ("a",)).master_port == 20001
    assert Allocation("123_4", ("a",)).master_port != Allocation("124_4", ("a",)).master_port  # array jobs


def test_the_step_is_one_srun_with_one_task_per_node_and_the_rank_from_slurm() -> None:
    spec = load_cluster_text("defaults:\n  nproc: 3\n  python: /venv/bin/python\n  env:\n    NCCL_DEBUG: INFO\n"
                             "hosts:\n  - host: gpu[01-02]\n", "hosts.yaml")
    step = build_step(Allocation("99", ("gpu01", "gpu02")), spec, "train.py", ["--", "--lr", "1 2"], name="train-1",
                      python="/usr/bin/python3", env_overrides={"SEED": "1"}, cwd="/home/me/proj")
    assert step.name == "train-1" and step.job_id.startswith("train-1-")
    assert step.argv[:9] == ("srun", "--jobid=99", "--nodelist=gpu[01-02]", "--nodes=2", "--ntasks=2",
                             "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label", f"--job-name={step.job_id}")
    assert step.argv[9:] == ("sh", "-c", TASK_SCRIPT, "clusterrun-node", "/venv/bin/python", "3", "/home/me/proj", "",
                             "preflight", "train.py", "--", "--", "--lr", "1 2")
    assert step.env == {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "INFO", "SEED": "1",
                        "MASTER_ADDR": "gpu01", "MASTER_PORT": "20099",
                        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
    assert step.world_size == 6


def test_slurms_gpus_set_nproc_and_no_cuda_visible_devices_of_ours() -> None:
    spec = load_cluster_text("hosts:\n  - host: a\n    gpus: [0, 1]\n", "hosts.yaml")
    step = build_step(Allocation("5", ("n1", "n2"), gpus_per_node=4), spec, "t.py", [], name="t",
                      python="python3", env_overrides={}, cwd=None)
    assert step.nprocs == (4, 4) and "CUDA_VISIBLE_DEVICES" not in step.env
    assert step.argv[-6:] == ("python3", "4", "", "", "preflight", "t.py")  # no workdir, no setup
    alone = build_step(Allocation("5", ("n1",)), None, "t.py", [], name="t", python="/py", env_overrides={}, cwd="/w")
    assert alone.nprocs == (1,) and alone.argv[-6:] == ("/py", "1", "/w", "", "preflight", "t.py")


def _task(tmp_path: Path, step_argv: tuple[str, ...], node: str = "n2", node_id: str = "1",
          ) -> subprocess.CompletedProcess[str]:
    """The task of ``step_argv`` run by its shell as srun runs it on node ``node``, in ``tmp_path``. Its
    ``sleep`` (the second a failing task waits for its last line to reach srun) is written down in
    ``tmp_path/slept``, not waited for."""
    task = list(step_argv[step_argv.index("-c") - 1:])
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "sleep").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "slept"}\n')
    (tmp_path / "bin" / "sleep").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path), "MASTER_ADDR": "n1",
           "MASTER_PORT": "20003",
           "SLURM_NODEID": node_id, "SLURM_NNODES": "2", "SLURMD_NODENAME": node, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.run(task, env=env, capture_output=True, text=True, check=False, cwd=tmp_path)


def _echo_python(tmp_path: Path, torch: bool = True) -> Path:
    """A python that passes the preflight's torch check (or not) and prints its argv, one word a line, and
    the variable CRTEST_SETUP."""
    echo = tmp_path / "python"
    echo.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exit {0 if torch else 1}; fi\n'
                    'for a in "$@"; do printf "%s\\n" "$a"; done\necho "setup left ${CRTEST_SETUP:-nothing}"\n')
    echo.chmod(0o755)
    (tmp_path / "t.py").write_text("")
    return echo


def test_the_task_script_puts_slurms_node_rank_into_torchruns_argv(tmp_path: Path) -> None:
    """The constant script, run by sh as srun runs it: what torchrun's argv becomes on node 1."""
    echo = _echo_python(tmp_path)
    step = build_step(Allocation("3", ("n1", "n2")), None, "t.py", ["a b", "$HOME"], name="t", python=str(echo),
                      env_overrides={}, cwd=None)
    done = _task(tmp_path, step.argv)
    assert done.returncode == 0, done.stderr
    words = done.stdout.splitlines()
    logs = words.pop(words.index(next(w for w in words if w.startswith("--log-dir="))))
    assert words == ["-m", "torch.distributed.run", "--node-rank=1", "--nnodes=2",
                     "--master-addr=n1", "--master-port=20003", "--nproc-per-node=1",
                     "--rdzv-backend=static", "--max-restarts=0", "--redirects=3", "--tee=3",
                     "t.py", "a b", "$HOME", "setup left nothing"]
    # torchrun's per-rank files in a directory of the task's under TMPDIR, gone once torchrun ended
    assert logs.startswith(f"--log-dir={tmp_path / 'tmp'}/clusterrun-torchrun.")
    assert not list((tmp_path / "tmp").iterdir())


def test_each_node_finds_its_own_process_count_by_its_slurm_name(tmp_path: Path) -> None:
    spec = load_cluster_text(f"defaults:\n  python: {_echo_python(tmp_path)}\nhosts:\n  - host: n1\n    nproc: 2\n"
                             "  - host: n2\n    nproc: 1\n  - host: n3\n    nproc: 4\n", "hosts.yaml")
    step = build_step(Allocation("3", ("n2", "n1", "n[4]")), spec, "t.py", [], name="t", python="p",
                      env_overrides={}, cwd=None)
    assert (step.nprocs, step.world_size) == ((1, 2, 1), 4)  # n[4] is not in the file: the template's (n2's)
    assert [(n.host.host, n.nproc, n.first_rank) for n in launch_plan(step).nodes] \
        == [("n2", 1, 0), ("n1", 2, 1), ("n[4]", 1, 3)]
    for node, count in (("n1", 2), ("n2", 1), ("n[4]", 1)):
        done = _task(tmp_path, step.argv, node=node)
        assert done.returncode == 0 and f"--nproc-per-node={count}" in done.stdout.splitlines(), done.stderr
    stranger = _task(tmp_path, step.argv, node="n9")
    assert stranger.returncode == 2
    assert stranger.stderr == "clusterrun: node n9: no process count for this node in: n2=1 n1=2 n[4]=1\n"
    assert (tmp_path / "slept").read_text() == "1\n"  # its line reaches srun before the task ends


@pytest.mark.parametrize(("setup", "code", "said"), [
    (["export CRTEST_SETUP=yes", "false", "echo never"], 1, "clusterrun: node n2: setup[1] exited with status 1"),
    (["echo preparing; exit 3"], 3, "clusterrun: node n2: setup ended the shell (exit?) with status 3"),
    (["exit 0"], 2, "clusterrun: node n2: setup ended the shell (exit?) with status 2"),  # torchrun never ran: failed
])
def test_a_failing_setup_fails_the_node_with_its_status_and_output(tmp_path: Path, setup: list[str], code: int,
                                                                    said: str) -> None:
    spec = load_cluster_text(f"defaults:\n  python: {_echo_python(tmp_path)}\n  setup: {setup!r}\n"
                             "hosts:\n  - host: n[1-2]\n", "hosts.yaml")
    step = build_step(Allocation("3", ("n1", "n2")), spec, "t.py", [], name="t", python="p", env_overrides={},
                      cwd=None)
    assert step.argv[step.argv.index("-c") - 1] == "bash"  # setup is written for bash, over SSH as here
    done = _task(tmp_path, step.argv)
    assert done.returncode == code and said in done.stderr and "never" not in done.stdout
    assert "--node-rank=1" not in done.stdout
    assert (tmp_path / "slept").read_text() == "1\n"


def test_setup_runs_in_the_workdir_in_the_shell_that_execs_torchrun(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "venv.sh").write_text("CRTEST_SETUP=sourced; export CRTEST_SETUP\n")
    spec = load_cluster_text(f"defaults:\n  python: {_echo_python(tmp_path / 'proj')}\n  workdir: ~/proj\n"
                             "  setup: ['source venv.sh', 'nproc=9 python=nope node=x; fail() { :; }']\n"
                             "hosts:\n  - host: n[1-2]\n", "hosts.yaml")
    step = build_step(Allocation("3", ("n1", "n2")), spec, "t.py", [], name="t", python="p", env_overrides={},
                      cwd="/elsewhere")
    done = _task(tmp_path, step.argv)  # HOME is tmp_path: ~/proj is tmp_path/proj
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["t.py", "setup left sourced"]
    assert "--nproc-per-node=1" in done.stdout.splitlines()  # setup's own names do not touch the task's


@pytest.mark.parametrize(("python", "workdir", "script", "code", "said"), [
    ("/no/python", "", "t.py", 127, "python not found: /no/python (the hosts file's python:, or PATH)"),
    ("echo", "/no/dir", "t.py", 2, "the workdir /no/dir does not exist"),
    ("echo", "", "trian.py", 2, "the script trian.py does not exist in {tmp}"),
    ("notorch", "", "t.py", 2, "torch is not installed for {tmp}/notorch"),
])
def test_the_preflight_in_the_task_names_the_node_and_what_is_missing(tmp_path: Path, python: str, workdir: str,
                                                                      script: str, code: int, said: str) -> None:
    _echo_python(tmp_path, torch=False).rename(tmp_path / "notorch")
    interpreters = {"echo": str(_echo_python(tmp_path)), "notorch": str(tmp_path / "notorch")}
    workdir_line = f"  workdir: {workdir}\n" if workdir else ""
    spec = load_cluster_text(f"defaults:\n  python: {interpreters.get(python, python)}\n{workdir_line}"
                             "hosts:\n  - host: n[1-2]\n", "hosts.yaml")
    step = build_step(Allocation("3", ("n1", "n2")), spec, script, [], name="t", python="p", env_overrides={},
                      cwd=None)
    done = _task(tmp_path, step.argv)
    assert (done.returncode, done.stderr) == (code, f"clusterrun: node n2: {said.format(tmp=tmp_path)}\n")
    assert done.stdout == ""
    assert (tmp_path / "slept").read_text() == "1\n"


def test_no_preflight_leaves_the_checks_to_torchrun(tmp_path: Path) -> None:
    spec = load_cluster_text(f"defaults:\n  python: {_echo_python(tmp_path, torch=False)}\nhosts:\n  - host: n[1-2]\n",
                             "hosts.yaml")
    step = build_step(Allocation("3", ("n1", "n2")), spec, "absent.py", [], name="t", python="p", env_overrides={},
                      cwd=None, preflight=False)
    done = _task(tmp_path, step.argv)
    assert done.returncode == 0 and done.stdout.splitlines()[-2:] == ["absent.py", "setup left nothing"]


def test_slurms_compressed_counts_and_which_count_wins() -> None:
    assert slurm_counts("2(x3),1", 4, "X") == (2, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"SLURM_TASKS_PER_NODE='2\(x3\)' gives 3 counts for 2 nodes"):
        slurm_counts("2(x3)", 2, "SLURM_TASKS_PER_NODE")
    with pytest.raises(ConfigError, match=r"cannot read '2\(3\)'"):
        slurm_counts("2(3)", 3, "X")
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2,1"}
    assert allocation_from_env(env).tasks_per_node is None  # salloc -N2 says 1(x2): no tasks were asked for
    asked = allocation_from_env({**env, "SLURM_NTASKS": "3"})
    assert build_step(asked, None, "t.py", [], name="t", python="p", env_overrides={}, cwd=None).nprocs == (2, 1)
    spec = load_cluster_text("hosts:\n  - host: n1\n    nproc: 4\n", "hosts.yaml")
    assert build_step(asked, spec, "t.py", [], name="t", python="p", env_overrides={}, cwd=None).nprocs == (4, 4)
    gpus = Allocation("1", ("n1", "n2"), gpus_per_node=8, tasks_per_node=(2, 1))
    assert build_step(gpus, spec, "t.py", [], name="t", python="p", env_overrides={}, cwd=None).nprocs == (8, 8)


def test_sync_is_refused_under_slurm_unless_no_sync() -> None:
    spec = load_cluster_text("defaults:\n  workdir: /w\nhosts:\n  - host: n1\n  - host: n2\n    sync: .\n",
                             "hosts.yaml")
    with pytest.raises(ConfigError) as err:
        build_step(Allocation("1", ("n1", "n2")), spec, "t.py", [], name="t", python="p", env_overrides={}, cwd=None)
    assert err.value.render().startswith("hosts.yaml:5: sync: host n2 has `sync: .`, which --from-slurm does not do")
    assert "--no-sync" in (err.value.hint or "")
    step = build_step(Allocation("1", ("n1", "n2")), spec, "t.py", [], name="t", python="p", env_overrides={},
                      cwd=None, no_sync=True)
    assert step.nprocs == (1, 1)
    with pytest.raises(ConfigError, match="sync"):
        sbatch_script(spec, "t.py", [], name="t", env_overrides={}, hosts_file="hosts.yaml")


def test_the_batch_script_gives_each_host_its_nproc_by_name_and_refuses_uneven_gpus() -> None:
    spec = load_cluster_text("hosts:\n  - host: a\n    nproc: 2\n  - host: b\n    nproc: 4\n", "hosts.yaml")
    text = sbatch_script(spec, "t.py", [], name="t", env_overrides={}, hosts_file="hosts.yaml")
    assert "#SBATCH --nodelist=a,b" in text.splitlines()
    assert shlex.split(text[text.index("\nsrun ") + 1:].replace("\\\n", " "))[-6:] == ["python3", "a=2 b=4", "", "",
                                                                                      "preflight", "t.py"]
    gpus = load_cluster_text("hosts:\n  - host: a\n    gpus: [0, 1]\n  - host: b\n    gpus: [0]\n", "hosts.yaml")
    with pytest.raises(ConfigError, match="one count for every node; a has 2 GPUs, b has 1"):
        sbatch_script(gpus, "t.py", [], name="t", env_overrides={}, hosts_file="hosts.yaml")


def test_the_batch_script_names_secrets_but_never_holds_their_values() -> None:
    spec = load_cluster_text("forward_env: [HF_TOKEN, WANDB_*]\nsecret_env: [MY_CRED]\n"
                             "defaults:\n  gpus: [0, 1, 2, 3]\n  workdir: /shared/proj\n  env:\n    NCCL_DEBUG: INFO\n"
                             "hosts:\n  - host: gpu[01-03]\n",
                             "hosts.yaml")
    text = sbatch_script(spec, "train.py", ["--lr", "1 2"], name="train",
                         env_overrides={"API_TOKEN": "s3cr3t", "MY_CRED": "hunter2", "SEED": "7"},
                         hosts_file="hosts.yaml")
    assert "s3cr3t" not in text and "hunter2" not in text
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "export NCCL_DEBUG=INFO", "export SEED=7", ': "${API_TOKEN:?set API_TOKEN in the environment you run '
                 'sbatch from}"', "export HF_TOKEN  # forward_env: from the environment you run sbatch from"):
        assert line in lines, text
    assert "# MY_CRED is secret: not written here; set it where you run sbatch" in lines
    assert "CUDA_VISIBLE_DEVICES" not in text  # Slurm hands out the GPUs
    command = shlex.split(text[text.index("\nsrun ") + 1:].replace("\\\n", " "))
    assert command[:7] == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                           "--label", "--job-name=train"]
    assert command[7:] == ["sh", "-c", TASK_SCRIPT, "clusterrun-node", "python3", "4", "/shared/proj", "", "preflight",
                           "train.py", "--lr", "1 2"]
    assert "#SBATCH --nodelist" not in text  # the same nproc everywhere: any three nodes


def test_the_batch_script_is_valid_bash() -> None:
    spec = load_cluster_text("hosts:\n  - host: a\n", "hosts.yaml")
    text = sbatch_script(spec, "t.py", ["it's"], name="t", env_overrides={"X": "a'b$c"}, hosts_file="h")
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0


def test_srun_reports_are_read_per_task() -> None:
    assert [(e.node, e.exit_code, e.signal) for e in parse_task_end("srun: error: gpu02: task 1: Exited with exit "
                                                                    "code 7")] == [(1, 7, None)]
    assert [(e.node, e.signal) for e in parse_task_end("srun: error: n1: tasks 0-1,3: Killed")] == \
        [(0, 9), (1, 9), (3, 9)]
    assert parse_task_end("srun: Force Terminated StepId=1.0") == []
    assert step_of(["12.0 other", "12.1 train-x", "12.batch batch"], "train-x") == "12.1"
    assert step_of([], "train-x") is None


def _stand_in(tmp_path: Path, script: str) -> SlurmStep:
    """A step whose "srun" is ``script`` run by this Python: labelled lines and srun's reports, as srun prints them."""
    path = tmp_path / "srun.py"
    path.write_text(script)
    return SlurmStep(job_id="job-1", name="job", script="t.py", script_args=(), argv=(sys.executable, str(path)),
                     env={"X": "1"}, nodes=("n1", "n2"), nprocs=(1, 1), master_addr="n1", master_port=1)


def test_the_runner_turns_labelled_output_into_node_logs_and_results(tmp_path: Path) -> None:
    step = _stand_in(tmp_path, "import sys, os\nprint('0: hello', os.environ['X'])\nprint(' 1: world')\n"
                     "print('0: last words')\nprint('srun: error: n1: task 0: Exited with exit code 3')\n"
                     "print('srun: error: n2: task 1: Killed')\nsys.exit(3)\n")
    events: list[Event] = []
    run = SlurmRun(step, job_id="job-1", slurm_job="9", emit=events.append, environ={})
    run.start()
    result = run.run()
    logs = [(e.node, e.lines) for e in events if isinstance(e, LogLines)]
    assert logs == [(0, ("hello 1",)), (1, ("world",)), (0, ("last words",))]
    assert [(n.node, n.state, n.exit_code, n.signal) for n in result.nodes] == [
        (0, NodeState.FAILED, 3, None), (1, NodeState.STOPPED, None, 9)]
    assert result.root_cause is not None and result.root_cause.node == 0
    assert result.root_cause.last_lines == ("hello 1", "last words")
    assert isinstance(events[-1], JobFinished) and events[-1].result == result


def test_a_node_failing_before_torchrun_is_the_root_cause_with_its_reason(tmp_path: Path) -> None:
    step = _stand_in(tmp_path, "import sys\nprint('1: clusterrun: node n2: torch is not installed for python3')\n"
                     "print('srun: error: n2: task 1: Exited with exit code 2')\nprint('srun: error: n1: task 0: "
                     "Terminated')\nsys.exit(2)\n")
    run = SlurmRun(step, job_id="j", slurm_job="9", emit=lambda e: None, environ={})
    run.start()
    cause = run.run().root_cause
    assert cause is not None and (cause.node, cause.rank, cause.exit_code) == (1, None, 2)
    assert cause.describe() == "torchrun on node 1 (n2): exit code 2: torch is not installed for python3"


def test_srun_failing_before_any_task_fails_every_node(tmp_path: Path) -> None:
    step = _stand_in(tmp_path, "import sys\nprint('srun: error: Unable to create step for job 9: Invalid node name')\n"
                     "sys.exit(1)\n")
    result = SlurmRun(step, job_id="j", slurm_job="9", emit=lambda e: None, environ={})
    result.start()
    done = result.run()
    assert [(n.state, n.error) for n in done.nodes] == [(NodeState.FAILED, "srun exited with 1")] * 2
    assert not done.ok


def _clusterrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return clirun.clusterrun(*args, env={**base, "PYTHONPATH": str(ROOT), **(env or {})})


def test_up_from_slurm_outside_an_allocation_or_without_srun_says_what_to_do(tmp_path: Path) -> None:
    outside = _clusterrun("up", "--from-slurm", "train.py")
    assert outside.returncode == 2
    assert outside.stderr.startswith("clusterrun: error: --from-slurm: not inside a Slurm allocation: SLURM_JOB_ID "
                                     "is not set\n  hint: run it inside an allocation: `salloc -N2 clusterrun up "
                                     "--from-slurm train.py`"), outside.stderr
    inside = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]", "PATH": str(tmp_path)}
    no_srun = _clusterrun("up", "--from-slurm", "train.py", env=inside)
    assert no_srun.returncode == 2 and "--from-slurm: srun not found on PATH" in no_srun.stderr
    assert "Traceback" not in no_srun.stderr
    yaml = _clusterrun("up", "--from-slurm", "hosts.yaml", "train.py", env=inside)
    assert yaml.returncode == 2 and "hint: give the hosts file as --slurm-hosts hosts.yaml" in yaml.stderr
    stray = _clusterrun("up", "--slurm-hosts", "hosts.yaml", "hosts.yaml", "train.py")
    assert stray.returncode == 2 and "--slurm-hosts goes with --from-slurm" in stray.stderr
    detached = _clusterrun("up", "--from-slurm", "-d", "--sync", ".", "train.py", env=inside)
    assert detached.returncode == 2
    assert "--detach, --sync cannot go with --from-slurm" in detached.stderr


def test_up_from_slurm_dry_run_prints_the_srun_command_and_masks_secrets() -> None:
    done = _clusterrun("up", "--from-slurm", "--dry-run", "--env", "HF_TOKEN=s3cr3t", "train.py", "--", "--lr", "1",
                       env={"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "2"})
    assert done.returncode == 0, done.stderr
    assert "Slurm job 5, 2 nodes, world size 4, master n1:20005" in done.stdout
    assert "  processes per node (one per GPU Slurm allocated): n1 2, n2 2\n" in done.stdout
    assert "HF_TOKEN='****'" in done.stdout and "s3cr3t" not in done.stdout
    command = shlex.split(done.stdout.split("  command: ", 1)[1])
    assert command[:3] == ["srun", "--jobid=5", "--nodelist=n[1-2]"] and command[-3:] == ["train.py", "--lr", "1"]


def test_export_writes_an_executable_script_and_names_the_secrets_left_out(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - host: gpu[1-2]\n    gpus: [0, 1]\n")
    out = tmp_path / "job.sbatch"
    done = _clusterrun("export", "--sbatch", "-o", str(out), "--env", "WANDB_API_KEY=k3y", str(hosts), "t.py", "x")
    assert done.returncode == 0, done.stderr
    assert done.stderr == (f"clusterrun: wrote {out}; submit it with `sbatch {out}`; set WANDB_API_KEY in sbatch's "
                           "environment (secret: not written)\n")
    assert out.stat().st_mode & 0o777 == 0o755 and "k3y" not in out.read_text()
    assert "#SBATCH --gpus-per-node=2" in out.read_text()
    without = _clusterrun("export", str(hosts), "t.py")
    assert without.returncode == 2 and "say which format: --sbatch" in without.stderr


def test_the_hosts_files_master_wins_over_the_first_nodes_name() -> None:
    spec = load_cluster_text("master:\n  addr: 10.0.0.1\n  port: 1234\nhosts:\n  - host: a\n", "hosts.yaml")
    step = build_step(Allocation("5", ("n1", "n2")), spec, "t.py", [], name="t", python="p", env_overrides={},
                      cwd=None)
    assert (step.master_addr, step.master_port) == ("10.0.0.1", 1234)
    assert (step.env["MASTER_ADDR"], step.env["MASTER_PORT"]) == ("10.0.0.1", "1234")


def test_up_from_slurm_refuses_a_hosts_files_sync_and_no_sync_leaves_it_out(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("defaults:\n  workdir: /shared/proj\n  sync: .\nhosts:\n  - host: n[1-2]\n    nproc: 2\n")
    inside = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]"}
    refused = _clusterrun("up", "--from-slurm", "--slurm-hosts", str(hosts), "--dry-run", "t.py", env=inside)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith(f"clusterrun: error: {hosts}:5: sync: host n1 has `sync: .`, which --from-slurm "
                                     "does not do"), refused.stderr
    assert "hint: pass --no-sync" in refused.stderr
    left_out = _clusterrun("up", "--from-slurm", "--no-sync", "--slurm-hosts", str(hosts), "--dry-run", "t.py",
                           env=inside)
    assert left_out.returncode == 0, left_out.stderr
    assert "processes per node (the hosts file's nproc): n1 2, n2 2" in left_out.stdout


SCONTROL = """\
JobId=1 JobName=interactive
   NodeList=sim[1-2,4]
   JOB_GRES=gpu:3
     Nodes=sim1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=sim[2,4] CPU_IDs=0 Mem=0 GRES=gpu:a100:1(IDX:0),nic:4(IDX:0-3)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
"""


def test_each_nodes_gpus_come_from_scontrol_and_win() -> None:
    assert gpus_by_node(SCONTROL) == {"sim1": 2, "sim2": 1, "sim4": 1}
    assert gpus_by_node("     Nodes=sim[1-2] CPU_IDs=0 Mem=0 GRES=\n") == {}
    assert gpus_by_node("") == {}
    spec = load_cluster_text("hosts:\n  - host: sim1\n    nproc: 4\n", "hosts.yaml")
    alloc = Allocation("1", ("sim1", "sim2", "sim4"), gpus_per_node=8, node_gpus=gpus_by_node(SCONTROL))
    step = build_step(alloc, spec, "t.py", [], name="t", python="p", env_overrides={}, cwd=None)
    assert (step.nprocs, step.nproc_source) == ((2, 1, 1), "one per GPU Slurm allocated on the node")
    partly = Allocation("1", ("sim1", "sim3"), node_gpus={"sim1": 2})  # a node scontrol gave none: not GPUs
    assert build_step(partly, spec, "t.py", [], name="t", python="p", env_overrides={}, cwd=None).nprocs == (4, 4)
