"""Files the controller keeps in the user's cache between runs: ``$XDG_CACHE_HOME/clusterrun/KIND/``
(else ``~/.cache/clusterrun/KIND/``), the folders the user's own (0700), each file written whole,
then renamed (0600). A cache that cannot be written, or that another user could write, is skipped,
never an error. Users:
``sshgcache`` (``ssh -G``'s answers) and ``bundle`` (the agent's zip)."""

from __future__ import annotations

import os


def cache_path(kind: str, name: str) -> str:
    """Where the file ``name`` of the cache ``kind`` (``ssh-g``, ``bundle``) is kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "clusterrun", kind, name)


def keep(path: str, data: bytes, alone: bool = False) -> None:
    """Keep ``data`` at ``path`` (a ``cache_path``): written whole, then renamed. ``alone``: the
    other files of its kind with its suffix (other versions') are removed once it is kept."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(os.path.dirname(os.path.dirname(folder)), exist_ok=True)  # ~/.cache
        for each in (os.path.dirname(folder), folder):  # clusterrun/ and KIND/: the user's own, 0700
            try:
                os.mkdir(each, 0o700)
            except FileExistsError:
                pass
            if not _private(each):  # another user could swap what is kept: nothing is written there
                return
        tmp = f"{path}.{os.urandom(6).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    try:  # not jobs.write_atomic: a cache that cannot be written is no error, and no fsync is owed
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)  # a full disk: no half-written temporary left behind
        except OSError:
            pass
        return
    suffix = os.path.splitext(path)[1]
    for other in os.listdir(folder) if alone else ():
        if other.endswith(suffix) and other != os.path.basename(path):
            try:
                os.unlink(os.path.join(folder, other))
            except OSError:
                pass


def own(folder: str) -> bool:
    """Whether ``folder`` and its parent are the user's and nobody else can write them (True where
    they do not exist yet: ``keep`` makes them so)."""
    return _private(folder) and _private(os.path.dirname(folder))


def _private(folder: str) -> bool:
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022
