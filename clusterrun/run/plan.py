"""Turn a ``ClusterSpec`` and a script into a ``LaunchPlan``: pure code, no I/O, no clock, no env.

Everything that depends on the hosts (their interpreter, the torchrun options their torch knows,
the free port found on node 0) or on the moment (the job id, the working directory) comes in as
arguments, so the same inputs always give the same plan and ``up --dry-run`` prints exactly what
``up`` runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from clusterrun.config.environment import mask_env
from clusterrun.config.envrules import check_env_entry, check_env_total
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen

TORCHRUN_MODULE = "torch.distributed.run"
# torchrun traps these and stops the workers; SIGHUP is left out on purpose: a job must not die
# because a terminal or an SSH session that once started it went away.
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGQUIT"
# A stop SIGKILLs torchrun when its grace is over; torchrun's own SIGKILL of its workers
# (--shutdown-timeout) comes this many seconds later. At the same moment the two would race, and
# whether the stop's report says "torchrun outlived the grace" would be down to the scheduler.
SHUTDOWN_MARGIN = 5
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_NAME = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 40  # characters of a job's name, the first part of its id


@frozen
class HostFacts:
    """What the probe found on a host, as far as the plan needs it."""

    python: str
    torchrun_flags: tuple[str, ...] = ()
    address: str | None = None  # how the controller reached it (ssh_config's HostName), if known


@frozen
class NodeLaunch:
    """One node's part of the job: the exact argv, environment and directory torchrun gets."""

    rank: int
    host: HostSpec
    nproc: int
    first_rank: int  # global rank of this node's local rank 0
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


@frozen
class LaunchPlan:
    """The whole job: one ``NodeLaunch`` per host, in hosts-file order."""

    job_id: str
    name: str
    master_addr: str
    master_port: int
    nodes: tuple[NodeLaunch, ...]
    state_dir: str | None = None
    grace: float = 10.0
    script: str = ""
    script_args: tuple[str, ...] = field(default_factory=tuple)
    secret_env: tuple[str, ...] = ()  # the hosts file's secret_env: more names whose values are masked

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def node_of_rank(self, rank: int) -> NodeLaunch | None:
        return next((n for n in self.nodes if rank in n.ranks), None)


def job_name(name: str | None, script: str) -> str:
    """A name usable in paths: the ``--name`` given, or the script's stem; it starts with a letter
    or digit, as the agent wants a job id to (``_prepare.py`` runs as ``prepare``)."""
    base = name or re.sub(r"\.py$", "", script.rstrip("/").rsplit("/", 1)[-1]) or "job"
    cleaned = _JOB_NAME.sub("-", base).strip("-._") or "job"
    return cleaned[:MAX_NAME]


def make_job_id(name: str, timestamp: str, suffix: str) -> str:
    """``train-20261122-150102-3f9a``: readable, sortable, unique with a random ``suffix``."""
    return f"{name}-{timestamp}-{suffix}"


JOB_ID_SHAPE = re.compile(r"-\d{8}-\d{6}-[0-9a-f]{4}$")  # what ``new_job_id`` appends to a job's name


def new_job_id(name: str) -> str:
    """A new job's id: its name, the local time to the second, and 4 random hex digits."""
    return make_job_id(name, time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(2))


def parse_env_overrides(items: Sequence[str]) -> dict[str, str]:
    """``--env K=V`` values into a dict; the value is kept verbatim (spaces, quotes, ``$``)."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise ConfigError(f"expected NAME=VALUE with NAME made of letters, digits and _, got {item!r}",
                              key="--env")
        if (problem := check_env_entry(key, value)) is not None:
            raise ConfigError(f"{key}: {problem}", key="--env", hint="pass large data in a file on the hosts")
        env[key] = value
    if (problem := check_env_total(env)) is not None:
        raise ConfigError(problem, key="--env", hint="pass large data in a file on the hosts")
    return env


def master_addr(spec: ClusterSpec, node0_facts: HostFacts | None = None) -> str:
    """Where every node finds node 0: ``master.addr``, else node 0's ``address``, else the address
    SSH reached it at (an ssh_config alias resolved to its HostName), else its ``host``
    (``127.0.0.1`` for a local host)."""
    if spec.master_addr:
        return spec.master_addr
    node0 = spec.hosts[0]
    if node0.address:
        return node0.address
    if node0.transport == "local":
        return "127.0.0.1"
    return (node0_facts.address if node0_facts else None) or node0.host


def node_env(host: HostSpec, overrides: Mapping[str, str]) -> dict[str, str]:
    """clusterrun's defaults < the host's env (forward_env < env_file < env: see ``environment``)
    < ``--env``; ``OMP_NUM_THREADS=1`` only where the user set none (torchrun would set it too,
    with a warning, for more than one process per node)."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update(host.env)
    env.update(overrides)
    if host.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(host.gpus)
    return env


def torchrun_argv(
    facts: HostFacts, *, nnodes: int, nproc: int, node_rank: int, addr: str, port: int, grace: float,
    script: str, script_args: Sequence[str], job_id: str,
) -> tuple[str, ...]:
    argv = [
        facts.python, "-m", TORCHRUN_MODULE,
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
        # the ranks see the job id as TORCHELASTIC_RUN_ID (torchrun's default is "none")
        "--rdzv-backend=static", f"--rdzv-id={job_id}", f"--master-addr={addr}", f"--master-port={port}",
        # workers' output goes to per-rank files that the node agent merges, whole lines tagged
        # with the global rank, into the node's log (torchrun's --tee splits lines)
        "--max-restarts=0", "--redirects=3",
    ]
    if "--signals-to-handle" in facts.torchrun_flags:
        argv.append(f"--signals-to-handle={HANDLED_SIGNALS}")
    if "--shutdown-timeout" in facts.torchrun_flags:
        argv.append(f"--shutdown-timeout={math.ceil(grace) + SHUTDOWN_MARGIN}")
    # Each rank's stderr goes where its stdout goes (torchrun's stdout.log: one file, one offset), so
    # its lines stay in the order it wrote them; sh execs the interpreter: the rank is still one
    # process, as torchrun would start it (python -u). torchrun drops one "--" right after its
    # script, which is sh here: the script's own arguments pass verbatim.
    rank = ("--no-python", "/bin/sh", "-c", 'exec 2>&1; exec "$0" "$@"', facts.python, "-u")
    return (*argv, *rank, script, *script_args)


def build_plan(
    spec: ClusterSpec,
    script: str,
    script_args: Sequence[str],
    *,
    job_id: str,
    name: str,
    facts: Sequence[HostFacts],
    master_port: int,
    env_overrides: Mapping[str, str] | None = None,
    local_cwd: str | None = None,
    grace: float = 10.0,
) -> LaunchPlan:
    """The launch plan: node ranks in file order, global ranks packed node after node."""
    if len(facts) != len(spec.hosts):
        raise ValueError("one HostFacts per host is needed")
    addr = master_addr(spec, facts[0] if facts else None)
    nodes = []
    first = 0
    for rank, (host, fact) in enumerate(zip(spec.hosts, facts, strict=True)):
        cwd = host.workdir or (local_cwd if host.transport == "local" else None)
        argv = torchrun_argv(fact, nnodes=len(spec.hosts), nproc=host.nproc, node_rank=rank, addr=addr,
                             port=master_port, grace=grace, script=script, script_args=script_args,
                             job_id=job_id)
        nodes.append(NodeLaunch(rank=rank, host=host, nproc=host.nproc, first_rank=first, argv=argv,
                                env=node_env(host, env_overrides or {}), cwd=cwd))
        first += host.nproc
    return LaunchPlan(job_id=job_id, name=name, master_addr=addr, master_port=master_port, nodes=tuple(nodes),
                      state_dir=spec.state_dir, grace=grace, script=script, script_args=tuple(script_args),
                      secret_env=spec.secret_env)


def with_flags(plan: LaunchPlan, rank: int, flags: Sequence[str]) -> NodeLaunch:
    """Node ``rank``'s launch with torchrun's argv for a torch that has ``flags`` (the job's
    interpreter after the host's setup may not be the one probed)."""
    launch = plan.nodes[rank]
    argv = torchrun_argv(HostFacts(python=launch.argv[0], torchrun_flags=tuple(flags)), nnodes=plan.nnodes,
                         nproc=launch.nproc, node_rank=rank, addr=plan.master_addr, port=plan.master_port,
                         grace=plan.grace, script=plan.script, script_args=plan.script_args, job_id=plan.job_id)
    return dataclasses.replace(launch, argv=argv)


def plan_to_json(plan: LaunchPlan) -> dict[str, Any]:
    """The plan as JSON data, for the job record; the hosts are kept by rank (see ``plan_from_json``).
    Secret values are masked (``environment.MASK``): a record never holds one."""
    return {
        "job_id": plan.job_id, "name": plan.name, "master_addr": plan.master_addr,
        "master_port": plan.master_port, "state_dir": plan.state_dir, "grace": plan.grace,
        "script": plan.script, "script_args": list(plan.script_args), "secret_env": list(plan.secret_env),
        "nodes": [{"rank": n.rank, "host": n.host.host, "nproc": n.nproc, "first_rank": n.first_rank,
                   "argv": list(n.argv), "env": mask_env(n.env, plan.secret_env), "cwd": n.cwd}
                  for n in plan.nodes],
    }


def about_json(plan: LaunchPlan, env_overrides: Mapping[str, str]) -> dict[str, Any]:
    """What each host keeps of the job beside its own node's command (the agent's ``spec.json``),
    so that a controller without the job's record can adopt it: the names of the ``--env``
    overrides, not their values (those are in the node's environment)."""
    return {"name": plan.name, "script": plan.script, "script_args": list(plan.script_args),
            "master_addr": plan.master_addr, "master_port": plan.master_port, "grace": plan.grace,
            "nnodes": plan.nnodes, "env_overrides": sorted(env_overrides)}


def plan_from_json(data: Mapping[str, Any], spec: ClusterSpec) -> LaunchPlan:
    """The plan ``plan_to_json`` wrote, its nodes joined again with the hosts of ``spec``."""
    nodes = data["nodes"]
    names = [h.host for h in spec.hosts]
    if [n["host"] for n in nodes] != names:
        raise ValueError(f"the plan's hosts {[n['host'] for n in nodes]} are not the hosts file's {names}")
    return LaunchPlan(
        job_id=data["job_id"], name=data["name"], master_addr=data["master_addr"],
        master_port=int(data["master_port"]), state_dir=data.get("state_dir"), grace=float(data["grace"]),
        script=data["script"], script_args=tuple(data["script_args"]),
        secret_env=tuple(data.get("secret_env") or ()),
        nodes=tuple(NodeLaunch(rank=int(n["rank"]), host=host, nproc=int(n["nproc"]),
                               first_rank=int(n["first_rank"]), argv=tuple(n["argv"]), env=dict(n["env"]),
                               cwd=n["cwd"]) for n, host in zip(nodes, spec.hosts, strict=True)),
    )
