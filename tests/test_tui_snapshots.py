"""Snapshots of the dashboard's main screen in a few states (pytest-textual-snapshot).

The app is fed a fixed script of the orchestrator's events by a stand-in for the session, with
an injected clock and fixed pids, so a snapshot changes only when what the dashboard draws does.
Update them after a deliberate change with ``python -m pytest tests/test_tui_snapshots.py --snapshot-update``
and look at the report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from clusterrun.core.events import (
    AttemptStarted,
    Event,
    GpuReading,
    JobFinished,
    JobResult,
    LogLines,
    NodeExited,
    NodeGpus,
    NodeLink,
    NodeResult,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    RootCause,
)
from clusterrun.life.session import Session
from clusterrun.tui import Dashboard

pytestmark = pytest.mark.usefixtures("young_heap")

T0 = 1000.0
WALL = 1_795_608_000.0  # the wall clock at T0: 2026-11-25T12:00:00Z
HOSTS = ("gpu-a", "gpu-b", "gpu-c")


class Scripted:
    """Stands in for ``clusterrun.life.session.Session``: emits a fixed list of events when begun."""

    job_id = "train-20261122-150102-3f9a"
    owner = True
    busy = False
    failed_start = False
    detached = False
    error = None
    supports = Session.supports

    def __init__(self, events: list[Event], running: bool, result: JobResult | None = None) -> None:
        self.events = events
        self.running = running
        self.result = result
        self.emit: Callable[[Event], None] = lambda event: None

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self.emit = listener

    def begin(self) -> None:
        for event in self.events:
            self.emit(event)

    def kill(self) -> None: ...

    def restart(self) -> None: ...

    def detach(self) -> None: ...

    def wait(self, timeout: float | None = None) -> None: ...


def started() -> list[Event]:
    events: list[Event] = [AttemptStarted(None, job_id=Scripted.job_id, name="train", attempt=1,
                                          master_addr="10.0.0.11", master_port=29500, world_size=6,
                                          nodes=tuple((h, 2, "0,1") for h in HOSTS), ts=T0)]
    for rank, host in enumerate(HOSTS):
        events.append(NodeStarted(rank, host=host, attempt=1, pid=4100 + rank, ts=T0))
        events.append(NodeStateChanged(rank, host=host, state=NodeState.RUNNING, ts=T0))
        events.append(LogLines(rank, host=host, ts=T0 + 5 + rank, lines=tuple(
            f"[rank{2 * rank + local}]:epoch 1 step {step} loss 0.{900 - 37 * step - rank:03d}"
            for step in range(6) for local in (0, 1))))
    return events


def failed() -> tuple[list[Event], JobResult]:
    events = started()
    trace = ("[rank3]:Traceback (most recent call last):", '[rank3]:  File "train.py", line 41, in <module>',
             "[rank3]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    events.append(LogLines(1, host="gpu-b", ts=T0 + 9, lines=trace))
    events.append(NodeExited(1, result=NodeResult(1, "gpu-b", NodeState.FAILED, exit_code=1), ts=T0 + 9))
    events.append(NodeStateChanged(1, host="gpu-b", state=NodeState.FAILED, detail="exit code 1", ts=T0 + 9))
    for rank in (0, 2):
        events.append(NodeStateChanged(rank, host=HOSTS[rank], state=NodeState.STOPPED, ts=T0 + 10))
    nodes = tuple(NodeResult(r, h, NodeState.FAILED if r == 1 else NodeState.STOPPED, exit_code=1 if r == 1 else None)
                  for r, h in enumerate(HOSTS))
    cause = RootCause(node=1, host="gpu-b", rank=3, local_rank=1, exit_code=1, signal=None,
                      last_lines=tuple(line.removeprefix("[rank3]:") for line in trace),
                      message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    result = JobResult(Scripted.job_id, nodes, root_cause=cause)
    events.append(JobFinished(None, result=result, ts=T0 + 11))
    return events, result


def done() -> tuple[list[Event], JobResult]:
    events = started()
    nodes = []
    for rank, host in enumerate(HOSTS):
        events.append(LogLines(rank, host=host, ts=T0 + 20, lines=(f"[rank{2 * rank}]:done",)))
        events.append(NodeExited(rank, result=NodeResult(rank, host, NodeState.SUCCEEDED, exit_code=0), ts=T0 + 20))
        events.append(NodeStateChanged(rank, host=host, state=NodeState.SUCCEEDED, ts=T0 + 20))
        nodes.append(NodeResult(rank, host, NodeState.SUCCEEDED, exit_code=0))
    result = JobResult(Scripted.job_id, tuple(nodes))
    events.append(JobFinished(None, result=result, ts=T0 + 21))
    return events, result


ESCAPES = ("[rank0]:\x1b[1;32mgreen\x1b[0m and \x1b[31mred\x1b[0m pass",
           "[rank0]:clipboard \x1b]52;c;aGVsbG8=\x07 title \x1b]0;pwned\x07 shown escaped",
           "[rank0]:clear \x1b[2J\x1b[H cursor \x1b[5A bell \x07 cr \r c1 \x9b2J \udc9b end")


def escapes() -> list[Event]:
    """A rank's output with colours and escape sequences that a terminal would act on."""
    return [*started(), LogLines(0, host=HOSTS[0], ts=T0 + 9, lines=ESCAPES)]


def unreachable() -> list[Event]:
    """gpu-c's connection lost at 12:00:12Z: its node is unreachable since then, not running."""
    return [*started(), NodeLink(2, host="gpu-c", up=False, detail="gpu-c: connection lost: timed out", ts=T0 + 12)]


def with_gpus() -> list[Event]:
    """gpu-a's nvidia-smi reads two GPUs, gpu-b's is broken (exit 9), gpu-c has none."""
    two = (GpuReading(0, 87, 30123, 81920), GpuReading(1, 85, 29876, 81920))
    return [*started(), NodeGpus(0, host="gpu-a", gpus=two, ts=T0 + 12),
            NodeGpus(1, host="gpu-b", problem="nvidia-smi exited with status 9: NVIDIA-SMI has failed", ts=T0 + 12),
            NodeGpus(2, host="gpu-c", missing=True, ts=T0 + 12)]


def many(count: int = 64, failed: tuple[int, ...] = (62, 63)) -> list[Event]:
    """A job of ``count`` nodes, all running but ``failed``, which failed (the first is the root cause)."""
    hosts = [f"sim{i:02d}" for i in range(1, count + 1)]
    events: list[Event] = [AttemptStarted(None, job_id=Scripted.job_id, name="train", attempt=1,
                                          master_addr="10.0.0.11", master_port=29500, world_size=count,
                                          nodes=tuple((h, 1, None) for h in hosts), ts=T0)]
    for rank, host in enumerate(hosts):
        events.append(NodeStarted(rank, host=host, attempt=1, pid=4100 + rank, ts=T0))
        events.append(NodeStateChanged(rank, host=host, state=NodeState.RUNNING, ts=T0))
        events.append(LogLines(rank, host=host, ts=T0 + 5, lines=(f"[rank{rank}]:step 1 loss 0.9",)))
    for rank in failed:
        events.append(NodeExited(rank, result=NodeResult(rank, hosts[rank], NodeState.FAILED, exit_code=1), ts=T0 + 9))
        events.append(NodeStateChanged(rank, host=hosts[rank], state=NodeState.FAILED, ts=T0 + 9))
    return events


def app_for(session: Scripted) -> Dashboard:
    return Dashboard(session, clock=lambda: T0 + 30, wall=lambda: WALL + 30)  # type: ignore[arg-type]


@pytest.mark.parametrize("state", ["running", "one failed", "all done", "escapes", "unreachable"])
def test_main_screen(snap_compare: Any, state: str) -> None:
    if state in ("running", "escapes", "unreachable"):
        script = {"running": started, "escapes": escapes, "unreachable": unreachable}[state]
        session = Scripted(script(), running=True)
    else:
        events, result = failed() if state == "one failed" else done()
        session = Scripted(events, running=False, result=result)
    keys = ["a"] if state == "all done" else []  # the merged view, with its coloured prefixes
    assert snap_compare(app_for(session), terminal_size=(120, 36), press=keys)


def test_gpu_column_and_the_selected_nodes_gpus(snap_compare: Any) -> None:
    """A GPU column once a host has nvidia-smi: a mark on the broken and the missing one; the
    selected node's GPUs one by one under the table."""
    assert snap_compare(app_for(Scripted(with_gpus(), running=True)), terminal_size=(120, 36))


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_64_nodes_scroll_to_the_failed_one_with_a_node_set_summary(snap_compare: Any, size: tuple[int, int]) -> None:
    """64 nodes: the table scrolls to the first failed node and the header counts the 62 running
    and names the failed ones (nodes 62-63)."""
    assert snap_compare(app_for(Scripted(many(), running=True)), terminal_size=size)


async def mounted(app: Any, pilot: Any, selector: str = "#nodes") -> None:
    """Until the main screen holds ``selector`` (one pause is not enough on a loaded machine)."""
    import time

    deadline = time.monotonic() + 30
    await pilot.pause()
    while not app.query(selector):
        assert time.monotonic() < deadline, f"{selector} never shown"
        await pilot.pause(0.05)


def test_node_table_caches_are_sized_only_on_textual_versions_checked() -> None:
    """NodeTable sizes DataTable's private render caches. This fails on a Textual newer than the
    versions checked to have them: check them (the names in NodeTable.fit_caches, and that
    maxsize is settable), then raise CACHES_CHECKED."""
    import asyncio

    from clusterrun.tui import CACHES_CHECKED, COLUMNS, NodeTable, textual_version

    assert textual_version() <= CACHES_CHECKED[1], f"Textual {textual_version()} is newer than checked"

    async def main() -> int:
        app = app_for(Scripted(started(), running=True))
        async with app.run_test(size=(120, 36)) as pilot:
            await mounted(app, pilot)
            return app.query_one("#nodes", NodeTable)._cell_render_cache.maxsize

    maxsize = asyncio.run(main())
    assert maxsize == (2 * (len(HOSTS) + 1) * len(COLUMNS) if textual_version() >= CACHES_CHECKED[0] else 10000)


def test_the_gpu_line_follows_the_selected_node_and_keys_answer_at_64_nodes() -> None:
    import asyncio

    from textual.widgets import Static

    from clusterrun.tui import NodeTable

    async def gpus_line() -> list[str]:
        import time

        app = app_for(Scripted(with_gpus(), running=True))
        seen = []
        async with app.run_test(size=(120, 36)) as pilot:
            await mounted(app, pilot)
            for node, key in enumerate(("", "j", "j")):
                if key:
                    await pilot.press(key)
                deadline = time.monotonic() + 30  # the readings and the cursor are drawn in their own time
                while not str(app.query_one("#gpus", Static).render()).startswith(f"node {node} GPUs: "):
                    assert time.monotonic() < deadline, f"node {node}'s GPU line never shown"
                    await pilot.pause(0.05)
                seen.append(str(app.query_one("#gpus", Static).render()))
        return seen

    assert asyncio.run(gpus_line()) == ["node 0 GPUs: gpu0 87% 29/80G · gpu1 85% 29/80G",
                                        "node 1 GPUs: nvidia-smi exited with status 9: NVIDIA-SMI has failed",
                                        "node 2 GPUs: no nvidia-smi on this host"]

    async def cursor() -> list[int]:
        import time

        app = app_for(Scripted(many(), running=True))
        rows = []
        async with app.run_test(size=(80, 24)) as pilot:
            await mounted(app, pilot)
            table = app.query_one("#nodes", NodeTable)
            deadline = time.monotonic() + 30
            while table.row_count < 64 or table.cursor_row != 62:  # every row, and the failures, drawn
                assert time.monotonic() < deadline, f"{table.row_count} rows, row {table.cursor_row} selected"
                await pilot.pause(0.05)
            rows.append(table.cursor_row)  # the first failed node, selected and in view
            await pilot.press("k", "k")
            rows.append(table.cursor_row)
            await pilot.press("1")
            rows.append(table.cursor_row)
            assert table.row_count == 64
        return rows

    assert asyncio.run(cursor()) == [62, 60, 1]  # key 1 selects node 1
