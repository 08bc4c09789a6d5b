"""The attempt's cgroup v2 (``agent/cgroup.py``): where one may be made, making it (a stale one of the
same name gets a suffix), listing, killing and waiting for what runs in it, and removing it. In this
process, on this machine's cgroup2 with real ``sleep`` children; where cgroup2 is not writable (a user
without a delegated cgroup) the tests that make one skip, and CI (root) fails them instead."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterrun.agent import cgroup as cg
from tests.agenthost import Processes, gone
from tests.conftest import start_time, unique_job
from tests.simhosts import unavailable


@pytest.fixture
def parent() -> str:
    """Where this agent makes an attempt's cgroup here."""
    where, why = cg.cgroup_parent()
    if where is None:
        unavailable(f"no cgroup for an attempt here: {why}")
    assert where is not None
    return where


@pytest.fixture
def made(parent: str) -> Iterator[list[str]]:
    """The cgroups a test makes, removed at its end (their processes killed first)."""
    cgroups: list[str] = []
    yield cgroups
    for path in cgroups:
        if os.path.isdir(path):
            cg.cg_kill(path, {})
            cg.cg_wait_empty(path, _in(10))
            cg.cg_remove(path)


def test_off_by_the_hosts_variable_and_the_reason_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cg.CGROUP_OFF_VAR, "1")
    assert cg.cgroup_parent() == (None, f"cgroups turned off on this host ({cg.CGROUP_OFF_VAR} is set)")
    assert cg.make_cgroup("j", 0, 1) == (None, f"cgroups turned off on this host ({cg.CGROUP_OFF_VAR} is set)")


def test_the_mount_is_found_in_mountinfo_and_this_process_is_in_a_cgroup_of_it(parent: str) -> None:
    mount = cg.cgroup2_mount()
    assert mount is not None and Path(mount, "cgroup.procs").exists()
    own = cg.own_cgroup()
    assert own is not None and own.startswith("/") and cg.own_cgroup(os.getpid()) == own
    assert cg.own_cgroup(2**22 + 1) is None  # no such process
    assert cg.cgroup_path(mount + "/a/b") == "/a/b" and cg.cgroup_path(mount) == "/"


def test_made_with_a_job_child_and_a_stale_name_gets_a_suffix(parent: str, made: list[str]) -> None:
    job = unique_job("cg")
    first, why = cg.make_cgroup(job, 3, 2)
    assert first is not None and why == "", why
    made.append(first)
    assert first == os.path.join(parent, f"clusterrun-{job}-n3-a2") and os.path.isdir(os.path.join(first, "job"))
    second, _ = cg.make_cgroup(job, 3, 2)  # the first is still there: a stale one, for this start
    assert second is not None
    made.append(second)
    assert second.startswith(first + "-") and len(second) == len(first) + 7
    assert cg.cg_remove(first) and cg.cg_remove(second) and not os.path.exists(first)


def test_everything_in_it_is_listed_killed_at_once_and_then_it_can_go(procs: Processes, parent: str,
                                                                        made: list[str]) -> None:
    path, _ = cg.make_cgroup(unique_job("cg"), 0, 1)
    assert path is not None
    made.append(path)
    job = os.path.join(path, "job")
    sleeps = [procs.start(["sleep", "600"]) for _ in range(2)]
    for proc in sleeps:
        cg.cg_write(os.path.join(job, "cgroup.procs"), str(proc.pid).encode())
    pids = sorted(p.pid for p in sleeps)
    assert cg.cg_pids(path) == pids and cg.cg_pids(job) == pids  # the cgroup counts what is below it
    assert cg.own_cgroup(pids[0]) == cg.cgroup_path(job)
    assert cg.cg_populated(path) and not cg.cg_remove(path)  # a cgroup in use cannot be removed

    started = {pid: start_time(pid) for pid in pids}
    killed: dict[int, dict[str, object]] = {}
    assert cg.cg_kill(job, killed) == "cgroup.kill"
    assert sorted(killed) == pids and {k["signal"] for k in killed.values()} == {"SIGKILL"}
    assert cg.cg_wait_empty(path, deadline=_in(10)) and not cg.cg_populated(path)
    assert [p.wait(10) for p in sleeps] == [-9, -9] and all(gone(pid, started[pid]) for pid in pids)
    assert cg.cg_remove(path) and not os.path.exists(path)
    assert cg.cg_kill(path, {}) == "gone" and not cg.cg_populated(path) and cg.cg_remove(path)


def test_without_cgroup_kill_the_cgroup_is_frozen_and_each_process_killed(
        procs: Processes, parent: str, made: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux before 5.14 has no cgroup.kill: freeze (nothing forks meanwhile), SIGKILL each process
    seen in the cgroup through its pidfd, thaw."""
    path, _ = cg.make_cgroup(unique_job("cg"), 0, 1)
    assert path is not None
    made.append(path)
    sleeps = [procs.start(["sleep", "600"]) for _ in range(2)]
    for proc in sleeps:
        cg.cg_write(os.path.join(path, "job", "cgroup.procs"), str(proc.pid).encode())
    real = cg.cg_write

    def older_kernel(file: str, data: bytes) -> None:
        if file.endswith("cgroup.kill"):
            raise FileNotFoundError(2, "No such file or directory", file)
        real(file, data)

    monkeypatch.setattr(cg, "cg_write", older_kernel)
    killed: dict[int, dict[str, object]] = {}
    assert cg.cg_kill(path, killed) == "freeze + SIGKILL"
    assert sorted(killed) == sorted(p.pid for p in sleeps) and [p.wait(10) for p in sleeps] == [-9, -9]
    assert Path(path, "cgroup.freeze").read_text().strip() == "0"  # thawed again
    assert cg.cg_wait_empty(path, _in(10))


def test_waiting_for_a_cgroup_to_empty_ends_at_the_deadline(procs: Processes, parent: str, made: list[str]) -> None:
    path, _ = cg.make_cgroup(unique_job("cg"), 0, 1)
    assert path is not None
    made.append(path)
    sleep = procs.start(["sleep", "600"])
    cg.cg_write(os.path.join(path, "cgroup.procs"), str(sleep.pid).encode())
    assert not cg.cg_wait_empty(path, deadline=_in(0))


def test_a_supervisor_gone_leaves_its_empty_cgroup_to_be_forgotten_but_not_a_populated_one(
        procs: Processes, parent: str, made: list[str]) -> None:
    empty, _ = cg.make_cgroup(unique_job("cg"), 0, 1)
    busy, _ = cg.make_cgroup(unique_job("cg"), 0, 1)
    assert empty is not None and busy is not None
    made += [empty, busy]
    sleep = procs.start(["sleep", "600"])
    cg.cg_write(os.path.join(busy, "job", "cgroup.procs"), str(sleep.pid).encode())
    cg.forget_cgroup({"cgroup": empty})
    cg.forget_cgroup({"cgroup": busy})
    cg.forget_cgroup({"cgroup": None})
    assert not os.path.exists(empty) and os.path.isdir(busy)


def test_a_folder_that_is_no_cgroup_lists_nothing_and_counts_as_empty(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cgroup.procs").write_text("garbage\n")
    assert cg.cg_pids(str(tmp_path)) == [] and not cg.cg_populated(str(tmp_path / "missing"))
    assert cg.cg_remove(str(tmp_path / "missing"))


def _in(seconds: float) -> float:
    """A deadline as the agent takes one (monotonic)."""
    return time.monotonic() + seconds
