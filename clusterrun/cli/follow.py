"""Following a job from this terminal: signals while it runs, the dashboard, the exit code."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from clusterrun.cli import EXIT_FAILED, EXIT_HOSTS, EXIT_OK, EXIT_SIGNAL, _fail
from clusterrun.core.events import JobResult
from clusterrun.views.printer import Printer

if TYPE_CHECKING:  # the sessions are the dashboard's: made by the commands that open it
    from clusterrun.life.session import Session
    from clusterrun.slurm.job import SlurmSession


@contextmanager
def _on_signals(handlers: Mapping[signal.Signals, Callable[[int], None]]) -> Iterator[dict[str, int]]:
    """Install ``handlers`` (by signal) for the duration; the dict yielded says which signal came first."""
    got: dict[str, int] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        got.setdefault("signal", signum)
        handlers[signal.Signals(signum)](signum)

    previous = {s: signal.signal(s, handler) for s in handlers}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _exit_code(result: JobResult | None, got: dict[str, int]) -> int:
    if got.get("signal"):
        return EXIT_SIGNAL.get(got["signal"], 1)
    return EXIT_OK if result is not None and result.ok else EXIT_FAILED


# How long a thread may keep the interpreter lock while another waits for it (CPython: 5 ms).
# Following N nodes, paramiko's readers and the followers' JSON decoding hold it while the
# printing thread waits to get it back after each write to stdout: at 5 ms a flood of 8 nodes
# was printed ~1.6 times slower (docs/benchmarks.md, "Logs").
HANDOFF = 0.0005


def quick_handoffs() -> None:
    """Let the printing thread have the interpreter lock back soon after each write (``HANDOFF``)."""
    sys.setswitchinterval(HANDOFF)


def _follow_hint(job_id: str) -> str:
    return (f"follow it with `clusterrun attach {job_id}` or `clusterrun logs -f {job_id}`; "
            f"stop it with `clusterrun down {job_id}`")


def _use_tui(no_tui: bool) -> bool:
    """The dashboard unless --no-tui, and never without a terminal on stdin and stdout."""
    return not no_tui and sys.stdout.isatty() and sys.stdin.isatty() and os.environ.get("TERM") != "dumb"


def _dashboard(session: Session | SlurmSession, ring: int, *, term_stops: bool = True) -> int:
    """Run the dashboard over ``session``; afterwards print what happened; the exit code. SIGTERM
    stops the job (``up``), or, without ``term_stops`` (``attach``), detaches as SIGHUP does: only
    an explicit stop (K, ``down``) stops a job one attached to."""
    from clusterrun.tui import Dashboard  # Textual is loaded only for the dashboard
    from clusterrun.views.board import exit_code

    app = Dashboard(session, ring=ring)
    printer = Printer()

    def hand_over(signum: int) -> None:  # the terminal is gone: leave the job to a monitor
        session.detach()
        os._exit(EXIT_SIGNAL.get(signum, 1))

    def terminate(signum: int) -> None:  # stop the job, show its stop, then leave
        if not term_stops:
            app.action_detach()
            return
        app.quit_when_ended = True
        session.kill()

    with _on_signals({signal.SIGHUP: hand_over, signal.SIGTERM: terminate}) as got:
        code = app.run()
    if session.failed_start and session.error is not None:
        _fail(session.error, EXIT_HOSTS)
    if session.error is not None:
        printer.note(f"error: {session.error.render()}")
    job_id = session.job_id
    if app.outcome in ("detached", "left") or (code is None and session.running):
        if session.running:
            session.detach()
        printer.note(f"detached; job {job_id} keeps running. {_follow_hint(job_id)}")
        return EXIT_SIGNAL.get(got.get("signal", 0), EXIT_OK)
    session.wait(timeout=60)
    if session.result is not None:
        printer.reports(session.result.stops, len(session.result.nodes))
        printer.summary(session.result)
    if got.get("signal"):
        return EXIT_SIGNAL.get(got["signal"], 1)
    return code if code is not None else exit_code(session.result, session.error)  # not left running: see above
