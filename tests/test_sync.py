"""The sync's pure parts: .gitignore-style excludes, the local scan, the diff against a host's
manifest, and the agent's ``sync_put`` reading its data from a stream (in this process)."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from clusterrun.agent import syncops
from clusterrun.agent.records import AgentFailure
from clusterrun.agent.wire import SyncPutRequest
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import ConfigError
from clusterrun.core.protocol import RemoteEntry
from clusterrun.sync.carriers import DELTA_MIN, RemotePipe, carrier
from clusterrun.sync.copy import HostSync, source_of
from clusterrun.sync.excludes import Excludes
from clusterrun.sync.tree import LocalEntry, diff, scan, settle
from clusterrun.transports.local import LocalTransport
from tests.simhosts import unavailable


@pytest.mark.parametrize(("patterns", "path", "is_dir", "excluded"), [
    ((), ".git", True, True),  # by default, at any depth, a directory or a file (a worktree's)
    ((), "sub/.git", False, True),
    ((), "a.gitx", False, False),
    (("*.log",), "a.log", False, True),
    (("*.log",), "deep/er/a.log", False, True),  # no slash: a name at any depth
    (("*.log",), "a.log.txt", False, False),
    (("build/",), "build", True, True),  # trailing slash: directories only
    (("build/",), "build", False, False),
    (("build/",), "src/build", True, True),
    (("/build",), "src/build", True, False),  # leading slash: anchored
    (("/build",), "build", False, True),
    (("doc/*.md",), "doc/a.md", False, True),  # a slash inside: anchored too
    (("doc/*.md",), "x/doc/a.md", False, False),
    (("doc/*.md",), "doc/sub/a.md", False, False),  # * stays within a component
    (("doc/**/*.md",), "doc/sub/deep/a.md", False, True),
    (("doc/**/*.md",), "doc/a.md", False, True),
    (("**/cache",), "a/b/cache", True, True),
    (("out/**",), "out/a/b", False, True),
    (("out/**",), "out", True, False),
    (("?.txt",), "a.txt", False, True),
    (("?.txt",), "ab.txt", False, False),
    (("[ab].txt",), "b.txt", False, True),
    (("[!ab].txt",), "b.txt", False, False),
    (("[!ab].txt",), "c.txt", False, True),
    (("*.log", "!keep.log"), "keep.log", False, False),  # the last match decides
    (("!keep.log", "*.log"), "keep.log", False, True),
    (("# a comment", ""), "# a comment", False, False),
    (("\\#hash",), "#hash", False, True),
    (("\\!bang",), "!bang", False, True),
    (("!.git",), ".git", True, False),  # sync_exclude comes last: it may take the default back
])
def test_exclude_patterns_follow_gitignore(patterns: tuple[str, ...], path: str, is_dir: bool,
                                           excluded: bool) -> None:
    assert Excludes.of(patterns).excluded(path, is_dir) is excluded


def test_a_nested_gitignore_applies_below_its_directory_only() -> None:
    rules = Excludes.of().below("", "*.bin\n").below("sub", "/local.txt\n!keep.bin\n")
    assert rules.excluded("sub/local.txt", False)
    assert not rules.excluded("local.txt", False)
    assert not rules.excluded("sub/deeper/local.txt", False)  # anchored to sub/
    assert rules.excluded("x.bin", False)
    assert not rules.excluded("sub/keep.bin", False)  # the deeper file wins below it
    assert rules.excluded("keep.bin", False)


def make_tree(root: Path) -> None:
    (root / "pkg" / "data").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / "build").mkdir()
    (root / "build" / "out.o").write_text("o")
    (root / ".gitignore").write_text("build/\n*.log\n")
    (root / "pkg" / ".gitignore").write_text("/secret.txt\n")
    (root / "pkg" / "secret.txt").write_text("s")
    (root / "secret.txt").write_text("kept: the pattern is anchored to pkg/")
    (root / "run.log").write_text("l")
    (root / "train.py").write_text("print(1)\n")
    (root / "pkg" / "tool.sh").write_text("#!/bin/sh\n")
    (root / "pkg" / "tool.sh").chmod(0o750)
    (root / "pkg" / "data" / "big.ckpt").write_bytes(b"x" * 10)
    (root / "link").symlink_to("pkg/tool.sh")


def test_scan_lists_what_is_not_excluded_with_modes_and_link_targets(tmp_path: Path) -> None:
    make_tree(tmp_path)
    manifest = scan(str(tmp_path), ["*.ckpt"])
    by_path = {e.path: e for e in manifest.entries}
    assert sorted(by_path) == [".gitignore", "link", "pkg", "pkg/.gitignore", "pkg/data", "pkg/tool.sh",
                               "secret.txt", "train.py"]
    assert by_path["pkg/tool.sh"].mode == 0o750 and by_path["pkg/tool.sh"].kind == "f"
    assert by_path["link"].kind == "l" and by_path["link"].target == "pkg/tool.sh"
    assert by_path["pkg"].kind == "d"
    assert by_path["train.py"].size == 9
    assert by_path["train.py"].mtime_ns == os.stat(tmp_path / "train.py").st_mtime_ns
    assert manifest.files == 5


def test_scan_of_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        scan(str(tmp_path / "nope"))


def remote(kind: str = "f", size: int = 3, mtime: int = 100, mode: int = 0o644, target: str | None = None
           ) -> RemoteEntry:
    return RemoteEntry(kind, size, mtime, mode, target)


def test_diff_copies_what_is_missing_or_different_and_compares_where_only_the_mtime_differs() -> None:
    local = [LocalEntry("same", "f", 3, 100, 0o644), LocalEntry("missing", "f", 3, 100, 0o644),
             LocalEntry("size", "f", 4, 100, 0o644), LocalEntry("mtime", "f", 3, 200, 0o644),
             LocalEntry("mode", "f", 3, 100, 0o755), LocalEntry("kind", "f", 3, 100, 0o644),
             LocalEntry("d", "d", mode=0o755), LocalEntry("dmode", "d", mode=0o700),
             LocalEntry("l", "l", target="a"), LocalEntry("l2", "l", target="b")]
    there = {"same": remote(), "size": remote(), "mtime": remote(), "mode": remote(), "kind": remote("l"),
             "d": remote("d", mode=0o755), "dmode": remote("d", mode=0o755), "l": remote("l", target="a"),
             "l2": remote("l", target="a")}
    changes = diff(local, there)
    assert [e.path for e in changes.put] == ["missing", "size", "kind", "dmode", "l2"]
    assert [e.path for e in changes.touch] == ["mode"]
    assert [e.path for e in changes.compare] == ["mtime"]
    assert changes.unchanged == 3  # same, d, l
    assert changes.revised == 4  # the bytes of the files the host holds in another version: "size" ("kind" is a link)

    equal = settle(changes, {"mtime": "h1"}, {"mtime": "h1"})
    assert [e.path for e in equal.touch] == ["mode", "mtime"] and "mtime" not in [e.path for e in equal.put]
    assert equal.revised == 4
    differ = settle(changes, {"mtime": "h1"}, {"mtime": "h2"})
    assert "mtime" in [e.path for e in differ.put] and [e.path for e in differ.touch] == ["mode"]
    assert differ.revised == 4 + 3
    unreadable = settle(changes, {}, {})
    assert "mtime" in [e.path for e in unreadable.put]


def test_sync_is_read_from_the_hosts_file_relative_to_it_and_needs_a_workdir(tmp_path: Path) -> None:
    text = "defaults:\n  workdir: /w\n  sync: ..\n  sync_exclude: [data/, '*.ckpt']\nhosts:\n  - a\n"
    spec = load_cluster_text(text, str(tmp_path / "hosts" / "h.yaml"))
    assert spec.hosts[0].sync == ".." and spec.hosts[0].sync_exclude == ("data/", "*.ckpt")
    assert source_of(spec, spec.hosts[0]) == str(tmp_path)
    assert source_of(spec, spec.hosts[0], "x") == os.path.abspath("x")  # --sync: the current directory's
    with pytest.raises(ConfigError) as info:
        load_cluster_text("hosts:\n  - host: a\n    sync: .\n", "h.yaml")
    assert info.value.line == 3 and "needs a workdir" in info.value.render()
    with pytest.raises(ConfigError, match="expected a list of patterns"):
        load_cluster_text("defaults:\n  workdir: /w\n  sync_exclude: data\nhosts: [a]\n", "h.yaml")


def put(monkeypatch: pytest.MonkeyPatch, request: dict[str, object], data: bytes) -> tuple[dict[str, object], bytes]:
    """Run the agent's sync_put on ``data`` as its stdin; its answer and what is left unread."""
    stream = io.BytesIO(data)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(stream)))  # type: ignore[arg-type]
    try:
        answer = syncops.op_sync_put(SyncPutRequest.from_json(request))
    except AgentFailure as exc:
        answer = {"ok": False, "error": str(exc)}
    return answer, sys.stdin.buffer.read()


def test_sync_put_writes_files_with_mode_and_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "w"
    entries = [{"path": "d", "kind": "d", "mode": 0o750},
               {"path": "d/a", "kind": "f", "size": 3, "mode": 0o741, "mtime_ns": 10**18, "data": True},
               {"path": "b", "kind": "f", "size": 2, "mode": 0o600, "mtime_ns": 5 * 10**17, "data": True},
               {"path": "l", "kind": "l", "target": "d/a", "mode": 0o777}]
    answer, rest = put(monkeypatch, {"root": str(root), "root_mode": 0o705, "entries": entries}, b"abcxy" + b"NEXT\n")
    assert answer == {"ok": True, "written": 2}
    assert rest == b"NEXT\n"
    assert (root / "d" / "a").read_bytes() == b"abc" and (root / "b").read_bytes() == b"xy"
    assert (root / "d" / "a").stat().st_mode & 0o7777 == 0o741 and (root / "d").stat().st_mode & 0o7777 == 0o750
    assert root.stat().st_mode & 0o7777 == 0o705
    assert (root / "d" / "a").stat().st_mtime_ns == 10**18
    assert os.readlink(root / "l") == "d/a"
    assert not [p for p in root.rglob("*") if "clusterrun-tmp" in p.name]


def test_sync_put_fails_naming_the_path_and_reads_the_data_to_its_end(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "w"
    (root / "x").mkdir(parents=True)  # a directory where a file goes
    entries = [{"path": "x", "kind": "f", "size": 3, "mode": 0o644, "mtime_ns": 1, "data": True},
               {"path": "y", "kind": "f", "size": 2, "mode": 0o644, "mtime_ns": 1, "data": True}]
    answer, rest = put(monkeypatch, {"root": str(root), "entries": entries}, b"abcxyNEXT\n")
    assert answer["ok"] is False and f"{root / 'x'}" in str(answer["error"]) and "directory" in str(answer["error"])
    assert rest == b"NEXT\n"  # the next request is read from the right place
    assert not (root / "y").exists()  # nothing after the first failure


def test_sync_put_refuses_paths_outside_the_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("../escape", "/abs", "a/../../b", ""):
        entries = [{"path": bad, "kind": "f", "size": 1, "mode": 0o644, "mtime_ns": 1, "data": True}]
        answer, rest = put(monkeypatch, {"root": str(tmp_path / "w"), "entries": entries}, b"zNEXT\n")
        assert answer["ok"] is False and "invalid sync path" in str(answer["error"]), bad
        assert rest == b"NEXT\n"
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize(("files", "local", "remote", "expected"), [
    ("ssh", "/usr/bin/rsync", "/usr/bin/rsync", "rsync"),
    ("ssh", None, "/usr/bin/rsync", "agent"),  # both ends need it
    ("ssh", "/usr/bin/rsync", None, "agent"),
    ("ssh", "/usr/bin/rsync", "/opt/my tools/rsync", "agent"),  # a path a login shell would split
    ("local", "/usr/bin/rsync", None, "rsync"),  # one machine: this one's rsync is the host's
    ("local", None, None, "agent"),
    (None, "/usr/bin/rsync", "/usr/bin/rsync", "agent"),  # a transport that runs only the agent
])
def test_the_agent_carries_the_data_unless_a_delta_may_spare_it_and_both_ends_have_rsync(
        files: str | None, local: str | None, remote: str | None, expected: str) -> None:
    assert carrier(files, local, remote, DELTA_MIN) == expected  # the host holds other versions of enough
    assert carrier(files, local, remote, DELTA_MIN - 1) == "agent"  # files new there, or a little changed


class PipeRecorder:
    name = "gpu-a"

    def __init__(self) -> None:
        self.commands: list[str] = []

    def pipe(self, command: str, peer: socket.socket) -> tuple[int, str]:
        self.commands.append(command)
        return 0, ""


@pytest.mark.parametrize(("words", "runs"), [
    (["/usr/bin/rsync", "--server", "-stpRe.LsfxCIvu", "."], True),
    (["/usr/bin/rsync", "--server", "-e.LsfxCIvu", ".", "/w/my proj"], False),  # a space: a shell would split it
    (["/usr/bin/rsync", "--server", "x;rm", "."], False),
    (["/usr/bin/rsync", "--sender", "."], False),  # only the receiving server
    (["sh", "-c", "id"], False),
    ("/usr/bin/rsync --server", False),
])
def test_rsyncs_remote_shell_runs_only_the_hosts_rsync_server_with_shell_safe_words(
        tmp_path: Path, words: object, runs: bool) -> None:
    recorder = PipeRecorder()
    pipe = RemotePipe(recorder, str(tmp_path / "s"), "/usr/bin/rsync")  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(json.dumps(words).encode() + b"\nPROTOCOL")
        status, said = pipe._one(ours)
        assert ours.recv(8) == b"PROTOCOL"  # the command's bytes are left for the command
    pipe.listener.close()
    assert recorder.commands == ([" ".join(words)] if runs else [])  # type: ignore[arg-type]
    assert (status, said) == ((0, "") if runs else (-1, f"refused to run {words} for rsync"))


@pytest.mark.parametrize("use_rsync", [pytest.param(True, marks=pytest.mark.integration, id="rsync"),
                                       pytest.param(False, id="no-rsync")])
def test_a_local_host_is_synced_by_the_agent_and_a_changed_big_file_by_rsync_where_it_is_installed(
        tmp_path: Path, use_rsync: bool) -> None:
    rsync = shutil.which("rsync") if use_rsync else None  # the integration setup installs it
    if use_rsync and rsync is None:
        unavailable("rsync is not installed (tests/_support/install_sshd.sh rsync)")
    make_tree(tmp_path / "src")
    (tmp_path / "src" / "big.bin").write_bytes(os.urandom(DELTA_MIN))
    spec = load_cluster_text(f"defaults:\n  python: {sys.executable}\nhosts:\n  - host: here\n    transport: local\n"
                             f"    workdir: {tmp_path / 'w'}\n", path=str(tmp_path / "hosts.yaml"))
    transport = LocalTransport(spec.hosts[0])
    manifest = scan(str(tmp_path / "src"), ["*.ckpt"])
    session = transport.session()
    try:
        report = HostSync(0, spec.hosts[0], session, manifest, transport=transport, rsync=rsync).run()
        (tmp_path / "src" / "train.py").write_text("print(2)\n")
        small = HostSync(0, spec.hosts[0], session, scan(str(tmp_path / "src"), ["*.ckpt"]), transport=transport,
                         rsync=rsync).run()
        with open(tmp_path / "src" / "big.bin", "ab") as f:  # another version of DELTA_MIN bytes on the host
            f.write(b"more")
        again = HostSync(0, spec.hosts[0], session, scan(str(tmp_path / "src"), ["*.ckpt"]), transport=transport,
                         rsync=rsync).run()
    finally:
        session.close()
    assert (report.via, report.copied, small.via, small.copied) == ("agent", 6, "agent", 1)
    assert (again.via, again.copied, again.unchanged) == ("rsync" if rsync else "agent", 1, 8)
    for entry in manifest.entries:
        copy, source = tmp_path / "w" / entry.path, tmp_path / "src" / entry.path
        assert copy.lstat().st_mode == source.lstat().st_mode, entry.path
        if entry.kind == "f":
            assert copy.read_bytes() == source.read_bytes() and copy.stat().st_mtime_ns == source.stat().st_mtime_ns
        if entry.kind == "l":
            assert os.readlink(copy) == os.readlink(source)


def test_the_progress_shows_bytes_and_files_per_host_on_a_terminal_and_plain_lines_elsewhere() -> None:
    from clusterrun.sync.copy import SyncProgress, SyncReport
    from clusterrun.views.sync import SyncView

    events = [SyncProgress(0, "gpu-a", "compare"), SyncProgress(0, "gpu-a", "copy", 1, 3, 2 * 2**20, 6 * 2**20),
              SyncProgress(1, "gpu-b", "copy", 0, 0, 0, 0),
              SyncProgress(0, "gpu-a", "done", 3, 3, 6 * 2**20, 6 * 2**20)]
    plain = io.StringIO()
    with SyncView(plain, live=False) as view:
        for event in events:
            view(event)
    view.report({0: SyncReport(0, "gpu-a", "/src", "/w", copied=3, bytes=6 * 2**20, unchanged=2, seconds=1.5)})
    assert plain.getvalue().splitlines() == [
        "clusterrun: sync gpu-a: copying 3 file(s), 6.3 MB",  # gpu-b has nothing to copy: no line
        "clusterrun: sync node0 gpu-a: 3 file(s) copied (6.3 MB), 2 unchanged, to /w in 1.5 s"]
    terminal = io.StringIO()
    with SyncView(terminal, live=True) as view:
        for event in events[:2]:
            view(event)
    drawn = terminal.getvalue()
    assert "sync gpu-a" in drawn and "2.1/6.3 MB" in drawn and "1/3 files" in drawn
