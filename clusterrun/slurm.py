"""Slurm as the launcher: the allocation read from Slurm's variables, the one ``srun`` that starts a
torchrun per node, and the batch script of ``clusterrun export --sbatch``. Pure: no I/O, no clock;
the environment comes in as a mapping.

Under Slurm the job is one job step: ``srun --nodes=N --ntasks-per-node=1 --kill-on-bad-exit=1``
runs the same command on every node, Slurm tracks, limits and signals every process of it, and
``scancel JOBID.STEPID`` is the stop. So every node gets the same argv and environment: a node's
rank comes from ``SLURM_NODEID`` in the task (``TASK_SCRIPT``), the master is the first node of
the allocation, and GPUs are Slurm's to hand out (no ``CUDA_VISIBLE_DEVICES`` of ours).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clusterrun.config import ClusterSpec, HostSpec
from clusterrun.envrules import looks_secret
from clusterrun.errors import ConfigError
from clusterrun.nodesets import NodeSetError, expand, fold
from clusterrun.plan import TORCHRUN_MODULE, LaunchPlan, NodeLaunch, node_env

# What each task runs, one constant script: the node rank from Slurm, the rest as arguments
# (``sh -c TASK_SCRIPT clusterrun-node PYTHON TORCHRUN-OPTIONS... SCRIPT ARGS...``), so no value
# of the job is ever formatted into shell text.
TASK_SCRIPT = ('python=$1; shift; exec "$python" -m ' + TORCHRUN_MODULE
               + ' --node-rank="$SLURM_NODEID" --nnodes="$SLURM_NNODES"'
               ' --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" "$@"')
TASK_NAME = "clusterrun-node"  # $0 of the task's shell: what ps shows
# torchrun's --tee copies each rank's lines, whole, to its own output with this tag (the one the
# agent's merged logs carry over SSH): the ranks of a node share srun's pipe, and unbuffered
# Python writes a line and its newline apart, so untagged output would interleave mid-line.
RANK_PREFIX_VAR, RANK_PREFIX = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:"
PORT_BASE, PORT_SPAN = 20000, 20000  # the master port when none is given: one per job id, as Lightning does
NOT_IN_ALLOCATION_HINT = ("run it inside an allocation: `salloc -N2 clusterrun up --from-slurm train.py`, or in a "
                          "batch script (`clusterrun export --sbatch HOSTS.yaml train.py` writes one)")
_GPU_COUNT = re.compile(r"(?:^|:)(\d+)$")  # "4", "a100:4" (SLURM_GPUS_PER_NODE), "gpu:a100:4"


@dataclass(frozen=True)
class Allocation:
    """The Slurm job clusterrun runs in: its id, its nodes in Slurm's order, the GPUs per node
    (None: Slurm gave none, or did not say) and the CPUs asked for per task (``-c``), if any."""

    job_id: str
    nodes: tuple[str, ...]
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None

    @property
    def master_port(self) -> int:
        """A port derived from the job id, so that two jobs on one node do not pick the same one."""
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits) % PORT_SPAN


def allocation_from_env(env: Mapping[str, str]) -> Allocation:
    """The allocation ``env`` (this process's environment under ``salloc``/``sbatch``) describes;
    ``ConfigError`` outside one, or for a node list that cannot be expanded."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        missing = "SLURM_JOB_ID" if not job_id else "SLURM_JOB_NODELIST"
        raise ConfigError(f"not inside a Slurm allocation: {missing} is not set", key="--from-slurm",
                          hint=NOT_IN_ALLOCATION_HINT)
    if env.get("SLURM_STEP_ID") not in (None, "", "batch", "extern", "interactive"):
        # one srun per task would start the job once per task, each waiting for CPUs the step holds
        raise ConfigError(f"inside job step {job_id}.{env['SLURM_STEP_ID']}: run `up --from-slurm` once, in the "
                          "allocation itself (salloc's shell or the batch script), not under srun",
                          key="--from-slurm", hint=NOT_IN_ALLOCATION_HINT)
    try:
        nodes = tuple(expand(nodelist))
    except NodeSetError as exc:
        raise ConfigError(f"SLURM_JOB_NODELIST: {exc}", key="--from-slurm",
                          hint="Slurm set this list; `scontrol show hostnames` shows how Slurm reads it") from None
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    return Allocation(job_id=job_id, nodes=nodes, gpus_per_node=_gpus(env),
                      cpus_per_task=int(cpus) if cpus.isdigit() and int(cpus) > 0 else None)


def _gpus(env: Mapping[str, str]) -> int | None:
    """GPUs per node as Slurm says: ``SLURM_GPUS_ON_NODE`` (in a step or batch script), else
    ``SLURM_GPUS_PER_NODE`` (``--gpus-per-node``, maybe typed: ``a100:4``)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        match = _GPU_COUNT.search(env.get(name, "").strip())
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def template_host(spec: ClusterSpec | None, first: str) -> HostSpec:
    """The hosts file's settings every node under Slurm gets (one srun, one command): those of the
    host named like the allocation's first node, else of its first host; none without a file."""
    if spec is None or not spec.hosts:
        return HostSpec(host=first, transport="local")
    return next((h for h in spec.hosts if h.host == first), spec.hosts[0])


def nproc_of(allocation: Allocation, host: HostSpec, given_by_file: bool) -> int:
    """Processes per node: one per GPU Slurm allocated, else the hosts file's ``nproc``/``gpus``, else 1."""
    if allocation.gpus_per_node:
        return allocation.gpus_per_node
    return host.nproc if given_by_file else 1


def same_nproc(spec: ClusterSpec) -> int:
    """The one ``nproc`` of every host of ``spec``; ``ConfigError`` where they differ (one srun
    runs the same command on every node)."""
    counts = {h.nproc for h in spec.hosts}
    if len(counts) != 1:
        first = spec.hosts[0]
        odd = next(h for h in spec.hosts if h.nproc != first.nproc)
        raise ConfigError(f"under Slurm every node runs the same number of processes; {first.host} has "
                          f"{first.nproc}, {odd.host} has {odd.nproc}", path=spec.path, line=odd.line,
                          hint="give every host the same nproc (or gpus) for Slurm")
    return counts.pop()


@dataclass(frozen=True)
class SlurmStep:
    """The job step ``up --from-slurm`` runs: the ``srun`` argv and the environment it needs
    (Slurm passes srun's environment on to every task: ``--export=ALL``)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    nodes: tuple[str, ...]
    nproc: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nproc * len(self.nodes)


def launch_plan(step: SlurmStep, *, job_id: str, name: str, script: str,
                script_args: Sequence[str]) -> LaunchPlan:
    """The step as the plan a consumer (the printer) knows: node ranks in Slurm's order, global
    ranks packed node after node as torchrun's static rendezvous assigns them."""
    nodes = tuple(NodeLaunch(rank=i, host=HostSpec(host=host, nproc=step.nproc), nproc=step.nproc,
                             first_rank=i * step.nproc, argv=step.argv, env=step.env, cwd=None)
                  for i, host in enumerate(step.nodes))
    return LaunchPlan(job_id=job_id, name=name, master_addr=step.master_addr, master_port=step.master_port,
                      nodes=nodes, script=script, script_args=tuple(script_args))


def task_argv(python: str, nproc: int, script: str, script_args: Sequence[str]) -> tuple[str, ...]:
    """What each task runs: ``TASK_SCRIPT`` with torchrun's per-job options as arguments."""
    # torchrun drops one "--" right after the script; protect an argument list that starts with one.
    guard = ("--",) if tuple(script_args[:1]) == ("--",) else ()
    return ("sh", "-c", TASK_SCRIPT, TASK_NAME, python, f"--nproc-per-node={nproc}", "--rdzv-backend=static",
            "--max-restarts=0", "--redirects=3", "--tee=3", script, *guard, *script_args)


def srun_options(nnodes: int, *, name: str, cwd: str | None) -> tuple[str, ...]:
    """srun's options: one task per node on every node, the whole step killed when one task fails,
    each output line labelled with its task (= node) number."""
    return (f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label",
            f"--job-name={name}", *((f"--chdir={cwd}",) if cwd else ()))


def build_step(allocation: Allocation, spec: ClusterSpec | None, script: str, script_args: Sequence[str], *,
               name: str, python: str, env_overrides: Mapping[str, str], cwd: str | None) -> SlurmStep:
    """The step for ``allocation``: every node of it, the hosts file's first host as the template."""
    host = template_host(spec, allocation.nodes[0])
    nproc = nproc_of(allocation, host, spec is not None)
    master_port = (spec.master_port if spec is not None and spec.master_port else None) or allocation.master_port
    master_addr = (spec.master_addr if spec is not None else None) or allocation.nodes[0]
    env = node_env(dataclasses.replace(host, gpus=None), env_overrides)
    env.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), RANK_PREFIX_VAR: RANK_PREFIX})
    # srun no longer takes -c from SLURM_CPUS_PER_TASK (Slurm 22.05): without it, torchrun and all
    # its workers would share one CPU where Slurm confines tasks to theirs
    cpus = (f"--cpus-per-task={allocation.cpus_per_task}",) if allocation.cpus_per_task else ()
    argv = ("srun", f"--jobid={allocation.job_id}", f"--nodelist={fold(list(allocation.nodes))}", *cpus,
            *srun_options(len(allocation.nodes), name=name, cwd=host.workdir or cwd),
            *task_argv(host.python or python, nproc, script, script_args))
    return SlurmStep(argv=argv, env=env, nodes=allocation.nodes, nproc=nproc, master_addr=master_addr,
                     master_port=master_port)


def sbatch_script(spec: ClusterSpec, script: str, script_args: Sequence[str], *, name: str,
                  env_overrides: Mapping[str, str], hosts_file: str) -> str:
    """A batch script that runs the job of ``spec`` under Slurm, as ``up`` would over SSH: as many
    nodes as hosts, their ``nproc`` and GPUs, the environment (secrets only by name: the file never
    holds a value of one), torchrun per node with the rendezvous on the first node."""
    nproc = same_nproc(spec)
    host = spec.hosts[0]
    lines = ["#!/bin/bash", f"# Written by `clusterrun export --sbatch` from {hosts_file}; submit with: sbatch FILE",
             f"#SBATCH --job-name={name}", f"#SBATCH --nodes={len(spec.hosts)}", "#SBATCH --ntasks-per-node=1"]
    if host.gpus:
        lines.append(f"#SBATCH --gpus-per-node={len(host.gpus)}")
    lines += ["set -euo pipefail", ""]
    lines += _env_lines(host, env_overrides, spec.secret_env)
    first_node = '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    addr = shlex.quote(spec.master_addr) if spec.master_addr else first_node
    port = str(spec.master_port) if spec.master_port else f"$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"
    lines += ["# sbatch's -c for srun's task too (srun does not read SLURM_CPUS_PER_TASK since Slurm 22.05)",
              'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi', "",
              "# the rendezvous: torchrun's static one, on the first node of the allocation",
              f"export MASTER_ADDR={addr}", f"export MASTER_PORT={port}",
              f"export {RANK_PREFIX_VAR}={shlex.quote(RANK_PREFIX)}  # each line tagged with its rank", ""]
    task = task_argv(host.python or "python3", nproc, script, script_args)
    # srun and its options; the task's shell; its interpreter and torchrun's options; the script
    groups = [("srun", *srun_options(len(spec.hosts), name=name, cwd=host.workdir)), task[:4], task[4:10], task[10:]]
    lines.append(" \\\n    ".join(shlex.join(words) for words in groups if words))
    return "\n".join(lines) + "\n"


def _env_lines(host: HostSpec, env_overrides: Mapping[str, str], secret_env: Sequence[str]) -> list[str]:
    """The job's environment as shell lines: values of ``env:`` and ``--env`` written out, except
    secrets; ``forward_env`` and secrets taken from sbatch's own environment (which Slurm passes
    on), checked at the start; ``env_file`` read on the node when the job starts."""
    lines: list[str] = []
    env = node_env(dataclasses.replace(host, gpus=None), env_overrides)
    for name in sorted(env):
        if looks_secret(name, secret_env):
            lines += [f"# {name} is secret: not written here; set it where you run sbatch",
                      f': "${{{name}:?set {name} in the environment you run sbatch from}}"', f"export {name}"]
        else:
            lines.append(f"export {name}={shlex.quote(env[name])}")
    for pattern in host.forward_env:
        if any(c in pattern for c in "*?[") or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", pattern):
            lines.append(f"# forward_env {pattern}: every variable of sbatch's environment reaches the job")
        else:
            lines.append(f"export {pattern}  # forward_env: from the environment you run sbatch from")
    for ref in host.env_file:
        lines.append(f"set -a; . {shlex.quote(ref.path)}; set +a  # env_file, read when the job starts")
    return [*lines, ""] if lines else []
