"""One contract for every transport: the fake, local processes, and SSH to simulated machines.

The same requests get answers of the same shape and meaning whichever way the agent is reached
(``clusterrun.agent``'s protocol), so a policy tested against the fake transport (tests/test_orchestrator.py,
tests/test_runner.py) is tested against what real hosts say. The fake runs no processes: where a
real job prints and exits, the harness makes the fake node do the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import AgentError
from clusterrun.core.protocol import decode_network, stop_report
from clusterrun.transports import Transport, transport_for
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.printer import stop_text
from tests.conftest import unique_job, wait_for
from tests.simhosts import SimCluster

# Prints `line I` for I < COUNT, waits for RELEASE to exist, exits with CODE; ignores SIGTERM with a 4th argument.
SCRIPT = ("import os,signal,sys,time\ncount,release,code=int(sys.argv[1]),sys.argv[2],int(sys.argv[3])\n"
          "if sys.argv[4:]:\n signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "for i in range(count):\n print('line %d' % i, flush=True)\n"
          "while not os.path.exists(release):\n time.sleep(0.02)\nsys.exit(code)\n")


def expected(count: int) -> str:
    return "".join(f"line {i}\n" for i in range(count))


@dataclass
class Harness:
    """One transport, and a way to run a small job on its host."""

    transport: Transport
    state_dir: str
    folder: Path
    fake: FakeCluster | None = None
    # Its own per test: the agent names machine-wide cgroups after the job (tests run at once under xdist).
    job: str = field(default_factory=lambda: unique_job("contract"))

    def request(self, op: str, node: int, **extra: Any) -> dict[str, Any]:
        return {"op": op, "job": self.job, "node": node, "attempt": 1, "state_dir": self.state_dir, **extra}

    def argv(self, node: int, count: int, code: int = 0, ignore_term: bool = False) -> list[str]:
        return [sys.executable, "-c", SCRIPT, str(count), str(self.folder / f"release-{node}"), str(code),
                *(["ignore-term"] if ignore_term else [])]

    def start(self, node: int, count: int, code: int = 0, ignore_term: bool = False, **extra: Any) -> dict[str, Any]:
        argv = self.argv(node, count, code, ignore_term)
        answer = self.transport.call(self.request("start", node, **{"argv": argv, "env": {}, "cwd": None,
                                                                    "first_rank": 0, **extra}))
        if self.fake is not None:
            self.fake.node(self.job, node).write(expected(count))
            self.fake.node(self.job, node).outlives_grace = ignore_term
        return answer

    def release(self, node: int, code: int = 0) -> None:
        if self.fake is not None:
            self.fake.node(self.job, node).exit(code)
        else:
            (self.folder / f"release-{node}").touch()

    def wait_ended(self, node: int) -> None:
        wait_for(lambda: self.transport.call(self.request("status", node))["state"]["state"] == "exited",
                 timeout=30, what=f"node {node}'s job to end")

    def wait_gone(self, node: int) -> None:
        """Until nothing of the node's job runs (its supervisor may outlive torchrun's exit briefly)."""
        wait_for(lambda: not any(self.transport.call(self.request("status", node))["alive"].values()),
                 timeout=30, what=f"node {node}'s supervisor and torchrun to end")

    def wait_printed(self, node: int, count: int) -> None:
        wait_for(lambda: log_of(self.follow(node, offset=0, once=True)) == expected(count), timeout=30,
                 what=f"node {node}'s job to print {count} lines")

    def follow(self, node: int, **where: Any) -> list[dict[str, Any]]:
        return list(self.transport.stream(self.request("follow", node, **where)))


def _local(tmp_path: Path) -> Harness:
    spec = load_cluster_text("hosts:\n  - host: here\n    transport: local\n", "hosts.yaml").hosts[0]
    return Harness(transport_for(spec), str(tmp_path / "state"), tmp_path)


@pytest.fixture(params=["fake", pytest.param("local", marks=pytest.mark.integration),
                        pytest.param("ssh", marks=pytest.mark.integration)])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    if request.param == "fake":
        fake = FakeCluster()
        spec = load_cluster_text("hosts:\n  - host: h0\n", "hosts.yaml").hosts[0]
        yield Harness(fake.transport(spec), str(tmp_path / "state"), tmp_path, fake)
        return
    if request.param == "local":
        made = _local(tmp_path)
    else:
        make: Callable[..., SimCluster] = request.getfixturevalue("sim_cluster")
        cluster = make(1)
        text = (f"ssh_config: {cluster.ssh_config}\ndefaults:\n  python: {sys.executable}\n"
                f"hosts:\n  - host: {cluster.hosts[0].name}\n")
        made = Harness(transport_for(load_cluster_text(text, "hosts.yaml").hosts[0],
                                     ssh_config=str(cluster.ssh_config)), str(tmp_path / "state"), tmp_path)
    made.transport.connect()
    try:
        yield made
    finally:
        for node in range(4):  # nothing of a test's jobs may outlive it
            try:
                made.transport.call(made.request("stop", node, grace=1))
            except AgentError:
                pass
        made.transport.close()


def log_of(messages: list[dict[str, Any]]) -> str:
    return b"".join(m["data"] for m in messages if m.get("t") == "log").decode("utf-8", "surrogateescape")


def test_probe_describes_the_host(harness: Harness) -> None:
    answer = harness.transport.call({"op": "probe", "free_port": True, "state_dir": harness.state_dir})
    assert answer["ok"] is True
    assert answer["python"].count(".") == 2 and answer["torch"]
    assert isinstance(answer["boot_id"], str) and answer["boot_id"]
    assert isinstance(answer["port"], int) and 1024 < answer["port"] < 65536
    assert isinstance(answer["torchrun_flags"], list) and isinstance(answer["hostname"], str)


def test_route_says_how_the_host_reaches_an_address(harness: Harness) -> None:
    answer = harness.transport.call({"op": "route", "route_to": {"addr": "127.0.0.1", "port": 29500, "peers": []}})
    assert answer["ok"] is True
    network = decode_network("h0", answer["network"])
    assert network.netns and network.master.target == "127.0.0.1" and network.master.resolved == "127.0.0.1"
    assert network.master.error is None and network.master.source and network.master.interface
    assert set(network.preset) <= {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}


def test_the_probe_answers_the_route_inspect_and_listen_it_carries_and_the_start_closes_the_listener(
        harness: Harness) -> None:
    """``up``'s preflight in the probe's exchange: each part answered as if asked alone; node 0's
    listener answers its token until the start, which closes it before its command runs."""
    route_to = {"addr": "127.0.0.1", "port": 29500, "peers": []}
    session = harness.transport.session()
    try:
        answer = session.call({"op": "probe", "state_dir": harness.state_dir, "route_to": route_to,
                               "inspect": {"op": "inspect", "paths": ["."], "state_dir": harness.state_dir},
                               "listen": {"op": "listen", "port": None, "token": "t0k"}})
        alone = harness.transport.call({"op": "route", "route_to": route_to})
        assert decode_network("h0", answer["network"]).master == decode_network("h0", alone["network"]).master
        assert answer["inspect"]["ok"] is True and answer["inspect"]["disk"]["free"] > 0
        assert answer["listen"]["ok"] is True and answer["listen"]["listening"] is True
        port = answer["listen"]["port"]
        reach = {"op": "reach", "addr": "127.0.0.1", "port": port, "token": "t0k", "timeout": 5}
        assert harness.transport.call(reach)["reached"] is True
        started = session.call(harness.request("start", 0, argv=harness.argv(0, 1), env={}, cwd=None, first_rank=0,
                                               unlisten=port))
        assert started["ok"] is True
        assert harness.transport.call(reach)["reached"] is False  # closed before the start answered
    finally:
        session.close()
    harness.release(0)


def test_follow_streams_every_line_then_the_end_with_the_exit_code(harness: Harness) -> None:
    started = harness.start(0, 50, code=3)
    assert started["ok"] is True and started["state"]["state"] in ("running", "exited")
    harness.release(0, code=3)
    messages = harness.follow(0, offset=0)
    assert log_of(messages) == expected(50)
    assert messages[-1]["t"] == "end" and messages[-1]["state"]["exit_code"] == 3
    logs = [m for m in messages if m["t"] == "log"]
    assert all(a["next"] == b["offset"] for a, b in zip(logs, logs[1:], strict=False))  # contiguous
    assert {m["t"] for m in messages} <= {"log", "state", "beat", "end"}


def test_resuming_from_any_next_offset_gives_exactly_the_rest(harness: Harness) -> None:
    harness.start(0, 200)
    harness.release(0)
    text = expected(200)
    whole = harness.follow(0, offset=0)
    for message in [m for m in whole if m["t"] == "log"]:
        rest = harness.follow(0, offset=message["next"])
        assert log_of(rest) == text[message["next"]:]
    middle = text.index("line 100\n")
    assert log_of(harness.follow(0, offset=middle)) == text[middle:]


def test_tail_starts_at_the_last_complete_lines(harness: Harness) -> None:
    harness.start(0, 30)
    harness.release(0)
    harness.wait_ended(0)  # a tail is taken of what is written when the follow begins
    assert log_of(harness.follow(0, tail=5)) == "".join(f"line {i}\n" for i in range(25, 30))
    assert log_of(harness.follow(0, tail=0)) == ""


def test_before_starts_at_the_last_complete_lines_ahead_of_the_offset(harness: Harness) -> None:
    harness.start(0, 30)
    harness.release(0)
    harness.wait_ended(0)
    text = expected(30)
    resume = text.index("line 20\n")
    messages = harness.follow(0, offset=resume, before=3)
    assert next(m for m in messages if m["t"] == "log")["offset"] == text.index("line 17\n")
    assert log_of(messages) == text[text.index("line 17\n"):]
    assert log_of(harness.follow(0, offset=text.index("line 2\n"), before=5)) == text  # fewer lines than asked for
    assert log_of(harness.follow(0, offset=resume, before=0)) == text[resume:]


def test_once_ends_with_eof_while_the_job_runs(harness: Harness) -> None:
    harness.start(0, 10)
    harness.wait_printed(0, 10)
    messages = harness.follow(0, offset=0, once=True)
    assert messages[-1]["t"] == "eof" and messages[-1]["next"] == len(expected(10))
    assert messages[-1]["state"]["state"] == "running"
    harness.release(0)


def test_logs_false_sends_states_only(harness: Harness) -> None:
    harness.start(0, 20)
    harness.release(0)
    messages = harness.follow(0, logs=False)
    assert not [m for m in messages if m["t"] == "log"] and messages[-1]["t"] == "end"


def test_stop_is_verified_and_idempotent(harness: Harness) -> None:
    harness.start(0, 5)
    harness.wait_printed(0, 5)
    first = harness.transport.call(harness.request("stop", 0, grace=2))
    assert first["ok"] is True and first["left"] == []
    assert first["killed"] and all(isinstance(p["pid"], int) and p["name"] for p in first["killed"])
    assert first["state"]["state"] == "exited" and first["state"]["stop_requested"] is True
    torchrun = next(k for k in first["killed"] if k["pid"] == first["state"]["torchrun"]["pid"])
    assert torchrun["signal"] == "SIGTERM" and first["grace"] == 2  # it ended within the grace
    assert not stop_report("h", 0, first).grace_ran_out
    again = harness.transport.call(harness.request("stop", 0, grace=2))
    assert again["ok"] is True and again["killed"] == [] and again["left"] == []
    ended = harness.follow(0, offset=0)
    assert ended[-1]["t"] == "end"
    log = log_of(ended)  # the stop's mark after the job's lines, once
    assert re.fullmatch(re.escape(expected(5)) + r"---- stopped by clusterrun at \d\d:\d\d:\d\dZ ----\n", log), log
    status = harness.transport.call(harness.request("status", 0))
    assert status["state"]["state"] == "exited" and status["log_size"] == len(log.encode())


def test_a_stop_says_when_torchrun_outlived_the_grace(harness: Harness) -> None:
    """A torchrun still running when the grace after SIGTERM is over is SIGKILLed, and the answer
    says so (its ``killed`` entry); the stop report (one place for every stop path) tells."""
    harness.start(0, 2, ignore_term=True)
    harness.wait_printed(0, 2)
    answer = harness.transport.call(harness.request("stop", 0, grace=1))
    assert answer["ok"] is True and answer["left"] == [] and answer["grace"] == 1
    torchrun = next(k for k in answer["killed"] if k["pid"] == answer["state"]["torchrun"]["pid"])
    assert torchrun["signal"] == "SIGKILL"
    report = stop_report("h0", 0, answer)
    assert report.grace_ran_out and report.grace == 1
    assert "; torchrun outlived the 1 s grace after SIGTERM: SIGKILLed; " in stop_text(report)


def test_a_node_never_started_is_absent_not_an_error(harness: Harness) -> None:
    for op in ("status", "stop"):
        answer = harness.transport.call(harness.request(op, 3, grace=1))
        assert answer["ok"] is True and answer["state"] == {"state": "absent"}


def test_errors_are_answers(harness: Harness) -> None:
    with pytest.raises(AgentError, match="unknown op"):
        harness.transport.call({"op": "bogus"})
    with pytest.raises(AgentError, match="^bad request: ValueError: stop request: node must be int, not str$"):
        harness.transport.call(dict(harness.request("stop", 0), node="0"))  # wire's types, on both sides
    stream = harness.transport.stream(harness.request("follow", 2, offset=0))
    first = next(iter(stream))  # the agent then waits for another request: the caller closes
    stream.close()
    assert first == {"ok": False, "error": first["error"]} and "no job" in first["error"]
    harness.start(1, 1)
    with pytest.raises(AgentError, match="already|exists"):
        harness.start(1, 1)
    harness.release(1)


def test_answers_are_json_round_trips(harness: Harness) -> None:
    """Nothing but JSON types cross the wire, and a log's bytes: what the fake answers could be sent by the agent."""
    harness.start(0, 3)
    harness.release(0)
    for message in harness.follow(0, offset=0):
        head = {k: v for k, v in message.items() if not (k == "data" and message["t"] == "log")}
        assert json.loads(json.dumps(head)) == head
        assert message["t"] != "log" or isinstance(message["data"], bytes)


# Bytes a log may hold that JSON text would have to escape: invalid UTF-8, NUL, a carriage return
# (a progress bar), a terminal escape, a lone surrogate's encoding; then a line longer than one
# read of the agent (1 MiB) and of the transports (a few hundred KiB), and a last line without newline.
ODD = b"\xff\xfe bad\n\x00nul\x00\n50%\r100%\n\x1b[31mred\x1b[0m\n\xed\xa0\x80\n" + b"y" * (1 << 21) + b"\nend"


def test_a_log_arrives_byte_for_byte_whatever_it_holds(harness: Harness) -> None:
    argv = [sys.executable, "-c", "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())",
            str(harness.folder / "odd.log")]
    (harness.folder / "odd.log").write_bytes(ODD)
    harness.transport.call(harness.request("start", 0, argv=argv, env={}, cwd=None, first_rank=0))
    if harness.fake is not None:
        harness.fake.node(harness.job, 0).write(ODD)
        harness.fake.node(harness.job, 0).exit(0)
    harness.wait_ended(0)
    messages = harness.follow(0, offset=0)
    assert b"".join(m["data"] for m in messages if m["t"] == "log") == ODD and messages[-1]["t"] == "end"
    logs = [m for m in messages if m["t"] == "log"]
    assert all(m["next"] - m["offset"] == len(m["data"]) for m in logs)  # each message's bytes are its range
    cut = ODD.index(b"red")  # resumed in the middle: the rest, from there
    assert b"".join(m["data"] for m in harness.follow(0, offset=cut) if m["t"] == "log") == ODD[cut:]


def test_setup_answers_ok_or_fails_with_its_output(harness: Harness) -> None:
    """``setup`` (the host's ``setup:`` commands, before any start): ``ok``, or an error with their
    status and last lines (the fake is told what its broken setup says)."""
    answer = harness.transport.call(harness.request("setup", 0, setup=["export A=1"], env={"B": "2"}, cwd=None))
    assert answer == {"ok": True}
    if harness.fake is not None:
        harness.fake.host(harness.transport.name).setup_error = (
            "setup failed with status 3; nothing was started; its last lines:\n  | broken")
    with pytest.raises(AgentError, match=r"setup failed with status 3; nothing was started; its last lines:\n  \| "
                                         r"broken"):
        harness.transport.call(harness.request("setup", 0, setup=["echo broken >&2; exit 3"], env={}, cwd=None))


def test_setup_says_how_the_jobs_interpreter_runs_in_its_environment(harness: Harness) -> None:
    """``setup`` with ``python``: the job's interpreter as it runs after setup (found on the PATH it
    leaves): its Python and torch, for the checks; one it cannot find is an ``error``, not a failure."""
    python = os.path.basename(sys.executable)
    answer = harness.transport.call(harness.request("setup", 0, setup=[f"export PATH={os.path.dirname(sys.executable)}:"
                                                                       "$PATH"], env={}, cwd=None, python=python))
    seen = answer["python"]
    assert answer["ok"] is True and seen["python"].startswith("3.") and seen["torch"] and not seen.get("error")
    if harness.fake is not None:
        harness.fake.host(harness.transport.name).after_setup = {"error": "nope is not found on the PATH setup leaves"}
    answer = harness.transport.call(harness.request("setup", 0, setup=["true"], env={}, cwd=None, python="nope"))
    assert answer["ok"] is True and "nope is not found on the PATH setup leaves" in answer["python"]["error"]

def test_the_doctors_inspect_listen_and_reach(harness: Harness) -> None:
    """``clusterrun doctor``'s requests (doctor.py): paths relative to the workdir, the clock, a
    listener on node 0 that a connection reaches with its token until ``unlisten``."""
    from clusterrun.core.protocol import decode_inspection, decode_listening, decode_reach

    (harness.folder / "train.py").write_text("")
    if harness.fake is not None:
        harness.fake.host(harness.transport.name).missing.add("nothere.py")
    before = time.time()
    answer = decode_inspection("h", harness.transport.call(
        {"op": "inspect", "cwd": str(harness.folder), "paths": [".", "train.py", "nothere.py"],
         "state_dir": harness.state_dir, "deep": False, "gpus": False}))
    assert answer.paths == {".": "dir", "train.py": "file", "nothere.py": "missing"}
    assert answer.disk_free is not None and answer.disk_free > 0
    assert before - 5 < answer.time < time.time() + 5 and answer.logind == ""
    session = harness.transport.session()  # the listener lives as long as its agent
    try:
        listening = decode_listening("h", session.call({"op": "listen", "port": None, "token": "t0k"}))
        assert listening.listening and 1024 < listening.port < 65536
        again = decode_listening("h", harness.transport.call({"op": "listen", "port": listening.port, "token": "x"}))
        assert not again.listening and again.error == "Address already in use"
        reach = {"op": "reach", "addr": "127.0.0.1", "port": listening.port, "token": "t0k", "timeout": 5}
        assert decode_reach("h", harness.transport.call(reach)).reached
        other = decode_reach("h", harness.transport.call(dict(reach, token="another")))  # not our listener
        assert not other.reached and other.error is not None and "something else answers" in other.error
        session.call({"op": "unlisten", "port": listening.port})
        gone = decode_reach("h", harness.transport.call(reach))
        assert not gone.reached and gone.error == "Connection refused"
    finally:
        session.close()


def test_jobs_lists_every_node_attempt_with_what_start_was_given(harness: Harness) -> None:
    """``jobs`` (discover.py, for ``--hosts``): each node attempt under the state dir, its state as
    ``status`` says, when it started, and its start request as ``spec.json`` keeps it (secrets masked)."""
    empty = harness.transport.call({"op": "jobs", "state_dir": harness.state_dir})
    assert empty == {"ok": True, "root": f"{harness.state_dir}/jobs", "jobs": []}
    about = {"name": "contract", "script": "s.py", "script_args": ["a b"], "nnodes": 2, "master_port": 29501}
    before = time.time()
    harness.start(0, 2, about=about, env={"TOKEN": "s3cret", "OTHER": "o"}, secret_env=["TOKEN"],
                  cwd=str(harness.folder), first_rank=0)
    harness.start(1, 1, code=4, about=about, env={}, first_rank=2)
    harness.release(1, code=4)
    harness.wait_ended(1)
    answer = harness.transport.call({"op": "jobs", "state_dir": harness.state_dir})
    assert answer["ok"] is True and answer["root"] == f"{harness.state_dir}/jobs"
    assert [(e["job"], e["node"], e["attempt"]) for e in answer["jobs"]] == [(harness.job, 0, 1), (harness.job, 1, 1)]
    first, second = answer["jobs"]
    assert first["state"]["state"] == "running" and first["state"]["torchrun"]["pid"] > 0
    assert second["state"]["state"] == "exited" and second["state"]["exit_code"] == 4
    assert first["argv"] == harness.argv(0, 2) and second["argv"] == harness.argv(1, 1, 4)
    assert first["env"] == {"TOKEN": "****", "OTHER": "o"} and second["env"] == {}
    assert (first["cwd"], second["cwd"]) == (str(harness.folder), None)
    assert (first["first_rank"], second["first_rank"]) == (0, 2)
    assert first["about"] == about == second["about"] and first["state_dir"] == harness.state_dir
    assert before - 5 < first["started"] <= second["started"] < time.time() + 5
    assert json.loads(json.dumps(answer)) == answer
    other = harness.transport.call({"op": "jobs", "state_dir": f"{harness.state_dir}-other"})
    assert other["jobs"] == []  # another state dir holds other jobs
    harness.release(0)


def test_remove_deletes_a_nodes_state_and_logs_once_nothing_of_it_runs(harness: Harness) -> None:
    """``remove`` (``rm --hosts-too``): refused while the node's job runs; then every attempt of
    that node is gone (``status`` absent, ``jobs`` does not list it), other nodes stay; idempotent."""
    harness.start(0, 5)
    harness.start(1, 3)
    harness.wait_printed(0, 5)
    with pytest.raises(AgentError, match=rf"/jobs/{harness.job}/node0/attempt1 still runs; stop the job first "
                                         r"\(`clusterrun down`\)"):
        harness.transport.call(harness.request("remove", 0))
    assert harness.transport.call(harness.request("status", 0))["state"]["state"] == "running"
    harness.release(0)
    harness.wait_ended(0)
    harness.wait_gone(0)
    removed = harness.transport.call(harness.request("remove", 0))
    assert removed["ok"] is True and removed["removed"] == f"{harness.state_dir}/jobs/{harness.job}/node0"
    assert removed["bytes"] >= len(expected(5))
    assert harness.transport.call(harness.request("status", 0))["state"] == {"state": "absent"}
    listed = harness.transport.call({"op": "jobs", "state_dir": harness.state_dir})["jobs"]
    assert [(e["node"], e["state"]["state"]) for e in listed] == [(1, "running")]
    assert harness.transport.call(harness.request("remove", 0)) == {"ok": True, "removed": None, "bytes": 0}
    with pytest.raises(AgentError, match="invalid job id"):
        harness.transport.call(dict(harness.request("remove", 0), job="../etc"))
    harness.release(1)
    harness.wait_ended(1)
    harness.wait_gone(1)
    removed = harness.transport.call(harness.request("remove", 1))
    assert removed["removed"] == f"{harness.state_dir}/jobs/{harness.job}/node1"
    assert harness.transport.call({"op": "jobs", "state_dir": harness.state_dir})["jobs"] == []


def test_pipe_runs_a_command_on_the_socket_until_it_ends(harness: Harness) -> None:
    """``pipe`` (a sync's rsync, ``exec``): the socket is the command's stdin and stdout; its exit
    status and the end of its stderr come back. The fake runs only the agent."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        if harness.fake is not None:
            with pytest.raises(NotImplementedError):
                harness.transport.pipe("true", theirs)
            return
        ours.sendall(b"hello\n")
        ours.shutdown(socket.SHUT_WR)
        status, stderr = harness.transport.pipe("cat; echo done; echo oops >&2; exit 3", theirs)
        assert (status, stderr.strip()) == (3, "oops")
        assert b"".join(iter(lambda: ours.recv(65536), b"")) == b"hello\ndone\n"


def test_gpus_reads_the_first_nvidia_smi_on_path_or_says_there_is_none(harness: Harness,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from clusterrun.views.gpus import cell, decode
    from tests.test_gpus import NVIDIA, REAL

    monkeypatch.setenv("PATH", f"{NVIDIA / 'good'}:{os.environ['PATH']}")  # a local agent inherits it
    if harness.fake is not None:
        harness.fake.host("h0").gpu_query = REAL
    reading = decode(0, "h0", harness.transport.call({"op": "gpus", "timeout": 5}))
    if harness.transport.files == "ssh":  # a simulated host's own PATH: no nvidia-smi on these machines
        assert reading.missing or shutil.which("nvidia-smi") is not None
    else:
        assert cell(reading) == "2× 86% 59/160G" and not reading.problem
