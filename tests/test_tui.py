"""The dashboard driven by Textual's Pilot over real local jobs (real torchrun), and in a real terminal (tmux)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import html
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from textual.strip import Strip
from textual.widgets import Sparkline

from clusterrun.core.events import (
    AttemptStarted,
    Event,
    JobState,
    LogLines,
    NodeDegraded,
    NodeExited,
    NodeResult,
    NodeState,
    ProgressChanged,
)
from clusterrun.core.progress import Progress
from clusterrun.life.session import Session
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.tui import Dashboard, RingLog
from clusterrun.tui.screens import Confirm
from clusterrun.views.board import RESUMED
from tests.conftest import ROOT, SUPPORT, marked, wait_for, write_hosts
from tests.test_lifecycle import attempt_dir, clusterrun, counter_lines, ps_json, up_detached, wait_state
from tests.test_tui_snapshots import T0, Scripted, started

pytestmark = pytest.mark.integration


async def until(pilot: object, predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.1)  # type: ignore[attr-defined]


def dashboard_on(job: str, ring: int = 10_000, **session: object) -> Dashboard:
    store = JobStore()
    record = store.load(store.resolve(job))
    return Dashboard(Session(store, record, lambda event: None, **session), ring=ring)  # type: ignore[arg-type]


def drive(app: Dashboard, script: Callable[[Dashboard, object], Awaitable[None]],
          size: tuple[int, int] = (140, 40)) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await script(app, pilot)

    asyncio.run(main())


def _screen_text(app: Dashboard) -> str:
    """The screen as text, line by line: from Textual's SVG screenshot (its public export), each
    piece of text put at its column (Rich draws a cell 12.2 px wide)."""
    rows: dict[int, dict[int, str]] = {}
    svg = app.export_screenshot()
    for x, line, text in re.findall(r'<text [^>]*?x="([\d.]+)"[^>]*?clip-path="url\(#[\w-]+-line-(\d+)\)"[^>]*>'
                                    r'([^<]*)</text>', svg):
        rows.setdefault(int(line), {})[round(float(x) / 12.2)] = html.unescape(text).replace("\xa0", " ")
    out = []
    for line in sorted(rows):
        text = ""
        for column in sorted(rows[line]):
            text = text.ljust(column) + rows[line][column]
        out.append(text.rstrip())
    return "\n".join(out)


def table_states(app: Dashboard) -> list[str]:
    return [row.state.value for row in app.board.nodes]


def log_lines(app: Dashboard) -> list[str]:
    return list(app.query_one("#log").lines)  # type: ignore[attr-defined]


def test_the_table_follows_the_nodes_and_the_log_shows_the_selected_one(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "40", "0.05")
    app = dashboard_on(job, tail=0)

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"], 60, "both nodes running")
        cells = app.query_one("#nodes").get_row("1")  # type: ignore[attr-defined]
        assert cells[1] == "local-b" and "running" in str(cells[3])
        await until(pilot, lambda: table_states(app) == ["succeeded", "succeeded"], 90, "both nodes succeeded")
        await until(pilot, lambda: app.board.finished, 10, "the job's result")  # it follows the nodes' ends
        assert app.board.state == "succeeded"
        await pilot.press("j", "enter")  # type: ignore[attr-defined]
        await until(pilot, lambda: app._view == 1 and log_lines(app), 5, "node 1's log")
        assert [line for line in log_lines(app) if line.startswith("[rank")] == counter_lines(1, 40)
        assert "node 1 (local-b)" in str(app.query_one("#logtitle").render())  # type: ignore[attr-defined]
        await pilot.press("a")  # type: ignore[attr-defined]
        merged = log_lines(app)
        assert [line.removeprefix("node0 | ") for line in merged if line.startswith("node0 | [rank")] == \
            counter_lines(0, 40)
        await pilot.press("slash", *"line 3[0-9]", "enter")  # type: ignore[attr-defined]
        assert len(app._matches.lines) == 20  # lines 30..39 of both ranks
        assert not app.check_action("kill", ())  # the job is over: nothing to kill
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)
    assert app.return_value == 0


@pytest.mark.fake_torchrun
def test_kill_asks_then_stops_the_job_and_nothing_is_left(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [2, 1], state_dir)
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    app = dashboard_on(job, ring=50, tail=10)

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"] and app.board.nodes[0].log.count > 80,
                    60, "both nodes running with output")
        assert 40 <= len(log_lines(app)) <= 50  # the ring keeps the last 50 lines of a node, no more
        await pilot.press("K")  # type: ignore[attr-defined]
        await pilot.press("n")  # type: ignore[attr-defined]  # no: nothing happens
        await until(pilot, lambda: not isinstance(app.screen, Confirm), 10, "the question to close")
        assert table_states(app) == ["running", "running"] and marked(job) and not app.session.busy
        await pilot.press("K", "y")  # type: ignore[attr-defined]
        await until(pilot, lambda: app.board.finished, 60, "the job to end")
        assert table_states(app) == ["stopped", "stopped"]
        assert sorted(app.board.stops) == [0, 1] and all(r.ok for r in app.board.stops.values())
        assert "nothing left (verified by cgroup)" in str(app.query_one("#report").render())  # type: ignore
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)
    assert marked(job) == []
    assert wait_state(job, "stopped")["state"] == "stopped"
    assert app.return_value == 130


@pytest.mark.fake_torchrun
def test_restart_asks_then_starts_attempt_two(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    app = dashboard_on(job, tail=0)

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"], 60, "both nodes running")
        first = list(marked(job))
        await pilot.press("R", "y")  # type: ignore[attr-defined]
        await until(pilot, lambda: app.board.attempt == 2 and table_states(app) == ["running", "running"], 90,
                    "attempt 2 running")
        assert not set(first) & set(marked(job))  # nothing of attempt 1 is left
        header = str(app.query_one("#header").render())  # type: ignore[attr-defined]
        assert "attempt 2 · " in header
        assert header.splitlines()[-1] == "attempt 2 started"  # not "restarting: stopping attempt 1 ..." any more
        stops = [note for note in app.board.notes if note.startswith("node")]
        assert len(stops) == 2 and not [n for n in stops if "nothing was running" in n], stops  # one stop each
        await pilot.press("d")  # type: ignore[attr-defined]
        await until(pilot, lambda: not app.is_running, 15, "the app to exit")

    drive(app, script)
    record = ps_json(job)
    assert record["attempt"] == 2 and [a["attempt"] for a in record["attempts"]] == [1, 2]
    assert record["state"] == "running"
    assert (state_dir / "jobs" / job / "node0" / "attempt2" / "output.log").exists()
    assert subprocess.run([sys.executable, "-m", "clusterrun", "down", job], cwd=ROOT).returncode == 0


def failing_once(tmp_path: Path, state_dir: Path, backoff: str) -> tuple[str, Path]:
    """A detached job whose rank 1 fails once when the test touches the gate, restarted once after ``backoff``."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra=f"restart: {{backoff: {backoff}}}\n")
    gate = tmp_path / "fail"
    return up_detached("--max-restarts", "1", hosts, SUPPORT / "fail_once_gated.py", tmp_path / "runs", gate), gate


def test_an_attached_dashboard_follows_the_owners_restart_to_the_next_attempt(tmp_path: Path,
                                                                              state_dir: Path) -> None:
    job, gate = failing_once(tmp_path, state_dir, "1s")
    app = dashboard_on(job, tail=0)

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"], 60, "both nodes running")
        gate.touch()  # rank 1 fails: the job's monitor restarts it
        await until(pilot, lambda: app.board.attempt == 2 and table_states(app) == ["running", "running"], 90,
                    "attempt 2 running")
        assert "attempt 2 · " in str(app.query_one("#header").render())  # type: ignore[attr-defined]
        await until(pilot, lambda: any("run 2 rank" in line for line in log_lines(app)), 60, "attempt 2's lines")
        assert "FAILED" not in str(app.query_one("#header").render())  # type: ignore[attr-defined]
        await pilot.press("d")  # type: ignore[attr-defined]
        await until(pilot, lambda: not app.is_running, 15, "the app to exit")

    drive(app, script)
    assert app.outcome == "detached"
    assert ps_json(job)["attempt"] == 2 and clusterrun("down", job).returncode == 0


def test_an_attached_dashboard_whose_jobs_monitor_died_in_the_backoff_starts_one_and_follows_the_restart(
        tmp_path: Path, state_dir: Path) -> None:
    job, gate = failing_once(tmp_path, state_dir, "3s")
    app = dashboard_on(job, tail=0)
    pidfile = JobStore().dir(job) / "monitor.pid"

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"], 60, "both nodes running")
        first = pidfile.read_text()
        gate.touch()
        await until(pilot, lambda: app.board.state == "restarting", 60, "the owner's backoff")
        os.kill(int(first.split()[0]), signal.SIGKILL)  # nobody owns the job now: nothing would restart it
        await until(pilot, lambda: app.board.attempt == 2 and table_states(app) == ["running", "running"], 90,
                    "attempt 2 running, restarted by a new monitor")
        assert pidfile.read_text() != first
        await pilot.press("d")  # type: ignore[attr-defined]
        await until(pilot, lambda: not app.is_running, 15, "the app to exit")

    drive(app, script)
    assert ps_json(job)["attempt"] == 2 and clusterrun("down", job).returncode == 0


def test_k_in_an_attached_dashboard_during_the_owners_backoff_stops_the_job(tmp_path: Path, state_dir: Path) -> None:
    job, gate = failing_once(tmp_path, state_dir, "10m")
    app = dashboard_on(job, tail=0)

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"], 60, "both nodes running")
        gate.touch()
        await until(pilot, lambda: app.board.state == "restarting", 60, "the owner's backoff")
        await pilot.press("K", "y")  # type: ignore[attr-defined]
        await until(pilot, lambda: app.board.finished and app.board.state == "stopped", 60, "the job's end")
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)
    record = wait_state(job, "stopped")
    assert record["attempt"] == 1 and marked(job) == []


@pytest.mark.fake_torchrun
def test_detach_leaves_the_job_running(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    gate = tmp_path / "gate"  # the job ends only after the test has seen it outlive the dashboard
    job = up_detached(hosts, SUPPORT / "counter.py", "60", "0.05", gate)
    app = dashboard_on(job)

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: table_states(app) == ["running", "running"], 60, "both nodes running")
        await pilot.press("d")  # type: ignore[attr-defined]
        await until(pilot, lambda: not app.is_running, 15, "the app to exit")

    drive(app, script)
    assert app.outcome == "detached" and app.return_value == 0
    assert marked(job), "the job runs on"
    gate.touch()
    record = wait_state(job, "succeeded")
    assert [n["exit_code"] for n in record["nodes"]] == [0, 0]


def test_scrolling_up_freezes_the_log_while_lines_pour_in_and_end_or_f_follows_again() -> None:
    app = Dashboard(Scripted(started(), running=True), ring=200)  # type: ignore[arg-type]

    def pour(first: int, last: int) -> None:
        app.emit(LogLines(0, host="gpu-a", lines=tuple(f"line {i}" for i in range(first, last))))

    async def script(app: Dashboard, pilot: object) -> None:
        log = app.query_one("#log", RingLog)
        pour(0, 150)
        await until(pilot, lambda: "line 149" in log.lines, 5, "the first lines")
        await pilot.pause()  # type: ignore[attr-defined]
        assert log.is_vertical_scroll_end and not log.frozen
        log.focus()
        await pilot.press("pageup")  # type: ignore[attr-defined]
        assert log.frozen and not log.is_vertical_scroll_end
        top = int(log.scroll_offset.y)
        shown = list(log.lines)[top:top + 5]
        pour(150, 450)  # more than the ring holds: every line shown is gone from the ring
        await until(pilot, lambda: app.board.nodes[0].log.count == 12 + 450, 5, "the flood")
        await pilot.pause()  # type: ignore[attr-defined]
        assert list(log.lines)[int(log.scroll_offset.y):][:5] == shown  # what the user reads stays put
        assert "paused (300 new lines)" in str(app.query_one("#logtitle").render())  # type: ignore[attr-defined]
        await pilot.press("end")  # type: ignore[attr-defined]
        assert not log.frozen and log.is_vertical_scroll_end and log.lines[-1] == "line 449"
        assert len(log.lines) == 200 and "following" in str(app.query_one("#logtitle").render())  # type: ignore
        app.query_one("#nodes").focus()
        await pilot.press("slash", *"line 4[0-4]0", "enter")  # type: ignore[attr-defined]
        assert log.frozen and len(app._matches.lines) == 5
        pour(450, 700)
        await until(pilot, lambda: app.board.nodes[0].log.count == 12 + 700, 5, "more lines")
        await pilot.press("N")  # type: ignore[attr-defined]
        current = app._matches.lines[app._matches.current]
        assert log.lines[current - log.first] == "line 440"  # the matches still point at their lines
        await pilot.press("escape", "f")  # type: ignore[attr-defined]
        assert not log.frozen and log.lines[-1] == "line 699"
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)


def test_what_arrives_while_the_table_is_gone_is_not_an_error() -> None:
    """The app starting or ending (its timers fire until it has ended): nothing to redraw, no
    exception that would end the dashboard with a traceback."""
    app = Dashboard(Scripted(started(), running=True), ring=100)  # type: ignore[arg-type]

    async def script(app: Dashboard, pilot: object) -> None:
        await app.query_one("#nodes").remove()
        app.emit(LogLines(0, host="gpu-a", lines=("late",)))
        app._drain()
        app._tick_clock()
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)


def test_the_log_view_leaves_no_reference_cycles_as_lines_pour_in_and_views_switch() -> None:
    # Garbage in a cycle waits for a full collection, and a key pressed during one waits too.
    app = Dashboard(Scripted(started(), running=True), ring=200)  # type: ignore[arg-type]

    async def script(app: Dashboard, pilot: object) -> None:
        log = app.query_one("#log", RingLog)
        await until(pilot, lambda: log.lines, 5, "the first lines")
        await pilot.pause()  # type: ignore[attr-defined]
        rings = [row.log for row in app.board.nodes] + [app.board.merged]
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
        try:
            for n in range(12):  # nothing else of the app runs in between: no await
                ring = rings[n % len(rings)]
                log.show(ring)
                ring.extend([f"line {n}.{i}" + " x" * (i % 90) for i in range(150)])
                log.advance()
                drawn = [log.render_line(y) for y in range(log.size.height)]
                if n % 4 == 3:
                    log.restyle()
            del drawn
            gc.collect()
            # (strips of earlier frames may go too: the compositor's cut caches a strip in itself)
            cyclic = [o for o in gc.garbage if isinstance(o, Strip) and "line " in o.text]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert cyclic == []
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)


@contextlib.contextmanager
def in_terminal(tmp_path: Path, arguments: str) -> Iterator[tuple[list[str], str]]:
    """`clusterrun ARGUMENTS` in a real terminal (tmux); yields (tmux argv, session) once the
    dashboard shows both nodes running."""
    subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "tmux"], check=True, capture_output=True)
    assert shutil.which("tmux"), "tmux could not be installed"
    session = f"crtest{os.getpid()}"
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    command = f"cd {ROOT} && {sys.executable} -m clusterrun {arguments}"
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "45",
                    f"{command}; echo EXIT=$?; sleep 60"], check=True,
                   env={**os.environ, "TERM": "xterm-256color"})
    try:
        wait_for(lambda: "rank 0 line 3" in screen(tmux, session) and screen(tmux, session).count("running") >= 2,
                 timeout=90, what=f"the dashboard with both nodes running:\n{screen(tmux, session)}")
        yield tmux, session
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


@pytest.fixture
def terminal(tmp_path: Path, state_dir: Path) -> Iterator[tuple[list[str], str]]:
    """`clusterrun up` of a long job in a real terminal (``in_terminal``)."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    with in_terminal(tmp_path, f"up --name tuitest --grace 2 --ui-lines 500 {hosts} "
                               f"{SUPPORT / 'counter.py'} 10000 0.05") as shown:
        yield shown


def the_clusterrun_in(tmux: list[str], session: str) -> int:
    """The pid of the clusterrun the terminal's shell runs."""
    shell = int(subprocess.run([*tmux, "display", "-p", "-t", session, "#{pane_pid}"], capture_output=True,
                               text=True, check=True).stdout)
    found = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_of(int(p)) == shell]
    assert len(found) == 1 and b"clusterrun" in Path(f"/proc/{found[0]}/cmdline").read_bytes()
    return found[0]


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def screen(tmux: list[str], session: str) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


@pytest.mark.fake_torchrun
def test_up_in_a_real_terminal_shows_the_dashboard_and_kill_leaves_nothing(terminal: tuple[list[str], str],
                                                                           state_dir: Path) -> None:
    tmux, session = terminal
    shown = screen(tmux, session)
    assert "local-a" in shown and "local-b" in shown and "world size 2" in shown
    job = next(p.name for p in (state_dir / "jobs").iterdir())
    assert marked(job)
    subprocess.run([*tmux, "send-keys", "-t", session, "K"], check=True)
    wait_for(lambda: "Kill job" in screen(tmux, session), timeout=10, what="the confirm dialog")
    subprocess.run([*tmux, "send-keys", "-t", session, "y"], check=True)
    wait_for(lambda: "STOPPED" in screen(tmux, session), timeout=60, what=f"the job stopped:\n{screen(tmux, session)}")
    subprocess.run([*tmux, "send-keys", "-t", session, "q"], check=True)
    wait_for(lambda: "EXIT=" in screen(tmux, session), timeout=30, what=f"clusterrun to exit:\n{screen(tmux, session)}")
    assert "EXIT=130" in screen(tmux, session)
    assert "nothing left (verified by cgroup)" in screen(tmux, session)
    assert marked(job) == []
    assert ps_json(job)["state"] == "stopped"
    assert NodeState.STOPPED.value in ps_json(job)["nodes"][0]["state"]


def test_k_in_ups_dashboard_during_a_restarts_backoff_stops_the_job(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="restart: {backoff: 10m}\n")
    counter, gate = tmp_path / "runs", tmp_path / "fail"
    with in_terminal(tmp_path, f"up --name inbackoff --max-restarts 1 {hosts} {SUPPORT / 'fail_once_gated.py'} "
                               f"{counter} {gate}") as (tmux, session):
        gate.touch()  # rank 1 fails: `up` waits its backoff
        wait_for(lambda: "· RESTARTING ·" in screen(tmux, session), timeout=60,
                 what=f"the backoff:\n{screen(tmux, session)}")
        subprocess.run([*tmux, "send-keys", "-t", session, "K"], check=True)
        wait_for(lambda: "Kill job" in screen(tmux, session), timeout=15,
                 what=f"K's question:\n{screen(tmux, session)}")
        subprocess.run([*tmux, "send-keys", "-t", session, "y"], check=True)
        wait_for(lambda: "· STOPPED ·" in screen(tmux, session), timeout=60,
                 what=f"the job stopped:\n{screen(tmux, session)}")
    record = ps_json("inbackoff")
    assert record["state"] == "stopped" and record["attempt"] == 1


@pytest.mark.fake_torchrun
def test_sigterm_to_up_in_a_terminal_stops_the_job_and_exits_143(terminal: tuple[list[str], str],
                                                                  state_dir: Path) -> None:
    tmux, session = terminal
    job = next(p.name for p in (state_dir / "jobs").iterdir())
    shell = int(subprocess.run([*tmux, "display", "-p", "-t", session, "#{pane_pid}"], capture_output=True,
                               text=True, check=True).stdout)
    up = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_of(int(p)) == shell]
    assert len(up) == 1 and b"clusterrun" in Path(f"/proc/{up[0]}/cmdline").read_bytes()
    os.kill(up[0], signal.SIGTERM)
    wait_for(lambda: "EXIT=" in screen(tmux, session), timeout=60, what=f"up to exit:\n{screen(tmux, session)}")
    assert "EXIT=143" in screen(tmux, session)
    assert marked(job) == []
    assert ps_json(job)["state"] == "stopped"


@pytest.mark.fake_torchrun
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_attach_in_a_terminal_detaches_and_the_job_runs_on(tmp_path: Path, state_dir: Path,
                                                                                signum: signal.Signals) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    try:
        with in_terminal(tmp_path, f"attach {job}") as (tmux, session):
            os.kill(the_clusterrun_in(tmux, session), signum)
            wait_for(lambda: "EXIT=" in screen(tmux, session), timeout=60,
                     what=f"attach to exit:\n{screen(tmux, session)}")
            assert f"EXIT={128 + signum}" in screen(tmux, session)
        assert ps_json(job)["state"] == "running" and len(marked(job)) >= 2
    finally:
        assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


def test_a_detach_that_ends_after_the_app_does_not_touch_it() -> None:
    """The detach runs in a thread and the app may be gone when it is done (its terminal closed,
    a test harness shut it): the thread must not call into the ended app (it did, and raised
    'Event loop is closed' in that thread)."""
    import threading

    app_ended = threading.Event()

    class SlowDetach(Scripted):
        def detach(self) -> None:
            app_ended.wait(10)

    errors: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        app = Dashboard(SlowDetach(started(), running=True), ring=100)  # type: ignore[arg-type]

        async def script(app: Dashboard, pilot: object) -> None:
            await pilot.press("d")  # type: ignore[attr-defined]  # and the harness ends the app at once

        drive(app, script)
        app_ended.set()
        detach = next(t for t in threading.enumerate() if t.name == "detach")
        detach.join(10)  # the detach, then what the thread does after it
        assert not detach.is_alive()
    finally:
        threading.excepthook = hook
    assert errors == [] and app.outcome == "detached"


def test_the_help_says_what_the_digit_keys_do() -> None:
    """Key 1 shows node 1, the node of that number (it showed node 0), and the help says so."""
    app = Dashboard(Scripted(started(), running=True), ring=100)  # type: ignore[arg-type]
    seen: dict[str, str] = {}

    async def script(app: Dashboard, pilot: object) -> None:
        await pilot.press("question_mark")  # type: ignore[attr-defined]
        seen["help"] = str(app.screen.query_one("Static").render())
        await pilot.press("escape", "1")  # type: ignore[attr-defined]
        await pilot.pause()  # type: ignore[attr-defined]
        seen["title"] = str(app.query_one("#logtitle").render())

    drive(app, script)
    assert "0–9        select the node of that number" in seen["help"], seen["help"]
    assert seen["title"].startswith("node 1 (gpu-b)"), seen["title"]


def test_at_80_by_24_the_footer_shows_every_key_whole() -> None:
    """The footer at 80 columns: every shown key with its whole name (it ended "d Deta", cut by the
    command palette's entry), quit as q; and the help's entries each on one line."""
    app = Dashboard(Scripted(started(), running=True), ring=100)  # type: ignore[arg-type]
    seen: dict[str, str] = {}

    def last_line() -> str:
        return [line for line in _screen_text(app).splitlines() if line.strip()][-1]

    async def script(app: Dashboard, pilot: object) -> None:
        # the footer is drawn after the first frame (under load its last line was still a log line)
        await until(pilot, lambda: "a All" in last_line(), 30, "the footer")
        seen["footer"] = last_line()
        await pilot.press("question_mark")  # type: ignore[attr-defined]
        await pilot.pause()  # type: ignore[attr-defined]
        seen["help"] = _screen_text(app)

    drive(app, script, size=(80, 24))
    for key, name in (("a", "All"), ("/", "Search"), ("K", "Kill"), ("R", "Restart"),
                      ("s", "Stacks"), ("h", "Attempts"), ("d", "Detach"), ("?", "Help"), ("q", "Quit")):
        assert f"{key} {name}" in seen["footer"], seen["footer"]
    assert "palette" not in seen["footer"] and len(seen["footer"].rstrip()) <= 80, seen["footer"]
    for line in ("0–9        select the node of that number", "d          detach: leave the job running and exit",
                 "/          search, text or regex; n/N next/previous; Esc clears"):
        assert line in seen["help"], seen["help"]


def saved_lines(node: int) -> list[Event]:
    """Node ``node`` saves three checkpoints among its lines."""
    lines = tuple(f"[rank{2 * node}]:step {i}" + (" checkpoint saved" if i % 10 == 5 else "") for i in range(30))
    return [LogLines(node, host="gpu-a", lines=lines, ts=T0 + 6)]


def test_a_search_goes_on_working_after_switching_nodes_and_back() -> None:
    """`/saved` finds 1/3; after showing another node and coming back the three matches are
    still found (it said "no match" with three on screen, and n did nothing)."""
    app = Dashboard(Scripted([*started(), *saved_lines(0)], running=True), ring=200)  # type: ignore[arg-type]

    def title() -> str:
        return str(app.query_one("#logtitle").render())

    def current() -> str:
        log = app.query_one("#log", RingLog)
        return log.lines[app._matches.lines[app._matches.current] - log.first]

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: any("saved" in line for line in log_lines(app)), 5, "node 0's lines")
        await pilot.press("slash", *"saved", "enter")  # type: ignore[attr-defined]
        assert "/saved/ 1/3" in title() and current().endswith("step 5 checkpoint saved")
        await pilot.press("1")  # type: ignore[attr-defined]
        await pilot.pause()  # type: ignore[attr-defined]
        assert "/saved/ no match" in title()  # node 1 saved nothing
        await pilot.press("0")  # type: ignore[attr-defined]
        await pilot.pause()  # type: ignore[attr-defined]
        assert "/saved/ 3 matches" in title(), title()
        app.emit(LogLines(0, host="gpu-a", lines=("[rank0]:step 30 checkpoint saved", "[rank0]:step 31")))
        await until(pilot, lambda: "/saved/ 4 matches" in title(), 5, "the new line found while following")
        await pilot.press("n")  # type: ignore[attr-defined]
        assert "/saved/ 1/4" in title() and current().endswith("step 5 checkpoint saved")
        await pilot.press("n", "n")  # type: ignore[attr-defined]
        assert "/saved/ 3/4" in title() and current().endswith("step 25 checkpoint saved")
        await pilot.press("n")  # type: ignore[attr-defined]
        assert "/saved/ 4/4" in title() and current().endswith("step 30 checkpoint saved")
        await pilot.press("N", "N")  # type: ignore[attr-defined]
        assert "/saved/ 2/4" in title() and current().endswith("step 15 checkpoint saved")
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)


def test_after_a_failure_the_root_cause_node_is_selected_and_its_log_shown(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached("--grace", "3", hosts, SUPPORT / "fail_rank.py", "1", "raise", "custom failure 42")
    app = dashboard_on(job, tail=0)

    async def script(app: Dashboard, pilot: object) -> None:
        assert app._view == 0
        await until(pilot, lambda: app.board.finished, 90, "the job to fail")
        await pilot.pause()  # type: ignore[attr-defined]
        assert app.board.state == "failed" and app.board.root_rank() == 1
        assert app._view == 1 and app.query_one("#nodes").cursor_row == 1  # type: ignore[attr-defined]
        assert any("custom failure 42" in line for line in log_lines(app))
        assert str(app.query_one("#logtitle").render()).startswith("node 1 (local-b)")  # type: ignore[attr-defined]
        await pilot.press("0")  # type: ignore[attr-defined]  # the user looks elsewhere: it stays there
        await pilot.pause(0.3)  # type: ignore[attr-defined]
        assert app._view == 0
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)
    assert app.return_value == 1


def test_the_node_that_fails_first_is_selected_while_the_others_are_stopped() -> None:
    app = Dashboard(Scripted(started(), running=True), ring=200)  # type: ignore[arg-type]

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: log_lines(app), 5, "the first lines")
        assert app._view == 0
        app.emit(LogLines(2, host="gpu-c", lines=("[rank5]:RuntimeError: boom",)))
        app.emit(NodeExited(2, result=NodeResult(2, "gpu-c", NodeState.FAILED, exit_code=1)))
        await until(pilot, lambda: app._view == 2, 5, "node 2 to be shown")
        assert app.query_one("#nodes").cursor_row == 2  # type: ignore[attr-defined]
        assert log_lines(app)[-1] == "[rank5]:RuntimeError: boom"
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)


@pytest.mark.fake_torchrun
def test_attach_shows_what_came_before_the_resume_point_the_real_elapsed_time_and_a_degraded_node(
        tmp_path: Path, state_dir: Path) -> None:
    """attach resumes where the last viewer stopped, with the 5 lines before that point above a
    separator; the header counts from the attempt's start in its record (1000 s ago here), not from
    the attach; a node whose supervisor left its `degraded` marker shows it while the job runs."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    log0 = attempt_dir(state_dir, job, 0) / "output.log"
    wait_for(lambda: b"[rank0]:rank 0 line 25\n" in log0.read_bytes(), timeout=60, what="node 0's lines")
    data = log0.read_bytes()
    resume = data.index(b"[rank0]:rank 0 line 20\n")
    store = JobStore()

    def viewed_earlier(record: JobRecord) -> None:  # a viewer showed node 0 up to line 19; the job started long ago
        record.nodes[0].seen = resume
        record.attempts[-1].started -= 1000

    record = store.update(job, viewed_earlier)
    started = record.attempts[-1].started
    app = dashboard_on(job, offsets={n.rank: n.seen for n in record.nodes}, scrollback=5)
    reason = "the supervisor could not write its state (no space left on the file system of a test)"

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: RESUMED in log_lines(app) and log_lines(app)[-1] != RESUMED, 60, "the new lines")
        shown = log_lines(app)
        at = shown.index(RESUMED)
        assert shown[:at] == data[:resume].decode().splitlines()[-5:] == [
            f"[rank0]:rank 0 line {i}" for i in range(15, 20)]
        assert shown[at + 1:at + 4] == [f"[rank0]:rank 0 line {i}" for i in range(20, 23)]  # nothing lost or repeated
        header = str(app.query_one("#header").render())  # type: ignore[attr-defined]
        assert time.time() - started + 1 >= app.board.elapsed() >= 1000  # the record's start, not the attach's
        assert " · 16:" in header or " · 17:" in header, header
        (attempt_dir(state_dir, job, 1) / "degraded").write_text(reason)  # as the supervisor leaves it
        await until(pilot, lambda: app.board.nodes[1].degraded == reason, 30, "node 1 degraded")
        await pilot.pause(0.2)  # type: ignore[attr-defined]
        assert "degraded" in str(app.query_one("#nodes").get_row("1")[3])  # type: ignore[attr-defined]
        assert f"node1 local-b: degraded: {reason}" in str(app.query_one("#report").render())  # type: ignore
        assert "1 degraded" in str(app.query_one("#header").render())  # type: ignore[attr-defined]
        await pilot.press("d")  # type: ignore[attr-defined]
        await until(pilot, lambda: not app.is_running, 15, "the app to exit")

    drive(app, script)
    assert subprocess.run([sys.executable, "-m", "clusterrun", "down", job], cwd=ROOT).returncode == 0


def test_the_elapsed_time_is_the_attempt_s_as_recorded_and_stops_at_its_recorded_end() -> None:
    now = 50_000.0  # the wall clock; the board's own clock is the snapshots' T0 + 30

    def attempt(**times: float) -> list[Event]:
        first = started()[0]
        assert isinstance(first, AttemptStarted)
        return [dataclasses.replace(first, **times), *started()[1:]]

    for times, shown in (({"started": now - 125}, "02:05"), ({"started": now - 4000, "ended": now - 400}, "1:00:00")):
        app = Dashboard(Scripted(attempt(**times), running=True), clock=lambda: T0 + 30,  # type: ignore[arg-type]
                        wall=lambda: now)

        async def script(app: Dashboard, pilot: object, shown: str = shown) -> None:
            await until(pilot, lambda: app.board.job_id, 5, "the attempt")
            await pilot.pause()  # type: ignore[attr-defined]
            assert f"attempt 1 · {shown}\n" in str(app.query_one("#header").render())  # type: ignore[attr-defined]
            await pilot.press("q")  # type: ignore[attr-defined]

        drive(app, script)


def test_a_degraded_node_is_shown_in_the_table_below_it_and_in_the_header() -> None:
    reason = "the supervisor could not write its state (read-only file system)"
    app = Dashboard(Scripted([*started(), NodeDegraded(2, host="gpu-c", reason=reason)], running=True))  # type: ignore

    async def script(app: Dashboard, pilot: object) -> None:
        await until(pilot, lambda: app.board.nodes and app.board.nodes[-1].degraded, 5, "the events")
        await pilot.pause()  # type: ignore[attr-defined]
        assert "▶ running ⚠ degraded" in str(app.query_one("#nodes").get_row("2")[3])  # type: ignore[attr-defined]
        assert "degraded" not in str(app.query_one("#nodes").get_row("1")[3])  # type: ignore[attr-defined]
        assert str(app.query_one("#report").render()) == f"node2 gpu-c: degraded: {reason}"  # type: ignore
        header = str(app.query_one("#header").render())  # type: ignore[attr-defined]
        assert "3 nodes × 2: 3 running · 1 degraded" in header and f"node2 gpu-c: degraded: {reason}" in header
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)


def test_h_shows_the_attempts_of_the_job_from_its_record(tmp_path: Path) -> None:
    """The dashboard's `h`: the attempts as `ps JOB` lists them, read from the job's record."""
    from clusterrun.life.session import Session
    from clusterrun.store.jobs import AttemptRecord
    from tests.test_joblist import make_record

    store = JobStore(tmp_path / "jobs")
    record = make_record("train-1", "failed", 10)
    record.attempts = [AttemptRecord(1, started=record.created, master_port=29500, state=JobState.FAILED,
                                     ended=record.created + 12, root_cause="rank 1 on node 0: exit code 1",
                                     restart="policy"),
                       AttemptRecord(2, started=record.created + 40, master_port=29501, state=JobState.FAILED,
                                     ended=record.created + 52, root_cause="rank 0 on node 0: exit code 3")]
    record.attempt = 2
    store.create(record)
    lines = Session(store, record, gpu_interval=None).history()
    assert lines[0].split() == ["ATTEMPT", "STARTED", "DURATION", "STATE", "RESTARTED", "ROOT", "CAUSE"]
    assert lines[1].split()[2:6] == ["12", "s", "failed", "policy"] and lines[1].endswith("exit code 1")
    assert lines[2].split()[0] == "2" and lines[2].endswith("rank 0 on node 0: exit code 3")

    class WithHistory(Scripted):
        def history(self) -> list[str]:
            return lines

    app = Dashboard(WithHistory(started(), running=True), ring=100)  # type: ignore[arg-type]
    seen: dict[str, str] = {}

    async def script(app: Dashboard, pilot: object) -> None:
        await pilot.press("h")  # type: ignore[attr-defined]
        await pilot.pause()  # type: ignore[attr-defined]
        seen["screen"] = _screen_text(app)
        await pilot.press("escape")  # type: ignore[attr-defined]

    drive(app, script)
    assert "Attempts of the job" in seen["screen"] and "rank 0 on node 0: exit code 3" in seen["screen"]


def test_the_training_s_progress_shows_under_the_header_with_a_sparkline_of_its_loss() -> None:
    app = Dashboard(Scripted(started(), running=True), ring=200)  # type: ignore[arg-type]

    async def script(app: Dashboard, pilot: object) -> None:
        shown = app.query_one("#progress")
        await pilot.pause()  # type: ignore[attr-defined]
        assert not shown.has_class("shown")  # nothing read yet: no line for it
        app.emit(ProgressChanged(0, host="gpu-a", progress=Progress(100, 1000, 45.0, 12.0, (("loss", 3.0),))))
        await until(pilot, lambda: shown.has_class("shown"), 5, "the progress line")
        assert list(app.query_one("#loss", Sparkline).data or ()) == []  # one point is no curve
        for step, loss in ((200, 2.5), (450, 2.31)):
            app.emit(ProgressChanged(0, host="gpu-a", progress=Progress(step, 1000, 45.0, 12.0, (("loss", loss),))))
        await until(pilot, lambda: len(app.query_one("#loss", Sparkline).data or ()) == 3, 5, "the curve")
        text = str(app.query_one("#progress-text").render())  # type: ignore[attr-defined]
        assert text == "progress: step 450/1000 (45%), 45 steps/s, loss 2.31, ETA 12 s"
        assert list(app.query_one("#loss", Sparkline).data or ()) == [3.0, 2.5, 2.31]
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)
