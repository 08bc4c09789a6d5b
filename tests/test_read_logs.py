"""``logread.read_logs``: several nodes' logs read ahead in threads, within one memory budget."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from clusterrun.life import logread
from tests.conftest import wait_for

CHUNK = 1000


def stopped(thread: threading.Thread) -> bool:
    """The reader ``thread`` can read no more until the logs are printed on: it ended, or it waits in
    ``read_logs``'s ``put`` for the budget."""
    frame = sys._current_frames().get(thread.ident or 0) if thread.is_alive() else None
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return not names or (names[0] == "wait" and "put" in names)


def test_what_is_read_ahead_is_bounded_in_bytes_across_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, chunks, budget = 4, 200, 10 * CHUNK
    produced = [0]
    lock = threading.Lock()

    def fake_read_log(record: Any, rank: int, attempt: int, tail: int | None = None,
                      transport: Any = None) -> Iterator[str]:
        for i in range(chunks):
            with lock:
                produced[0] += CHUNK
            yield f"{rank}:{i:04d}".ljust(CHUNK - 1, ".") + "\n"

    monkeypatch.setattr(logread, "read_log", fake_read_log)
    logs = logread.read_logs(None, list(range(nodes)), 1, budget=budget)  # type: ignore[arg-type]
    first = next(logs)
    assert first[0] == 0 and first[1].startswith("0:0000")
    # Held: the budget, one chunk of the node being printed, and one in each reader's hand.
    bound = budget + (nodes + 1) * CHUNK + CHUNK
    readers = [thread for thread in threading.enumerate() if thread.name.startswith("logs-node")]  # or ended
    seen: list[int] = []

    def still() -> bool:  # twice in a row every reader ended or waits for the budget, and nothing was read between
        seen.append(produced[0] if all(map(stopped, readers)) else -1)
        return len(seen) > 1 and seen[-1] == seen[-2] >= 0

    wait_for(still, timeout=30, interval=0.01, what="the readers to stop")
    assert produced[0] <= bound, f"{produced[0]} characters read ahead, budget {budget}"
    rest = list(logs)
    assert [(rank, text[:6]) for rank, text in rest] == [
        (rank, f"{rank}:{i:04d}") for rank in range(nodes) for i in range(chunks)][1:]


def test_a_reader_that_fails_unexpectedly_raises_where_the_logs_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a ClusterrunError (a bug): raised by ``read_logs``, after the nodes before it, not waited on forever."""
    def fake_read_log(record: Any, rank: int, attempt: int, tail: int | None = None,
                      transport: Any = None) -> Iterator[str]:
        if rank == 1:
            raise TypeError("a reader's bug")
        yield f"node {rank}\n"

    monkeypatch.setattr(logread, "read_log", fake_read_log)
    got: list[object] = []

    def consume() -> None:
        try:
            got.extend(logread.read_logs(None, [0, 1, 2], 1))  # type: ignore[arg-type]
        except TypeError as exc:
            got.append(exc)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    reader.join(timeout=30)  # (before the fix, forever)
    assert not reader.is_alive()
    assert got[0] == (0, "node 0\n") and isinstance(got[1], TypeError) and len(got) == 2, got
