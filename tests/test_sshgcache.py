"""``ssh -G``'s answers kept between runs: private to the user (folders 0700, answers 0600), found again."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from clusterrun.transports import sshgcache, usercache


def test_an_answer_is_kept_private_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu01\n  User trainer\n")
    path, found = sshgcache.load("gpu01", str(config), None, None, "/usr/bin/ssh")
    assert path is not None and found is None
    sshgcache.store(path, {"user": ["trainer"]})
    assert sshgcache.load("gpu01", str(config), None, None, "/usr/bin/ssh") == (path, {"user": ["trainer"]})
    for folder in (tmp_path / "cache" / "clusterrun", tmp_path / "cache" / "clusterrun" / "ssh-g"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    config.write_text("Host gpu01\n  User someone-else\n")  # the file changed: not the kept answer
    assert sshgcache.load("gpu01", str(config), None, None, "/usr/bin/ssh")[1] is None


def test_a_cache_another_user_could_write_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu01\n")
    path, _ = sshgcache.load("gpu01", str(config), None, None, "/usr/bin/ssh")
    assert path is not None
    sshgcache.store(path, {"proxycommand": ["sh -c 'touch /tmp/owned'"]})
    Path(path).parent.chmod(0o777)  # anybody could have put that answer there
    assert sshgcache.load("gpu01", str(config), None, None, "/usr/bin/ssh") == (None, None)


def test_a_failed_write_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu01\n")
    path, _ = sshgcache.load("gpu01", str(config), None, None, "/usr/bin/ssh")
    assert path is not None

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(usercache.os, "replace", full)
    sshgcache.store(path, {"user": ["trainer"]})  # a cache: no error
    assert os.listdir(Path(path).parent) == []


@pytest.mark.parametrize("folder", ["clusterrun", "clusterrun/bundle"])
def test_nothing_is_kept_in_a_folder_another_user_could_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              folder: str) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = Path(usercache.cache_path("bundle", "agent.zip"))
    (tmp_path / "cache" / folder).mkdir(parents=True, mode=0o700)
    (tmp_path / "cache" / folder).chmod(0o777)  # another user could swap the zip in it
    theirs = tmp_path / "cache" / folder / "theirs.zip"
    theirs.write_bytes(b"")
    usercache.keep(str(path), b"zip", alone=True)
    assert sorted(p.relative_to(tmp_path / "cache").as_posix() for p in (tmp_path / "cache").rglob("*")) == \
        sorted({"clusterrun", folder, f"{folder}/theirs.zip"})  # nothing written there, nothing removed
    (tmp_path / "cache" / folder).chmod(0o700)
    usercache.keep(str(path), b"zip", alone=True)
    assert path.read_bytes() == b"zip"
    assert theirs.exists() == (folder == "clusterrun")  # in the zips' own folder: another version, removed
