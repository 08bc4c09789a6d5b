"""The agent's request loop (``agent/serve.py``) in this process, its stdin and stdout in memory: one
answer per request line, blank lines skipped, a bad line answered and the loop going on, the end at
stdin's end or after a ``follow``; and its entry point from the loader, which compiles a version on its
first run and prunes old ones once a new one is in. Through a real pipe: ``tests/test_agent.py``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent import serve
from clusterrun.transports.base import AgentReader, AgentStream


@pytest.fixture(autouse=True)
def umask() -> Iterator[None]:
    """The agent sets its umask (077) as a process would: this one gets its own back."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


class Stdio:
    """stdin and stdout of this process replaced, as the agent's pipe would give them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, lines: list[bytes]) -> None:
        self.out = io.BytesIO()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"".join(lines))))
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(self.out))

    def answers(self) -> list[dict[str, Any]]:
        """What the agent wrote, read as the controller does (a log's bytes raw after its line)."""
        sys.stdout.flush()
        written = [self.out.getvalue()]
        return list(AgentStream("h", AgentReader(lambda: written.pop() if written else b""), None))


def test_each_request_line_gets_its_answer_line_until_stdin_ends(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = json.dumps({"op": "jobs", "state_dir": str(tmp_path)}).encode()
    stdio = Stdio(monkeypatch, [jobs + b"\n", b"\n", b"not json\n", b'{"op": "dance"}\n',
                                b'{"op": "status", "job": "j"}\n'])
    assert serve.serve() == 0
    assert [a["ok"] for a in stdio.answers()] == [True, False, False, False]
    assert stdio.answers()[2] == {"ok": False, "error": "unknown op 'dance'"}
    assert stdio.answers()[3]["error"].startswith("bad request: ") and "node" in stdio.answers()[3]["error"]
    assert os.umask(0o077) == 0o077  # what the agent writes is the user's alone


def test_a_follow_ends_the_loop_once_it_has_streamed_to_its_end(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "jobs" / "j" / "node0" / "attempt1"
    folder.mkdir(parents=True)
    (folder / "output.log").write_bytes(b"hello\n")
    (folder / "state.json").write_text(json.dumps({"state": "exited", "job": "j", "node": 0, "attempt": 1}))
    follow = json.dumps({"op": "follow", "job": "j", "node": 0, "state_dir": str(tmp_path)}).encode()
    stdio = Stdio(monkeypatch, [b'{"op": "dance"}\n'])
    assert serve.serve(first=follow + b"\n") == 0  # the request that came with the loader's preamble
    assert [a["t"] for a in stdio.answers()] == ["log", "state", "end"]
    assert sys.stdin.readline() == '{"op": "dance"}\n'  # not read: the controller closes the channel


def test_the_loaders_entry_compiles_a_new_version_and_prunes_old_ones(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "source.zip"
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr("clusterrun_agent/__init__.py", "")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    old = tmp_path / "agent-old.zip"
    old.write_bytes(b"")
    os.utime(old, (1, 1))
    Stdio(monkeypatch, [])
    assert serve.main(str(tmp_path), digest, str(source), installed=True) == 0
    assert not old.exists()
    assert [p.name for p in tmp_path.glob(f"agent-{digest}-*.zip")]  # compiled for the next run

    with zipfile.ZipFile(source, "w") as archive:  # cannot be compiled: said, and served all the same
        archive.writestr("clusterrun_agent/__init__.py", "def broken(:\n")
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    Stdio(monkeypatch, [])
    assert serve.main(str(tmp_path), "f" * 64, str(source), installed=False) == 0
    assert stderr.getvalue().startswith(f"clusterrun: cannot compile the agent in {tmp_path}: ")
