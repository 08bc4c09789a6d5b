"""The host's side of ``sync`` (``agent/syncops.py``) in this process: what is below the workdir, the
hashes of its files, and files, directories and symlinks written from the request's entries and the
data after it (stdin, in memory here), each a rename of a complete temporary file; what it refuses.
The controller's side against real hosts: ``tests/test_sync_hosts.py``."""

from __future__ import annotations

import hashlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.agenthost import ask


def put(monkeypatch: pytest.MonkeyPatch, root: Path, entries: list[dict[str, Any]], data: bytes,
        **fields: Any) -> tuple[dict[str, Any], bytes]:
    """``sync_put``'s answer, and what it left unread of stdin (the next request must be next)."""
    stdin = io.BytesIO(data + b"NEXT")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stdin))
    answer = ask({"op": "sync_put", "root": str(root), "entries": entries, **fields})
    return answer, stdin.read()


def test_stat_and_hash_say_what_is_below_the_workdir(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.py").write_bytes(b"print(1)\n")
    os.symlink("d/f.py", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    answer = ask({"op": "sync_stat", "root": str(tmp_path),
                  "paths": ["d", "d/f.py", "link", "fifo", "gone", "d/f.py/x"]})
    assert answer["exists"] and answer["root"] == str(tmp_path) and answer["ino"] == tmp_path.stat().st_ino
    entries = answer["entries"]
    assert sorted(entries) == ["d", "d/f.py", "fifo", "link"]
    assert entries["d/f.py"][:2] == ["f", 9] and entries["d"][0] == "d" and entries["fifo"][0] == "o"
    assert entries["link"][0] == "l" and entries["link"][4] == "d/f.py"
    hashes = ask({"op": "sync_hash", "root": str(tmp_path), "paths": ["d/f.py", "gone"]})["hashes"]
    assert hashes == {"d/f.py": hashlib.sha256(b"print(1)\n").hexdigest()}
    assert ask({"op": "sync_stat", "root": str(tmp_path / "new"), "paths": ["a"]})["exists"] is False
    (tmp_path / "file").write_text("")
    refused = ask({"op": "sync_stat", "root": str(tmp_path / "file")})
    assert refused["error"] == f"{tmp_path / 'file'} (workdir) is not a directory"


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a//b", "a/./b", ""])
def test_a_path_that_leaves_the_workdir_is_refused(tmp_path: Path, path: str) -> None:
    assert ask({"op": "sync_hash", "root": str(tmp_path), "paths": [path]}) == {
        "ok": False, "error": f"invalid sync path {path!r}"}


def test_put_writes_files_directories_and_links_with_their_mode_and_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "work"
    entries = [{"path": "pkg", "kind": "d", "mode": 0o750},
               {"path": "pkg/a.py", "kind": "f", "size": 5, "mode": 0o640, "mtime_ns": 10**18, "data": True},
               {"path": "run.sh", "kind": "f", "size": 3, "mode": 0o755, "mtime_ns": 2 * 10**18, "data": True},
               {"path": "latest", "kind": "l", "target": "pkg/a.py"}]
    answer, rest = put(monkeypatch, root, entries, b"a = 1" + b"ls\n", root_mode=0o700)
    assert answer == {"ok": True, "written": 2} and rest == b"NEXT"
    assert (root / "pkg" / "a.py").read_bytes() == b"a = 1" and (root / "run.sh").read_bytes() == b"ls\n"
    assert (root / "pkg").stat().st_mode & 0o777 == 0o750 and (root / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (root / "pkg" / "a.py").stat().st_mtime_ns == 10**18 and os.readlink(root / "latest") == "pkg/a.py"
    assert root.stat().st_mode & 0o777 == 0o700 and not list(root.rglob("*.clusterrun-tmp"))

    touched = [{"path": "run.sh", "kind": "f", "size": 3, "mode": 0o700, "mtime_ns": 3 * 10**18}]  # no data
    assert put(monkeypatch, root, touched, b"")[0] == {"ok": True, "written": 0}
    assert (root / "run.sh").stat().st_mode & 0o777 == 0o700 and (root / "run.sh").stat().st_mtime_ns == 3 * 10**18


def test_a_failed_entry_is_the_answer_and_the_data_after_it_is_read_all_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "work"
    (root / "in-the-way").mkdir(parents=True)
    entries = [{"path": "in-the-way", "kind": "f", "size": 4, "mode": 0o644, "data": True},
               {"path": "later.py", "kind": "f", "size": 3, "mode": 0o644, "data": True},
               {"path": "bad", "kind": "x"}]
    answer, rest = put(monkeypatch, root, entries, b"1234abc")
    assert answer == {"ok": False, "error": f"cannot write {root / 'in-the-way'}: a directory is in the way of a "
                                            "file; remove it on the host"}
    assert rest == b"NEXT" and not (root / "later.py").exists()

    short, rest = put(monkeypatch, root, [{"path": "cut.py", "kind": "f", "size": 100, "data": True}], b"")
    assert short["error"].startswith(f"the data of {root / 'cut.py'} ended after 4 of 100 bytes")
    assert not (root / "cut.py").exists() and not list(root.glob(".cut.py.*"))
    link_in_the_way = [{"path": "in-the-way", "kind": "l", "target": "x"}]
    assert "a directory is in the way of a symlink" in put(monkeypatch, root, link_in_the_way, b"")[0]["error"]
