"""The agent's ``probe`` (``agent/probe.py``) in this process: the interpreter, torch found without
importing it (in a virtual environment's own site directory too), the torchrun flags it has, a free
port, containment and the preflight's requests answered in the same exchange."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from clusterrun.agent import cgroup as cg
from clusterrun.agent import probe
from tests.agenthost import ask


def test_the_probe_says_what_this_host_runs_and_finds_a_free_port(tmp_path: Path) -> None:
    answer = ask({"op": "probe", "free_port": True, "state_dir": str(tmp_path / "state")})
    assert answer["ok"] and answer["protocol"] == probe.PROTOCOL and answer["state_dir"] == str(tmp_path / "state")
    assert answer["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert answer["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert answer["torch"] and answer["torch"] != "unknown"  # torch is installed here, and never imported
    assert set(answer["torchrun_flags"]) <= set(probe.OPTIONAL_TORCHRUN_FLAGS)
    assert 20000 <= answer["port"] <= 32000
    with socket.socket() as s:
        s.bind(("", answer["port"]))  # still free
    parent, why = cg.cgroup_parent()
    assert answer["containment"] == ("cgroup" if parent else "sweep")
    assert ([f"no cgroup: {why}"] if why else []) == [f for f in answer["fallbacks"] if f.startswith("no cgroup")]


def test_the_preflights_requests_are_answered_in_the_probes_exchange(tmp_path: Path) -> None:
    answer = ask({"op": "probe", "state_dir": str(tmp_path), "route_to": {"addr": "127.0.0.1", "port": 9},
                  "inspect": {"op": "inspect", "cwd": str(tmp_path), "paths": ["missing.py"]},
                  "listen": {"op": "listen", "port": None, "token": "t"}})
    assert answer["port"] is None and answer["network"]["master"]["loopback"]
    assert answer["inspect"]["ok"] and answer["inspect"]["paths"] == {"missing.py": "missing"}
    assert answer["listen"]["ok"] and answer["listen"]["listening"]
    assert ask({"op": "unlisten", "port": answer["listen"]["port"]})["ok"]


def test_torch_is_found_in_a_virtual_environments_own_site_directory(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent runs without ``site``: the job's venv's site-packages come from its pyvenv.cfg."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    torch = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "torch"
    (torch / "distributed").mkdir(parents=True)
    (torch / "__init__.py").write_text("raise SystemExit('torch must not be imported')\n")
    (torch / "version.py").write_text("__version__ = '9.1.0+cpu'\ngit_version = 'x'\n")
    (torch / "distributed" / "run.py").write_text('parser.add_argument("--shutdown-timeout")\n')
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing-here")])
    answer = ask({"op": "probe", "state_dir": str(tmp_path)})
    assert answer["torch"] == "9.1.0+cpu" and answer["torchrun_flags"] == ["--shutdown-timeout"]

    (torch / "version.py").unlink()  # torch there, but not as a release lays it out
    assert ask({"op": "probe", "state_dir": str(tmp_path)})["torch"] == "unknown"


@pytest.mark.parametrize(("source", "version"), [
    ("__version__ = '2.13.0'\n", "2.13.0"),
    ('__version__: str = "2.1.0+cu121"\n', "2.1.0+cu121"),
    ("version = '1'\n__version__ = ''\n", "unknown"),
    ("__version__ = get()\n", "unknown"),
])
def test_the_version_is_read_from_version_py_without_running_it(source: str, version: str) -> None:
    assert probe.version_of(source) == version


def test_a_listener_answers_its_token_and_reach_tells_it_from_anything_else() -> None:
    listening = ask({"op": "listen", "port": None, "token": "node0-token"})
    port = listening["port"]
    try:
        assert listening == {"ok": True, "port": port, "listening": True}
        reached = ask({"op": "reach", "addr": "127.0.0.1", "port": port, "token": "node0-token", "timeout": 5})
        assert reached["ok"] and reached["reached"] and reached["local"] == "127.0.0.1"
        other = ask({"op": "reach", "addr": "127.0.0.1", "port": port, "token": "another job's", "timeout": 5})
        assert not other["reached"] and other["error"] == ("something else answers there "
                                                           "(not clusterrun's listener on node 0)")
        taken = ask({"op": "listen", "port": port, "token": "x"})
        assert not taken["listening"] and taken["error"]
    finally:
        assert ask({"op": "unlisten", "port": port})["ok"]
    refused = ask({"op": "reach", "addr": "127.0.0.1", "port": port, "token": "node0-token", "timeout": 5})
    assert not refused["reached"] and refused["error"]


def test_the_route_to_the_master_names_the_interface_and_a_loopback_name_its_hosts_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    network = ask({"op": "route", "route_to": {"addr": "localhost", "port": 9,
                                               "peers": ["no-such-host.invalid", "127.0.0.1"], "always_peers": True}})
    master = network["network"]["master"]
    assert master["resolved"] == "127.0.0.1" and master["interface"] == "lo" and master["loopback"]
    if master["hosts_line"] is not None:  # where /etc/hosts names localhost
        assert master["hosts_line"].startswith("/etc/hosts:") and "localhost" in master["hosts_line"]
    assert network["network"]["peer"] is None  # no peer reached through another interface than loopback
    assert network["network"]["preset"] == {"GLOO_SOCKET_IFNAME": "lo"}
    unknown = ask({"op": "route", "route_to": {"addr": "no-such-host.invalid", "port": 9}})["network"]["master"]
    assert unknown["resolved"] is None and unknown["error"].startswith("cannot resolve no-such-host.invalid: ")
