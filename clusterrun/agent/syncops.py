"""``sync_stat``, ``sync_hash`` and ``sync_put``: the host's side of ``clusterrun/sync/copy.py``."""

from __future__ import annotations

import os
import sys

from .records import AgentFailure, boot_id, unlink_quietly
from .system import which
from .wire import SyncHashRequest, SyncPutRequest, SyncStatRequest

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


SYNC_CHUNK = 1 << 20


def _sync_root(root: object) -> str:
    if not isinstance(root, str) or not root:
        raise AgentFailure(f"invalid sync root {root!r}")
    return os.path.abspath(os.path.expanduser(root))


def _sync_path(root: str, rel: object) -> str:
    """``root/rel`` for a relative path that stays below ``root`` (never ``..`` or absolute)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\x00" in rel:
        raise AgentFailure(f"invalid sync path {rel!r}")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise AgentFailure(f"invalid sync path {rel!r}")
    return os.path.join(root, *parts)


def _sync_error(exc: OSError, path: str) -> AgentFailure:
    return AgentFailure(f"cannot write {path}: {os.strerror(exc.errno) if exc.errno else exc}")


def op_sync_stat(req: SyncStatRequest) -> dict[str, Any]:
    """What is at each of ``paths`` below ``root``: ``[kind, size, mtime_ns, mode, link target]``
    (kind ``f`` file, ``d`` directory, ``l`` symlink, ``o`` anything else); missing paths are left out."""
    root = _sync_root(req.root)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return {"ok": True, "root": root, "exists": False, "entries": {}, "rsync": which("rsync")}
    import stat as _stat  # already loaded by os

    if not _stat.S_ISDIR(st.st_mode):
        raise AgentFailure(f"{root} (workdir) is not a directory")
    entries: dict[str, list[Any]] = {}
    for rel in req.paths or ():
        path = _sync_path(root, rel)
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        mode = info.st_mode
        kind = ("f" if _stat.S_ISREG(mode) else "d" if _stat.S_ISDIR(mode)
                else "l" if _stat.S_ISLNK(mode) else "o")
        entries[rel] = [kind, info.st_size, info.st_mtime_ns, _stat.S_IMODE(mode),
                        os.readlink(path) if kind == "l" else None]
    return {"ok": True, "root": root, "exists": True, "dev": st.st_dev, "ino": st.st_ino,
            "boot_id": boot_id(), "rsync": which("rsync"), "entries": entries}


def op_sync_hash(req: SyncHashRequest) -> dict[str, Any]:
    """The sha256 of each regular file of ``paths`` below ``root`` (missing ones left out)."""
    import hashlib

    root = _sync_root(req.root)
    hashes: dict[str, str] = {}
    for rel in req.paths or ():
        digest = hashlib.sha256()
        try:
            with open(_sync_path(root, rel), "rb") as f:
                block = f.read(SYNC_CHUNK)
                while block:
                    digest.update(block)
                    block = f.read(SYNC_CHUNK)
        except OSError:
            continue
        hashes[rel] = digest.hexdigest()
    return {"ok": True, "hashes": hashes}


def op_sync_put(req: SyncPutRequest) -> dict[str, Any]:
    """Write ``entries`` below ``root``; the contents of the files with ``data`` follow the request
    line on stdin, in order, ``size`` bytes each. Each file goes to a temporary name beside its
    target, then is renamed over it (a reader never sees half a file), with ``mode`` and
    ``mtime_ns`` set; ``d`` makes a directory, ``l`` a symlink, and an entry without ``data`` only
    sets mode and mtime. The data is always read to its end, so that the next request is read
    from the right place, also after a failure (then the first one is the answer)."""
    stdin = sys.stdin.buffer
    entries = req.entries or []
    pending = sum(int(e.get("size") or 0) for e in entries if e.get("kind") == "f" and e.get("data"))
    failure: AgentFailure | None = None
    written = 0
    try:
        root = _sync_root(req.root)
        try:
            if not os.path.isdir(root):  # a workdir made here gets the source's mode; one that exists keeps its own
                os.makedirs(root)
                if req.root_mode is not None:
                    os.chmod(root, req.root_mode)
        except OSError as exc:
            raise _sync_error(exc, root) from None
        for entry in entries:
            path = _sync_path(root, entry.get("path"))
            kind, size, mode = entry.get("kind"), int(entry.get("size") or 0), int(entry.get("mode") or 0o644)
            data = bool(entry.get("data"))
            if failure is not None:  # skip the rest, reading what belongs to it
                if kind == "f" and data:
                    _sync_skip(stdin, size)
                    pending -= size
                continue
            try:
                if kind == "d":
                    _sync_dir(path, mode)
                elif kind == "l":
                    _sync_link(path, str(entry.get("target")))
                elif kind == "f" and data:
                    pending -= size
                    _sync_file(stdin, path, size, mode, int(entry.get("mtime_ns") or 0))
                    written += 1
                elif kind == "f":
                    os.chmod(path, mode)
                    os.utime(path, ns=(int(entry["mtime_ns"]), int(entry["mtime_ns"])))
                else:
                    raise AgentFailure(f"invalid sync entry kind {kind!r}")
            except _SyncShort as exc:
                raise AgentFailure(str(exc)) from None
            except OSError as exc:
                named = exc.filename if isinstance(exc.filename, str) else ""  # a symlink's is its target
                inside = named.startswith(root + os.sep) and not named.endswith(".clusterrun-tmp")
                failure = _sync_error(exc, named if inside else path)
            except AgentFailure as exc:
                failure = exc
    finally:
        if pending > 0:
            _sync_skip(stdin, pending)
    if failure is not None:
        raise failure
    return {"ok": True, "written": written}


class _SyncShort(Exception):
    """stdin ended inside a file's data."""


def _sync_skip(stdin: Any, size: int) -> None:
    while size > 0:
        block = stdin.read(min(size, SYNC_CHUNK))
        if not block:
            return
        size -= len(block)


def _sync_dir(path: str, mode: int) -> None:
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, mode)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkdir(path)
    os.chmod(path, mode)  # the agent's umask is 077


def _sync_link(path: str, target: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        raise AgentFailure(f"cannot write {path}: a directory is in the way of a symlink; remove it on the host")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.urandom(6).hex()}.clusterrun-tmp"
    os.symlink(target, tmp)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _sync_file(stdin: Any, path: str, size: int, mode: int, mtime_ns: int) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        _sync_skip(stdin, size)
        raise AgentFailure(f"cannot write {path}: a directory is in the way of a file; remove it on the host")
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.urandom(6).hex()}.clusterrun-tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        _sync_skip(stdin, size)
        raise
    left = size
    try:
        try:
            while left > 0:
                block = stdin.read(min(left, SYNC_CHUNK))
                if not block:
                    raise _SyncShort(f"the data of {path} ended after {size - left} of {size} bytes")
                left -= len(block)
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.rename(tmp, path)
    except BaseException:
        _sync_skip(stdin, left)
        unlink_quietly(tmp)
        raise
