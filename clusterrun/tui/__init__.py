"""The live dashboard: a Textual app over a ``Session`` (this package is the only one that imports
Textual; the log view is in ``logview``, the modal screens in ``screens``, the search's matches
in ``search``).

Threads never touch widgets: the session's thread puts events into a queue, and a 50 ms timer in
the app's thread drains it into the ``Board`` (clusterrun/views/board.py) and redraws what changed —
the changed rows of the node table (``nodetable``), and the lines of the one log view on screen, taken from that
node's bounded ring. Hidden views get nothing. The log view (``RingLog``) reads the ring it shows
by reference, as Textual's ``Log`` draws (plain lines; only the visible ones are rendered), so
switching views and arriving lines cost the lines on screen, not the ring.
"""

from __future__ import annotations

import gc
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer, Input, Sparkline, Static

from clusterrun.core.events import Event
from clusterrun.core.terminal import safe
from clusterrun.life.session import Session
from clusterrun.tui.logview import LogHighlighter, RingLog
from clusterrun.tui.nodetable import (
    CACHES_CHECKED,
    COLUMNS,
    NodeTable,
    cells,
    clock_text,
    layout,
    same_cell,
    textual_version,
)
from clusterrun.tui.screens import Confirm, Help, History, QuitQuestion, Stacks
from clusterrun.tui.search import Matches
from clusterrun.views import gpus
from clusterrun.views.board import Board, NodeRow, exit_code

if TYPE_CHECKING:
    from clusterrun.slurm.job import SlurmSession

__all__ = ["CACHES_CHECKED", "COLUMNS", "Dashboard", "LogHighlighter", "NodeTable", "RingLog", "textual_version"]

TICK = 0.05  # seconds between draining the event queue
class Dashboard(App[int]):
    """Every node's state and log; kill, restart, detach. Returns the exit code from ``run()``."""

    TITLE = "clusterrun"
    ENABLE_COMMAND_PALETTE = False  # its footer entry cut the keys' at 80 columns; nothing is in it
    CSS = """
    #header { height: 3; padding: 0 1; background: $boost; text-wrap: nowrap; text-overflow: ellipsis; }
    #progress { height: 1; padding: 0 1; display: none; }
    #progress.shown { display: block; }
    #progress-text { width: auto; max-width: 70%; text-wrap: nowrap; text-overflow: ellipsis; }
    #loss { width: 1fr; height: 1; margin-left: 2; }
    #nodes { height: auto; max-height: 40%; }
    #gpus { height: auto; max-height: 2; padding: 0 1; display: none; }
    #gpus.shown { display: block; }
    #report { height: auto; max-height: 12; padding: 0 1; color: $error; display: none; }
    #report.shown { display: block; }
    #logtitle { height: 1; padding: 0 1; background: $boost; }
    #log { height: 1fr; }
    #search { dock: bottom; display: none; }
    #search.shown { display: block; }
    #dialog { width: 80; max-width: 100%; height: auto; border: thick $primary; background: $surface; padding: 1 2; }
    Confirm, QuitQuestion, Help, Stacks, History { align: center middle; }
    #stacks { width: 95%; height: 90%; border: thick $primary; background: $surface; padding: 0 1; }
    #buttons { height: auto; margin-top: 1; }
    #buttons Button { margin-right: 2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "move(1)", "Down", show=False),
        Binding("k", "move(-1)", "Up", show=False),
        Binding("l", "node_log", "Node log", show=False),
        Binding("a", "all_nodes", "All"),
        Binding("r", "rank", "Rank filter", show=False),
        Binding("f,end", "follow", "Follow", show=False),  # the log's title says so when it is paused
        Binding("slash", "search", "Search"),
        Binding("n", "match(1)", "Next", show=False),
        Binding("N", "match(-1)", "Previous", show=False),
        Binding("escape", "clear_search", "Clear search", show=False),
        Binding("K", "kill", "Kill"),
        Binding("R", "restart", "Restart"),
        Binding("s", "stack", "Stacks"),
        Binding("h", "history", "Attempts"),
        Binding("d", "detach", "Detach"),
        Binding("question_mark", "help", "Help"),
        Binding("q,ctrl+c", "quit_job", "Quit", priority=True, key_display="q"),
        *(Binding(str(i), f"jump({i})", f"Node {i}", show=False) for i in range(10)),
    ]

    def __init__(self, session: Session | SlurmSession, *, ring: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.session = session
        self.board = Board(ring=ring, clock=clock, wall=wall)
        self.clock = clock
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._view: int | None = 0  # the node whose log is shown; None: all nodes
        # The search: matching lines of the view, by their number in its ring (``Ring.first``
        # counts from the ring's first line ever), the current one, and the ring's lines searched.
        self._matches = Matches()
        self._cause: tuple[int, int] | None = None  # (attempt, node) of the root cause last selected
        self._highlighter = LogHighlighter()
        self.outcome = "running"  # how the app ended: "detached", "left", "stopped", "finished"
        self.quit_when_ended = False  # SIGTERM: exit once the job's stop has been shown
        self._rows_ready: tuple[int, tuple[str, ...]] = (0, ())  # the rows and the columns in the table
        self._columns: list[tuple[str, int | None]] = []  # the table's columns (name, width) now
        self._gpu_line = ""
        self._drawn: dict[int, tuple[Any, ...]] = {}  # the cells in the table, per rank
        self._report = ""
        self._actions: tuple[bool | None, ...] = ()
        self._title = ""
        # Set by a worker thread (detach, quit) once its work is done: the next tick exits with the
        # code it returns. Threads never call into the app: it may have ended meanwhile.
        self._exit_soon: Callable[[], int] | None = None

    # ------------------------------------------------------------------------ the session side

    def emit(self, event: Event) -> None:
        """The session's ``emit``: called from its thread; only queues."""
        self._events.put(event)

    # ------------------------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Horizontal(Static(id="progress-text"), Sparkline([], id="loss"), id="progress")
        yield NodeTable(id="nodes", cursor_type="row", zebra_stripes=True)
        yield Static(id="gpus")
        yield Static(id="report")
        yield Static(id="logtitle")
        yield RingLog(self._highlighter, id="log")
        yield Input(placeholder="search: text or regex, Enter to find, Esc to clear", id="search")
        footer = Footer()
        footer.compact = True  # every key shown fits in 80 columns (an argument only from Textual 6)
        yield footer

    def on_mount(self) -> None:
        table = self.query_one("#nodes", DataTable)
        table.focus()
        self.set_interval(TICK, self._drain)
        self.set_interval(1.0, self._tick_clock)
        self.session.subscribe(self.emit)
        self.session.begin()
        self._drain()
        self.call_after_refresh(self._freeze_heap)

    def _freeze_heap(self) -> None:
        # Objects made before the first frame live as long as the app: leave them out of every full
        # garbage collection, which would walk them all (the slowest frames: docs/benchmarks.md).
        gc.collect()
        gc.freeze()

    def on_unmount(self) -> None:
        gc.unfreeze()

    # --------------------------------------------------------------------------- redrawing

    def _drain(self) -> None:
        exit_soon, self._exit_soon = self._exit_soon, None
        if exit_soon is not None:
            self.exit(exit_soon())
            return
        got = False
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            self.board.apply(event)
            got = True
        if self.session.failed_start:
            self.outcome = "finished"
            self.exit(3)
            return
        if self.session.error is not None and not self.board.finished:
            self.board.note(f"error: {self.session.error.render()}")
            self.session.error = None
            self.board.header_changed = True
        if got or self.board.header_changed:
            self._redraw()
        if self.quit_when_ended and (self.board.finished or not self.session.running):
            self.outcome = "stopped"
            self.exit(self.exit_code_of())

    def _redraw(self) -> None:
        found = self.query("#nodes")
        if not found:  # the app starting or ending (its timers may still fire): no table to redraw
            return
        board = self.board
        table = found.first(NodeTable)
        self._columns = columns = self._layout()
        names = tuple(name for name, _width in columns)
        if (len(board.nodes), names) != self._rows_ready:
            cursor = table.cursor_row
            table.clear(columns=True)
            for name, width in columns:
                if width is None:
                    width = max([len(name), *(len(str(self._cells(r)[names.index(name)])) for r in board.nodes)])
                table.add_column(name, key=name, width=width)
            self._drawn = {}
            for row in board.nodes:
                self._drawn[row.rank] = cells = self._cells(row)
                table.add_row(*cells, key=str(row.rank))
            table.fit_caches()
            if 0 < cursor < table.row_count:
                table.move_cursor(row=cursor)
            self._rows_ready = (len(board.nodes), names)
            board.changed.clear()
            self._draw_gpus()
        for rank in sorted(board.changed):
            if rank < len(board.nodes):
                cells, drawn = self._cells(board.nodes[rank]), self._drawn.get(rank, ())
                for i, ((name, _width), value) in enumerate(zip(columns, cells, strict=True)):
                    if i >= len(drawn) or not same_cell(value, drawn[i]):  # each update repaints the table
                        table.update_cell(str(rank), name, value)
                self._drawn[rank] = cells
                if rank == table.cursor_row:
                    self._draw_gpus()
        board.changed.clear()
        self._go_to_cause()
        self._append_view()
        if board.header_changed:
            board.header_changed = False
            self._draw_header()
            report = self.query_one("#report", Static)
            root = board.root_text()
            text = "\n".join([*board.degraded_text(), *([root] if root else [])])
            if board.stops and board.state in ("stopped", "stopping", "failed", "lost"):
                said = [f"  {line}" for line in board.notes if line.startswith(("node", "no cgroup on "))]  # the caveat
                text = "\n".join([*([text] if text else []), "stop report:", *said][-12:])
            if text != self._report:
                self._report = text
                report.update(Text(safe(text, colour=False)))
                report.set_class(bool(text), "shown")
        actions = tuple(self.check_action(action, ()) for action in ("kill", "restart", "detach", "match"))
        if actions != self._actions:  # the footer is composed again on every refresh
            self._actions = actions
            self.refresh_bindings()

    def _cells(self, row: NodeRow) -> tuple[Any, ...]:
        return cells(row, self.board, self.clock(), self._columns)

    def _layout(self) -> list[tuple[str, int | None]]:
        return layout(self.size.width, self.board.gpus_shown)

    def on_resize(self) -> None:
        if self.board.nodes:  # mounted, with rows: the columns for the new width
            self._redraw()

    def _draw_gpus(self) -> None:
        """The selected node's GPUs, one entry each, under the table (once a host has nvidia-smi)."""
        rank = self.query_one("#nodes", NodeTable).cursor_row
        row = self.board.nodes[rank] if self.board.gpus_shown and 0 <= rank < len(self.board.nodes) else None
        text = f"node {row.rank} GPUs: " + " · ".join(gpus.per_gpu(row.gpus)) if row and row.gpus else ""
        if text != self._gpu_line:
            self._gpu_line = text
            line = self.query_one("#gpus", Static)
            line.update(Text(text))
            line.set_class(bool(text), "shown")

    def _draw_header(self) -> None:
        board = self.board
        nodes = board.nodes
        per = {n.nproc for n in nodes}
        shape = f"{len(nodes)} nodes × {per.pop()}" if len(per) == 1 else f"{len(nodes)} nodes (uneven)"
        state = board.state.upper()
        colour = {"SUCCEEDED": "green", "FAILED": "red", "LOST": "red", "RUNNING": "green"}.get(state, "yellow")
        header = Text.assemble(("clusterrun ", "bold"), f"{board.name} ({board.job_id}) · ", (state, f"bold {colour}"),
                               f" · attempt {board.attempt} · {clock_text(board.elapsed())}")
        # What the nodes do first: on a narrow terminal a line is cut at its end (CSS), never wrapped.
        header.append(f"\n{shape}: {board.summary()} · world size {board.world_size} · master {board.master}")
        header.append("\n" + (safe(board.notes[-1], colour=False) if board.notes else ""), style="italic")
        self.query_one("#header", Static).update(header, layout=False)  # its height is fixed
        if board.progress is not None:  # the training's progress and its loss, once rank 0 showed any
            ended = board.state not in ("starting", "running", "restarting")  # no time left to show
            shown = replace(board.progress, eta_seconds=None) if ended else board.progress
            self.query_one("#progress-text", Static).update(Text(safe("progress: " + shown.text(), colour=False)))
            losses = list(board.losses)  # one point is no curve: a full bar that says nothing
            self.query_one("#loss", Sparkline).data = losses if len(losses) > 1 else []
            self.query_one("#progress").set_class(True, "shown")

    def _tick_clock(self) -> None:
        self.board.header_changed = True
        self.board.changed.update(range(len(self.board.nodes)))
        self._redraw()

    def _ring(self) -> Any:
        if self._view is None:
            return self.board.merged
        rank_view = self.board.rank_view
        return rank_view[2] if rank_view is not None and rank_view[0] == self._view else self.board.node(self._view).log

    def _append_view(self) -> None:
        log = self.query_one("#log", RingLog)
        ring = self._ring()
        if log.ring is not ring:  # the first rows, or a new attempt with more nodes
            log.show(ring)
            self._find(log)
        log.advance()
        self._find_new(log)
        self._draw_log_title()

    def _show(self, view: int | None) -> None:
        """Switch the log to a node (or all nodes, None): it shows that ring, following it, and
        the search goes on in it."""
        if view is not None and not 0 <= view < len(self.board.nodes):
            return
        if view != self._view or view is None:
            self.board.watch_rank(0, None)  # another node: its lines unfiltered
        self._view = view
        log = self.query_one("#log", RingLog)
        log.show(self._ring())
        self._find(log)
        self._draw_log_title()
        self.refresh_bindings()

    def _go_to_cause(self) -> None:
        """Select the node that failed first (then the root cause the result names) and show its
        log, once per attempt and node: the user may look elsewhere afterwards."""
        rank = self.board.root_rank()
        if rank is None or (self.board.attempt, rank) == self._cause or rank >= len(self.board.nodes):
            return
        self._cause = (self.board.attempt, rank)
        self.query_one("#nodes", DataTable).move_cursor(row=rank)
        self._show(rank)

    # ------------------------------------------------------------------------------- search

    def _find(self, log: RingLog) -> None:
        """Search every line the view shows; no match is the current one."""
        self._matches.find(self._highlighter.pattern, log.lines, log.first)

    def _find_new(self, log: RingLog) -> None:
        """While the view follows, search the lines that arrived since (only those), and forget
        matches whose lines left the ring."""
        pattern = self._highlighter.pattern
        if pattern is not None and not log.frozen:
            self._matches.find_new(pattern, log.lines, log.first)

    def _draw_log_title(self) -> None:
        log = self.query_one("#log", RingLog)
        if self._view is None:
            what = "all nodes"
        else:
            row = self.board.node(self._view)
            what = f"node {row.rank} ({row.host})"
            if self.board.rank_view is not None:
                what += f" · {self.board.rank_view[1][1:-2]} only (r: next)"
        mode = "following"
        if log.frozen:
            mode = f"paused ({log.pending:,} new lines) — f or End to follow" if log.pending else \
                "paused — f or End to follow"
        search = ""
        if self._highlighter.pattern is not None:
            search = f" · /{self._highlighter.pattern.pattern}/ {self._matches.describe()} (n/N, Esc clears)"
        title = f"{what} · {mode}{search}"
        if title != self._title:  # a layout pass on every tick would redraw the whole screen
            self._title = title
            self.query_one("#logtitle", Static).update(title, layout=False)

    # ------------------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        running = self.session.running and not self.board.finished
        waiting = self.session.running and self.board.restart_next  # the owner's backoff: K cancels the restart
        if action in ("kill", "restart", "stack", "detach") and action not in self.session.supports:
            return False  # a Slurm job's session: K only
        if action == "kill":
            return (running or waiting) and self.board.state != "stopping" and not self.session.busy
        if action == "restart":
            return not self.session.busy and self.board.attempt > 0
        if action == "detach":
            return running or waiting
        if action == "stack":
            return running
        if action in ("match",):
            return bool(self._matches.lines)
        return True

    @on(RingLog.Paused)
    def _paused(self) -> None:
        self._draw_log_title()

    @on(DataTable.RowHighlighted, "#nodes")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        rank = int(event.row_key.value) if event.row_key.value is not None else 0
        self._draw_gpus()
        if self._view is not None and rank != self._view:
            self._show(rank)

    @on(DataTable.RowSelected, "#nodes")
    def _selected(self, event: DataTable.RowSelected) -> None:
        self._show(int(event.row_key.value) if event.row_key.value is not None else 0)

    def action_move(self, step: int) -> None:
        table = self.query_one("#nodes", DataTable)
        table.move_cursor(row=max(0, min(table.row_count - 1, table.cursor_row + step)))

    def action_jump(self, rank: int) -> None:
        if 0 <= rank < len(self.board.nodes):
            self.query_one("#nodes", DataTable).move_cursor(row=rank)
            self._show(rank)

    def action_node_log(self) -> None:
        self._show(self.query_one("#nodes", DataTable).cursor_row)

    def action_all_nodes(self) -> None:
        self._show(None)

    def action_rank(self) -> None:
        """In a node's view: show only one of its ranks' lines, the next one at each press, then all."""
        if self._view is None:
            return
        ranks = list(self.board.ranks_of(self._view))
        current = self.board.rank_view
        shown = int(current[1][5:-2]) if current is not None and current[0] == self._view else None
        following = ranks[ranks.index(shown) + 1] if shown in ranks and ranks.index(shown) + 1 < len(ranks) else (
            ranks[0] if shown is None and ranks else None)
        self.board.watch_rank(self._view, following)
        log = self.query_one("#log", RingLog)
        log.show(self._ring())
        self._find(log)
        self._draw_log_title()

    def action_follow(self) -> None:
        self.query_one("#log", RingLog).follow()
        self._draw_log_title()

    def action_search(self) -> None:
        field = self.query_one("#search", Input)
        field.add_class("shown")
        field.focus()

    @on(Input.Submitted, "#search")
    def _search(self, event: Input.Submitted) -> None:
        text = event.value
        event.input.remove_class("shown")
        self.query_one("#nodes", DataTable).focus()
        if not text:
            self.action_clear_search()
            return
        try:
            pattern = re.compile(text)
        except re.error:
            pattern = re.compile(re.escape(text))
        self._highlighter.pattern = pattern
        log = self.query_one("#log", RingLog)
        was_frozen = log.frozen
        log.freeze()  # the lines shown stay put while the user goes from match to match
        self._find(log)
        log.restyle()
        if self._matches.lines:
            self.action_match(1)
        else:
            if not was_frozen:
                log.follow()
            self._draw_log_title()
        self.refresh_bindings()

    def action_match(self, step: int) -> None:
        log = self.query_one("#log", RingLog)
        log.freeze()  # the lines shown stay put while the user goes from match to match
        self._matches.forget_before(log.first)  # lines the ring dropped since the last tick
        self._matches.forget_from(log.first + len(log.lines))  # lines that arrived after the last tick
        line = self._matches.step(step)
        if line is not None:
            log.scroll_to(y=max(0, line - log.first - log.size.height // 2), animate=False)
        self._draw_log_title()

    def action_clear_search(self) -> None:
        field = self.query_one("#search", Input)
        if field.has_class("shown"):
            field.remove_class("shown")
            self.query_one("#nodes", DataTable).focus()
        self._highlighter.pattern = None
        self._matches.clear()
        self.query_one("#log", RingLog).restyle()
        self._draw_log_title()
        self.refresh_bindings()

    def action_help(self) -> None:
        self.push_screen(Help())

    def action_kill(self) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.board.note("stopping the job on every host (SIGTERM, then SIGKILL after the grace period)")
                self.session.kill()
                self.refresh_bindings()

        self.push_screen(Confirm(f"Kill job {self.board.job_id} on every host?"), answered)

    def action_restart(self) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.board.note(f"restarting: checking a new attempt, then stopping attempt {self.board.attempt}")
                self.session.restart()
                self.refresh_bindings()

        self.push_screen(Confirm(f"Restart job {self.board.job_id}: stop it and start a new attempt?"), answered)

    def action_stack(self) -> None:
        self.push_screen(Stacks(self.session.stacks))

    def action_history(self) -> None:
        self.push_screen(History(self.session.history()))

    def action_detach(self) -> None:
        self._leave("detached")

    def _leave(self, outcome: str) -> None:
        self.board.note("detaching; the job keeps running")
        self.outcome = outcome

        def work() -> None:
            self.session.detach()
            self._exit_soon = lambda: 0

        threading.Thread(target=work, daemon=True, name="detach").start()

    def action_quit_job(self) -> None:
        if not (self.session.running and not self.board.finished):
            self.outcome = "finished"
            self.exit(self.exit_code_of())
            return
        if "detach" not in self.session.supports:  # under Slurm the job cannot run on without this process
            self.push_screen(Confirm(f"Stop job {self.board.job_id} and quit? It cannot run on without this up."),
                             lambda yes: self._stop_and_quit() if yes else None)
            return

        def answered(choice: str | None) -> None:
            if choice == "leave":
                self._leave("left")
            elif choice == "stop":
                self._stop_and_quit()

        self.push_screen(QuitQuestion(), answered)

    def _stop_and_quit(self) -> None:
        self.outcome = "stopped"
        self.board.note("stopping the job on every host before quitting")
        self.session.kill()

        def work() -> None:
            self.session.wait()
            self._exit_soon = self.exit_code_of

        threading.Thread(target=work, daemon=True, name="quit").start()

    def exit_code_of(self) -> int:
        """0 succeeded or detached; 1 failed; 130 stopped by the user; 3 could not start."""
        return 0 if self.outcome in ("detached", "left") else exit_code(self.session.result, self.session.error)
