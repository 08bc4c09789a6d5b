"""DeepSpeed/MPI hostfiles read as hosts files, decided by content, and spec_yaml's round trip."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from clusterrun.config.hostfiles import is_hostfile, load_any, spec_yaml
from clusterrun.config.hostsfile import load_cluster, load_cluster_text
from clusterrun.core.errors import ConfigError
from clusterrun.run.plan import HostFacts, build_plan, plan_to_json
from tests import clirun

FACTS = HostFacts(python="/usr/bin/python3", torchrun_flags=())

DEEPSPEED = """\
# the training machines
worker-1 slots=4
worker-2 slots=4   # the second one
trainer@worker-3 slots=2 max_slots=8

"""

EQUIVALENT = """\
hosts:
  - host: worker-1
    gpus: 4
  - host: worker-2
    gpus: [0, 1, 2, 3]
  - host: worker-3
    user: trainer
    gpus: 2
"""


def write(tmp_path: Path, text: str, name: str = "hostfile") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def plan_of(spec):  # type: ignore[no-untyped-def]
    plan = build_plan(spec, "train.py", ["--lr", "0.1"], job_id="j-1", name="j", facts=[FACTS] * len(spec.hosts),
                      master_port=29500)
    return plan_to_json(plan)


@pytest.mark.parametrize("name", ["hostfile", "hosts.yaml", "cluster.txt"])
def test_a_deepspeed_hostfile_gives_the_plan_of_the_equivalent_yaml(tmp_path: Path, name: str) -> None:
    spec, text = load_any(write(tmp_path, DEEPSPEED, name))  # by content, whatever the name says
    yaml_spec = load_cluster(write(tmp_path, EQUIVALENT, "equivalent.yaml"))
    assert plan_of(spec) == plan_of(yaml_spec)
    assert [h.nproc for h in spec.hosts] == [4, 4, 2]
    assert plan_of(load_cluster_text(text)) == plan_of(spec)  # the YAML it printed is the same hosts
    assert "# the training machines" in text and "# the second one" in text


def test_yaml_files_are_not_hostfiles() -> None:
    assert not is_hostfile("hosts: [a]\n")
    assert not is_hostfile("hosts:\n  - a\n")
    assert not is_hostfile("# only a comment\n\n")
    assert not is_hostfile("---\n")
    assert is_hostfile("node1\nnode2\n")  # a plain machine list (MPI's machinefile)
    assert is_hostfile("gpu[01-04] slots=8\n")
    assert is_hostfile("node1:4\nnode2\n")  # MPICH's
    assert not is_hostfile("hosts:\n  - node1:4\n")


def test_mpich_host_colon_count(tmp_path: Path) -> None:
    spec, _ = load_any(write(tmp_path, "worker-1:4\nworker-2:4  # MPICH, Intel MPI\ntrainer@worker-3:2\n"))
    assert plan_of(spec) == plan_of(load_cluster(write(tmp_path, EQUIVALENT, "equivalent.yaml")))


def test_a_hostfile_may_hold_node_sets(tmp_path: Path) -> None:
    spec, _ = load_any(write(tmp_path, "gpu[01-03] slots=2\nlogin\n"))
    assert [(h.host, h.gpus) for h in spec.hosts] == [
        ("gpu01", ("0", "1")), ("gpu02", ("0", "1")), ("gpu03", ("0", "1")), ("login", None)]


@pytest.mark.parametrize(("text", "line", "message"), [
    ("a slots=2\nb slot=2\n", 2, "expected slots=N or max_slots=N after the host name, got 'slot=2'"),
    ("a slots=four\n", 1, "slots must be a count from 1 to 9999, got 'four'"),
    ("a slots=0\n", 1, "slots must be a count from 1 to 9999, got '0'"),
    ("a slots=4 max_slots=2\n", 1, "slots=4 is more than max_slots=2"),
    ("# c\na\n\nb\nA slots=1\n", 5, "host 'A' is listed twice (also at line 2, as 'a')"),
    ("a\ngpu[1-\n", 2, "invalid node set: missing bracket at position 4 of 'gpu[1-'"),
])
def test_hostfile_mistakes_name_the_hostfile_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_any(path)
    assert (info.value.path, info.value.line, info.value.message) == (path, line, message)
    assert info.value.render().startswith(f"{path}:{line}: {message}")


def test_spec_yaml_round_trips_every_setting(tmp_path: Path) -> None:
    (tmp_path / "x.env").write_text("A=1\n")
    path = write(tmp_path, """\
        master: {addr: 10.0.0.1, port: 29500}
        state_dir: /var/tmp/cr
        secret_env: [MY_*]
        env: {SHARED: "010"}
        forward_env: [NCCL_*]
        env_file: x.env
        defaults: {user: u, python: /opt/py, workdir: /w, setup: "echo hi"}
        hosts:
          - host: a
            address: 10.0.0.1
            port: 2222
            gpus: [1, 3]
            env: {OWN: "yes"}
            sync: .
            sync_exclude: [data/]
          - host: b
            nproc: 3
            transport: local
            identity_file: ~/.ssh/k
    """, "hosts.yaml")
    spec = load_cluster(path)
    again = load_cluster_text(spec_yaml(spec, "a comment"), path)
    strip = [h.__class__(**{**h.__dict__, "line": None, "env_file": ()}) for h in spec.hosts]
    assert [h.__class__(**{**h.__dict__, "line": None, "env_file": ()}) for h in again.hosts] == strip
    assert [f.path for f in again.hosts[0].env_file] == [str(tmp_path / "x.env")]
    assert (again.master_addr, again.master_port, again.state_dir, again.secret_env) == (
        "10.0.0.1", 29500, "/var/tmp/cr", ("MY_*",))


def test_hosts_convert_prints_the_yaml(tmp_path: Path) -> None:
    def convert(path: str) -> subprocess.CompletedProcess[str]:
        return clirun.clusterrun("hosts", "convert", path)

    done = convert(write(tmp_path, DEEPSPEED))
    assert done.returncode == 0, done.stderr
    assert plan_of(load_cluster_text(done.stdout)) == plan_of(load_cluster(write(tmp_path, EQUIVALENT, "eq.yaml")))
    done = convert(write(tmp_path, "defaults: {gpus: 2}\nhosts: ['n[1-2]']\n", "hosts.yaml"))
    assert done.stdout.endswith("hosts:\n- host: n1\n  gpus: 2\n- host: n2\n  gpus: 2\n"), done.stdout
    done = convert(write(tmp_path, "a slots=x\n"))
    assert (done.returncode, done.stderr) == (2, f"clusterrun: error: {tmp_path / 'hostfile'}:1: slots must be a "
                                                 "count from 1 to 9999, got 'x'\n")
