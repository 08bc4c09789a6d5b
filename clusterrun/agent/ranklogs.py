"""``RankLogs``: torchrun's per-rank files merged into the node's log, whole lines, tagged."""

from __future__ import annotations

import os
import time

from .codec import json_dumps
from .records import fs_problem, read_json
from .waker import Waker

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
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


def _tagged(prefix: bytes, data: bytes, final: bool) -> bytes:
    """The complete lines of ``data``, each tagged with ``prefix`` (and, when ``final``, a partial
    last line too, ended): what ``RankLogs`` appends to output.log for one per-rank file."""
    cut = len(data) if final else data.rfind(b"\n") + 1
    return b"".join(prefix + line + b"\n" for line in data[:cut].splitlines())


IN_PLACE = 4096  # the journal's longest record written in place: one page, which a kill cannot tear


class RankLogs:
    """Merge torchrun's per-rank files into ``output.log``: whole lines, each tagged ``[rankN]:``.

    torchrun runs with ``--redirects=3`` and its log dir inside the attempt directory
    (``<dir>/torchrun/<run id>/attempt_<k>/<local rank>/std{out,err}.log``). Its own ``--tee``
    would copy those files to the console with a prefix, but it emits a line as soon as part of
    it was written (Python writes a printed text and its newline separately), which splits lines
    and mixes ranks. Here a line is only passed on once complete, and every batch goes to the
    O_APPEND log in one write, so no line is ever split or interleaved.

    With a ``journal`` (``ranklogs.json``) a monitor killed at any moment is resumed by the next
    one without losing or repeating a line: before each batch is appended, the journal records
    every file's offset so far, the batch's ranges and the log's size; on resume the batch is
    rebuilt from those ranges and counts as written if output.log holds it past that size.
    """

    def __init__(self, root: str, out_fd: int, first_rank: int, waker: Waker | None = None,
                 journal: str | None = None, times: str | None = None,
                 tap: Callable[[int, bytes], object] | None = None) -> None:
        self.root, self.out_fd, self.first_rank = root, out_fd, first_rank
        self.tap = tap  # told every rank's new bytes as read, partial lines included (the progress tracker)
        self.times = times  # output.times: when the bytes of output.log were written (``note_time``)
        self.timed = -1  # the size of output.log after the last time noted
        self.files: dict[str, list[Any]] = {}  # path → [file, pending bytes, prefix]
        self.names: dict[str, tuple[str, int]] = {}  # path → (relative to ``root``, global rank)
        self.done: dict[str, int] = {}  # path relative to ``root`` → bytes of it passed on
        self.error: str | None = None
        self.waker = waker  # told to watch every directory of the tree
        self.journal = journal
        self._journal_fd = self._times_fd = -1  # opened at their first write, kept open
        self._journal_size = 0
        if journal is not None:
            self.done = resume_offsets(journal, root, out_fd, first_rank)

    def _prefix(self, path: str) -> bytes | None:
        local = os.path.basename(os.path.dirname(path))
        return b"[rank%d]:" % (self.first_rank + int(local)) if local.isdigit() and path.endswith(".log") else None

    def _discover(self, final: bool) -> bool:
        """Open the per-rank files not seen yet; True if there were any. Where the waker watches
        every directory of the tree, only after it saw something made in one (or ``final``)."""
        waker = self.waker
        if waker is not None and waker.reliable and not final and self.root in waker.watched:
            if not waker.created:  # every directory of the tree is watched: nothing new was made
                return False
            waker.created = False
        found = False
        watch = waker.watch if waker is not None else None
        for path in _files_at(self.root, ("", "attempt_", "", "std"), before_listing=watch):
            prefix = self._prefix(path)
            if path not in self.files and prefix is not None:
                try:
                    handle = open(path, "rb")  # noqa: SIM115 - kept open while the job runs
                    handle.seek(self.done.get(os.path.relpath(path, self.root), 0))
                except OSError:
                    continue
                self.files[path] = [handle, b"", prefix]
                self.names[path] = (os.path.relpath(path, self.root),
                                    self.first_rank + int(os.path.basename(os.path.dirname(path))))
                found = True
        return found

    def _written_order(self, path: str) -> tuple[str, int, bool]:
        """Where a rank's file goes in a batch. clusterrun starts each rank with its stderr on its
        stdout (plan.torchrun_argv: exact order, stderr.log stays empty); a rank started without
        that (a plan recorded by an older clusterrun) has two files, and what it wrote to both
        since the last batch is ordered by when each was last written (a traceback after the
        prints before it), stdout first when the clock cannot tell them apart."""
        try:
            written = os.fstat(self.files[path][0].fileno()).st_mtime_ns
        except OSError:
            written = 0
        return os.path.dirname(path), written, os.path.basename(path) != "stdout.log"

    def poll(self, final: bool = False) -> bool:
        """Pass on every complete line written so far (and, when ``final``, the rest too); True if
        torchrun made new per-rank files (it is starting workers)."""
        found = self._discover(final)
        out: list[bytes] = []
        batch: list[tuple[str, int, int, bool]] = []  # per file: the range of it in this batch
        for path in sorted(self.files, key=self._written_order):
            entry = self.files[path]
            handle, pending, prefix = entry
            new = handle.read()
            if new and self.tap is not None:
                self.tap(self.names[path][1], new)
            pending += new
            cut = len(pending) if final else pending.rfind(b"\n") + 1
            if cut:
                rel = self.names[path][0]
                start = self.done.get(rel, 0)
                out.append(_tagged(prefix, pending[:cut], final))
                batch.append((rel, start, start + cut, final))
            entry[1] = pending[cut:]
        data = b"".join(out)
        self.note_time(bool(batch))  # before the batch: a reader of the log finds its time already there
        if not batch:
            return found
        if self.journal is not None:
            try:
                size = os.fstat(self.out_fd).st_size
                record = {"done": self.done, "batch": batch, "log_start": size}
                self._write_journal(self.journal, json_dumps(record).encode())
            except OSError:  # a full disk: the lines still go out; a monitor resumed later may repeat this batch
                pass
        try:
            while data:
                data = data[os.write(self.out_fd, data):]
        except OSError as exc:  # a full disk: the lines are lost, the job goes on
            self.error = f"lines of the workers were lost: cannot write output.log: {fs_problem(exc)}"
        for rel, _, end, _ in batch:
            self.done[rel] = end
        if self.times is not None:
            try:  # not contextlib.suppress: contextlib imports collections and functools (2 ms a start)
                self.timed = os.fstat(self.out_fd).st_size
            except OSError:
                pass
        return found

    def note_time(self, batch: bool) -> None:
        """Append ``<offset> <ns>`` to ``times``: output.log's bytes from ``offset`` on (up to the
        next entry's) were written about ``ns`` (wall clock): what torchrun appended since the
        last entry, and the ``batch`` about to be written. ``logs`` interleaves nodes by it."""
        if self.times is None:
            return
        try:
            size = os.fstat(self.out_fd).st_size
            if self.timed < 0:  # the first look (a resumed monitor: the bytes before are timed or lost)
                self.timed = size
            if size > self.timed or batch:
                if self._times_fd < 0:
                    self._times_fd = os.open(self.times, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                os.write(self._times_fd, b"%d %d\n" % (self.timed, time.time_ns()))
            self.timed = size
        except OSError:  # a full disk: these lines go out untimed (shown at their neighbours' time)
            pass

    def _write_journal(self, path: str, data: bytes) -> None:
        """Write the journal's record in place, padded with spaces over a longer one before it
        (JSON allows them). Not a temporary file renamed over it: on ext4 a rename that replaces
        a file starts writing its data out, and this is written for every batch of log lines
        (docs/benchmarks.md). A record within a page is not torn by the writer's death (a longer
        one could be, between two pages: it is renamed into place); a host's crash may tear it,
        but no monitor resumes an attempt after a reboot."""
        if len(data) > IN_PLACE:
            tmp = f"{path}.tmp"  # one writer at a time: the monitor's lock
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
            if self._journal_fd >= 0:
                os.close(self._journal_fd)
            self._journal_fd = -1
            return
        if self._journal_fd < 0:
            self._journal_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._journal_size = os.fstat(self._journal_fd).st_size
        padded = data.ljust(self._journal_size)
        view = memoryview(padded)
        while view:
            view = view[os.pwrite(self._journal_fd, view, len(padded) - len(view)):]
        self._journal_size = len(padded)

    def close(self) -> None:
        for handle, _, _ in self.files.values():
            handle.close()
        for fd in (self._journal_fd, self._times_fd):
            if fd >= 0:
                os.close(fd)
        self._journal_fd = self._times_fd = -1


def resume_offsets(journal: str, root: str, log_fd: int, first_rank: int) -> dict[str, int]:
    """The offsets in torchrun's per-rank files (relative to ``root``) up to which their lines are
    in the log ``log_fd``, from ``RankLogs``'s journal: the offsets before the last batch, moved
    past it if the log holds that batch after the size it had then (torchrun appends its own
    lines too, so the batch need not start there)."""
    record = read_json(journal)
    if record is None:
        return {}
    done = {str(k): int(v) for k, v in (record.get("done") or {}).items()}
    batch = record.get("batch") or []
    expected = []
    try:
        for rel, start, end, final in batch:
            path = os.path.join(root, rel)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            local = os.path.basename(os.path.dirname(path))
            expected.append(_tagged(b"[rank%d]:" % (first_rank + int(local)), data, bool(final)))
        written = b"".join(expected)
        size = os.fstat(log_fd).st_size
        start_at = int(record.get("log_start") or 0)
        found = False
        if written and size - start_at >= len(written):
            found = written in os.pread(log_fd, size - start_at, start_at)
    except (OSError, ValueError, TypeError):
        return done
    if found:
        for rel, _, end, _ in batch:
            done[rel] = end
    return done
