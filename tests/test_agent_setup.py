"""The agent's ``setup`` (``agent/setup.py``) and its loader (``agent/loader.py``), called in this process:
setup's commands in bash, the environment they leave kept for this agent's start, the job's interpreter
as it then runs, and what a failing or endless setup says; the loader's have/need exchange with the
controller, its cache, and the refusals. Through a real SSH channel: ``tests/test_ssh.py``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterrun.agent import loader, setup
from clusterrun.transports.bundle import agent_bundle
from tests.agenthost import Attempt, ask


def test_setup_keeps_its_environment_for_the_start_and_says_how_the_jobs_python_runs(attempt: Attempt) -> None:
    answer = ask(attempt.request("setup", setup=["export CRTEST_READY=yes", "unset HOME"], env={"A": "1"},
                                 cwd=str(attempt.state_dir.parent), python=sys.executable))
    assert answer["ok"], answer
    job = answer["python"]
    assert job["executable"] == sys.executable and job["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert job["torch"]  # found on this interpreter's paths, not imported
    prepared = setup.PREPARED.pop((attempt.job, 0, 1))
    assert prepared.env["CRTEST_READY"] == "yes" and prepared.env["A"] == "1" and "HOME" not in prepared.env
    assert prepared.python == job


def test_a_job_python_that_is_not_on_the_path_setup_leaves_is_an_error_naming_it(attempt: Attempt) -> None:
    answer = ask(attempt.request("setup", setup=["export PATH=/nonexistent"], python="python3"))
    assert answer["python"] == {"error": "python3 is not found on the PATH setup leaves (/nonexistent)"}
    assert setup.PREPARED.pop((attempt.job, 0, 1)).python is None


def test_nothing_runs_in_a_workdir_a_dry_runs_sync_would_make(attempt: Attempt, tmp_path: Path) -> None:
    answer = ask(attempt.request("setup", setup=["touch ran"], cwd=str(tmp_path / "later"), if_cwd=True))
    assert answer == {"ok": True, "skipped": f"{tmp_path / 'later'} does not exist yet"}


@pytest.mark.parametrize(("commands", "timeout", "said"), [
    (["echo about to fail", "false"], None, "clusterrun: setup[1] exited with status 1"),
    (["echo started", "sleep 30"], 0.3, "setup did not finish within 0.3 s (killed)"),
    (["exit 0"], None, "setup ended before its last command (does one call `exit`?)"),
])
def test_a_setup_that_fails_says_why_with_its_last_lines(attempt: Attempt, commands: list[str],
                                                          timeout: float | None, said: str) -> None:
    answer = ask(attempt.request("setup", setup=commands, setup_timeout=timeout))
    assert not answer["ok"] and said in answer["error"] and "nothing was started" in answer["error"]
    if commands[0].startswith("echo"):
        assert f"  | {commands[0][5:]}" in answer["error"]


def test_setup_that_cannot_start_names_the_missing_directory(attempt: Attempt, tmp_path: Path) -> None:
    answer = ask(attempt.request("setup", setup=["true"], cwd=str(tmp_path / "missing")))
    assert answer == {"ok": False, "error": f"setup could not run: {tmp_path / 'missing'}: No such file or "
                                            "directory; nothing was started"}


@pytest.fixture
def agent_modules() -> Iterator[None]:
    """The loader imports the agent from its zip (``clusterrun_agent``): gone from this process after."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name in [n for n in sys.modules if n == "clusterrun_agent" or n.startswith("clusterrun_agent.")]:
        del sys.modules[name]


def load(monkeypatch: pytest.MonkeyPatch, stdin: bytes) -> tuple[int, str, str]:
    """The loader's ``main`` with ``stdin`` as the controller sends it: its status, stdout and stderr."""
    out, err = io.BytesIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, write_through=True))
    monkeypatch.setattr(sys, "stderr", err)
    old = os.umask(0o077)
    try:
        code = loader.main()
    finally:
        os.umask(old)
    return code, out.getvalue().decode(), err.getvalue()


def test_the_loader_asks_for_the_zip_once_then_serves_from_its_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent_modules: None) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bundle = agent_bundle()
    head = f"{bundle.sha256} {len(bundle.zip)} ahead\n".encode()
    request = json.dumps({"op": "jobs", "state_dir": str(tmp_path / "state")}).encode() + b"\n"
    code, out, _ = load(monkeypatch, head + request + bundle.zip)
    assert code == 0
    said, answer = out.splitlines()
    assert said == '{"agent": "need"}' and json.loads(answer)["ok"]
    folder = tmp_path / "cache" / "clusterrun"
    assert (folder / f"agent-{bundle.sha256}.zip").read_bytes() == bundle.zip
    assert list(folder.glob(f"agent-{bundle.sha256}-*.zip"))  # compiled for the next run

    code, out, _ = load(monkeypatch, head + request)
    assert code == 0 and out.splitlines()[0] == '{"agent": "have"}'


def test_the_loader_refuses_a_damaged_zip_a_bad_digest_and_a_cache_others_can_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent_modules: None) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = b"not the agent"
    digest = hashlib.sha256(b"the agent").hexdigest()
    code, _, err = load(monkeypatch, f"{digest} {len(data)} push\n".encode() + data)
    assert code == 2 and err == f"clusterrun: the agent's zip arrived damaged ({len(data)} of {len(data)} bytes)\n"
    code, _, err = load(monkeypatch, b"../../etc 10\n")
    assert code == 2 and err == "clusterrun: not a sha256: ../../etc\n"
    os.chmod(tmp_path / "cache" / "clusterrun", 0o777)
    code, _, err = load(monkeypatch, f"{digest} 1\n".encode())
    assert code == 2 and "is writable by others (mode 777)" in err
