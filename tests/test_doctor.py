"""The doctor's verdicts (pure functions and the fake cluster) and ``up``'s preflight on it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import clusterrun.cli.tools as cli_tools
import clusterrun.cli.up as cli_up
from clusterrun import cli
from clusterrun.agent import doctorops
from clusterrun.agent.wire import ReachRequest
from clusterrun.checks import doctor
from clusterrun.checks.doctor import Check, Verdict
from clusterrun.config.hostsfile import ClusterSpec, load_cluster_text
from clusterrun.core.errors import ConnectError, HostsUnavailable
from clusterrun.core.protocol import DeepTorch, Inspection
from clusterrun.life import gate
from clusterrun.run.orchestrator import Job
from clusterrun.transports.fake import FakeCluster
from clusterrun.transports.fakehosts import FakeHost
from tests.conftest import ROOT


def spec_of(n: int = 2, extra: str = "", host_extra: str = "") -> ClusterSpec:
    hosts = "\n".join(f"  - host: h{i}\n    workdir: /proj{host_extra}" for i in range(n))
    return load_cluster_text(f"{extra}hosts:\n{hosts}\n", "hosts.yaml")


def rows(report: doctor.Report, host: str) -> dict[str, Check]:
    (found,) = [h for h in report.hosts if h.host == host]
    return {c.name: c for c in found.checks}


def verdicts(report: doctor.Report, host: str) -> dict[str, str]:
    return {name: c.verdict.value for name, c in rows(report, host).items()}


@pytest.fixture
def fake() -> FakeCluster:
    return FakeCluster()


# ---------------------------------------------------------------------------- on the fake cluster


def test_a_healthy_cluster_is_all_ticks(fake: FakeCluster) -> None:
    report = doctor.run_doctor(spec_of(3), "train.py", fake.transport)
    assert not report.failed
    for host in ("h0", "h1", "h2"):
        assert set(verdicts(report, host).values()) == {"✓"}, report.render()
        assert {"connection", "python", "torch", "interface", "workdir", "script", "state disk", "clock", "logind",
                "master port", "same versions"} <= set(verdicts(report, host))
    assert fake.listeners == {}  # node 0's listener was closed again
    assert "no problem found on 3 host(s)" in report.render()


def test_the_interface_each_node_would_use_and_a_master_that_resolves_to_loopback(fake: FakeCluster) -> None:
    report = doctor.run_doctor(spec_of(2), None, fake.transport)
    assert rows(report, "h1")["interface"].detail.startswith("eth0 192.0.2.1 (routes to the master h0; "
                                                            "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME set)")
    fake.host("h1").network = {  # Debian's /etc/hosts on h1 names h0 as 127.0.1.1
        "netns": "fake:h1", "peer": None, "preset": {},
        "master": {"target": "h0", "resolved": "127.0.1.1", "source": "127.0.0.1", "interface": "lo",
                   "loopback": True, "error": None, "hosts_line": "/etc/hosts:2: 127.0.1.1 h0"}}
    report = doctor.run_doctor(spec_of(2), None, fake.transport)
    row = rows(report, "h1")["interface"]
    assert row.verdict.value == "✗" and report.failed
    assert "the master h0 resolves to 127.0.1.1 on this host, its own loopback" in row.detail
    assert row.fix is not None and "/etc/hosts:2: 127.0.1.1 h0 maps h0 to 127.0.1.1" in row.fix
    assert verdicts(report, "h0")["interface"] == "✓"


def test_doctor_and_up_see_the_interface_variables_set_in_env_file_forward_env_and_defaults(
        fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interface row of ``clusterrun doctor`` says what ``up --dry-run`` says, node by node,
    whether the user set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in ``defaults.env``, an
    ``env_file`` or through ``forward_env`` (both commands, on the fake cluster)."""
    (tmp_path / "net.env").write_text("NCCL_SOCKET_IFNAME=ib0\n")
    hosts = tmp_path / "hosts.yaml"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setattr(cli_tools, "transport_for", fake.transport)  # doctor
    monkeypatch.setattr(cli_up, "transport_for", fake.transport)  # up --dry-run

    def both(defaults: str) -> tuple[list[str], list[str]]:
        hosts.write_text(f"defaults:\n  workdir: /proj\n{defaults}hosts:\n  - host: h0\n  - host: h1\n")
        checked = CliRunner().invoke(cli.main, ["doctor", str(hosts)])
        planned = CliRunner().invoke(cli.main, ["up", "--dry-run", str(hosts), "train.py"])
        assert checked.exit_code == 0 and planned.exit_code == 0, checked.output + planned.output
        doctor_rows = re.findall(r"✓ interface +(.*)$", checked.output, re.M)
        return doctor_rows, re.findall(r"^  network: (.*)$", planned.output, re.M)

    for defaults in ("  env_file: net.env\n  forward_env: [GLOO_*]\n",
                     "  env:\n    NCCL_SOCKET_IFNAME: ib0\n    GLOO_SOCKET_IFNAME: eth9\n"):
        doctor_rows, up_rows = both(defaults)
        assert doctor_rows == up_rows and len(up_rows) == 2, (doctor_rows, up_rows)
        assert up_rows[1] == ("eth0 192.0.2.1 (routes to the master h0; GLOO_SOCKET_IFNAME=eth9 yours; "
                              "NCCL_SOCKET_IFNAME=ib0 yours)")


def test_doctor_replaces_a_derived_master_that_another_machine_reaches_through_loopback_as_up_does(
        fake: FakeCluster) -> None:
    """Node 0 on this machine (master 127.0.0.1, derived) and a remote node: ``up`` uses node 0's
    address towards it (``interfaces.settle_master``), and so do the doctor's interface rows and
    its TCP test of the master port."""

    from tests.test_interfaces import routes_of_two_machines

    fake.host("here").network = routes_of_two_machines("10.0.0.1", "A", node0=True)
    fake.host("b").network = routes_of_two_machines("10.0.0.2", "B")
    spec = load_cluster_text("hosts:\n  - host: here\n    transport: local\n  - host: b\n", "hosts.yaml")
    report = doctor.run_doctor(spec, None, fake.transport)
    assert not report.failed, report.render()
    job = Job(spec, "train.py", job_id="t-20261123-120000-abcd", name="t", emit=None, transport_factory=fake.transport)
    try:
        plan = job.prepare()
    finally:
        job.close()
    assert [rows(report, h)["interface"].detail for h in ("here", "b")] == [i.describe() for i in job.interfaces]
    assert rows(report, "b")["interface"].detail.startswith("eth1 10.0.0.2 (routes to the master 10.0.0.1; ")
    assert plan.master_addr == "10.0.0.1" and [r["addr"] for r in fake.ops("reach")] == ["10.0.0.1", "10.0.0.1"]


def test_a_missing_script_on_one_host_is_a_problem_there_only(fake: FakeCluster) -> None:
    fake.host("h1").missing.add("train.py")
    report = doctor.run_doctor(spec_of(3), "train.py", fake.transport)
    assert report.failed
    assert [h.host for h in report.hosts if h.failed] == ["h1"]
    script = rows(report, "h1")["script"]
    assert script.verdict is Verdict.FAIL and "relative to the host's workdir" in script.detail
    assert script.fix is not None and "/proj" in script.fix and "h1" in script.fix
    assert f"fix: {script.fix}" in report.render()


def test_a_mistyped_script_is_given_the_close_name_of_this_directory(fake: FakeCluster, tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("")
    for host in ("h0", "h1"):
        fake.host(host).missing.add("mian.py")
    report = doctor.run_doctor(spec_of(2), "mian.py", fake.transport, local_cwd=str(tmp_path))
    assert [rows(report, h)["script"].fix.startswith("did you mean main.py? else copy mian.py to ")  # type: ignore[union-attr]
            for h in ("h0", "h1")] == [True, True]
    (tmp_path / "mian.py").write_text("")  # here, not there: nothing to suggest
    report = doctor.run_doctor(spec_of(2), "mian.py", fake.transport, local_cwd=str(tmp_path))
    assert not rows(report, "h0")["script"].fix.startswith("did you mean")  # type: ignore[union-attr]


def test_a_missing_workdir_is_a_problem_and_the_script_is_not_looked_for(fake: FakeCluster) -> None:
    fake.host("h0").missing.add(".")
    report = doctor.run_doctor(spec_of(2), "train.py", fake.transport)
    assert verdicts(report, "h0")["workdir"] == "✗"
    assert "script" not in verdicts(report, "h0")


def test_a_workdir_the_sync_makes_is_no_problem_as_up_would_make_it(fake: FakeCluster) -> None:
    fake.host("h0").missing.add(".")  # not there yet: up's sync makes it before the checks (issue 25)
    report = doctor.run_doctor(spec_of(2, host_extra="\n    sync: ."), "train.py", fake.transport)
    assert not report.failed, report.render()
    assert "the sync makes or updates it" in rows(report, "h0")["workdir"].detail


def test_an_odd_torch_is_a_warning_that_names_the_odd_host(fake: FakeCluster) -> None:
    fake.host("h2").torch = "2.12.0"
    report = doctor.run_doctor(spec_of(3), None, fake.transport)
    assert not report.failed  # a warning, not a refusal
    odd = rows(report, "h2")["same versions"]
    assert odd.verdict is Verdict.WARN
    assert odd.detail == "torch 2.12.0 here, 2.13.0 on h0, h1"
    assert verdicts(report, "h0")["same versions"] == verdicts(report, "h1")["same versions"] == "✓"


def test_nccl_and_cuda_come_from_the_import_and_are_compared(fake: FakeCluster) -> None:
    for name in ("h0", "h1"):
        fake.host(name).torch_cuda, fake.host(name).nccl = "12.4", "2.21.5"
    fake.host("h1").nccl = "2.20.3"
    report = doctor.run_doctor(spec_of(2), None, fake.transport)
    assert rows(report, "h0")["torch"].detail == "2.13.0, CUDA 12.4, NCCL 2.21.5"
    # two hosts, two values: node 0's is the reference
    assert rows(report, "h1")["same versions"].detail == "NCCL 2.20.3 here, 2.21.5 on h0"


def test_a_torch_that_does_not_import_is_a_problem(fake: FakeCluster) -> None:
    fake.host("h1").torch_error = "ImportError: libcudart.so.12: cannot open shared object file"
    report = doctor.run_doctor(spec_of(2), None, fake.transport)
    assert verdicts(report, "h1")["torch"] == "✗"
    assert "libcudart" in rows(report, "h1")["torch"].detail


def test_an_unreachable_host_is_one_row_and_the_others_are_checked(fake: FakeCluster) -> None:
    fake.host("h1").reachable = False
    report = doctor.run_doctor(spec_of(2), None, fake.transport)
    assert list(verdicts(report, "h1").items()) == [("connection", "✗")]
    assert rows(report, "h1")["connection"].detail.startswith("unreachable: ")
    assert verdicts(report, "h0")["master port"] == "✓"


def test_a_master_port_firewalled_on_node0_fails_on_the_other_nodes_with_the_fix(fake: FakeCluster) -> None:
    fake.host("h0").firewalled = True
    report = doctor.run_doctor(spec_of(3), None, fake.transport)
    assert verdicts(report, "h0")["master port"] == "✓"  # it reaches itself
    for host in ("h1", "h2"):
        check = rows(report, host)["master port"]
        assert check.verdict is Verdict.FAIL and "not reached by TCP: timed out" in check.detail
        assert check.fix is not None and "allow TCP to port 29500 on h0" in check.fix


def test_a_test_of_the_master_port_that_gets_no_answer_is_a_problem_there_not_a_crash(
        fake: FakeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the agent's ``reach`` not answer at all, the transport's read timeout ends the call
    (over SSH a ``ConnectError``: timed out): a ✗ on that host, with the fix; the others are checked."""
    real = fake._reach

    def reach(host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        if host.name == "h1":
            raise ConnectError("h1", "timed out", hint="is the host up and reachable on its SSH port?")
        return real(host, request)

    monkeypatch.setattr(fake, "_reach", reach)
    report = doctor.run_doctor(spec_of(3), None, fake.transport)
    check = rows(report, "h1")["master port"]
    assert check.verdict is Verdict.FAIL and check.detail == (
        "h0:29500 on h0 not reached by TCP: the test got no answer from this host (timed out)")
    assert check.fix is not None and check.fix.startswith("allow TCP to port 29500 on h0 from h1")
    assert verdicts(report, "h2")["master port"] == "✓" and verdicts(report, "h0")["master port"] == "✓"
    assert fake.listeners == {}  # node 0's listener was closed all the same


@pytest.mark.parametrize("op", ["inspect", "route"])
def test_a_connection_lost_during_the_checks_is_a_problem_of_that_host_not_a_crash(
        fake: FakeCluster, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """A host whose connection dies between the probe and a later check (the transport raises a
    ``ConnectError``): a ✗ row on that host, no traceback; the other hosts are checked."""
    real = getattr(fake, f"_{op}")

    def lost(host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        if host.name == "h1":
            raise ConnectError("h1", "SSH error: the connection closed")
        return real(host, request)

    monkeypatch.setattr(fake, f"_{op}", lost)
    report = doctor.run_doctor(spec_of(3), None, fake.transport)
    row = "agent" if op == "inspect" else "interface"
    check = rows(report, "h1")[row]
    assert check.verdict is Verdict.FAIL and check.detail == "SSH error: the connection closed"
    assert verdicts(report, "h2")["master port"] == "✓"


def test_the_agents_tcp_test_is_bounded_when_packets_are_dropped_or_nothing_answers() -> None:
    """``reach`` in this process, against listeners on loopback: one whose accept queue is full
    (the kernel drops the SYN, as a firewall's DROP does) and one that accepts but never answers."""
    with socket.socket() as full, socket.socket() as mute:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the one connection its queue holds
            answer = doctorops.op_reach(ReachRequest(addr="127.0.0.1", port=port, token="t0k", timeout=0.2))
        assert answer == {"ok": True, "reached": False, "local": None, "error": (
            "timed out after 0.2 s: no answer at all (packets dropped on the way, as a firewall's DROP does)")}
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        answer = doctorops.op_reach(ReachRequest(addr="127.0.0.1", port=mute.getsockname()[1], token="t0k",
                                                 timeout=0.2))
        assert not answer["reached"] and answer["local"] == "127.0.0.1"
        assert answer["error"] == "connected, but no answer within 0.2 s (not clusterrun's listener on node 0)"


def test_a_fixed_master_port_in_use_on_node0_fails_there(fake: FakeCluster) -> None:
    fake.host("h0").ports_taken.add(29400)
    report = doctor.run_doctor(spec_of(2, "master:\n  port: 29400\n"), None, fake.transport)
    check = rows(report, "h0")["master port"]
    assert check.verdict is Verdict.FAIL and check.detail == "29400 cannot be opened on h0: Address already in use"
    assert check.fix == "choose another master.port, or `port: auto`"
    assert "master port" not in verdicts(report, "h1")


def test_skew_disk_logind_and_gpus_on_the_fake(fake: FakeCluster) -> None:
    fake.host("h0").torch_cuda, fake.host("h0").torch_devices = "12.4", 2  # nvidia-smi alone is missing
    h1 = fake.host("h1")
    h1.clock_offset, h1.disk_free = 30.0, 512 << 10
    h1.logind = "logind kills every process of this login session at logout. Fix: `loginctl enable-linger u`"
    h1.gpu_list = "GPU 0: NVIDIA A100 (UUID: GPU-aaa)\n"
    report = doctor.run_doctor(spec_of(2, host_extra="\n    gpus: [0, 1]"), None, fake.transport)
    v = verdicts(report, "h1")
    assert (v["clock"], v["state disk"], v["logind"], v["gpus"]) == ("!", "✗", "✗", "✗")
    assert rows(report, "h1")["logind"].fix == "`loginctl enable-linger u`"
    assert rows(report, "h1")["gpus"].detail == "GPU 1 asked for; nvidia-smi sees 0"
    assert verdicts(report, "h0")["gpus"] == "!"  # no nvidia-smi: cannot check


def test_a_module_the_script_imports_missing_on_one_host_is_found_before_the_run(fake: FakeCluster) -> None:
    fake.host("h1").modules_missing = {"wandb"}
    report = doctor.run_doctor(spec_of(2), "train.py", fake.transport)
    assert (verdicts(report, "h0")["imports"], verdicts(report, "h1")["imports"]) == ("✓", "✗")
    row = rows(report, "h1")["imports"]
    assert row.detail == "train.py imports wandb, not found by python3"
    assert row.fix == "install wandb on h1 for python3, or add the directory that holds it to PYTHONPATH in env:"
    assert "imports" not in verdicts(doctor.run_doctor(spec_of(2), None, fake.transport), "h1")  # no script
    fake.host("h1").missing.add("train.py")
    assert "imports" not in verdicts(doctor.run_doctor(spec_of(2), "train.py", fake.transport), "h1")


def test_the_hosts_python_finds_the_top_level_imports_without_running_the_script(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "extra.py").write_text("")
    (tmp_path / "helper.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("import os, json.decoder\nimport helper\nfrom extra import x\nfrom . import y\n"
                      "import no_such_module_here\ntry:\n    import optional_module_xyz\nexcept ImportError:\n"
                      "    pass\ndef f():\n    import inner_module_xyz\nraise SystemExit('never run')\n")
    done = subprocess.run([sys.executable, "-c", doctorops.FIND_IMPORTS, str(script), str(tmp_path / "lib")],
                          capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == {"missing": ["no_such_module_here"]}
    bad = tmp_path / "bad.py"
    bad.write_text("def (:\n")
    done = subprocess.run([sys.executable, "-c", doctorops.FIND_IMPORTS, str(bad), ""], capture_output=True, text=True,
                          timeout=60)
    assert json.loads(done.stdout)["error"].startswith("SyntaxError")


# ------------------------------------------------------------------------------- up's preflight


def prepared(fake: FakeCluster, spec: ClusterSpec) -> Job:
    job = Job(spec, "train.py", job_id="j-1", name="j", emit=None, transport_factory=fake.transport)
    job.prepare()
    return job


def run_preflight(job: Job, spec: ClusterSpec, full: bool = True) -> doctor.Report:
    assert job.plan is not None
    return doctor.Preflight(spec, "train.py", None, full).run([job.probed(r) for r in range(job.plan.nnodes)],
                                                              addr=job.plan.master_addr, port=job.plan.master_port)


def test_preflight_refuses_a_missing_script_on_any_host_before_anything_starts(fake: FakeCluster) -> None:
    spec = spec_of(3)
    fake.host("h2").missing.add("train.py")
    job = prepared(fake, spec)
    try:
        refused = doctor.refusal(run_preflight(job, spec))
    finally:
        job.close()
    assert refused is not None
    assert refused.render().splitlines() == [
        "1 host(s) cannot run the job (preflight); nothing was started",
        "h2: script: train.py is missing in /proj (SCRIPT is relative to the host's workdir)",
        "  hint: copy train.py to /proj on h2 (`sync: .` in the hosts file copies the project before each start), "
        "or fix workdir: for this host"]
    assert fake.ops("start") == []
    # the preflight asked the agents that probed (one session per host, no new connection)
    assert {h: fake.host(h).connects for h in ("h0", "h1", "h2")} == {"h0": 2, "h1": 2, "h2": 2}


def test_preflight_refuses_gpus_declared_that_torch_does_not_see(fake: FakeCluster) -> None:
    spec = spec_of(2, host_extra="\n    gpus: [0, 1]")
    for name in ("h0", "h1"):
        fake.host(name).gpu_list = "GPU 0: NVIDIA A100 (UUID: GPU-aaa)\nGPU 1: NVIDIA A100 (UUID: GPU-bbb)\n"
        fake.host(name).torch_cuda, fake.host(name).torch_devices = "12.4", 2
    fake.host("h1").torch_devices = 1  # minGPT: "Unable to locate 2 gpus", and the job succeeded
    job = prepared(fake, spec)
    try:
        refused = doctor.refusal(run_preflight(job, spec))
    finally:
        job.close()
    assert refused is not None and fake.ops("start") == []
    assert "h1: gpus: torch sees 1 CUDA device(s), the hosts file asks for 2" in refused.render(), refused.render()
    assert "h0:" not in refused.render()


def test_gpus_asked_of_a_host_without_nvidia_smi_and_a_cpu_torch_are_a_problem(fake: FakeCluster) -> None:
    """`gpus: 2` where torch says CUDA none and nvidia-smi is missing: the job would run on the CPU, so
    doctor says ✗ with the fix and up's preflight refuses; with a CUDA build it stays a warning."""
    spec = spec_of(2, host_extra="\n    gpus: 2")
    fake.host("h1").torch_cuda, fake.host("h1").torch_devices = "12.4", 2
    report = doctor.run_doctor(spec, None, fake.transport)
    gpus = rows(report, "h0")["gpus"]
    assert (gpus.verdict, verdicts(report, "h1")["gpus"]) == (Verdict.FAIL, "!")
    assert gpus.detail == ("GPU 0, 1 asked for; no nvidia-smi on PATH and torch is built without CUDA: the job "
                           "would run on the CPU")
    assert gpus.fix == ("install the NVIDIA driver and a CUDA build of torch on h0, or use nproc: instead of gpus: on "
                        "a host without GPUs")
    job = prepared(fake, spec)
    try:
        refused = doctor.refusal(run_preflight(job, spec))
    finally:
        job.close()
    assert refused is not None and "h0: gpus: GPU 0, 1 asked for" in refused.render() and fake.ops("start") == []


def test_no_preflight_skips_the_port_test_and_versions_but_not_the_script(fake: FakeCluster) -> None:
    spec = spec_of(2)
    fake.host("h0").firewalled = True
    fake.host("h1").torch = "2.12.0"
    job = prepared(fake, spec)
    try:
        cheap = run_preflight(job, spec, full=False)
        assert fake.ops("listen") == [] and fake.ops("reach") == []
        full = run_preflight(job, spec, full=True)
    finally:
        job.close()
    assert doctor.refusal(cheap) is None
    assert "master port" not in verdicts(cheap, "h1") and "same versions" not in verdicts(cheap, "h1")
    assert {"workdir", "script"} <= set(verdicts(cheap, "h1"))
    assert verdicts(full, "h1")["master port"] == "✗"
    assert doctor.warnings(full) == ["h1: same versions: torch 2.12.0 here, 2.13.0 on h0 (fix: install the same "
                                     "versions on every host (mismatches hang or crash collectives))"]


def test_up_asks_each_host_the_probe_the_reach_and_the_start_and_checks_as_when_each_was_asked_alone(
        fake: FakeCluster) -> None:
    """``up``'s requests to "torchrun started": the probe carries the route, ``inspect`` and (node 0)
    the master port's listener; then ``reach``; node 0's start closes the listener. The checks
    find what they find when every request goes alone."""
    fake.host("h1").clock_offset = 30.0
    job = Job(spec_of(2), "train.py", job_id="j-1", name="j", emit=None, transport_factory=fake.transport)
    try:
        plan, _, warned = gate.check_new(job, job.spec, "train.py", "/here", full=True, dry_run=False)
        job.start()
    finally:
        job.close()
    assert len(warned) == 1 and warned[0].startswith("h1: clock: +30.0")  # the inspect the probe carried
    assert {h: [r["op"] for g, r in fake.requests if g == h] for h in ("h0", "h1")} == {
        "h0": ["probe", "reach", "start"], "h1": ["probe", "reach", "start"]}
    (probe0,) = fake.ops("probe", "h0")
    assert probe0["listen"]["port"] is None and probe0["inspect"]["paths"] == [".", "train.py"]
    assert fake.ops("start", "h0")[0]["unlisten"] == plan.master_port and fake.ops("start", "h1")[0]["unlisten"] is None
    assert fake.listeners == {}

    def refusal(fake: FakeCluster, ahead: bool) -> str:
        fake.host("h2").missing.add("train.py")
        fake.host("h1").firewalled = True
        fake.host("h0").clock_offset = 30.0
        spec = spec_of(3)
        job = Job(spec, "train.py", job_id="j-2", name="j", emit=None, transport_factory=fake.transport)
        try:
            if ahead:
                with pytest.raises(HostsUnavailable) as refused:
                    gate.check_new(job, spec, "train.py", "/here", full=True, dry_run=False)
                return refused.value.render()
            job.prepare()
            report = run_preflight(job, spec)
            return (doctor.refusal(report) or HostsUnavailable([])).render() + "\n" + "\n".join(doctor.warnings(report))
        finally:
            job.close()

    alone = FakeCluster()
    asked = refusal(alone, ahead=False)
    assert sorted({r["op"] for _, r in alone.requests}) == ["inspect", "listen", "probe", "reach", "unlisten"]
    assert "h2: script: train.py is missing" in asked and "h0: clock: " in asked
    assert refusal(FakeCluster(), ahead=True) == asked.split("\nh0: clock")[0]


def test_up_asks_alone_what_the_probe_cannot_carry(fake: FakeCluster) -> None:
    """``--no-preflight``: no listener, no ``reach``; a host with ``setup:``: its ``inspect`` after
    the setup, in the environment it made."""
    spec = load_cluster_text("hosts:\n  - host: h0\n    workdir: /proj\n  - host: h1\n    workdir: /proj\n"
                             "    setup:\n      - source env/bin/activate\n", "hosts.yaml")
    job = Job(spec, "train.py", job_id="j-1", name="j", emit=None, transport_factory=fake.transport)
    try:
        gate.check_new(job, spec, "train.py", "/here", full=False, dry_run=False)
        job.start()
    finally:
        job.close()
    assert {h: [r["op"] for g, r in fake.requests if g == h] for h in ("h0", "h1")} == {
        "h0": ["probe", "start"], "h1": ["probe", "setup", "inspect", "start"]}
    assert fake.ops("probe", "h0")[0]["listen"] is None and fake.ops("start", "h0")[0]["unlisten"] is None
    assert fake.ops("inspect", "h1")[0]["job"] == "j-1"  # in the environment of the attempt's setup


# ------------------------------------------------------------------------------ the pure checks


def inspection(**kw: object) -> Inspection:
    base: dict[str, object] = {"cwd": "/proj", "paths": {".": "dir"}, "time": 100.0, "disk_path": "/s",
                               "disk_free": 50 << 30}
    base.update(kw)
    return Inspection(**base)  # type: ignore[arg-type]


def test_version_checks_take_the_majority_and_name_every_odd_host() -> None:
    found = {0: ("a", {"torch": "2.12"}), 1: ("b", {"torch": "2.13"}), 2: ("c", {"torch": "2.13"}),
             3: ("d", {"torch": "2.11"})}
    checks = doctor.version_checks(found)
    assert checks[0].detail == "torch 2.12 here, 2.13 on b, c"
    assert checks[3].detail == "torch 2.11 here, 2.13 on b, c"
    assert checks[1].verdict is checks[2].verdict is Verdict.OK
    assert doctor.version_checks({0: ("a", {"torch": "2.12"})}) == {}


def test_clock_skew_counts_only_beyond_the_round_trip() -> None:
    assert doctor.clock_check(inspection(time=101.5), 99.0, 101.0).verdict is Verdict.OK  # within ±1 s + 1 s
    skewed = doctor.clock_check(inspection(time=103.5), 99.9, 100.1)
    assert skewed.verdict is Verdict.WARN and skewed.detail.startswith("+3.50 s")


def test_disk_thresholds() -> None:
    assert doctor.disk_check(inspection(disk_free=2 << 30)).verdict is Verdict.OK
    assert doctor.disk_check(inspection(disk_free=500 << 20)).verdict is Verdict.WARN
    assert doctor.disk_check(inspection(disk_free=512 << 10)).verdict is Verdict.FAIL
    assert doctor.disk_check(inspection(disk_free=4 << 20)).verdict is Verdict.WARN  # a small job still fits
    assert doctor.disk_check(inspection(disk_free=None, disk_error="Permission denied")).verdict is Verdict.FAIL
    read_only = doctor.disk_check(inspection(disk_path="/data", disk_free=2 << 30, disk_writable=False))
    assert read_only.verdict is Verdict.FAIL and read_only.detail.startswith("/data is not writable")


def test_gpus_by_index_or_uuid_and_busy_ones_warn() -> None:
    spec = load_cluster_text("hosts:\n  - host: g\n    gpus: [0, GPU-bbb]\n", "h.yaml")
    smi = "GPU 0: NVIDIA A100 (UUID: GPU-aaa)\nGPU 1: NVIDIA A100 (UUID: GPU-bbb)\n"
    host = spec.hosts[0]
    assert doctor.gpu_check(host, inspection(nvidia_smi="/x", gpu_list=smi)).verdict is Verdict.OK  # type: ignore[union-attr]
    busy = doctor.gpu_check(host, inspection(nvidia_smi="/x", gpu_list=smi,
                                             gpu_apps="GPU-bbb, 4242, /usr/bin/python3\n"))
    assert busy is not None and busy.verdict is Verdict.WARN and busy.detail == "busy: GPU GPU-bbb: pid 4242 python3"
    cpu_torch = doctor.gpu_check(host, inspection(nvidia_smi="/x", gpu_list=smi, deep=DeepTorch("2.13.0+cpu")))
    assert cpu_torch is not None and cpu_torch.verdict is Verdict.FAIL and "torch sees 0 CUDA" in cpu_torch.detail
    failed = doctor.gpu_check(host, inspection(nvidia_smi="/x", gpu_list=None))
    assert failed is not None and failed.verdict is Verdict.FAIL
    no_smi = {"cpu": inspection(), "cuda": inspection(torch_cuda="12.4"),
              "imported": inspection(deep=DeepTorch("2.13.0+cu124", cuda="12.4", devices=2)),
              "no devices": inspection(torch_cuda="12.4", deep=DeepTorch("2.13.0+cu124", cuda="12.4", devices=1))}
    assert {k: doctor.gpu_check(host, v).verdict.value for k, v in no_smi.items()} == {  # type: ignore[union-attr]
        "cpu": "✗", "cuda": "!", "imported": "!", "no devices": "✗"}
    assert doctor.gpu_check(load_cluster_text("hosts:\n  - c\n").hosts[0], inspection()) is None


def test_connection_errors_keep_the_transports_words_and_hint() -> None:
    from clusterrun.core.errors import AuthError, HostKeyError
    from clusterrun.transports.fake import FakeTransport

    transport = FakeTransport(load_cluster_text("hosts:\n  - gpu-b\n").hosts[0], FakeCluster())
    key = doctor.connection_check(transport, HostKeyError("gpu-b", "unknown host key for 10.0.0.12 (ssh-ed25519 "
                                                           "SHA256:Qm9v)", hint="`ssh-keyscan 10.0.0.12 >> ...`"))
    assert key == Check("connection", Verdict.FAIL, "host key: unknown host key for 10.0.0.12 (ssh-ed25519 "
                        "SHA256:Qm9v)", "`ssh-keyscan 10.0.0.12 >> ...`")
    auth = doctor.connection_check(transport, AuthError("gpu-b", "authentication failed"))
    assert auth.detail == "authentication: authentication failed" and auth.fix is not None and "ssh-add" in auth.fix


def test_doctor_on_a_bad_hosts_file_is_bad_input(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - host: a\n    gpus: four\n")
    proc = subprocess.run([sys.executable, "-m", "clusterrun", "doctor", str(hosts)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and "hosts[0].gpus: expected a list of GPU ids or a count" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # an env_file that cannot be read: as `up` reads it (the nodes' environment), named at its line
    hosts.write_text("env_file: missing.env\nhosts:\n  - host: a\n")
    proc = subprocess.run([sys.executable, "-m", "clusterrun", "doctor", str(hosts)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and f"hosts.yaml:1: env_file: cannot read {tmp_path / 'missing.env'}: No such file" \
        in proc.stderr, proc.stderr


# Each look, started, marks itself in the folder, then waits for the others' marks: side by side they
# meet at once; one after the other, the first gives up (20 s) and fails.
MEET = 'i=0; while [ ! -e "{d}/list" ] || [ ! -e "{d}/apps" ] || [ ! -e "{d}/torch" ]; do i=$((i+1)); ' \
       '[ $i -gt 400 ] && exit 1; sleep 0.05; done'
MEETING_SMI = """#!/bin/sh
case "$1" in -L) touch "{d}/list" ;; *) touch "{d}/apps" ;; esac
{meet}
case "$1" in
  -L) printf 'GPU 0: NVIDIA Fake 80GB (UUID: GPU-aaaa)\\n' ;;
  *) printf 'GPU-aaaa, 4242, /usr/bin/python3\\n' ;;
esac
"""
MEETING_TORCH = """import os, time
open(os.path.join({d!r}, "torch"), "w").close()
for _ in range(400):
    if all(os.path.exists(os.path.join({d!r}, n)) for n in ("list", "apps")):
        break
    time.sleep(0.05)
else:
    raise ImportError("alone")
__version__ = "2.13.0+cu124"
class version:
    cuda = "12.4"
class cuda:
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
"""


def test_the_inspect_runs_its_slow_looks_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host `up`'s preflight imports torch and runs nvidia-smi twice, each of which can take
    seconds there: they run at the same time (each fake waits for the others), not one after the other."""
    marks, bin_dir, site = tmp_path / "marks", tmp_path / "bin", tmp_path / "site"
    for folder in (marks, bin_dir, site / "torch"):
        folder.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text(MEETING_SMI.format(d=marks, meet=MEET.format(d=marks)))
    (bin_dir / "nvidia-smi").chmod(0o755)
    (site / "torch" / "__init__.py").write_text(MEETING_TORCH.format(d=str(marks)))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(site))
    answer = doctorops.op_inspect(doctorops.InspectRequest(cwd=str(tmp_path), deep=True, gpus=True, timeout=60))
    assert answer["deep"]["devices"] == 1 and answer["deep"]["cuda"] == "12.4", answer["deep"]
    assert answer["gpu_list"] == "GPU 0: NVIDIA Fake 80GB (UUID: GPU-aaaa)\n"
    assert answer["gpu_apps"] == "GPU-aaaa, 4242, /usr/bin/python3\n"


def test_the_inspections_that_go_with_the_probes_leave_out_the_hosts_a_sync_fills_first() -> None:
    """A host the sync copies to (its ``sync:``, or ``--sync`` for all) is inspected after the
    sync, not with its probe; a dry run copies nothing, so every host goes with its probe."""
    spec = load_cluster_text("hosts:\n  - host: h0\n    workdir: /proj\n    sync: .\n"
                             "  - host: h1\n    workdir: /proj\n", "hosts.yaml")
    checks = partial(doctor.Preflight, spec, "train.py", "/here", False, test_port=False)
    assert set(checks().ahead().inspect) == {1}
    assert set(checks(sync_dir="/src").ahead().inspect) == set()
    assert set(checks(sync_dir="/src", copies=False).ahead().inspect) == {0, 1}
