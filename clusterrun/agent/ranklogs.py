"""``RankLogs``: torchrun's per-rank files merged into the node's log, whole lines, tagged."""

from __future__ import annotations

import os

from .records import _fs_problem
from .waker import Waker

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _files_at(root: str, prefixes: tuple[str, ...], before_listing: Any = None) -> list[str]:
    """The paths ``root/a/b/...`` whose n-th part starts with ``prefixes[n]`` (a glob of
    ``*/attempt_*/...`` without glob's imports of re and fnmatch), hidden names excluded.
    ``before_listing(folder)`` is called before each directory is listed."""
    found = [root]
    for prefix in prefixes:
        deeper = []
        for folder in found:
            if before_listing is not None:
                before_listing(folder)
            try:
                with os.scandir(folder) as entries:
                    deeper += [e.path for e in entries if e.name.startswith(prefix) and not e.name.startswith(".")]
            except OSError:  # not there (yet), or not a directory
                pass
        found = deeper
    return sorted(found)


class RankLogs:
    """Merge torchrun's per-rank files into ``output.log``: whole lines, each tagged ``[rankN]:``.

    torchrun runs with ``--redirects=3`` and its log dir inside the attempt directory
    (``<dir>/torchrun/<run id>/attempt_<k>/<local rank>/std{out,err}.log``). Its own ``--tee``
    would copy those files to the console with a prefix, but it emits a line as soon as part of
    it was written (Python writes a printed text and its newline separately), which splits lines
    and mixes ranks. Here a line is only passed on once complete, and every batch goes to the
    O_APPEND log in one write, so no line is ever split or interleaved.
    """

    def __init__(self, root: str, out_fd: int, first_rank: int, waker: Waker | None = None) -> None:
        self.root, self.out_fd, self.first_rank = root, out_fd, first_rank
        self.files: dict[str, list[Any]] = {}  # path → [file, pending bytes, prefix]
        self.error: str | None = None
        self.waker = waker  # told to watch every directory of the tree

    def _discover(self) -> bool:
        found = False
        watch = self.waker.watch if self.waker is not None else None
        for path in _files_at(self.root, ("", "attempt_", "", "std"), before_listing=watch):
            local = os.path.basename(os.path.dirname(path))
            if path not in self.files and local.isdigit() and path.endswith(".log"):
                try:
                    handle = open(path, "rb")  # noqa: SIM115 - kept open while the job runs
                except OSError:
                    continue
                prefix = b"[rank%d]:" % (self.first_rank + int(local))
                self.files[path] = [handle, b"", prefix]
                found = True
        return found

    def poll(self, final: bool = False) -> bool:
        """Pass on every complete line written so far (and, when ``final``, the rest too); True if
        torchrun made new per-rank files (it is starting workers)."""
        found = self._discover()
        out = []
        for entry in self.files.values():
            handle, pending, prefix = entry
            pending += handle.read()
            cut = pending.rfind(b"\n") + 1
            for line in pending[:cut].splitlines():
                out.append(prefix + line + b"\n")
            pending = pending[cut:]
            if final and pending:
                out.append(prefix + pending + b"\n")
                pending = b""
            entry[1] = pending
        data = b"".join(out)
        try:
            while data:
                data = data[os.write(self.out_fd, data):]
        except OSError as exc:  # a full disk: the lines are lost, the job goes on
            self.error = f"lines of the workers were lost: cannot write output.log: {_fs_problem(exc)}"
        return found

    def close(self) -> None:
        for handle, _, _ in self.files.values():
            handle.close()
