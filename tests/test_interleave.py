"""``logs JOB``'s merge of several nodes' logs by when their lines were written (clusterrun/views/interleave.py),
the chunks' times (protocol.LogChunk) and where they come from on the host (RankLogs.note_time, follow's Times)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterrun.agent.follow import Times
from clusterrun.agent.ranklogs import RankLogs
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.protocol import LogChunk, decode_follow
from clusterrun.views.interleave import interleaved


def chunk(offset: int, data: str, *times: tuple[int, int]) -> LogChunk:
    return LogChunk(offset=offset, next=offset + len(data.encode()), data=data, times=times)


def test_a_chunks_lines_take_the_time_of_the_entry_that_covers_their_offset() -> None:
    c = chunk(10, "ab\ncd\r50%\nef\n", (4, 100), (13, 200), (20, 300))  # "cd\r50%" at 13, "ef" at 20
    assert c.timed_runs() == [(100, "ab\n"), (200, "cd\r50%\n"), (300, "ef\n")]
    assert chunk(0, "x\n").timed_runs() == [(None, "x\n")]
    # entries inside a line: the next line takes the last of them; a run is many lines; a last line is ended
    c = chunk(0, "ab\ncd\nef\ngh\nij", (0, 1), (1, 2), (2, 3), (7, 4), (12, 5), (40, 6))
    assert c.timed_runs() == [(1, "ab\n"), (3, "cd\nef\n"), (4, "gh\n"), (5, "ij\n")]
    assert chunk(20, "é\nz\n", (0, 1), (23, 2)).timed_runs() == [(1, "é\n"), (2, "z\n")]  # offsets count bytes
    message = {"t": "log", "offset": 0, "next": 2, "data": b"x\n", "times": [[0, 7]]}
    assert decode_follow("h", message) == chunk(0, "x\n", (0, 7))
    with pytest.raises(ClusterrunError, match="times"):
        decode_follow("h", dict(message, times=[[0, "7"]]))


def reader(chunks: dict[int, list[LogChunk | ClusterrunError]]):  # type: ignore[no-untyped-def]
    def read(rank: int) -> Iterator[LogChunk]:
        for item in chunks[rank]:
            if isinstance(item, ClusterrunError):
                raise item
            yield item
    return read


def test_nodes_are_interleaved_by_when_their_lines_were_written() -> None:
    chunks: dict[int, list[LogChunk | ClusterrunError]] = {
        0: [chunk(0, "a1\na2\n", (0, 10), (3, 30)), chunk(6, "a3\n", (6, 50))],
        1: [chunk(0, "b1\n", (0, 20)), chunk(3, "b2\nb3\n", (3, 40))],
        2: [ClusterrunError("h2: gone")],
    }
    out = list(interleaved([0, 1, 2], reader(chunks)))
    errors = [(rank, item.render()) for rank, item in out if isinstance(item, ClusterrunError)]
    assert errors == [(2, "h2: gone")]
    assert [(rank, item) for rank, item in out if isinstance(item, str)] == [
        (0, "a1\n"), (1, "b1\n"), (0, "a2\n"), (1, "b2\nb3\n"), (0, "a3\n")]


def test_untimed_logs_of_an_older_agent_come_node_after_node() -> None:
    chunks: dict[int, list[LogChunk | ClusterrunError]] = {0: [chunk(0, "a1\na2\n")], 1: [chunk(0, "b1\n")]}
    assert list(interleaved([0, 1], reader(chunks))) == [(0, "a1\na2\n"), (1, "b1\n")]


def test_the_monitor_notes_when_each_batch_and_torchruns_own_lines_were_written(tmp_path: Path) -> None:
    root, log, times = tmp_path / "torchrun", tmp_path / "output.log", str(tmp_path / "output.times")
    rank0 = root / "run" / "attempt_0" / "0" / "stdout.log"
    rank0.parent.mkdir(parents=True)
    rank0.write_bytes(b"one\n")
    fd = os.open(log, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    logs = RankLogs(str(root), fd, first_rank=0, times=times)
    logs.poll()  # "[rank0]:one\n" from 0
    logs.poll()  # nothing new: no entry
    os.write(fd, b"torchrun's line\n")  # from 12
    with rank0.open("ab") as f:
        f.write(b"two\n")
    logs.poll()  # torchrun's line, then the batch: one entry from 12
    logs.close()
    os.close(fd)
    entries = [tuple(map(int, line.split())) for line in Path(times).read_text().splitlines()]
    assert [offset for offset, _ in entries] == [0, 12]
    assert entries[0][1] <= entries[1][1]
    follow = Times(times)
    assert follow.covering(0, 12) == [list(entries[0])]
    assert follow.covering(12, 40) == [list(entries[1])]
    assert Times(times).covering(5, 40) == [list(entries[0]), list(entries[1])]  # the one before, then those in
    assert Times(str(tmp_path / "none")).covering(0, 10) == []
