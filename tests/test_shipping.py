"""The agent shipped to a host as one zip named by its sha256, cached there (``clusterrun.agent``'s
docstring): built deterministically, sent only when the host's cache lacks it or holds it damaged,
compiled once per version, and a cache that another user could write is refused."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import sys
import time
import zipfile
import zlib
from pathlib import Path

import pytest

from clusterrun.agent import cache
from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import AgentError
from clusterrun.transports.base import request_line
from clusterrun.transports.bundle import AGENT_DIR, agent_bundle, build_zip
from clusterrun.transports.local import LocalTransport
from tests.simhosts import unavailable

TRANSPORT = LocalTransport(HostSpec(host="here", transport="local"))


def probe(tmp_path: Path) -> dict[str, object]:
    return {"op": "probe", "free_port": False, "state_dir": str(tmp_path / "state")}


def sent_by_a_probe(tmp_path: Path) -> int:
    """The bytes one session wrote to its agent for one probe (whose answer must be ok)."""
    session = TRANSPORT.session()
    try:
        assert session.call(probe(tmp_path))["ok"]
        return session.sent
    finally:
        session.close()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The agent's cache on this host (a local agent inherits the environment)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "clusterrun"


def versions(folder: Path) -> tuple[Path, Path]:
    """The cached zip of this version and its compiled form, both verified by their names."""
    bundle = agent_bundle()
    source = folder / f"agent-{bundle.sha256}.zip"
    [compiled] = folder.glob(f"agent-{bundle.sha256}-{sys.implementation.cache_tag}-*.zip")
    assert hashlib.sha256(source.read_bytes()).hexdigest() == bundle.sha256
    assert f"{zlib.crc32(compiled.read_bytes()):08x}" == compiled.name.rsplit("-", 1)[1][:-4]
    return source, compiled


def test_the_zip_is_deterministic_and_holds_the_package_sources_only(tmp_path: Path) -> None:
    copy = tmp_path / "agent"
    shutil.copytree(AGENT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "serve.cpython-311.pyc").write_bytes(b"bytecode")
    for path in copy.iterdir():
        os.utime(path, (1e9, 1e9))  # other timestamps: the same bytes
    assert build_zip(copy) == build_zip(AGENT_DIR) == build_zip(AGENT_DIR)
    names = zipfile.ZipFile(io.BytesIO(build_zip())).namelist()
    assert names == sorted(names) and "clusterrun_agent/serve.py" in names
    assert all(n.startswith("clusterrun_agent/") and n.endswith(".py") for n in names)


def test_connections_opened_at_once_build_the_zip_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection asks for the bundle when it opens its agent, 64 of them at once in ``up``."""
    import threading

    from clusterrun.transports import bundle

    builds: list[int] = []
    both = threading.Barrier(2, timeout=1)  # passed only if a second build runs beside the first

    def build() -> bytes:
        builds.append(1)
        try:
            both.wait()
        except threading.BrokenBarrierError:
            pass
        return b"zip"

    monkeypatch.setattr(bundle, "_zip", build)
    bundle._bundle.cache_clear()
    try:
        threads = [threading.Thread(target=bundle.agent_bundle) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        bundle._bundle.cache_clear()
    assert len(builds) == 1


def test_the_zip_is_kept_between_commands_and_read_back_only_if_it_holds_the_sources(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later command reads the kept zip instead of compressing the sources again; a kept zip
    whose members differ from the sources (changed by anyone: it runs on every host) is replaced."""
    from clusterrun.transports import bundle

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built: list[int] = []
    build = bundle.build_zip
    monkeypatch.setattr(bundle, "build_zip", lambda **kw: built.append(1) or build(**kw))

    def command() -> bytes:  # a new process: the bundle not made yet
        bundle._bundle.cache_clear()
        try:
            return agent_bundle().zip
        finally:
            bundle._bundle.cache_clear()

    first = command()
    [kept] = (tmp_path / "cache" / "clusterrun" / "bundle").glob("*.zip")
    assert command() == first == kept.read_bytes() == build_zip() and built == [1]
    files = bundle.sources()
    name = next(iter(files))
    kept.write_bytes(build_zip(files={**files, name: files[name] + b"import os; os.system('touch /tmp/owned')\n"}))
    assert command() == first == kept.read_bytes() and built == [1, 1]
    kept.write_bytes(b"PK not a zip")
    older = kept.with_name("0" * 64 + ".zip")  # an earlier version's: replaced by this one
    older.write_bytes(b"")
    assert command() == first and built == [1, 1, 1]
    assert list(kept.parent.iterdir()) == [kept]


@pytest.mark.integration
def test_a_session_sends_the_zip_once_then_only_its_hash(tmp_path: Path, folder: Path) -> None:
    bundle = agent_bundle()
    asked = len(request_line(probe(tmp_path)))
    assert sent_by_a_probe(tmp_path) == len(bundle.preamble(ahead=True)) + len(bundle.zip) + asked  # first contact
    source, compiled = versions(folder)
    assert sent_by_a_probe(tmp_path) == len(bundle.preamble(ahead=True)) + asked  # the loader and the hash only
    assert sent_by_a_probe(tmp_path) < len(bundle.zip) / 5
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = [p for p in folder.iterdir() if p.is_file()]  # not the controller's own (bundle/, ssh-g/)
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
    assert sorted(files) == sorted([source, compiled])  # no temporary file left


@pytest.mark.integration
def test_a_damaged_cached_zip_is_replaced(tmp_path: Path, folder: Path) -> None:
    bundle = agent_bundle()
    sent_by_a_probe(tmp_path)
    source, compiled = versions(folder)
    damaged = bytearray(compiled.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    compiled.write_bytes(bytes(damaged))  # compiled again from the intact source: nothing sent
    assert sent_by_a_probe(tmp_path) < len(bundle.zip)
    assert versions(folder)[1].read_bytes() != bytes(damaged)
    for path in folder.glob(f"agent-{bundle.sha256}-*"):
        path.unlink()
    source.write_bytes(source.read_bytes()[:-1] + b"!")  # the source damaged, nothing compiled: sent again
    assert sent_by_a_probe(tmp_path) > len(bundle.zip)
    versions(folder)


@pytest.mark.integration
@pytest.mark.parametrize("problem", ["writable by others", "owned by another user"])
def test_a_cache_that_another_user_could_write_is_refused(tmp_path: Path, folder: Path, problem: str) -> None:
    folder.mkdir(parents=True, mode=0o700)
    if problem == "writable by others":
        folder.chmod(0o777)
        fix = f"chmod 700 {folder}"
    else:
        if os.geteuid() != 0:
            unavailable("needs root to give the directory away")
        os.chown(folder, 65534, 65534)
        fix = "set XDG_CACHE_HOME to a directory of your own"
    with pytest.raises(AgentError) as caught:
        TRANSPORT.call(probe(tmp_path))
    assert str(folder) in caught.value.message and fix in caught.value.message
    assert list(folder.iterdir()) == []  # nothing was written there


def test_versions_unused_for_long_are_pruned_and_the_current_one_kept(tmp_path: Path) -> None:
    now = time.time()
    for name, age in [("agent-old.zip", 8), ("agent-old-cpython-311-x.zip", 8), ("agent-recent.zip", 1),
                      ("agent-current.zip", 30), ("agent-current-cpython-311-y.zip", 30), ("notes.txt", 30)]:
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (now - age * 86400, now - age * 86400))
    assert cache.prune(str(tmp_path), "current", now) == ["agent-old-cpython-311-x.zip", "agent-old.zip"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "agent-current-cpython-311-y.zip", "agent-current.zip", "agent-recent.zip", "notes.txt"]


@pytest.mark.integration
def test_without_a_cache_it_can_make_the_agent_is_cached_in_a_temporary_directory_of_the_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-cache-here")  # no home, or a read-only one
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert sent_by_a_probe(tmp_path) > len(agent_bundle().zip)
    assert sent_by_a_probe(tmp_path) < len(agent_bundle().zip)  # kept there
    folder = tmp_path / "tmp" / f"clusterrun-{os.getuid()}"
    versions(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("word", ["have", "need"])
def test_the_first_request_goes_with_the_preamble_before_the_loader_answers(word: str) -> None:
    """One round trip fewer per connection: the request does not wait for the loader's have/need
    (the loader reads it before any zip); a request followed by data still waits."""
    from clusterrun.transports.base import AgentReader, AgentSession

    bundle = agent_bundle()
    request = {"op": "jobs", "state_dir": "/nowhere"}
    sent: list[bytes] = []

    def lines():  # type: ignore[no-untyped-def]
        assert sent == [bundle.preamble(ahead=True) + request_line(request)]  # before the loader's word
        yield b'{"agent": "%s"}\n' % word.encode()
        yield b'{"ok": true, "jobs": []}\n'

    received = lines()
    session = AgentSession("h", sent.append, AgentReader(lambda: next(received, b"")), lambda: None, bundle=bundle)
    assert session.call(request) == {"ok": True, "jobs": []}
    assert sent[1:] == ([bundle.zip] if word == "need" else [])

    sent.clear()
    replies = iter([b'{"agent": "have"}\n{"ok": true}\n'])  # both in one receive
    session = AgentSession("h", sent.append, AgentReader(lambda: next(replies, b"")), lambda: None, bundle=bundle)
    assert session.call_with_data({"op": "sync_put"}, [b"bytes"]) == {"ok": True}
    assert sent == [bundle.preamble(), request_line({"op": "sync_put"}), b"bytes"]


@pytest.mark.integration
def test_modules_in_the_agents_working_directory_do_not_shadow_the_standard_library(
        tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sshd starts the agent in the user's home: a ``zlib.py`` there (a name the loader imports)
    must not be imported in place of the standard library's (a local agent starts where we are)."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("zlib", "select", "__future__", "_json", "_socket", "ctypes", "marshal", "importlib"):
        (home / f"{name}.py").write_text(f"raise SystemExit('the home directory\\'s {name}.py was imported')\n")
    monkeypatch.chdir(home)
    sent_by_a_probe(tmp_path)  # first contact: the zip installed and compiled
    sent_by_a_probe(tmp_path)  # from the compiled zip
    versions(folder)
