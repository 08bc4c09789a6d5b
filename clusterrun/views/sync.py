"""The sync's progress on stderr: a bar per host (bytes and files) on a terminal, plain lines otherwise.

Lifecycle: ``SyncView()`` → ``with view:`` (the bars are drawn while inside) → ``view(progress)``
from any thread (``clusterrun.sync.copy`` serialises the calls) → ``view.report(reports)`` after.
rich (a dependency of Textual) is imported only for a terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

from clusterrun.config.nodesets import FOLD_PAST
from clusterrun.core.terminal import safe
from clusterrun.sync.copy import SyncProgress, SyncReport, human
from clusterrun.views.printer import alike_lines


class SyncView:
    """Shows ``SyncProgress`` as it comes (see the module docstring)."""

    def __init__(self, err: TextIO | None = None, live: bool | None = None, hosts: int = 0) -> None:
        self.err = err or sys.stderr
        self.live = self.err.isatty() if live is None else live
        self.hosts = hosts  # past FOLD_PAST hosts the plain lines announce only the first copy
        self._progress: Any = None
        self._tasks: dict[int, Any] = {}
        self._announced: set[int] = set()

    def __enter__(self) -> SyncView:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self._progress = Progress(TextColumn("sync {task.description}"), BarColumn(), DownloadColumn(),
                                      TextColumn("{task.fields[files]}"), TransferSpeedColumn(),
                                      console=Console(file=self.err), transient=False)
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __call__(self, p: SyncProgress) -> None:
        files = f"{p.files_done}/{p.files_total} files"
        if self._progress is not None:
            task = self._tasks.get(p.rank)
            if task is None:
                task = self._tasks[p.rank] = self._progress.add_task(safe(p.host, colour=False), total=None,
                                                                     files="comparing")
            if p.phase in ("copy", "done"):
                self._progress.update(task, completed=p.bytes_done, total=p.bytes_total or 1,
                                      files=files if p.phase == "copy" else f"{p.files_total} files copied")
            return
        if p.phase == "copy" and p.rank not in self._announced:
            many = self.hosts > FOLD_PAST
            if p.files_total and not (many and self._announced):
                self._announced.add(p.rank)
                self.err.write(f"clusterrun: sync {safe(p.host, colour=False)}: copying {p.files_total} file(s), "
                               f"{human(p.bytes_total)}" + (f" (the first host; past {FOLD_PAST} hosts the others' "
                                                          "copies are not announced: the report follows)" if many
                                                          else "") + "\n")
                self.err.flush()

    def report(self, reports: Mapping[int, SyncReport]) -> None:
        """What was copied: a line per host, or past ``FOLD_PAST`` hosts a line per set of hosts alike."""
        items = [(rank, reports[rank].host, reports[rank].describe(timed=False), reports[rank].describe())
                 for rank in sorted(reports)]
        for line in alike_lines(items, len(items)):
            self.err.write(f"clusterrun: sync {safe(line, colour=False)}\n")
        self.err.flush()
