"""The command line: bad input gets a clear error and exit code 2, `--dry-run` starts nothing."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import clirun
from tests.conftest import ROOT, write_hosts


def clusterrun(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return clirun.clusterrun(*args, cwd=cwd)


BAD_FILES = {
    "unknown key": ("hosts:\n  - host: a\n    gpu: 2\n", "hosts.yaml:3: hosts[0].gpu: unknown key 'gpu'",
                    "did you mean 'gpus'?"),
    "wrong type": ("hosts:\n  - host: a\n  - host: b\n    gpus: four\n",
                   "hosts.yaml:4: hosts[1].gpus: expected a list of GPU ids or a count, got 'four'", None),
    "empty hosts": ("hosts: []\n", "hosts.yaml:1: hosts:", None),
    "duplicate host": ("hosts:\n  - host: a\n  - host: a\n", "hosts.yaml:3: hosts[1]", "line 2"),
    "gpus vs nproc": ("hosts:\n  - host: a\n    gpus: [0, 1, 2, 3]\n    nproc: 2\n", "hosts.yaml:", "nproc"),
    "bad env name": ("env:\n  BAD-NAME: 1\nhosts:\n  - host: a\n", "hosts.yaml:2: env", "BAD-NAME"),
    "password": ("hosts:\n  - host: a\n    password: hunter2\n", "hosts.yaml:3: hosts[0].password",
                 "ssh-agent"),
    "yaml syntax": ("hosts:\n  - host: a\n   nproc: [1\n", "hosts.yaml:", "invalid YAML"),
    "unsafe tag": ("hosts:\n  - host: !!python/object/apply:os.system ['touch /tmp/pwned-clusterrun']\n",
                   "hosts.yaml:2", "tag"),
    "integer of 5000 digits": ("hosts:\n  - host: a\n    nproc: " + "1" * 5000 + "\n",
                               "hosts.yaml:3: hosts[0].nproc: expected a number of processes from 1 to 1024",
                               "5,000 digits"),
    "too many processes": ("hosts:\n  - host: a\n    nproc: 1025\n", "hosts.yaml:3: hosts[0].nproc",
                           "from 1 to 1024, got 1025"),
    "too many gpus": ("hosts:\n  - host: a\n    gpus: 2000\n", "hosts.yaml:3: hosts[0].gpus", "from 1 to 1024"),
    "duplicate host in another case": ("hosts:\n  - host: Node-A\n  - host: node-a\n",
                                       "hosts.yaml:3: hosts[1].host: host 'node-a' is listed twice",
                                       "line 2, as 'Node-A'"),
    # 8 times the limit; not 10 MB: PyYAML's composer reads a character at a time (5 s of CPU for 10 MB)
    "1 MB env value": ("env:\n  BIG: " + "x" * 1_000_000 + "\nhosts:\n  - host: a\n",
                        "hosts.yaml:2: env.BIG: the value is too long", "at most 131,071"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_hosts_file_is_a_clear_error_and_nothing_starts(tmp_path: Path, case: str) -> None:
    text, where, also = BAD_FILES[case]
    (tmp_path / "hosts.yaml").write_text(f"state_dir: {tmp_path / 'state'}\n" * 0 + text)
    (tmp_path / "train.py").write_text("print('must not run')\n")
    proc = clusterrun("up", "--no-tui", "hosts.yaml", "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert where in proc.stderr, proc.stderr
    if also:
        assert also in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not Path("/tmp/pwned-clusterrun").exists()


def test_missing_hosts_file_and_script(tmp_path: Path) -> None:
    proc = clusterrun("up", "nowhere.yaml", "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nowhere.yaml" in proc.stderr
    hosts = write_hosts(tmp_path, [1], tmp_path / "state")
    proc = clusterrun("up", str(hosts), "missing.py", cwd=tmp_path)
    assert proc.returncode == 2 and "missing.py does not exist" in proc.stderr, proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()


def test_bad_env_option(tmp_path: Path) -> None:
    hosts = write_hosts(tmp_path, [1], tmp_path / "state")
    (tmp_path / "t.py").write_text("")
    proc = clusterrun("up", "--env", "1X=y", str(hosts), "t.py", cwd=tmp_path)
    assert proc.returncode == 2 and "--env: expected NAME=VALUE" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unreachable_host_means_nothing_starts_anywhere(tmp_path: Path) -> None:
    (tmp_path / "hosts.yaml").write_text(f"state_dir: {tmp_path / 'state'}\nhosts:\n"
                                         "  - host: local-a\n    transport: local\n"
                                         "  - host: 127.0.0.1\n    port: 1\n")  # nothing listens there
    (tmp_path / "t.py").write_text("")
    proc = clusterrun("up", "hosts.yaml", "t.py", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "127.0.0.1: cannot connect" in proc.stderr and "nothing was started" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()


@pytest.mark.integration
def test_dry_run_prints_exact_commands_and_starts_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    hosts = write_hosts(tmp_path, [1, 3], state, extra="env:\n  SPACED_VALUE: 'a b'\n")
    proc = clusterrun("up", "--dry-run", "--env", "X=$(id)", str(hosts), "examples/train.py", "--", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2 nodes, world size 4, master 127.0.0.1:" in out
    commands = [line.split("command: ", 1)[1] for line in out.splitlines() if "command: " in line]
    assert len(commands) == 2
    argv1 = shlex.split(commands[1])
    assert argv1[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--node-rank=1" in argv1 and "--nproc-per-node=3" in argv1 and "--nnodes=2" in argv1
    assert argv1[-3:] == ["examples/train.py", "--epochs", "1"]
    assert "    X='$(id)'" in out and "    SPACED_VALUE='a b'" in out
    assert not (state / "jobs").exists()


def test_help_and_version() -> None:
    proc = clusterrun("up", "--help")
    assert proc.returncode == 0 and "HOSTS.yaml SCRIPT [-- ARGS...]" in proc.stdout
    assert clusterrun("--version").stdout.strip().startswith("clusterrun, version ")


def test_the_core_never_imports_textual() -> None:
    """Layers import one way: Textual is loaded only by clusterrun.tui, when the dashboard opens."""
    core = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "clusterrun").rglob("*.py") if "tui" not in p.parts and p.stem != "__main__")
    assert "clusterrun.run.orchestrator" in core and "clusterrun.transports.ssh" in core
    assert {"clusterrun.sync.copy", "clusterrun.sync.tree", "clusterrun.sync.carriers",
            "clusterrun.transports.sshhosts", "clusterrun.transports.sshlib", "clusterrun.run.follower"} <= set(core)
    assert {f"clusterrun.cli.{m}" for m in ("follow", "records", "up", "jobs", "manage", "tools")} <= set(core)
    code = (f"import sys, importlib\nfor name in {core!r}:\n    importlib.import_module(name)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'textual'))\n"
            "import clusterrun.tui\nprint('textual' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout


def test_the_cli_leaves_out_what_few_commands_use() -> None:
    """Every command pays for what ``clusterrun.cli`` imports: importlib.metadata (with email), for
    the fish completion only; statistics, for ``--timings``; ClusterShell's NodeSet (with logging's
    configparser), where a node set is expanded or folded."""
    code = "import sys, clusterrun.cli\nprint(sorted(sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    loaded = set(eval(done.stdout))
    assert not {"importlib.metadata", "email", "statistics", "ClusterShell.NodeSet"} & loaded



def test_up_starts_connecting_before_it_loads_the_launch_or_slurm() -> None:
    """What ``up`` imports before every host's connection starts (``cli.up``) leaves out the rest of
    the launch and Slurm's modules: they load while the hosts connect (docs/benchmarks.md)."""
    code = "import sys, clusterrun.cli.up\nprint(sorted(sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    loaded = set(eval(done.stdout))
    assert "clusterrun.transports" in loaded
    assert not {"clusterrun.cli.launch", "clusterrun.life.launch", "clusterrun.cli.slurm", "clusterrun.slurm.step",
                "clusterrun.life.attempt", "clusterrun.life.gate", "clusterrun.run.orchestrator"} & loaded

def test_the_job_list_shortens_long_host_lists() -> None:
    from clusterrun.cli.jobs import _hosts_cell

    assert _hosts_cell(["local-a", "local-b"]) == "local-a,local-b"
    many = [f"sim{i}" for i in range(1, 33)]
    cell = _hosts_cell(many)
    assert len(cell) <= 40 and cell.startswith("sim1,sim2,") and cell.endswith(f"… +{32 - cell.count(',')}")
    assert _hosts_cell(["a" * 50]) == "a" * 50  # one host: shown whole
    assert _hosts_cell(["a" * 50, "b"]) == "a" * 50 + ",… +1"


def test_too_large_an_environment_from_env_options_is_bad_input(tmp_path: Path) -> None:
    hosts = write_hosts(tmp_path, [1], tmp_path / "state")
    (tmp_path / "train.py").write_text("print('must not run')\n")
    values = [f"--env=V{i}=" + "x" * 100_000 for i in range(12)]
    proc = clusterrun("up", "--no-tui", *values, str(hosts), "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "error: --env: the environment is too large" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(("args", "message", "hint"), [
    (["--bogus", "hosts.yaml", "train.py"], "error: no such option: --bogus",
     "`clusterrun up --help` lists the options"),
    (["--dry-rnu", "hosts.yaml", "train.py"], "error: no such option: --dry-rnu", "did you mean --dry-run?"),
    (["--no-tui", "hosts.yaml", "--dry-run", "train.py", "--steps", "20"],
     "error: options go before HOSTS.yaml: --dry-run after hosts.yaml would be the script",
     "did you mean: clusterrun up --no-tui --dry-run hosts.yaml train.py --steps 20"),
    (["--no-tui", "hosts.yaml", "--name", "x", "-d", "train.py", "--", "--name", "y"],
     "error: options go before HOSTS.yaml: --name x -d after hosts.yaml",
     "did you mean: clusterrun up --no-tui --name x -d hosts.yaml train.py -- --name y"),
    (["--no-tui", "hosts.yaml", "-x.py"], "error: SCRIPT must not start with '-', got '-x.py'",
     "options go before HOSTS.yaml; a script named so: write ./-x.py"),
])
def test_misplaced_or_unknown_options_start_nothing(tmp_path: Path, args: list[str], message: str,
                                                    hint: str) -> None:
    write_hosts(tmp_path, [1], tmp_path / "state")
    (tmp_path / "train.py").write_text("print('must not run')\n")
    (tmp_path / "-x.py").write_text("print('must not run')\n")
    (tmp_path / "--dry-run").write_text("print('must not run')\n")
    proc = clusterrun("up", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert f"hint: {hint}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "state").exists()


def test_script_arguments_and_the_separator_still_pass_verbatim(tmp_path: Path) -> None:
    hosts = write_hosts(tmp_path, [1], tmp_path / "state")
    (tmp_path / "-odd.py").write_text("")
    (tmp_path / "train.py").write_text("")
    for args, tail in ((["train.py", "--dry-run", "--name", "a b"], "train.py --dry-run --name 'a b'"),
                       (["train.py", "--", "-x"], "train.py -x"),
                       (["--", "-odd.py", "--steps", "2"], "-odd.py --steps 2")):
        proc = clusterrun("up", "--dry-run", str(hosts), *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        command = next(line for line in proc.stdout.splitlines() if line.startswith("  command: "))
        assert command.endswith(tail), proc.stdout


def test_ps_shows_a_rank_s_escape_sequences_escaped(controller_state: Path) -> None:
    from clusterrun.store.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord

    store = JobStore()
    store.create(JobRecord(
        job_id="esc-20261123-100000-abcd", name="esc", created=0.0, hosts_file="hosts.yaml", hosts_text="",
        script="train.py", script_args=[], env_overrides={}, local_cwd="/", grace=1.0, ssh_config=None, plan={},
        state="failed", attempts=[AttemptRecord(1, started=0.0, master_port=1, state="failed",
                                                root_cause="rank 0: exit code 1: \x1b]0;pwned\x07 \x1b[2J")],
        nodes=[NodeRecord(0, "h", state="failed", exit_code=1, error="\x1b[31mboom\x1b[0m")]))
    proc = clusterrun("ps", "esc")
    assert proc.returncode == 0, proc.stderr
    assert "root cause: rank 0: exit code 1: \\x1b]0;pwned\\x07 \\x1b[2J" in proc.stdout
    assert "boom" in proc.stdout and "\x1b" not in proc.stdout
