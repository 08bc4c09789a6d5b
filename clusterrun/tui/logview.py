"""The dashboard's log view: a ``Ring`` of lines shown by reference, and its highlighter.

Lines are drawn terminal-safe (``terminal.safe``): a rank's colours (SGR) become Rich styles
(none with ``NO_COLOR``), every other escape sequence or control character is shown escaped.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from rich.cells import cell_len
from rich.highlighter import Highlighter
from rich.segment import Segment
from rich.text import Text
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.selection import Selection
from textual.strip import Strip

from clusterrun.core.terminal import colour_allowed, safe
from clusterrun.views.board import Ring

COLOURS = ("cyan", "yellow", "magenta", "green", "blue", "red", "bright_cyan", "bright_yellow",
           "bright_magenta", "bright_green", "bright_blue", "bright_red")
PREFIX = re.compile(r"^node(\d+) \| ")
CACHED = 1024  # rendered lines kept (the oldest go first)


class LogHighlighter(Highlighter):
    """Colours the ``nodeK |`` prefix of merged lines and marks search matches."""

    def __init__(self) -> None:
        self.pattern: re.Pattern[str] | None = None

    def highlight(self, text: Text) -> None:
        found = PREFIX.match(text.plain)
        if found:
            text.stylize(f"bold {COLOURS[int(found.group(1)) % len(COLOURS)]}", 0, found.end() - 2)
        if self.pattern is not None:
            for match in self.pattern.finditer(text.plain):
                if match.end() > match.start():
                    text.stylize("black on yellow", match.start(), match.end())


class RingLog(ScrollView, can_focus=True):
    """The log view: a ``Ring``'s lines, read by reference (Textual's Line API, as ``Log`` draws).

    ``show(ring)`` → ``advance()`` every tick → ``freeze()`` (the user scrolls up, or a search) →
    ``follow()``. Unlike ``Log.write_lines`` nothing is copied or measured when the view switches
    rings or lines arrive: the height is the ring's length, the width the ring's longest line, and
    only the lines on screen are rendered, each once (cached by its number in the ring). A frozen
    view shows the lines it had (references to them), so what the user reads does not slide away
    under a flood; the ring goes on filling behind it.
    """

    DEFAULT_CSS = """
    RingLog {
        background: $surface;
        color: $text;
        overflow: scroll;
        &:focus {
            background-tint: $foreground 5%;
        }
    }
    """

    class Paused(Message):
        """The view froze or follows again (the user scrolled, or pressed End in it)."""

    def __init__(self, highlighter: Highlighter, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.highlighter = highlighter
        self._ring = Ring(0)
        self._frozen: list[str] | None = None
        self._first = 0  # the ring's number of the first line shown
        self._seen = 0  # the ring's count when the view last moved
        self._width = 0  # widest line rendered, where the ring's width (characters) fell short
        self._rendered: dict[int, tuple[list[Segment], int]] = {}  # rendered lines: segments, cells
        self._colour = colour_allowed()  # the ranks' own colours

    @property
    def lines(self) -> Sequence[str]:
        """The lines the view shows: the ring's, or those it had when it was frozen."""
        return self._ring.lines if self._frozen is None else self._frozen

    @property
    def first(self) -> int:
        """The ring's number of the first line shown (``Ring.first`` counts from its first line ever)."""
        return self._first

    @property
    def ring(self) -> Ring:
        return self._ring

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    @property
    def pending(self) -> int:
        """Lines that arrived in the ring after the view was frozen."""
        return self._ring.count - self._seen if self._frozen is not None else 0

    def show(self, ring: Ring) -> None:
        """Show another ring, following it."""
        self._ring = ring
        self._width = 0
        self._rendered.clear()
        self.follow()

    def follow(self) -> None:
        """Show the ring's last lines, and the new ones as they come."""
        if self._frozen is not None:
            self._frozen = None
            self.post_message(self.Paused())
        self._advance()

    def freeze(self) -> None:
        """Keep showing the lines shown now; new lines wait in the ring."""
        if self._frozen is not None:
            return
        ring = self._ring
        kept = self._seen - ring.first  # lines shown at the last tick that the ring still has
        if kept <= 0:  # all of them went (a burst larger than the ring): keep what there is
            kept, self._seen = len(ring.lines), ring.count
        self._frozen = list(itertools.islice(ring.lines, kept))
        self.post_message(self.Paused())
        dropped = ring.first - self._first
        self._first = ring.first
        self._resize()
        if dropped > 0:  # the lines above went: the ones on screen stay where they are
            self.scroll_to(y=max(0, self.scroll_offset.y - dropped), animate=False, immediate=True)

    def advance(self) -> None:
        """Show the lines that arrived since the last call (nothing while frozen)."""
        if self._frozen is None and self._ring.count != self._seen:
            self._advance()

    def _advance(self) -> None:
        self._first, self._seen = self._ring.first, self._ring.count
        self._resize()
        self.scroll_end(animate=False, immediate=True, x_axis=False)
        self.refresh()

    def _resize(self) -> None:
        size = Size(max(self._ring.width, self._width), len(self.lines))
        if size != self.virtual_size:  # a new virtual size costs a layout of the screen
            self.virtual_size = size

    def restyle(self) -> None:
        """Render the lines again (the highlighter's search pattern changed)."""
        self._rendered.clear()
        self.refresh()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value < old_value and round(new_value) < self.max_scroll_y:  # scrolled up, not a resize
            self.freeze()

    def action_scroll_end(self) -> None:
        self.follow()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._rendered.clear()

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        return selection.extract("\n".join(self.lines)), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self._rendered.clear()
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.size.width
        style = self.rich_style
        lines = self.lines
        if index >= len(lines):
            return Strip.blank(width, style)
        selection = self.text_selection
        cached = self._rendered.get(self._first + index) if selection is None else None
        if cached is None:
            line = safe(lines[index].expandtabs(), self._colour)
            text = Text.from_ansi(line, no_wrap=True) if "\x1b" in line else Text(line, no_wrap=True)
            text.stylize(style)
            text = self.highlighter(text)
            if selection is not None and (span := selection.get_span(index)) is not None:
                start, end = span
                text.stylize(self.screen.get_component_rich_style("screen--selection"), start,
                             len(text) if end == -1 else end)
            cached = list(text.render(self.app.console)), cell_len(text.plain)
            if selection is None:
                if len(self._rendered) >= CACHED:
                    del self._rendered[next(iter(self._rendered))]
                self._rendered[self._first + index] = cached
            if cached[1] > max(self._ring.width, self._width):  # tabs or wide characters
                self._width = cached[1]
                self.call_later(self._resize)
        # A new Strip each time, and not crop_extend (which caches the strip in itself when nothing
        # is cut): every Strip the frame leaves behind is freed as soon as it is dropped, none waits
        # for a full garbage collection.
        strip = Strip(*cached).extend_cell_length(scroll_x + width, style).crop(scroll_x, scroll_x + width)
        return strip.apply_offsets(scroll_x, index)
