"""The per-chunk fast paths of a log message on the controller held to the line-by-line ones.

A chunk is made terminal-safe, prefixed and read for failure tails as a whole (a few ``str`` and
``bytes`` passes in C); each test here compares that, on random chunks, with doing it line by line.
"""

from __future__ import annotations

import io
import random

import pytest

from clusterrun.core import terminal
from clusterrun.core.events import LogLines
from clusterrun.core.terminal import safe
from clusterrun.diagnose.rootcause import NodeLog, split_rank
from clusterrun.run.follower import split_lines
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.printer import Printer
from tests.test_printer import plan

# Pieces of lines: tags of the node's ranks (1, 2) and of another's (9), torch's doubled tag,
# text that looks like a tag or a prefix, controls, colours, non-ASCII and undecodable bytes.
PIECES = ["[rank1]:", "[rank2]:", "[rank9]:", "[rank1]:[rank1]: Traceback", "[rank1]:[rank2]:", "[rank", "]:",
          "plain text", "", " ", "text with [rank2]: inside", "node1 host1 rank1 | ", "\t", "\r", "\x1b[31mred\x1b[0m",
          "\x1b]0;title\x07", "\x1b[2J", "\x7f", "\x00", "\x9b", "ü", "\udc9b", "\udcff", "  exitcode  : 1 (pid: 7)"]


def random_lines(rng: random.Random) -> tuple[str, ...]:
    lines = tuple("".join(rng.choice(PIECES) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 8)))
    if rng.random() < 0.5:  # one rank's lines only, as most of a flow is (one process per node)
        tag = rng.choice(["[rank1]:", "[rank2]:", "[rank9]:"])
        lines = tuple(tag + line for line in lines)
    return lines


def slow_line(printer: Printer, node: int, host: str, line: str) -> str:
    """One line as printed alone: made safe, then its rank's prefix (``split_rank``)."""
    rank, text = split_rank(safe(line, printer.colour))
    return f"{printer._prefix(node, host, rank)} | {text}\n"


def printed(printer: Printer, how: str, lines: tuple[str, ...]) -> str:
    out = printer.out
    assert isinstance(out, io.StringIO)
    out.seek(0)
    out.truncate()
    text = "\n".join(lines) + "\n"
    if how == "event with text":  # as the job's loop emits a chunk it read
        printer(LogLines(1, host="host1", lines=lines, text=text))
    elif how == "event":
        printer(LogLines(1, host="host1", lines=lines))
    else:  # `logs JOB`: a chunk of text, its lines not counted, maybe without its last newline
        printer.write_log(1, "host1", text[:-1] if lines[-1] else text)
    return out.getvalue()


@pytest.mark.parametrize("colour", [False, True])
@pytest.mark.parametrize("how", ["event with text", "event", "write_log"])
def test_a_chunk_prints_as_its_lines_printed_one_by_one(colour: bool, how: str) -> None:
    rng = random.Random(11)
    printer = Printer(out=io.StringIO(), err=io.StringIO(), colour=colour)
    printer.set_plan(plan(1, 2, 7))  # type: ignore[arg-type]  # the attributes the printer reads
    fast = 0
    for _ in range(3000):
        lines = random_lines(rng)
        if how == "write_log" and not lines[-1]:
            continue  # a chunk's last empty line is its newline
        expected = "".join(slow_line(printer, 1, "host1", line) for line in lines)
        assert printed(printer, how, lines) == expected, lines
        fast += lines[0].startswith(("[rank1]:", "[rank2]:")) and "]:[rank" not in "\n".join(lines)
    assert fast > 300  # the one-rank fast path was taken often


def test_a_chunk_of_one_rank_with_a_line_of_another_or_of_torchrun_is_prefixed_line_by_line() -> None:
    printer = Printer(out=io.StringIO(), err=io.StringIO(), colour=False)
    printer.set_plan(plan(1, 2))  # type: ignore[arg-type]
    for lines in (("[rank1]:a", "[rank1]:b", "torchrun says"), ("[rank1]:a", "[rank2]:b", "[rank1]:c"),
                  ("[rank1]:a", "[rank1]:[rank1]: Traceback", "[rank1]:c"), ("[rank1]:a", "", "[rank1]:c")):
        expected = "".join(slow_line(printer, 1, "host1", line) for line in lines)
        for how in ("event with text", "event", "write_log"):
            assert printed(printer, how, lines) == expected, (how, lines)


def test_the_ascii_check_escapes_every_control_as_the_pattern_does() -> None:
    """``safe``'s scan of ASCII text against the regular expression it stands in for, on every
    character below 0x100 and on random text."""
    def reference(text: str, colour: bool) -> str:
        return terminal._TOKEN.sub(terminal._keep_sgr if colour else terminal._drop_sgr, text)

    for code in range(0x100):
        for text in (chr(code), f"a{chr(code)}b\n", f"[rank0]:x\n[rank0]:{chr(code)}\n"):
            for colour in (False, True):
                assert safe(text, colour) == reference(text, colour), (code, text)
    rng = random.Random(3)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        assert safe(text) == reference(text, True) and safe(text, False) == reference(text, False), text


def test_failure_tails_read_from_a_chunks_text_as_from_its_lines() -> None:
    rng = random.Random(5)
    by_text, by_lines = NodeLog(tail=4), NodeLog(tail=4)
    for _ in range(3000):
        lines = random_lines(rng)
        if rng.random() < 0.05:  # torchrun's report of a failed rank
            lines += ("  rank      : 2 (local_rank: 1)", "  exitcode  : 1 (pid: 7)")
        if rng.random() < 0.2:  # first and last line of one rank, the others any
            lines = ("[rank1]:a", *lines, "[rank1]:z")
        by_text.feed(lines, "\n".join(lines) + "\n")
        by_lines.feed(iter(lines))  # not a sequence: read line by line
        assert by_text == by_lines, lines


def test_the_job_emits_each_chunk_with_its_lines_as_written(fake: FakeCluster) -> None:
    """The text a ``LogLines`` carries is its lines each ended by a newline, whatever the chunk
    held (a last line without newline, empty lines, ``\\r``, undecodable bytes)."""
    from tests.test_orchestrator import Running

    running = Running(fake, 1)
    node = fake.wait_started("train-20261123-120000-abcd", 0)
    rng = random.Random(9)
    written = ""
    for _ in range(50):
        piece = "\n".join(rng.choice(PIECES) for _ in range(rng.randint(1, 4))) + rng.choice(["\n", "\n\n", "\r\n"])
        node.write(piece.encode("utf-8", "surrogateescape"))  # an undecodable byte as the host wrote it
        written += piece
    node.write("last line, no newline")
    node.exit(0)
    assert running.finish() is not None
    events = [e for e in running.seen.events if isinstance(e, LogLines) and e.node == 0]
    assert all(e.text == "\n".join(e.lines) + "\n" for e in events)
    assert [line for e in events for line in e.lines] == list(split_lines(written + "last line, no newline"))


def test_a_stdout_in_utf16_has_one_byte_order_mark(tmp_path) -> None:
    """Chunks written into a UTF-16 stream (PYTHONIOENCODING=utf-16) make one UTF-16 text: the
    stream's byte-order mark once, not one per chunk."""
    path = tmp_path / "out"
    with open(path, "w", encoding="utf-16") as out:
        printer = Printer(out=out, err=io.StringIO(), colour=False)
        printer.set_plan(plan(1, 2))  # type: ignore[arg-type]
        expected = ""
        for chunk in (["first", "second"], ["thïrd"]):
            expected += "".join(slow_line(printer, 1, "host1", line) for line in chunk)
            printer(LogLines(1, host="host1", lines=tuple(chunk), text="\n".join(chunk) + "\n"))
    assert path.read_bytes().decode("utf-16") == expected


@pytest.fixture
def fake() -> FakeCluster:
    return FakeCluster()


def test_a_chunk_reaches_a_file_whole_through_writes_cut_anywhere(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a real file the prefix and the chunk go in one ``writev``, resumed where a write
    stopped (a pipe's reader that takes a few bytes at a time)."""
    import os

    real = os.writev
    rng = random.Random(2)
    calls = [0]

    def short(fd: int, buffers: list[memoryview]) -> int:  # at most a few bytes each time
        calls[0] += 1
        if calls[0] > 200_000:  # far more than the bytes written: the same bytes again and again
            raise RuntimeError("the writes never end")
        return real(fd, [bytes(b"".join(buffers)[:rng.randint(1, 9)])])

    monkeypatch.setattr(os, "writev", short)
    path = tmp_path / "out"
    expected = ""
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as out:
        printer = Printer(out=out, err=io.StringIO(), colour=False)
        printer.set_plan(plan(1, 2))  # type: ignore[arg-type]
        for _ in range(300):
            lines = random_lines(rng)
            expected += "".join(slow_line(printer, 1, "host1", line) for line in lines)
            printer(LogLines(1, host="host1", lines=lines, text="\n".join(lines) + "\n"))
    assert path.read_bytes() == expected.encode("utf-8", "surrogateescape")
