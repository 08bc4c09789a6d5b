"""The stdlib fake torchrun (tests/_support/fake_torchrun.py) that the tests marked ``fake_torchrun`` run:
held to what clusterrun reads of the real one (ranks, per-rank logs, the failure report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_up, write_hosts

pytestmark = [pytest.mark.integration, pytest.mark.fake_torchrun]


def test_the_fake_gives_torchruns_ranks_logs_and_failure_report(tmp_path: Path, state_dir: Path,
                                                                fake_python: Path) -> None:
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
