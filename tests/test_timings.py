"""``up --timings``: the start-up timeline names the slow host and its slow phase."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.core import timings
from tests.conftest import ROOT, SUPPORT, job_id_of, run_up, write_hosts
from tests.simhosts import SimCluster
from tests.test_cli_imports import NOT_FOR_LOGS, NOT_FOR_UP_PS_LOGS_DOWN
from tests.test_ssh import ssh_hosts


def _timeline() -> timings.Timeline:
    """Two hosts; b's authentication is slow; b probes last, a starts last."""
    line = timings.Timeline(origin=100.0)
    for host, auth, probe_end, start_end in (("a", 0.05, 100.4, 102.0), ("b", 1.5, 101.8, 101.9)):
        line.record(host, "resolve", 100.0, 100.01)
        line.record(host, "connect", 100.01, 100.05)
        line.record(host, "authenticate", 100.05, 100.05 + auth)
        line.record(host, "agent", 100.05 + auth, 100.1 + auth)
        line.record(host, "probe", 100.1 + auth, probe_end)
        line.record(host, "route", 101.8, 101.85)
        line.record(host, "start", 101.85, start_end)
    return line


def test_the_timeline_names_the_slowest_host_its_phase_and_the_critical_path() -> None:
    lines = timings.render(_timeline(), before=0.25)
    text = "\n".join(lines)
    assert lines[0] == ("timings: every node started 2.000 s after `up` began "
                        "(0.250 s of Python start-up and imports before that)")
    assert lines[1] == "  before the first host: 0.000 s (the hosts file, the SSH library's import)"
    assert "slowest host: b: authenticate 1.500 s of 1.900 s" in text
    assert "authenticate 0.050/0.775/1.500 (b)" in text
    assert ("critical path: resolve done at 0.010 s (last: a) → connect and probe done at 1.800 s (last: b) "
            "→ route done at 1.850 s (last: a) → start done at 2.000 s (last: a)") in text
    assert "agent requests per host: 3," in text  # probe, route, start
    rows = [line.split() for line in lines if line.startswith("  a ") or line.startswith("  b ")]
    assert [row[0] for row in rows] == ["b", "a"]  # slowest first


def test_spans_are_recorded_only_once_enabled_and_from_any_thread() -> None:
    timings._current = None
    with timings.span("h", "probe"):
        pass
    line = timings.enable(origin=0.0)
    try:
        threads = [threading.Thread(target=lambda: timings.record("h", "start", 1.0, 2.0)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with timings.span("h", "probe"):
            pass
        assert sorted({s.phase for s in line.spans}) == ["probe", "start"]
        assert len(line.spans) == 9
    finally:
        timings._current = None


@pytest.mark.integration
@pytest.mark.fake_torchrun
def test_up_timings_names_the_host_whose_agent_is_slow(sim_cluster: Callable[..., SimCluster],
                                                       tmp_path: Path) -> None:
    """sim2's login shell waits 2 s before it runs the agent: the timeline says so, and no other host."""
    slow = tmp_path / "slow-shell"
    slow.write_text('#!/bin/sh\nsleep 2\nexec /bin/sh "$@"\n')
    slow.chmod(0o755)
    cluster = sim_cluster(3, login_shell={"sim2": str(slow)})
    hosts = ssh_hosts(tmp_path, cluster, [1, 1, 1], tmp_path / "state")
    proc = run_up("--timings", hosts, SUPPORT / "counter.py", "0", "0")
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"slowest host: (\S+): (\w+) ([\d.]+) s of ([\d.]+) s", proc.stderr)
    assert found, proc.stderr
    assert found.group(1, 2) == ("sim2", "agent") and float(found.group(3)) >= 2.0, proc.stderr
    assert re.search(r"connect and probe done at [\d.]+ s \(last: sim2\)", proc.stderr), proc.stderr
    rows = {line.split()[1]: line.split()[2:] for line in proc.stderr.splitlines()
            if re.match(r"clusterrun:   sim\d ", line)}
    assert set(rows) == {"sim1", "sim2", "sim3"}, proc.stderr
    # the probe, the preflight's reach, the start: the route, inspect and listener go with the probe
    assert "agent requests per host: 3," in proc.stderr and " route " not in proc.stderr, proc.stderr
    # the timeline comes once every node started, before the job's end
    assert proc.stderr.index("timings:") > max(proc.stderr.index(f"node{n} sim{n + 1}: started") for n in range(3))
    assert proc.stderr.index("timings:") < proc.stderr.index("succeeded")


@pytest.mark.integration
@pytest.mark.fake_torchrun
def test_the_commands_that_print_import_no_textual(tmp_path: Path) -> None:
    """`up --no-tui`, `ps`, `logs` and `down` run without loading Textual (or rich), nor Slurm's,
    the dashboard's or `stack`'s modules: their start-up stays light; `logs` of an ended job loads no
    module of its owner (``NOT_FOR_LOGS``)."""
    state = tmp_path / "state"
    hosts = write_hosts(tmp_path, [1], state)
    code = ("import atexit, sys\n"
            "loaded = lambda names: sorted(m for m in sys.modules for n in names if m == n or m.startswith(n + '.'))\n"
            f"atexit.register(lambda: print('LOADED', loaded({NOT_FOR_UP_PS_LOGS_DOWN!r}), file=sys.stderr))\n"
            "if sys.argv[1] == 'logs':\n"
            f"    atexit.register(lambda: print('FOR LOGS', loaded({NOT_FOR_LOGS!r}), file=sys.stderr))\n"
            "from clusterrun.cli import main\nmain()\n")
    env_state = {"XDG_STATE_HOME": str(tmp_path / "xdg")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=120, env={**os.environ, **env_state})

    started = run("up", "--no-tui", str(hosts), str(SUPPORT / "counter.py"), "2", "0")
    assert started.returncode == 0 and "rank 0 done" in started.stdout, started.stderr
    job = job_id_of(started.stderr)
    # `ps` asks squeue for the running steps of `up --from-slurm` that have no record here
    for args, loaded in ((["ps"], "['clusterrun.slurm.run', 'clusterrun.slurm.step']"), (["ps", job], "[]"),
                         (["logs", job], "[]"), (["down", job], "[]")):
        done = run(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert f"LOADED {loaded}" in done.stderr, (args, done.stderr)
    assert "FOR LOGS []" in run("logs", job, "--node", "0").stderr  # an ended job's log: no owner's module
    assert "LOADED []" in started.stderr
