"""Secrets reach the script and nothing else; setup's exports reach the ranks; a failing setup starts
nothing. Real processes: simulated SSH hosts (``tests/simhosts.py``) and local hosts."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, job_id_of, run_up, up_argv, wait_for
from tests.simhosts import SimCluster

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]
SCRIPT = SUPPORT / "env_canary.py"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def canary_hosts(folder: Path, lines_before_hosts: Iterable[str], hosts: Iterable[str], out: Path) -> Path:
    """A hosts file whose script reports HF_TOKEN and FILE_SECRET (hashed) and the rest in plain."""
    (folder / "secrets.env").write_text(f"# the secrets\nexport FILE_SECRET='{FILE_CANARY}'\n")
    lines = ["forward_env: [HF_TOKEN, NCCL_*]", "env_file: secrets.env", "env:",
             f"  CANARY_OUT: {out}", "  CANARY_NAMES: HF_TOKEN,FILE_SECRET,CLI_TOKEN",
             "  PLAIN_NAMES: SETUP_VAR,OMP_NUM_THREADS,NCCL_CANARY_TEST", f"  CANARY_WAIT: {out / 'go'}",
             *lines_before_hosts, "hosts:", *hosts]
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


FWD_CANARY = "fwd-canary-" + secrets.token_hex(8)
FILE_CANARY = "file-canary-" + secrets.token_hex(8)
CLI_CANARY = "cli-canary-" + secrets.token_hex(8)
CANARIES = (FWD_CANARY, FILE_CANARY, CLI_CANARY)


def assert_clean(text: str | bytes, where: str) -> None:
    data = text.encode() if isinstance(text, str) else text
    for canary in CANARIES:
        assert canary.encode() not in data, f"a secret value appears in {where}"


def assert_tree_clean(root: Path) -> int:
    """No file under ``root`` holds a canary; how many files were read."""
    count = 0
    for path in root.rglob("*"):
        if path.is_file():
            assert_clean(path.read_bytes(), str(path))
            count += 1
    return count


def command_lines(mine: int) -> int:
    """No process on this machine (the simulated hosts' included: their PID namespaces are below
    this one) but ``mine`` (the ``up`` given ``--env CLI_TOKEN=...`` by its user) has a canary on
    its command line; how many were read."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != mine:
            try:
                data = (entry / "cmdline").read_bytes()
            except OSError:
                continue  # gone meanwhile
            assert_clean(data, f"the command line of pid {entry.name}")
            count += 1
    return count


def clusterrun(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


def rank_reports(out: Path, ranks: int) -> list[dict[str, object]]:
    wait_for(lambda: len(list(out.glob("rank*.json"))) >= ranks, timeout=120, what="every rank's report")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def run_canary_job(hosts: Path, out: Path, state: Path, controller: Path, ranks: int) -> list[dict[str, object]]:
    """up --dry-run, then up (followed, its stream read), ps and logs while and after it runs: no
    canary anywhere but in the ranks' environments. Returns what the ranks reported."""
    env = {**os.environ, "HF_TOKEN": FWD_CANARY, "NCCL_CANARY_TEST": "nccl-plain", "PYTHONPATH": str(ROOT)}
    dry = clusterrun("up", "--dry-run", "--env", f"CLI_TOKEN={CLI_CANARY}", str(hosts), str(SCRIPT), env=env)
    assert dry.returncode == 0, dry.stderr
    assert_clean(dry.stdout + dry.stderr, "up --dry-run")
    assert "HF_TOKEN='****'" in dry.stdout and "FILE_SECRET='****'" in dry.stdout and "CLI_TOKEN='****'" in dry.stdout
    assert "NCCL_CANARY_TEST=nccl-plain" in dry.stdout
    assert "export SETUP_VAR=" in dry.stdout  # the setup lines are shown (and were not run: no report yet)
    assert not list(out.glob("rank*.json"))

    with subprocess.Popen(up_argv("--env", f"CLI_TOKEN={CLI_CANARY}", hosts, SCRIPT), cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as up:
        try:
            reports = rank_reports(out, ranks)
            assert command_lines(up.pid) > 10
            job = next(p.name for p in (controller / "clusterrun" / "jobs").iterdir())
            for args in (("ps",), ("ps", "--json"), ("ps", job), ("ps", job, "--json"), ("logs", job)):
                shown = clusterrun(*args, env=env)
                assert shown.returncode == 0, (args, shown.stderr)
                assert_clean(shown.stdout + shown.stderr, f"clusterrun {' '.join(args)}")
        finally:
            (out / "go").touch()
        stdout, stderr = up.communicate(timeout=120)
    assert up.returncode == 0, stderr
    assert_clean(stdout + stderr, "up's stream")
    assert job_id_of(stderr) == job
    shown = clusterrun("logs", job, env=env)
    assert_clean(shown.stdout + shown.stderr, "clusterrun logs")
    assert assert_tree_clean(controller) >= 1  # every record on this machine
    assert assert_tree_clean(state) >= 4  # and the hosts' state dirs: spec.json, state.json, logs
    return reports


def test_a_secret_reaches_the_script_and_nothing_else_over_ssh(sim_cluster: MakeCluster, tmp_path: Path,
                                                              controller_state: Path) -> None:
    cluster = sim_cluster(2)
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    state = tmp_path / "state"
    hosts = canary_hosts(tmp_path, [f"state_dir: {state}", f"ssh_config: {cluster.ssh_config}", "defaults:",
                                    f"  python: {sys.executable}", f"  workdir: {ROOT}",
                                    '  setup: export SETUP_VAR="from setup on $(hostname)"'],
                         ["  - host: sim1", "  - host: sim2", "    env: {OMP_NUM_THREADS: 3}"], out)
    reports = run_canary_job(hosts, out, state, controller_state, ranks=2)
    for rank, report in enumerate(reports):
        assert report["hashed"] == {"HF_TOKEN": sha(FWD_CANARY), "FILE_SECRET": sha(FILE_CANARY),
                                    "CLI_TOKEN": sha(CLI_CANARY)}
        assert report["plain"] == {"SETUP_VAR": f"from setup on sim{rank + 1}",
                                   "OMP_NUM_THREADS": "1" if rank == 0 else "3",  # env: overrides the default
                                   "NCCL_CANARY_TEST": "nccl-plain"}


def test_a_failing_setup_is_a_host_error_and_starts_nothing_anywhere(sim_cluster: MakeCluster, tmp_path: Path,
                                                                      controller_state: Path) -> None:
    cluster = sim_cluster(2)
    state = tmp_path / "state"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("\n".join([
        f"state_dir: {state}", f"ssh_config: {cluster.ssh_config}", "defaults:", f"  python: {sys.executable}",
        f"  workdir: {ROOT}", "  setup: export FINE=1", "hosts:", "  - sim1", "  - host: sim2", "    setup:",
        "      - export FINE=1", "      - \"echo 'conda: environment train not found' >&2; false\"",
        "      - echo never reached",
    ]) + "\n")
    proc = run_up(hosts, "examples/allreduce.py")
    assert proc.returncode == 3, proc.stderr
    assert "1 host(s) cannot run the job; nothing was started" in proc.stderr
    assert "sim2: node 1: setup failed with status 1; nothing was started; its last lines:" in proc.stderr
    assert "conda: environment train not found" in proc.stderr
    assert "clusterrun: setup[1] exited with status 1" in proc.stderr
    assert not (state / "jobs").exists()  # nothing was started on any host
    assert not (controller_state / "clusterrun" / "jobs").exists() or not any(
        (controller_state / "clusterrun" / "jobs").iterdir())  # and no record was left


def test_restart_reads_the_secrets_again_locally(tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    """A later attempt gets the secrets from where they came from (this process's environment, the
    env_file), since the record holds them masked; setup runs again for it."""
    out = tmp_path / "out"
    out.mkdir()
    hosts = canary_hosts(tmp_path, [f"state_dir: {state_dir}", "defaults:", "  transport: local",
                                    "  setup: export SETUP_VAR=local-setup"], ["  - a", "  - b"], out)
    env = {**os.environ, "HF_TOKEN": FWD_CANARY, "CLI_TOKEN": CLI_CANARY, "PYTHONPATH": str(ROOT)}
    started = clusterrun("up", "-d", "--env", f"CLI_TOKEN={CLI_CANARY}", str(hosts), str(SCRIPT), env=env)
    assert started.returncode == 0, started.stderr
    job = started.stdout.strip()
    first = rank_reports(out, 2)
    restarted = clusterrun("restart", job, env=env)
    assert restarted.returncode == 0, restarted.stderr
    assert_clean(restarted.stdout + restarted.stderr, "restart")
    (out / "go").touch()
    reports = rank_reports(out, 4)
    assert [r["cluster"] for r in reports] == [f"{job}.0.1", f"{job}.0.2", f"{job}.1.1", f"{job}.1.2"]
    for report in (*first, *reports):
        assert report["hashed"] == {"HF_TOKEN": sha(FWD_CANARY), "FILE_SECRET": sha(FILE_CANARY),
                                    "CLI_TOKEN": sha(CLI_CANARY)}
        assert report["plain"]["SETUP_VAR"] == "local-setup"  # type: ignore[index]
    waited = clusterrun("wait", job, env=env)
    assert waited.returncode == 0, waited.stderr
    assert_tree_clean(controller_state)
    assert_tree_clean(state_dir)
