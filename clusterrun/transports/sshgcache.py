"""``ssh -G``'s answers kept in the user's cache between runs (``sshhosts`` asks here first).

An answer is kept under a key of everything that could change it: the alias, port and user asked,
the ``ssh`` binary, ``$HOME`` and the uid, and every configuration file ``ssh -G`` reads (the
``-F`` file, else ``~/.ssh/config`` and ``/etc/ssh/ssh_config``, and the files their ``Include``
patterns match) with its content's sha256, or its absence. A configuration that runs commands or
asks the network (``Match exec``, ``Match localnetwork``, ``CanonicalizeHostname``), or that
uses an environment variable or this machine's name, is never kept: its answer can change while
no file does. One ``ssh -G`` costs the controller about 5 ms of CPU per host (docs/benchmarks.md).
The files are read once for all the hosts of a run (``load``'s ``reuse``), not once per host.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
import time

from clusterrun.transports import usercache

# Words after which an answer may change with no file changing: a command's or the network's say,
# an environment variable (``${VAR}``), this machine's name (``%L``, ``%l``).
VOLATILE = ("exec", "localnetwork", "canonicalizehostname", "${", "%l")
MAX_FILES = 64  # Include loops, or a glob over a big folder: not cached


def _stat(path: str) -> list[object]:
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, st.st_ino, st.st_size, st.st_mtime_ns]


def config_signature(config: str | None) -> list[list[object]] | None:
    """The files ``ssh -G`` reads for ``config`` (None: the default files), each with its
    content's sha256 (None: absent); None when one holds a word of ``VOLATILE`` or there are too many."""
    home_ssh = os.path.expanduser("~/.ssh")
    roots = [os.path.expanduser(config)] if config else [os.path.join(home_ssh, "config"), "/etc/ssh/ssh_config"]
    todo = [(path, "/etc/ssh" if path == "/etc/ssh/ssh_config" else home_ssh) for path in roots]
    signature: list[list[object]] = []
    while todo:
        path, base = todo.pop(0)
        if len(signature) >= MAX_FILES:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            signature.append([path, None])
            continue
        signature.append([path, hashlib.sha256(data).hexdigest()])
        for line in data.decode("utf-8", "replace").lower().splitlines():
            words = line.replace("=", " ", 1).split()
            if not words or words[0].startswith("#"):
                continue
            if any(word in line for word in VOLATILE):
                return None
            if words[0] == "include":
                for pattern in words[1:]:
                    pattern = os.path.join(base, os.path.expanduser(pattern))
                    todo += [(found, base) for found in sorted(glob.glob(pattern))]
    return signature


_signatures: dict[tuple[str | None, str], tuple[float, list[list[object]] | None]] = {}
_signing = threading.Lock()


def _signature(config: str | None, reuse: float) -> list[list[object]] | None:
    """``config_signature``, read again only after ``reuse`` seconds: every host of a run has the
    same files, often a block per host, so reading them per host cost N times a file of N blocks
    (6.6 ms of CPU at N = 32, 25 ms at 64). The other hosts wait for the one that reads them."""
    key = (config, os.path.expanduser("~"))
    with _signing:
        found = _signatures.get(key)
        if found is not None and time.monotonic() - found[0] < reuse:
            return found[1]
        signature = config_signature(config)
        _signatures[key] = (time.monotonic(), signature)
        return signature


def _path(alias: str, config: str | None, port: int | None, user: str | None, ssh: str,
          reuse: float) -> str | None:
    signature = _signature(config, reuse)
    if signature is None:
        return None
    key = json.dumps([alias, config, port, user, _stat(ssh), os.path.expanduser("~"), os.getuid(), signature])
    return usercache.cache_path("ssh-g", hashlib.sha256(key.encode()).hexdigest() + ".json")


def load(alias: str, config: str | None, port: int | None, user: str | None,
         ssh: str, reuse: float = 0.0) -> tuple[str | None, dict[str, list[str]] | None]:
    """Where the answer for these is kept (None: never kept), and the answer if it is there; the
    configuration's files as read in the last ``reuse`` seconds (0: read now)."""
    path = _path(alias, config, port, user, ssh, reuse)
    if path is None or not usercache.own(os.path.dirname(path)):  # a kept answer may run a ProxyCommand
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError):
        return path, None
    return path, values if isinstance(values, dict) else None


def store(path: str, values: dict[str, list[str]]) -> None:
    """Keep ``values`` at ``path`` (written whole, then renamed); a cache that cannot be written is skipped."""
    usercache.keep(path, json.dumps(values).encode())
