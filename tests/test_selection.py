"""-w/--nodes and -x/--exclude: a part of the file's hosts and GPUs, in the file's order."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.config.selection import load_hosts, select
from clusterrun.core.errors import ConfigError
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from tests.conftest import ROOT, job_id_of, run_up, write_hosts
from tests.simhosts import SimCluster
from tests.test_ssh import check_ranks

HOSTS = """\
hosts:
  - host: gpu[01-04]
    gpus: 4
  - host: login
"""


def hosts(nodes: str | None = None, exclude: str | None = None) -> list[tuple[str, tuple[str, ...] | None, int]]:
    spec = select(load_cluster_text(HOSTS, "hosts.yaml"), nodes, exclude)
    return [(h.host, h.gpus, h.nproc) for h in spec.hosts]


ALL = ("0", "1", "2", "3")


def test_nodes_keeps_the_files_order() -> None:
    assert hosts("login,gpu[03-04]") == [("gpu03", ALL, 4), ("gpu04", ALL, 4), ("login", None, 1)]


def test_exclude_drops_hosts() -> None:
    assert hosts(exclude="gpu[01-03]") == [("gpu04", ALL, 4), ("login", None, 1)]
    assert hosts("gpu[01-02]", "gpu01") == [("gpu02", ALL, 4)]


def test_a_gpu_of_a_host() -> None:
    assert hosts(exclude="gpu02:1,gpu[01-04]:3,login")[:2] == [("gpu01", ("0", "1", "2"), 3), ("gpu02", ("0", "2"), 2)]
    assert hosts("gpu01:[2-3]") == [("gpu01", ("2", "3"), 2)]
    assert hosts(exclude="gpu01:[0-3]")[0][0] == "gpu02"  # no GPU left: the host is left out


def test_names_ignore_case_as_the_file_does() -> None:
    assert hosts("GPU01") == [("gpu01", ALL, 4)]


@pytest.mark.parametrize(("nodes", "exclude", "key", "message"), [
    ("gpu05", None, "--nodes", "gpu05 is not a host of hosts.yaml"),
    (None, "gpu[3-1]", "--exclude", "invalid node set: bad range \"3-1\" at position 5 of 'gpu[3-1]'"),
    (None, "login:0", "--exclude", "login:0: host login has no gpus in hosts.yaml"),
    ("gpu01:7", None, "--nodes", "gpu01:7: GPU 7 is not one of gpu01's gpus (0, 1, 2, 3)"),
    ("login", "login", "--exclude", "no host of hosts.yaml is left to run on"),
])
def test_mistakes(nodes: str | None, exclude: str | None, key: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        hosts(nodes, exclude)
    assert (info.value.key, info.value.message) == (key, message)
    if message.endswith("is not a host of hosts.yaml"):
        assert info.value.hint == "its hosts: gpu[01-04],login"


def test_the_record_keeps_the_whole_file_or_the_part_chosen(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text(HOSTS)
    spec, text = load_hosts(str(path))
    assert text == HOSTS
    spec, text = load_hosts(str(path), "gpu[01-02]", "gpu02:0")
    assert text.startswith(f"# the hosts of {path} that `-w gpu[01-02] -x gpu02:0` chose\n")
    assert [(h.host, h.gpus) for h in load_cluster_text(text).hosts] == [("gpu01", ALL), ("gpu02", ("1", "2", "3"))]


def test_up_refuses_a_node_set_mistake_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "hosts.yaml").write_text(HOSTS)
    done = subprocess.run([sys.executable, "-m", "clusterrun", "up", "-w", "gpu[01-", "hosts.yaml", "train.py"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == ("clusterrun: error: --nodes: invalid node set: missing bracket at position 4 of "
                           "'gpu[01-'\n  hint: node sets look like gpu[01-08], gpu[01-04,07] or rack[1-2]-n[1-4]; "
                           "HOST:GPU names one GPU\n")


@pytest.mark.integration
def test_up_runs_on_the_hosts_left_and_its_record_keeps_them(tmp_path: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1, 1], tmp_path / "state")
    done = run_up("-x", "local-b", hosts, "tests/_support/echo_args.py", "hello")
    assert done.returncode == 0, done.stderr
    job = job_id_of(done.stderr)
    assert f"clusterrun: job {job}: 2 nodes" in done.stderr
    assert 'ECHO {"argv": ["hello"]' in done.stdout
    shown = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "--json", job], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
    assert [n["host"] for n in json.loads(shown.stdout)["jobs"][0]["nodes"]] == ["local-a", "local-c"]
    store = JobStore()
    assert [h.host for h in Opened(store.load(job)).spec().hosts] == ["local-a", "local-c"]  # what a restart runs on


@pytest.mark.integration
def test_up_with_a_node_set_and_exclude_on_simulated_hosts(sim_cluster: Callable[..., SimCluster],
                                                          tmp_path: Path) -> None:
    cluster = sim_cluster(3)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"state_dir: {tmp_path / 'state'}\nssh_config: {cluster.ssh_config}\n"
                     f"defaults: {{python: {sys.executable}, workdir: {ROOT}}}\nhosts: ['sim[1-3]']\n")
    done = run_up("-x", "sim2", hosts, "examples/allreduce.py", timeout=300)
    assert done.returncode == 0, done.stderr
    check_ranks(done.stdout, [("sim1", 1), ("sim3", 1)])  # sim3 is node 1 now
