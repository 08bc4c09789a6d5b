"""The grouping of ranks' stacks (pure) and the agent's reading of py-spy's JSON and of a refused ptrace."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from clusterrun.agent import stackops
from clusterrun.agent.wire import Frame, RankStack, StackAnswer, ThreadStack
from clusterrun.core.errors import AgentError, ConnectError
from clusterrun.diagnose.stacks import fold_ranks, group, parse_ranks, render, view_json
from clusterrun.tui import Dashboard
from clusterrun.tui.screens import Stacks
from tests.test_joblist import documented_schema, violations
from tests.test_tui_snapshots import Scripted, started

BARRIER = [Frame("barrier", "torch/distributed/distributed_c10d.py", 5356, lib=True),
           Frame("wrapper", "torch/distributed/c10d_logger.py", 83, lib=True), Frame("wait_for_peers", "train.py", 42)]
LOADER = [Frame("__next__", "dataset.py", 88), Frame("main", "train.py", 30)]


def rank(r: int, frames: list[Frame], **extra: object) -> RankStack:
    return RankStack(rank=r, pid=1000 + r, threads=[ThreadStack(name="MainThread", frames=frames)], **extra)  # type: ignore[arg-type]


def node(*ranks: RankStack, state: str = "running", **extra: object) -> StackAnswer:
    return StackAnswer(ok=True, state=state, ranks=list(ranks), **extra)  # type: ignore[arg-type]


HOSTS = {0: "gpu01", 1: "gpu02", 2: "gpu03", 3: "gpu04"}


@pytest.mark.parametrize(("ranks", "text"), [
    ([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15], "0-6,8-15"),
    ([7], "7"), ([3, 1, 2, 1], "1-3"), ([0, 2, 4], "0,2,4"), ([], ""),
])
def test_fold_ranks(ranks: list[int], text: str) -> None:
    assert fold_ranks(ranks) == text


def test_parse_ranks_reads_lists_and_ranges_and_names_a_bad_part() -> None:
    assert parse_ranks("0,4-7") == [0, 4, 5, 6, 7]
    assert parse_ranks("3") == [3]
    for bad in ("x", "4-2", "-1", "1,,2"):
        with pytest.raises(ValueError, match="is not a rank or a range"):
            parse_ranks(bad)


def test_identical_stacks_are_one_group_with_their_ranks_across_nodes() -> None:
    answers = {n: node(*(rank(4 * n + i, LOADER if 4 * n + i == 7 else BARRIER) for i in range(4))) for n in range(4)}
    view = group(answers, HOSTS)
    assert [g.ranks for g in view.groups] == [(0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15), (7,)]
    assert view.groups[0].nodes == (0, 1, 2, 3) and view.groups[1].nodes == (1,)
    assert view.summary() == ("ranks 0-6,8-15: barrier in wait_for_peers at train.py:42 · "
                              "rank 7: __next__ at dataset.py:88")
    assert view.ok and not view.unreachable
    lines = render(view)
    assert lines[0] == view.summary()
    assert "rank 7 (node 1 gpu02):" in lines
    assert "    __next__ (dataset.py:88)" in lines and "    wait_for_peers (train.py:42)" in lines


def test_a_stopped_rank_is_a_group_of_its_own_that_says_so_even_where_the_others_are() -> None:
    view = group({0: node(rank(0, BARRIER), rank(1, BARRIER, state="T")), 1: node(rank(2, BARRIER))}, HOSTS)
    assert [(g.ranks, g.stopped) for g in view.groups] == [((0, 2), False), ((1,), True)]
    assert view.summary() == ("ranks 0,2: barrier in wait_for_peers at train.py:42 · "
                              "rank 1: barrier in wait_for_peers at train.py:42 (stopped)")
    lines = render(view)
    at = lines.index("rank 1 (node 0 gpu01):")
    assert lines[at + 1] == ("  stopped (a SIGSTOP, Ctrl-Z or a debugger holds it): the ranks that wait for it wait "
                             "until `kill -CONT 1001` on gpu01")
    assert view.ok


def test_the_same_threads_in_another_order_are_the_same_stack() -> None:
    main, loader = ThreadStack(name="MainThread", frames=BARRIER), ThreadStack(name="pin_memory", frames=LOADER)
    view = group({0: node(RankStack(rank=0, pid=1, threads=[main, loader]),
                          RankStack(rank=1, pid=2, threads=[loader, main]))}, HOSTS)
    assert [g.ranks for g in view.groups] == [(0, 1)]
    assert view.groups[0].headline == "barrier in wait_for_peers at train.py:42"  # the main thread's


def test_a_different_line_is_a_different_stack() -> None:
    other = [*BARRIER[:2], Frame("wait_for_peers", "train.py", 43)]
    view = group({0: node(rank(0, BARRIER), rank(1, other))}, HOSTS)
    assert [g.ranks for g in view.groups] == [(0,), (1,)]


def test_what_could_not_be_looked_at_is_grouped_with_its_fix_and_is_not_ok() -> None:
    refused = {"error": "ptrace of pid 5 refused by the kernel: kernel.yama.ptrace_scope is 1", "fix": "sudo sysctl"}
    answers: dict[int, StackAnswer | ConnectError] = {
        0: node(rank(0, BARRIER), rank(1, [], **refused)),
        1: node(rank(2, [], **refused), rank(3, BARRIER)),
        2: node(error="py-spy is not installed on this host", fix="/opt/venv/bin/python -m pip install py-spy"),
        3: node(state="exited"),
        4: node(state="starting"),
    }
    view = group(answers, {**HOSTS, 4: "gpu05"})
    assert [g.ranks for g in view.groups] == [(0, 3)]
    assert [(p.ranks, p.nodes) for p in view.problems] == [((), (2,)), ((), (4,)), ((1, 2), (0, 1))]
    assert not view.ok and not view.unreachable
    text = "\n".join(render(view))
    assert "ranks 1-2 (nodes 0-1): ptrace of pid 5 refused by the kernel" in text
    assert ("node 2 gpu03: py-spy is not installed on this host\n"
            "  fix: /opt/venv/bin/python -m pip install py-spy") in text
    assert "node 3 gpu04: not running (exited)" in text
    assert "node 4 gpu05: no rank of it runs now: torchrun is starting (or restarting) its workers" in text


def test_the_json_is_the_documented_schema_and_holds_the_groups() -> None:
    answers: dict[int, StackAnswer | ConnectError] = {
        0: node(rank(0, BARRIER), rank(1, LOADER)), 1: node(error="py-spy is not installed", fix="pip"),
        2: node(state="exited"), 3: ConnectError("gpu04", "connection refused")}
    data = json.loads(json.dumps(view_json(group(answers, HOSTS), "bert-1", 2)))
    assert violations(data, documented_schema("stack")) == []
    assert [(g["ranks"], g["where"]) for g in data["groups"]] == [([0], "barrier in wait_for_peers at train.py:42"),
                                                                  ([1], "__next__ at dataset.py:88")]
    assert data["groups"][0]["threads"][0]["frames"][0] == {
        "name": "barrier", "file": "torch/distributed/distributed_c10d.py", "line": 5356, "lib": True}
    assert [(p["nodes"], p["fix"]) for p in data["problems"]] == [([1], "pip"), ([3], None)]
    assert data["idle"] == [{"node": 2, "state": "exited"}]
    assert violations(dict(data, extra=1), documented_schema("stack"))


def test_an_unreachable_host_is_named() -> None:
    view = group({0: node(rank(0, BARRIER)), 1: ConnectError("gpu02", "connection refused")}, HOSTS)
    assert view.unreachable and not view.ok
    assert any("connection refused" in line for line in render(view))
    failed = group({0: node(rank(0, BARRIER)), 1: AgentError("gpu02", "bad request: ranks must be ...")}, HOSTS)
    assert not failed.unreachable and not failed.ok  # the host answered: exit 1, not 3


def test_the_wire_answer_round_trips_with_nested_stacks() -> None:
    answer = node(rank(0, BARRIER), rank(1, [], error="its process has ended"), tool="/usr/bin/py-spy")
    assert StackAnswer.from_json(json.loads(json.dumps(answer.to_json()))) == answer
    with pytest.raises(ValueError, match=r"ranks\[0\].threads\[0\].frames\[0\]: line must be"):
        bad = answer.to_json()
        bad["ranks"][0]["threads"][0]["frames"][0]["line"] = "42"
        StackAnswer.from_json(bad)


def test_py_spy_json_is_read_innermost_first() -> None:
    dumped = [{"pid": 1, "thread_id": 2, "thread_name": "MainThread", "os_thread_id": 1, "active": False,
               "owns_gil": False, "frames": [
                   {"name": "sleep", "filename": "/usr/lib/python3.11/asyncio/tasks.py", "module": None,
                    "short_filename": "asyncio/tasks.py", "line": 649, "locals": None, "is_entry": False},
                   {"name": "inner", "filename": "/w/train.py", "module": None, "short_filename": "train.py",
                    "line": 2, "locals": None, "is_entry": False},
                   {"name": "<module>", "filename": "/w/train.py", "module": None, "short_filename": "train.py",
                    "line": 3, "locals": None, "is_entry": True}]}]
    assert stackops.parse_dump(dumped) == [ThreadStack(name="MainThread", active=False, frames=[
        Frame("sleep", "asyncio/tasks.py", 649, lib=True), Frame("inner", "train.py", 2),
        Frame("<module>", "train.py", 3)])]


def test_a_refused_ptrace_names_the_cause_and_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = {"Uid": "0\t0\t0\t0", "CapEff": "0000000000000000", "CapBnd": "000001ffffffffff"}
    monkeypatch.setattr(stackops, "_status_field", lambda pid, key: fields[key])
    monkeypatch.setattr(stackops.os, "getuid", lambda: 0)
    scope = {"value": "1\n"}

    def fake_open(path: str, *args: object, **kwargs: object) -> object:
        import io

        if path == "/proc/sys/kernel/yama/ptrace_scope":
            if scope["value"] is None:
                raise FileNotFoundError(path)
            return io.StringIO(scope["value"])
        raise AssertionError(path)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(stackops.os.path, "exists", lambda path: False)
    error, fix = stackops.ptrace_refused(5, "/opt/venv/bin/py-spy")
    assert "kernel.yama.ptrace_scope is 1" in error and "ptrace_scope=0" in fix
    assert "sudo setcap cap_sys_ptrace+ep /opt/venv/bin/py-spy" in fix
    scope["value"] = "3\n"
    error, fix = stackops.ptrace_refused(5)
    assert "ptrace_scope is 3" in error and "reboot" in fix
    scope["value"] = None
    fields["CapBnd"] = "000001fffff7ffff"  # bit 19, CAP_SYS_PTRACE, dropped: a container without SYS_PTRACE
    error, fix = stackops.ptrace_refused(5)
    assert "lacks CAP_SYS_PTRACE" in error and "--cap-add SYS_PTRACE" in fix
    fields["CapBnd"] = "000001ffffffffff"
    error, fix = stackops.ptrace_refused(5)
    assert "not dumpable" in error


class WithStacks(Scripted):
    """The dashboard's session stand-in, whose ``stacks()`` counts its calls."""

    def __init__(self, running: bool) -> None:
        super().__init__(started(), running=running)
        self.taken = 0

    def stacks(self) -> list[str]:
        self.taken += 1
        view = group({0: node(rank(0, BARRIER), rank(1, BARRIER)), 1: node(rank(2, LOADER), rank(3, BARRIER))}, HOSTS)
        return [f"take {self.taken}", *render(view)]


@pytest.mark.usefixtures("young_heap")
def test_the_dashboard_s_key_shows_the_grouped_stacks_and_r_takes_them_again() -> None:
    session = WithStacks(running=True)
    app = Dashboard(session, ring=100)  # type: ignore[arg-type]
    seen: list[str] = []

    async def shown(pilot: Any, text: str) -> str:
        for _ in range(100):
            await pilot.pause(0.02)
            if isinstance(app.screen, Stacks) and text in (now := str(app.screen.query_one("#stacks-text").render())):
                return now
        raise AssertionError(f"{text!r} not shown")

    async def script(pilot: Any) -> None:
        await pilot.press("s")
        seen.append(await shown(pilot, "take 1"))
        await pilot.press("r")
        seen.append(await shown(pilot, "take 2"))
        await pilot.press("escape")
        await pilot.pause()
        seen.append(type(app.screen).__name__)

    async def main() -> None:
        async with app.run_test(size=(140, 40)) as pilot:
            await script(pilot)

    asyncio.run(main())
    assert "ranks 0-1,3: barrier in wait_for_peers at train.py:42 · rank 2: __next__ at dataset.py:88" in seen[0]
    assert "take 2" in seen[1] and seen[2] != "Stacks" and session.taken == 2


def test_the_s_key_is_off_once_the_job_has_ended() -> None:
    app = Dashboard(WithStacks(running=False), ring=100)  # type: ignore[arg-type]
    assert app.check_action("stack", ()) is False
