"""The dashboard's modal screens: a yes/no question, the quit question and the help."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
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


HELP = """\
[b]Keys[/b]
  ↑/↓ or j/k    select a node           1–9      jump to node 0–8
  Enter or l    log of the selected node  a        all nodes, merged
  f or End      follow the log again     /        search (text or regex); n/N next/previous; Esc clears
  K             kill the job (asks)      R        restart: kill, then a new attempt (asks)
  r             in a node's log: only its first rank's lines, then the next rank's, then all again
  d             detach: leave the job running and exit
  q             quit (asks whether to stop a running job)
  ?             this help

Scrolling the log up pauses following; f or End resumes it. The log keeps the last lines of each
node (--ui-lines); the whole log is on the hosts: `clusterrun logs JOB`."""


class Help(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(HELP)

    def action_close(self) -> None:
        self.dismiss(None)


__all__ = ["HELP", "Confirm", "Help", "QuitQuestion"]
