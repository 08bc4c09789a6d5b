"""The launch plan is pure: same inputs, same plan; ranks, env merge and argv are checked here."""

from __future__ import annotations

import pytest

from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core.errors import ConfigError
from clusterrun.run.plan import (
    JOB_ID_SHAPE,
    HostFacts,
    build_plan,
    job_name,
    make_job_id,
    master_addr,
    new_job_id,
    parse_env_overrides,
)

FACTS = HostFacts(python="/usr/bin/python3", torchrun_flags=("--signals-to-handle", "--shutdown-timeout"))


def spec(*hosts: HostSpec, **kw: object) -> ClusterSpec:
    return ClusterSpec(path="hosts.yaml", hosts=hosts, **kw)  # type: ignore[arg-type]


def plan_for(s: ClusterSpec, **kw: object):  # type: ignore[no-untyped-def]
    args = dict(job_id="train-1", name="train", facts=[FACTS] * len(s.hosts), master_port=29400)
    args.update(kw)
    return build_plan(s, "train.py", ["--lr", "0.1"], **args)  # type: ignore[arg-type]


def test_ranks_are_packed_node_after_node_with_uneven_sizes() -> None:
    p = plan_for(spec(HostSpec("a", nproc=1), HostSpec("b", nproc=3), HostSpec("c", nproc=2)))
    assert [n.rank for n in p.nodes] == [0, 1, 2]
    assert [list(n.ranks) for n in p.nodes] == [[0], [1, 2, 3], [4, 5]]
    assert p.world_size == 6 and p.nnodes == 3
    assert p.node_of_rank(3) is p.nodes[1] and p.node_of_rank(6) is None


def test_torchrun_argv_is_static_rendezvous_with_node_rank() -> None:
    p = plan_for(spec(HostSpec("gpu-a", address="10.0.0.1", nproc=2), HostSpec("gpu-b", nproc=2)), grace=7)
    assert p.nodes[1].argv == (
        "/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1",
        "--rdzv-backend=static", "--rdzv-id=train-1", "--master-addr=10.0.0.1", "--master-port=29400",
        "--max-restarts=0", "--redirects=3", "--signals-to-handle=SIGTERM,SIGINT,SIGQUIT", "--shutdown-timeout=12",
        # each rank's stderr to its stdout's file: its lines in the order it wrote them
        "--no-python", "/bin/sh", "-c", 'exec 2>&1; exec "$0" "$@"', "/usr/bin/python3", "-u",
        "train.py", "--lr", "0.1",
    )


@pytest.mark.parametrize("grace", [0.5, 1, 1.5, 7, 10])
def test_torchrun_kills_its_workers_only_well_after_the_stop_has_killed_it(grace: float) -> None:
    """A stop SIGKILLs torchrun when the grace is over. Had torchrun's own SIGKILL of its workers
    (--shutdown-timeout) come at the same moment, the two would race, and the report's "torchrun
    outlived the grace" (tests/test_stop_paths.py) would depend on the scheduler: seconds, not a tie."""
    argv = plan_for(spec(HostSpec("a")), grace=grace).nodes[0].argv
    timeout = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--shutdown-timeout="))
    assert timeout >= grace + 3


def test_older_torch_gets_no_new_flags() -> None:
    p = plan_for(spec(HostSpec("a")), facts=[HostFacts(python="python3")])
    assert not any(a.startswith(("--signals-to-handle", "--shutdown-timeout")) for a in p.nodes[0].argv)


def test_master_addr_choice() -> None:
    assert master_addr(spec(HostSpec("a", address="10.1.1.1"), master_addr="10.9.9.9")) == "10.9.9.9"
    assert master_addr(spec(HostSpec("a", address="10.1.1.1"), HostSpec("b"))) == "10.1.1.1"
    assert master_addr(spec(HostSpec("gpu-a"), HostSpec("gpu-b"))) == "gpu-a"
    assert master_addr(spec(HostSpec("l", transport="local"))) == "127.0.0.1"
    # an ssh_config alias: the HostName SSH resolved it to, which the other nodes can reach
    assert master_addr(spec(HostSpec("gpu-a")), HostFacts(python="p", address="10.0.0.7")) == "10.0.0.7"


def test_env_merge_order_and_gpus() -> None:
    host = HostSpec("a", gpus=("2", "3"), nproc=2, env={"OMP_NUM_THREADS": "4", "A": "host", "B": "host"})
    p = plan_for(spec(host), env_overrides={"B": "cli $(x) 'q'"})
    env = p.nodes[0].env
    assert env["OMP_NUM_THREADS"] == "4"  # the user's value wins over clusterrun's default of 1
    assert env["A"] == "host" and env["B"] == "cli $(x) 'q'"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert plan_for(spec(HostSpec("b"))).nodes[0].env["OMP_NUM_THREADS"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in plan_for(spec(HostSpec("b"))).nodes[0].env


def test_cwd_local_hosts_default_to_the_callers_directory() -> None:
    p = plan_for(spec(HostSpec("l", transport="local"), HostSpec("r"), HostSpec("w", workdir="~/code")),
                 local_cwd="/home/me/proj")
    assert [n.cwd for n in p.nodes] == ["/home/me/proj", None, "~/code"]


def test_plan_is_deterministic() -> None:
    s = spec(HostSpec("a", nproc=2), HostSpec("b", nproc=2))
    assert plan_for(s) == plan_for(s)


def test_job_names_and_ids() -> None:
    assert job_name(None, "examples/train.py") == "train"
    assert job_name("my run!/x", "t.py") == "my-run-x"
    assert job_name(None, "../") == "job"
    assert job_name(None, "benchmarks/_recover_train.py") == "recover_train"  # an agent's job id starts alphanumeric
    assert make_job_id("train", "20261122-150102", "3f9a") == "train-20261122-150102-3f9a"
    made = new_job_id("train")  # Slurm's `ps` tells a clusterrun step from others by this shape
    assert made.startswith("train-") and JOB_ID_SHAPE.sub("", made) == "train"
    assert len({new_job_id("train") for _ in range(8)}) > 1  # random: 8 alike 1 in 2**112


def test_env_overrides_parse_verbatim_and_reject_bad_names() -> None:
    assert parse_env_overrides(["A=1", "B=x=y", "C=", "D= sp 'q' $(id)"]) == {
        "A": "1", "B": "x=y", "C": "", "D": " sp 'q' $(id)"}
    for bad in ["NOEQUALS", "1A=x", "A-B=x", "=x"]:
        with pytest.raises(ConfigError, match="expected NAME=VALUE"):
            parse_env_overrides([bad])


def test_script_arguments_starting_with_a_separator_survive_torchrun() -> None:
    s = spec(HostSpec("a"))
    p = build_plan(s, "t.py", ["--", "x"], job_id="j", name="j", facts=[FACTS], master_port=1)
    # torchrun removes a "--" right after its script, which is the sh that starts the rank: none here
    assert p.nodes[0].argv[-3:] == ("t.py", "--", "x")
