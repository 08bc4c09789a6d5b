"""The stdlib fake torchrun (tests/_support/fake_torchrun.py) that the tests marked ``fake_torchrun`` run:
held to what clusterrun reads of the real one (ranks, per-rank logs, the failure report)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_up, write_hosts

pytestmark = [pytest.mark.integration, pytest.mark.fake_torchrun]


def test_the_fake_gives_torchruns_ranks_logs_and_failure_report(tmp_path: Path, state_dir: Path, fake_python: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # without a cgroup the failed node's torchrun (here the fake) is not cut short: it ends, and reports, on its own
    monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")  # the local agents inherit it
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    assert f"python: {fake_python}" in hosts.read_text()
    script = tmp_path / "ranks.py"
    # rank 1 fails once the others have printed (the fake, as torchrun, stops them when one fails)
    script.write_text("import os, sys, time\nrank, end = int(os.environ['RANK']), time.monotonic() + 30\n"
                      "print(f\"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}\",\n"
                      "      flush=True)\n"
                      "open(os.path.join(sys.argv[1], str(rank)), 'w').close()\n"
                      "while rank == 1 and time.monotonic() < end and not all(\n"
                      "        os.path.exists(os.path.join(sys.argv[1], r)) for r in '02'):\n"
                      "    time.sleep(0.01)\n"
                      "sys.exit(3 if rank == 1 else 0)\n")
    proc = run_up("--grace", "2", hosts, script, tmp_path)
    assert proc.returncode == 1, proc.stderr
    for node, rank, local in ((0, 0, 0), (0, 1, 1), (1, 2, 0)):
        host = "local-a" if node == 0 else "local-b"
        assert f"node{node} {host} rank{rank} | rank {rank} of 3 local {local}" in proc.stdout, proc.stdout
    assert "fake_torchrun: ChildFailedError" in proc.stdout
    assert "root cause: rank 1 on node 0 (local-a, local rank 1): exit code 3" in proc.stderr, proc.stderr


@pytest.mark.parametrize("which", ["torchrun", "the fake"])
def test_log_dir_given_as_an_argument_holds_every_log_and_nothing_is_left_in_tmpdir(
        which: str, tmp_path: Path, fake_python: Path) -> None:
    """``--log-dir`` (as the Slurm task gives it) wins over ``$PET_LOG_DIR``; without either, torchrun makes a
    ``torchelastic_*`` directory in TMPDIR that nobody removes: the fake must not differ, or tests leave them."""
    tmp, logs, script = tmp_path / "tmp", tmp_path / "logs", tmp_path / "hello.py"
    tmp.mkdir()
    script.write_text("import os\nprint('hello from', os.environ['RANK'], flush=True)\n")
    python = sys.executable if which == "torchrun" else str(fake_python)
    with socket.socket() as probe:  # a free port for node 0's store; the race with another test is harmless here
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "TMPDIR": str(tmp), "PET_LOG_DIR": str(tmp_path / "unused")}
    done = subprocess.run([python, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                           "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
                           "--redirects=3", f"--log-dir={logs}", str(script)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    found = sorted(p.read_text() for p in logs.glob("*/attempt_0/*/stdout.log"))
    assert found == ["hello from 0\n", "hello from 1\n"], found
    assert list(tmp.iterdir()) == [] and not (tmp_path / "unused").exists()
