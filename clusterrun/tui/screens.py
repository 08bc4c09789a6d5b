"""The dashboard's modal screens: a yes/no question, the quit question, the ranks' stacks and the help."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static


class Confirm(ModalScreen[bool]):
    """A yes/no question."""

    BINDINGS: ClassVar[list[BindingType]] = [("y", "answer(True)", "Yes"), ("n,escape", "answer(False)", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class QuitQuestion(ModalScreen[str]):
    """Quit while the job runs: leave it running, stop it, or stay."""

    BINDINGS: ClassVar[list[BindingType]] = [("l", "answer('leave')", "Leave running"),
                                             ("s", "answer('stop')", "Stop the job"),
                                             ("escape,c", "answer('cancel')", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("The job is still running. Leave it running, or stop it on every host?", id="question")
            with Horizontal(id="buttons"):
                yield Button("Leave running (l)", variant="primary", id="leave")
                yield Button("Stop the job (s)", variant="error", id="stop")
                yield Button("Cancel (esc)", id="cancel")

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(str(event.button.id))


class Stacks(ModalScreen[None]):
    """Every rank's Python stack, grouped (``clusterrun stack``'s text): taken in a thread of its
    own when shown and again on ``r``; the thread only posts the lines (``Taken``)."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,s", "close", "Close"), ("r", "take", "Again")]

    class Taken(Message):
        def __init__(self, lines: list[str]) -> None:
            super().__init__()
            self.lines = lines

    def __init__(self, take: Callable[[], list[str]]) -> None:
        super().__init__()
        self._take = take
        self._taking = False

    def compose(self) -> ComposeResult:
        with Vertical(id="stacks"):
            yield Label("Stacks of every rank (r: again, Esc: close)", id="stacks-title")
            with VerticalScroll():
                yield Static(id="stacks-text")

    def on_mount(self) -> None:
        self.action_take()

    def action_take(self) -> None:
        if self._taking:
            return
        self._taking = True
        self.query_one("#stacks-text", Static).update("taking the stacks of every rank with py-spy…")
        threading.Thread(target=lambda: self.post_message(self.Taken(self._take())), daemon=True,
                         name="stacks").start()

    @on(Taken)
    def _taken(self, message: Taken) -> None:
        self._taking = False
        self.query_one("#stacks-text", Static).update(Text("\n".join(message.lines) or "no ranks to look at"))

    def action_close(self) -> None:
        self.dismiss(None)


class History(ModalScreen[None]):
    """The job's attempts (``ps JOB``'s table): when each started, how long it ran, how it ended,
    whether it was restarted and its root cause."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,h", "close", "Close")]

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def compose(self) -> ComposeResult:
        with Vertical(id="stacks"):
            yield Label("Attempts of the job (Esc: close)", id="stacks-title")
            with VerticalScroll():
                yield Static(Text("\n".join(self.lines)))

    def action_close(self) -> None:
        self.dismiss(None)


# One entry a line, each short enough for an 80-column terminal, so that nothing wraps mid-entry.
KEYS = (
    ("↑/↓, j/k", "select a node"),
    ("0–9", "select the node of that number"),
    ("Enter, l", "the selected node's log"),
    ("a", "all nodes, merged"),
    ("r", "in a node's log: one rank's lines, the next rank's, all"),
    ("f, End", "follow the log again (scrolling up pauses it)"),
    ("/", "search, text or regex; n/N next/previous; Esc clears"),
    ("K", "kill the job on every host (asks first)"),
    ("R", "restart: the checks, the stop, a new attempt (asks)"),
    ("s", "every rank's Python stack, identical ones once"),
    ("h", "the job's attempts: when, how long, how each ended, why"),
    ("d", "detach: leave the job running and exit"),
    ("q", "quit (asks whether to stop a running job)"),
    ("?", "this help; Esc closes it"),
)
HELP = "\n".join(["[b]Keys[/b]", *(f"  {keys:<10} {what}" for keys, what in KEYS), "",
                   "The log keeps the last lines of each node (--ui-lines);",
                   "the whole log is on the hosts: `clusterrun logs JOB`."])


class Help(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(HELP)

    def action_close(self) -> None:
        self.dismiss(None)


__all__ = ["HELP", "Confirm", "Help", "History", "QuitQuestion", "Stacks"]
