"""What a sync copies: the local tree scanned (exclude rules applied) and compared with a host's.

Pure but for reading the local directory: ``scan()`` → ``Manifest``; ``diff()`` against what a host
listed → ``Changes``; ``settle()`` decides, by sha256, the files whose size matches but mtime does not.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import RemoteEntry
from clusterrun.sync.excludes import Excludes

CHUNK = 1 << 20

# ---------------------------------------------------------------------------------- manifest


@frozen
class LocalEntry:
    """A path to copy: ``f`` file, ``d`` directory or ``l`` symlink (``target``)."""

    path: str
    kind: str
    size: int = 0
    mtime_ns: int = 0
    mode: int = 0o644
    target: str | None = None


@frozen
class Manifest:
    root: str
    entries: tuple[LocalEntry, ...]
    mode: int  # the directory's own
    dev: int
    ino: int
    hashes: dict[tuple[str, int, int], str | None] = field(default_factory=dict, compare=False)  # sha256 cache

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries if e.kind == "f")

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "f")


def scan(root: str, patterns: Sequence[str] = ()) -> Manifest:
    """Every directory, file and symlink below ``root`` that is not excluded, sorted by path.
    Raises ``ConfigError`` if ``root`` is not a readable directory."""
    try:
        top = os.stat(root)
    except OSError as exc:
        raise ConfigError(f"the directory to sync, {root}, cannot be read: {exc.strerror}", key="sync",
                          hint="`sync:` is relative to the hosts file's directory, `--sync DIR` to the current "
                          "one") from None
    if not stat.S_ISDIR(top.st_mode):
        raise ConfigError(f"the directory to sync, {root}, is not a directory", key="sync")
    entries: list[LocalEntry] = []

    def walk(folder: str, rel: str, rules: Excludes) -> None:
        try:
            with open(os.path.join(folder, ".gitignore"), encoding="utf-8", errors="replace") as f:
                rules = rules.below(rel, f.read())
        except OSError:
            pass
        try:
            items = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise ConfigError(f"cannot read {folder}: {exc.strerror}", key="sync") from None
        for item in items:
            path = f"{rel}/{item.name}" if rel else item.name
            try:
                info = item.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            is_dir = stat.S_ISDIR(info.st_mode)
            if rules.excluded(path, is_dir):
                continue
            mode = stat.S_IMODE(info.st_mode)
            if is_dir:
                entries.append(LocalEntry(path, "d", mode=mode))
                walk(item.path, path, rules)
            elif stat.S_ISREG(info.st_mode):
                entries.append(LocalEntry(path, "f", info.st_size, info.st_mtime_ns, mode))
            elif stat.S_ISLNK(info.st_mode):
                entries.append(LocalEntry(path, "l", mode=mode, target=os.readlink(item.path)))
            # sockets, fifos and devices are not copied

    walk(root, "", Excludes.of(patterns))
    return Manifest(root, tuple(entries), stat.S_IMODE(top.st_mode), top.st_dev, top.st_ino)


# -------------------------------------------------------------------------------------- diff


@dataclass
class Changes:
    """What one host needs: ``put`` (dirs, links and files with their data), ``touch`` (files whose
    content is the same: mode and mtime only) and ``compare`` (same size, other mtime: hash them);
    ``revised``: the bytes of the files in ``put`` that the host holds in another version."""

    put: list[LocalEntry] = field(default_factory=list)
    touch: list[LocalEntry] = field(default_factory=list)
    compare: list[LocalEntry] = field(default_factory=list)
    unchanged: int = 0
    revised: int = 0


def diff(local: Sequence[LocalEntry], remote: Mapping[str, RemoteEntry]) -> Changes:
    """Compare the local entries with what the host has at their paths."""
    changes = Changes()
    for entry in local:
        there = remote.get(entry.path)
        if there is None or there.kind != entry.kind:
            changes.put.append(entry)
        elif entry.kind == "d":
            if there.mode != entry.mode:
                changes.put.append(entry)  # chmod only
            else:
                changes.unchanged += 1
        elif entry.kind == "l":
            if there.target != entry.target:
                changes.put.append(entry)
            else:
                changes.unchanged += 1
        elif there.size != entry.size:
            changes.put.append(entry)
            changes.revised += entry.size
        elif there.mtime_ns != entry.mtime_ns:
            changes.compare.append(entry)
        elif there.mode != entry.mode:
            changes.touch.append(entry)
        else:
            changes.unchanged += 1
    return changes


def settle(changes: Changes, local_hashes: Mapping[str, str], remote_hashes: Mapping[str, str]) -> Changes:
    """``changes`` with its ``compare`` list decided: equal hashes → ``touch``, else ``put``."""
    put, touch, revised = list(changes.put), list(changes.touch), changes.revised
    for entry in changes.compare:
        if local_hashes.get(entry.path) is not None and local_hashes.get(entry.path) == remote_hashes.get(entry.path):
            touch.append(entry)
        else:
            put.append(entry)
            revised += entry.size
    return Changes(put=sorted(put, key=lambda e: e.path), touch=touch, compare=[], unchanged=changes.unchanged,
                   revised=revised)


def file_hash(path: str) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()



__all__ = ["CHUNK", "Changes", "LocalEntry", "Manifest", "diff", "file_hash", "scan", "settle"]
