"""The dashboard's node table: its columns, each row's cells from the ``Board``, and ``NodeTable``,
Textual's ``DataTable`` with render caches sized for it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from clusterrun.core.events import NodeState
from clusterrun.tui.logview import COLOURS
from clusterrun.views import gpus
from clusterrun.views.board import Board, NodeRow

ICONS = {
    NodeState.PENDING: ("·", "dim"), NodeState.CONNECTING: ("…", "yellow"), NodeState.STARTING: ("◔", "yellow"),
    NodeState.RUNNING: ("▶", "green"), NodeState.STOPPING: ("◼", "yellow"), NodeState.SUCCEEDED: ("✔", "green"),
    NodeState.FAILED: ("✘", "bold red"), NodeState.STOPPED: ("■", "dim"), NodeState.LOST: ("?", "bold red"),
}
COLUMNS = ("node", "host", "gpus/procs", "state", "pid", "lines", "last output")
# Fixed widths (host: from the hosts): measuring columns again on every update costs more than
# drawing the table. None: sized from the content when the rows are added.
WIDTHS = (4, None, None, 34, 8, 9, 11)
# Added once a node's host has nvidia-smi (clusterrun.views.gpus): mean utilisation, memory used/total.
GPU_COLUMN, GPU_WIDTH = "gpu use", 16
# A terminal narrower than this (80x24) gets the table without these: the state and the last
# output fit beside the host.
NARROW, NARROW_DROPS = 100, ("pid", "lines")


def clock_text(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


def same_cell(a: object, b: object) -> bool:
    if isinstance(a, Text) and isinstance(b, Text):
        return a.plain == b.plain and a.style == b.style and a.spans == b.spans
    return a == b


# DataTable's render caches are private: sized only on the Textual versions checked to have them
# all, with a settable maxsize (tests/test_tui_snapshots.py fails on a newer Textual until checked).
CACHES_CHECKED = ((5, 0), (8, 2))


@functools.cache
def textual_version() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version("textual").split(".")[:2]
    return int(major), int(minor)


class NodeTable(DataTable[Any]):
    """The node table: Textual's ``DataTable`` with render caches for about two frames of it.

    The table changes on nearly every tick, and each change renews every key of DataTable's caches,
    so what they keep from earlier ticks is never read again; at their default sizes they fill with
    it, and every full garbage collection walks them (docs/benchmarks.md, "Dashboard under a flood").
    """

    def fit_caches(self) -> None:
        """Size the caches for the rows and columns the table has now (after adding them)."""
        if not CACHES_CHECKED[0] <= textual_version() <= CACHES_CHECKED[1]:
            return  # Textual's default sizes: more memory, the same table
        lines = 2 * (self.row_count + 1)  # the header's too
        for cache in (self._row_render_cache, self._row_renderable_cache, self._line_cache):
            cache.maxsize = lines
        self._cell_render_cache.maxsize = lines * max(1, len(self.columns))


def cells(row: NodeRow, board: Board, now: float, columns: Sequence[tuple[str, int | None]]) -> tuple[Any, ...]:
    """The cells of ``row`` for ``columns`` at ``now`` (the dashboard's monotonic clock)."""
    icon, style = ICONS.get(row.state, ("?", ""))
    status = row.status(board.wall())
    if row.unreachable:
        icon, style = "⚡", "bold yellow"
    state = Text(f"{icon} {status}", style=style)
    if board.root_rank() == row.rank:
        state.append("  ◀ root cause", style="bold red")
    if row.degraded:  # its reason is below the table
        state.append(" ⚠ degraded", style="bold yellow")
    since = "-" if row.last_output is None else clock_text(now - row.last_output) + " ago"
    use = gpus.cell(row.gpus) if board.gpus_shown else ""
    by_name = {"node": Text(str(row.rank), style=COLOURS[row.rank % len(COLOURS)]), "host": row.host,
               "gpus/procs": row.slots, "state": state, "pid": str(row.pid or "-"), "lines": str(row.log.count),
               "last output": since, GPU_COLUMN: Text(use, style="bold yellow") if use == gpus.BROKEN else use}
    return tuple(by_name[name] for name, _width in columns)


def layout(width: int, gpus_shown: bool) -> list[tuple[str, int | None]]:
    """The node table's columns and widths: the GPU column once a host has nvidia-smi; on a
    narrow terminal without pid and lines."""
    drop = NARROW_DROPS if width < NARROW else ()
    return [*((name, w) for name, w in zip(COLUMNS, WIDTHS, strict=True) if name not in drop),
            *([(GPU_COLUMN, GPU_WIDTH)] if gpus_shown else [])]
