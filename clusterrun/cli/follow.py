"""Following a job from this terminal: signals while it runs, the dashboard, the exit code."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from clusterrun.cli import EXIT_FAILED, EXIT_HOSTS, EXIT_OK, EXIT_SIGNAL, _fail, _note
from clusterrun.cli.records import _refresh
from clusterrun.core.events import JobResult, JobState
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened
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


class Viewer(Protocol):
    """What follows one attempt of a job for a viewer: ``Job`` over SSH, ``SlurmFollower`` under Slurm."""

    attempt: int
    offsets: dict[int, int]  # per node: the log's bytes shown so far

    def run(self) -> JobResult | None: ...

    def detach(self) -> None: ...

    def close(self) -> None: ...


def follow_attempts(store: JobStore, opened: Opened, viewer: Viewer, summary: Callable[[JobResult, bool], None],
                    next_viewer: Callable[[Opened], Viewer] | None, signals: Sequence[signal.Signals],
                    done: Callable[[Viewer], None] = lambda viewer: None) -> tuple[JobResult | None, dict[str, int]]:
    """Follow the job with ``viewer`` until one of ``signals`` detaches it or the job ends. An attempt
    that ends while the job goes on (its owner restarts it, or a ``restart`` started the next) is summed
    up as ``up`` does (``summary(result, True)``), and the next one is followed from its start with
    ``next_viewer(opened)``; None: this attempt only. The job's end: ``summary(result, False)``, or its
    outcome's line when it ended during a backoff. ``done(viewer)``: as each viewer ends. Returns the
    last attempt's result (None: detached) and the signals that came."""
    from clusterrun.views.joblist import outcome_text  # ps's module: not on `up`'s path

    current = [viewer]
    with _on_signals({s: lambda _s: current[0].detach() for s in signals}) as got:
        while True:
            try:
                result = current[0].run()
            finally:
                done(current[0])
                current[0].close()
            if result is None:
                return None, got
            if next_viewer is None:
                summary(result, False)
                return result, got
            attempt = current[0].attempt
            opened, record, said = _decided(store, opened, attempt, result, summary, got)
            if record is None:
                return None, got
            if record.attempt == attempt:  # the job's end
                if said:  # stopped during the backoff, or its restart failed
                    _note(outcome_text(record))
                else:
                    summary(result, False)
                return result, got
            _note(f"following attempt {record.attempt} of job {record.job_id}")
            current[0] = next_viewer(opened)


def _decided(store: JobStore, opened: Opened, attempt: int, result: JobResult,
             summary: Callable[[JobResult, bool], None], got: dict[str, int]) -> tuple[Opened, JobRecord | None, bool]:
    """``after_attempt`` for a command's viewer: the job as last read, what became of it (None: a
    signal came first), and whether the attempt's end (``result``) was said as a restart's."""
    from clusterrun.life.lifecycle import after_attempt  # not on `logs`'s path without -f
    from clusterrun.views.joblist import job_state_text  # ps's module: not on `up`'s path

    seen, said = [opened], [False]

    def look() -> JobRecord:  # nobody owns it: a monitor again (``_refresh``)
        seen.append(_refresh(store, seen[-1].with_record(store.load(opened.record.job_id))))
        return seen[-1].record

    def restarting(record: JobRecord) -> None:
        summary(result, True)
        said[0] = True
        if record.attempt == attempt and record.state is JobState.RESTARTING:  # its backoff: when the next starts
            _note(f"job {record.job_id} is {job_state_text(record, time.time())}")

    record = after_attempt(look, attempt, restarting, lambda: bool(got.get("signal")))
    return seen[-1], record, said[0]


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
