"""``logread.read_logs``: several nodes' logs read ahead in threads, within one memory budget."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from clusterrun.life import logread

CHUNK = 1000


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
    deadline = time.monotonic() + 2  # the readers stop within the budget, or exceed it within this time
    while time.monotonic() < deadline and produced[0] <= bound:
        time.sleep(0.01)
    assert produced[0] <= bound, f"{produced[0]} characters read ahead, budget {budget}"
    rest = list(logs)
    assert [(rank, text[:6]) for rank, text in rest] == [
        (rank, f"{rank}:{i:04d}") for rank in range(nodes) for i in range(chunks)][1:]
