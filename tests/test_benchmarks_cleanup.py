"""A benchmark ended by SIGTERM, SIGHUP or Ctrl-C (a CI timeout, a closed terminal) leaves no simulated host
behind: no network namespace, no link, no temporary folder of its clusters (``simhosts.close_on_signals``), and
no process of its own (a controller or a job's monitor following the hosts that are gone)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.simhosts import namespace_problem, unavailable
from tests.simnet import PREFIX, _ip_json, _netns_names

pytestmark = pytest.mark.integration

BENCHMARKS = {
    "fanout": ["--sizes", "2", "--repeat", "1"],
    "logs": ["--hosts", "2", "--repeat", "1", "--skip-big"],
    "recovery": ["--sizes", "2", "--repeat", "1"],
    "roundtrips": [],
    "stack": ["--hosts", "2"],
    "startsteps": [],
    "sync": ["--hosts", "2", "--repeat", "1"],
    "watching": ["--hosts", "2", "--seconds", "2"],
}


def left_of(pid: int) -> list[str]:
    """What the clusters of process ``pid`` made and is still there."""
    mine = f"{PREFIX}-{pid}"
    found = [n for n in _netns_names() if n == mine or n.startswith(mine + "-")]
    found += [link["ifname"] for link in _ip_json("link") if link.get("ifalias", "") == mine]
    found += [str(p) for p in Path(tempfile.gettempdir()).glob(f"{mine}-*")]
    for entry in os.listdir("/proc"):  # a process started with a path in its clusters' folders
        try:
            said = Path(f"/proc/{entry}/cmdline").read_bytes() + Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # not a process, or gone
            continue
        if f"/{mine}-".encode() in said:
            found.append(f"process {entry}: {said.split(bytes(1))[:6]}")
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "Ctrl-C"])
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_a_benchmark_ended_by_a_signal_closes_its_simulated_hosts(name: str, signum: int, tmp_path: Path) -> None:
    if problem := namespace_problem():
        unavailable(problem)
    with open(tmp_path / "out", "w") as out:
        bench = subprocess.Popen([sys.executable, f"benchmarks/{name}.py", *BENCHMARKS[name]], cwd=ROOT,
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not any(re.fullmatch(rf"{PREFIX}-{bench.pid}-\d+-sim\d+", n) for n in _netns_names()):  # a host is up
            assert bench.poll() is None, (tmp_path / "out").read_text()
            assert time.monotonic() < deadline, "the benchmark made no simulated host"
            time.sleep(0.05)
        bench.send_signal(signum)
        code = bench.wait(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    # Ctrl-C: Python ends by SIGINT itself once its finally blocks ran (-2); the others: close_on_signals's 128 + N
    assert code == (-signum if signum == signal.SIGINT else 128 + signum), (tmp_path / "out").read_text()
    assert left_of(bench.pid) == []
