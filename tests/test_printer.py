"""The prefixed stream: chunks prefixed as a whole must read exactly as if prefixed line by line."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace

import pytest

from clusterrun.core.events import LogLines, NodeStopped, StopReport
from clusterrun.core.protocol import stop_report
from clusterrun.diagnose.rootcause import split_rank
from clusterrun.views.board import Board
from clusterrun.views.printer import Printer, stop_remarks, stop_text


def plan(*nprocs: int) -> SimpleNamespace:
    nodes, first = [], 0
    for rank, nproc in enumerate(nprocs):
        nodes.append(SimpleNamespace(rank=rank, host=SimpleNamespace(host=f"host{rank}"),
                                     ranks=range(first, first + nproc)))
        first += nproc
    return SimpleNamespace(nodes=nodes, world_size=first)


def line_by_line(printer: Printer, node: int, host: str, lines: tuple[str, ...]) -> str:
    out = []
    for line in lines:
        rank, text = split_rank(line)
        out.append(f"{printer._prefix(node, host, rank)} | {text}\n")
    return "".join(out)


PIECES = ["[rank2]:", "[rank3]:", "[rank9]:", "[rank2]:[rank2]: Traceback", "[rank", "plain text", "",
          "text with [rank3]: inside", "node1 host1       | ", "  indented", "üñí", "\x1b[31mred\x1b[0m"]


@pytest.mark.parametrize("colour", [False, True])
def test_chunks_prefixed_at_once_read_as_line_by_line(colour: bool) -> None:
    rng = random.Random(7)
    printer = Printer(out=io.StringIO(), err=io.StringIO(), colour=colour)
    printer.set_plan(plan(2, 2))  # type: ignore[arg-type]  # the attributes the printer reads
    for _ in range(2000):
        size = rng.randint(1, 6)
        lines = tuple("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 2))) for _ in range(size))
        if rng.random() < 0.3:  # one rank's lines only, as with one process per node
            tag = rng.choice(["[rank2]:", "[rank3]:", "[rank9]:"])
            lines = tuple(tag + line for line in lines)
        head, text, skip = printer._prefix_parts(1, "host1", "\n".join(lines) + "\n")
        assert head + text[skip:] == line_by_line(printer, 1, "host1", lines), lines


def test_lines_of_ranks_and_of_torchrun_get_their_prefixes_or_none() -> None:
    out = io.StringIO()
    printer = Printer(out=out, err=io.StringIO(), colour=False)
    printer.set_plan(plan(1, 2))  # type: ignore[arg-type]
    printer(LogLines(1, host="host1", lines=("[rank1]:a", "[rank2]:b", "torchrun says", "[rank1]:c")))
    printer(LogLines(0, host="host0", lines=()))
    assert out.getvalue() == ("node1 host1 rank1 | a\nnode1 host1 rank2 | b\nnode1 host1       | torchrun says\n"
                              "node1 host1 rank1 | c\n")
    raw = io.StringIO()
    Printer(out=raw, err=io.StringIO(), colour=False, prefix=False)(LogLines(0, host="h", lines=("x", "[rank0]:y")))
    assert raw.getvalue() == "x\n[rank0]:y\n"


def test_colours_pass_and_other_controls_are_shown_escaped() -> None:
    from clusterrun.core.terminal import safe

    line = "\x1b[1;31mred\x1b[0m \x1b]52;c;aGk=\x07 \x1b[2J\x1b[10;1H \x1b]0;title\x1b\\ \r\b\x7f \x9b2J \udc9b \t ü"
    escaped = ("\\x1b]52;c;aGk=\\x07 \\x1b[2J\\x1b[10;1H \\x1b]0;title\\x1b\\ \\r\\x08\\x7f \\x9b2J \\x9b \t ü")
    assert safe(line) == "\x1b[1;31mred\x1b[0m " + escaped
    assert safe(line, colour=False) == "red " + escaped
    assert safe("plain [rank0]: text\n") == "plain [rank0]: text\n"


@pytest.mark.parametrize("colour", [False, True])
def test_the_stream_neutralises_escape_sequences(colour: bool) -> None:
    out, err = io.StringIO(), io.StringIO()
    printer = Printer(out=out, err=err, colour=colour)
    printer.set_plan(plan(1))  # type: ignore[arg-type]
    printer(LogLines(0, host="host0", lines=("[rank0]:\x1b[32mok\x1b[0m \x1b]0;x\x07", "\x1b[2Jcleared")))
    printer.note("node0: \x1b]52;c;aGk=\x07")
    head = "\x1b[36mnode0 host0 rank0\x1b[0m" if colour else "node0 host0 rank0"
    bare = "\x1b[36mnode0 host0      \x1b[0m" if colour else "node0 host0      "
    ok = "\x1b[32mok\x1b[0m" if colour else "ok"
    assert out.getvalue() == f"{head} | {ok} \\x1b]0;x\\x07\n{bare} | \\x1b[2Jcleared\n"
    assert err.getvalue() == "clusterrun: node0: \\x1b]52;c;aGk=\\x07\n"


def test_raw_output_is_the_nodes_bytes_with_no_newline_added() -> None:
    out = io.StringIO()
    printer = Printer(out=out, err=io.StringIO(), raw=True)
    printer.write_log(0, "h", "a \x1b]0;t\x07\n")
    printer.write_log(0, "h", "no newline \x1b[2J")
    assert out.getvalue() == "a \x1b]0;t\x07\nno newline \x1b[2J"


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}, {}])
def test_no_color_and_a_dumb_terminal_turn_colour_off(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    printer = Printer(out=out, err=io.StringIO())
    printer.set_plan(plan(1))  # type: ignore[arg-type]
    printer(LogLines(0, host="host0", lines=("\x1b[31mred\x1b[0m",)))
    assert out.getvalue() == ("\x1b[36mnode0 host0      \x1b[0m | \x1b[31mred\x1b[0m\n" if not env
                              else "node0 host0       | red\n")


SWEPT = ("swept 2 processes besides torchrun; processes that left the job's tree, session and environment could "
         "not be seen")


@pytest.mark.parametrize(("answer", "line"), [
    ({"killed": [{"pid": 5, "name": "pt_elastic"}], "left": [], "containment": "cgroup", "verified": True,
      "state": {"torchrun": {"pid": 5}}},
     "node1 h: stopped torchrun (pid 5); nothing left (verified by cgroup)"),
    ({"killed": [], "left": [], "containment": "sweep", "verified": False, "detail": SWEPT},
     "node1 h: nothing was running; nothing left"),
    ({"killed": [], "left": [{"pid": 7, "name": "python", "state": "D"}], "containment": "cgroup", "verified": False},
     "node1 h: nothing was running; STILL RUNNING: python[7] state D"),
    ({"killed": [], "left": []},  # an agent of before this report: it claims nothing
     "node1 h: nothing was running; no process of the job was found"),
])
def test_a_stop_report_says_which_guarantee_held(answer: dict, line: str) -> None:
    from clusterrun.views.board import describe_stop

    report = stop_report("h", 1, {"ok": True, **answer})
    assert stop_text(report) == line
    assert report.complete is (answer.get("verified") is True and not answer["left"])
    err = io.StringIO()
    Printer(err=err).report(report)
    assert err.getvalue().splitlines()[0] == f"clusterrun: {line}"
    assert "nothing of the job is left" not in describe_stop(report) or report.complete


def test_the_failed_nodes_stop_adds_no_line_to_its_failed_line_unless_something_is_left() -> None:
    """The node whose rank failed first says "failed (...; torchrun was stopped at once after it)":
    its stop's own line would say it again; a stop that left something, or could not be done, is said."""
    import dataclasses

    killed = {"ok": True, "killed": [{"pid": 5}], "containment": "cgroup", "verified": True, "at_once": True,
              "state": {"torchrun": {"pid": 5}}}
    for answer, said in [(dict(killed, left=[]), False),
                         (dict(killed, left=[{"pid": 7, "name": "python", "state": "D"}]), True)]:
        err = io.StringIO()
        Printer(err=err).report(dataclasses.replace(stop_report("h", 1, answer), failed=True))
        assert bool(err.getvalue()) is said, err.getvalue()
    err = io.StringIO()
    Printer(err=err).report(dataclasses.replace(stop_report("h", 1, dict(killed, left=[])), failed=False))
    assert err.getvalue() == "clusterrun: node1 h: stopped torchrun (pid 5) at once (SIGKILL, the attempt had " \
        "failed); nothing left (verified by cgroup)\n"


def test_a_stop_report_names_what_the_host_could_not_do() -> None:
    report = stop_report("h", 0, {
        "ok": True, "killed": [], "left": [], "containment": "sweep", "verified": False, "detail": SWEPT,
        "fallbacks": ["no cgroup: no cgroup2 file system is mounted", "no pidfd (Python 3.8): ..."],
        "degraded": "cannot write state.json: No space left on device",
        "notes": ["could not record the end of the job in state.json: No space left on device"]})
    assert stop_remarks(report) == ["node0 h: degraded: cannot write state.json: No space left on device",
                                "node0 h: could not record the end of the job in state.json: No space left on device"]
    assert stop_text(report) == "node0 h: nothing was running; nothing left"


def test_a_stop_is_one_short_line_per_host_and_the_sweeps_caveat_is_said_once() -> None:
    """Without a cgroup, "nothing left" means nothing the sweep could see: said once per command,
    after the first such host's line, not on every line nor again in the job's line."""
    from clusterrun.life.down import Downed

    def swept(node: int, pid: int) -> StopReport:
        return stop_report(f"crn-h{node}", node, {
            "ok": True, "killed": [{"pid": pid, "name": "pt_elastic", "signal": "SIGTERM"}], "left": [],
            "containment": "sweep", "verified": False, "detail": SWEPT, "state": {"torchrun": {"pid": pid}},
            "fallbacks": ["no cgroup: no cgroup2 file system is mounted"]})

    reports = [swept(0, 58), swept(1, 61)]
    err = io.StringIO()
    Printer(err=err).reports(reports, 2)
    assert err.getvalue().splitlines() == [
        "clusterrun: node0 crn-h0: stopped torchrun (pid 58); nothing left",
        "clusterrun: no cgroup on crn-h0 (no cgroup2 file system is mounted): \"nothing left\" there is of what could "
        "be seen; processes that left the job's tree, session and environment could not be seen",
        "clusterrun: node1 crn-h1: stopped torchrun (pid 61); nothing left"]
    summary = Downed("j-1", 2, dict(enumerate(reports))).summary()
    assert summary == "job j-1 stopped; nothing it could see is left (no cgroup on crn-h0, crn-h1)"
    board = Board()
    for report in reports:
        board.apply(NodeStopped(report.node, report=report))
    assert sum("could not be seen" in note for note in board.notes) == 1, board.notes


def test_a_stop_that_could_not_reach_a_host_is_not_called_a_stop() -> None:
    """Ctrl-C while a host cannot be reached: the summary says what `down` says, never "stopped"."""
    from clusterrun.core.events import JobResult, NodeResult, NodeState

    unreachable = NodeResult(1, "h1", NodeState.UNREACHABLE, error="unreachable, may still run: h1: gone")
    result = JobResult("j-1", (NodeResult(0, "h0", NodeState.STOPPED), unreachable), interrupted="SIGINT")
    err = io.StringIO()
    Printer(err=err).summary(result)
    assert err.getvalue().splitlines()[-1] == ("clusterrun: job j-1 is NOT marked stopped: node 1 (h1) could not be "
                                               "stopped (see above); it may still run there")
    assert "job j-1 stopped" not in err.getvalue()
