"""Issue 25: the checks see the environment the hosts' `setup:` makes, as the job will.

Local hosts, real torchrun. The job's interpreter is `python3` (a name found on a PATH): a bare
virtual environment (no torch) and a directory whose `python3` is this interpreter (torch) are
put first on the controller's PATH or on the PATH setup leaves. `up`, `up --dry-run` and
`doctor` agree, both ways round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_hosts

pytestmark = pytest.mark.integration


def _clusterrun(path: str, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=env)


@pytest.fixture
def pythons(tmp_path: Path) -> tuple[Path, Path]:
    """Two bin directories, each with a `python3`: a bare venv's (no torch) and this one's (torch)."""
    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True).create(bare)
    with_torch = tmp_path / "with-torch"
    with_torch.mkdir()
    # a script, not a symlink: a symlinked venv interpreter does not find its pyvenv.cfg (CI's venv)
    (with_torch / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (with_torch / "python3").chmod(0o755)
    assert subprocess.run([bare / "bin" / "python3", "-c", "import torch"], capture_output=True).returncode != 0
    return bare / "bin", with_torch


def test_setup_that_activates_torch_passes_up_dry_run_and_doctor(tmp_path: Path, state_dir: Path,
                                                                  pythons: tuple[Path, Path]) -> None:
    bare, with_torch = pythons
    hosts = write_hosts(tmp_path, [1], state_dir, python="python3",
                        extra=f"    setup: export PATH={with_torch}:$PATH\n")
    path = f"{bare}:{os.environ['PATH']}"  # the plain python3 has no torch
    runs = subprocess.run([with_torch / "python3", "-c", "import sys; print(sys.executable)"], capture_output=True,
                          text=True, check=True).stdout.strip()  # the interpreter as it names itself
    doctor = _clusterrun(path, "doctor", hosts)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "✓ setup" in doctor.stdout and f"the job runs python3 ({runs}, after setup)" in doctor.stdout
    dry = _clusterrun(path, "up", "--dry-run", "--json", hosts, "examples/allreduce.py")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["nodes"][0]["setup_ran"] == {
        "ran": True, "python": f"python3 ({runs}, after setup)", "why_not": None}
    up = _clusterrun(path, "up", "--no-tui", hosts, "examples/allreduce.py")
    assert up.returncode == 0, up.stderr
    assert "allreduce sum=1 expected=1 OK" in up.stdout, up.stdout


def test_setup_that_loses_torch_is_refused_by_up_dry_run_and_doctor(tmp_path: Path, state_dir: Path,
                                                                    pythons: tuple[Path, Path]) -> None:
    bare, with_torch = pythons
    hosts = write_hosts(tmp_path, [1, 1], state_dir, python="python3",
                        extra=f"    setup: export PATH={bare}:$PATH\n")  # node 1 (local-b) only
    path = f"{with_torch}:{os.environ['PATH']}"  # the plain python3 has torch
    refusal = f"local-b: node 1: torch is not installed for python3 ({bare}/python3, after setup)"
    doctor = _clusterrun(path, "doctor", hosts)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert f"torch is not installed for python3 ({bare}/python3, after setup)" in doctor.stdout
    assert "1 problem(s) (✗) on local-b" in doctor.stdout
    assert "have setup: activate an environment that has it" in doctor.stdout
    for argv in (["up", "--dry-run"], ["up", "--no-tui"]):
        proc = _clusterrun(path, *argv, hosts, "examples/allreduce.py")
        assert proc.returncode == 3, proc.stderr
        assert refusal in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (state_dir / "jobs").exists()  # nothing started anywhere


def test_the_stream_shows_setups_lines_before_the_start_they_preceded(tmp_path: Path, state_dir: Path) -> None:
    """`up --no-tui` with its stdout and stderr in one pipe, as a terminal shows them: each node's
    `[setup]:` lines come before its `started attempt 1`, once."""
    from tests.conftest import SUPPORT, up_argv

    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    hosts.write_text(hosts.read_text().replace("defaults:\n", "defaults:\n  setup: echo setup says hi\n"))
    proc = subprocess.run(up_argv(hosts, SUPPORT / "counter.py", "2", "0"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    for node, host in ((0, "local-a"), (1, "local-b")):
        said = [i for i, line in enumerate(lines) if line.replace(" ", "") == f"node{node}{host}|[setup]:setupsayshi"]
        started = [i for i, line in enumerate(lines) if line.startswith(f"clusterrun: node{node} {host}: started ")]
        assert len(said) == 1 and len(started) == 1 and said[0] < started[0], proc.stdout
