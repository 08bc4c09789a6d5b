"""Slurm as the launcher: the allocation read from Slurm's variables, the one ``srun`` that starts a
torchrun per node, and the batch script of ``clusterrun export --sbatch``. Pure: no I/O, no clock;
the environment comes in as a mapping.

Under Slurm the job is one job step: ``srun --nodes=N --ntasks-per-node=1 --kill-on-bad-exit=1``
runs the same command on every node, Slurm tracks, limits and signals every process of it, and
``scancel JOBID.STEPID`` is the stop. So every node gets the same argv and environment: in the task
(``TASK_SCRIPT``) a node finds its own process count by its Slurm node name, enters the workdir,
runs the hosts file's ``setup`` in its shell, checks python, the script and torch (the preflight),
then runs torchrun with its node rank from ``SLURM_NODEID``; the master is the first node of the
allocation, and GPUs are Slurm's to hand out (no ``CUDA_VISIBLE_DEVICES`` of ours).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence

from clusterrun.config.envrules import looks_secret
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.config.nodesets import NodeSetError, expand, fold
from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen
from clusterrun.run.plan import TORCHRUN_MODULE, LaunchPlan, NodeLaunch, job_name, new_job_id, node_env

# What each task runs, one constant script (its names prefixed _cr_: setup runs in its shell and must
# not change them); the job's values come as arguments (``sh -c TASK_SCRIPT
# clusterrun-node PYTHON NPROC WORKDIR SETUP CHECKS SCRIPT ARGS...``), so none is formatted into shell text
# but ``setup``, which is shell text already. NPROC is one count, or ``NODE=COUNT ...`` where nodes
# differ (torchrun's static rendezvous packs the ranks node after node, whatever each node's count).
# What fails before torchrun fails the node: a line ``clusterrun: node NAME: ...`` (FAILURE_MARK), a
# second's wait (else srun's --kill-on-bad-exit may end the step before that line reaches srun: seen
# once in 20 failures without it, none in 20 with it), and its exit code.
# torchrun's per-rank files (its --redirects, which --tee reads) go to a directory of the task's,
# removed when torchrun ends: without --log-dir torchrun leaves a /tmp/torchelastic_* with a copy of
# every rank's output on every node, at every run. So the shell waits for torchrun instead of exec'ing
# it; Slurm signals every process of the step, torchrun too, and the shell's trap lets it outlive the
# signal to remove the directory and exit with torchrun's status (a SIGKILL leaves it behind).
TASK_SCRIPT = (r"""set -f
_cr_python=$1 _cr_nproc=$2 _cr_workdir=$3 _cr_setup=$4 _cr_checks=$5; shift 5
_cr_node=${SLURMD_NODENAME:-$(uname -n)}
_cr_fail() { _cr_code=$1; shift; trap - EXIT; echo "clusterrun: node $_cr_node: $*" >&2; sleep 1; exit "$_cr_code"; }
case $_cr_nproc in *=*)
    _cr_count=; for _cr_word in $_cr_nproc; do case $_cr_word in "$_cr_node="*) _cr_count=${_cr_word#*=};; esac; done
    [ -n "$_cr_count" ] || _cr_fail 2 "no process count for this node in: $_cr_nproc"; _cr_nproc=$_cr_count;; esac
set +f
case $_cr_workdir in "~") _cr_workdir=$HOME;; "~/"*) _cr_workdir=$HOME/${_cr_workdir#"~/"};; esac
if [ -n "$_cr_workdir" ]; then
    [ -d "$_cr_workdir" ] || _cr_fail 2 "the workdir $_cr_workdir does not exist"
    cd "$_cr_workdir" || _cr_fail 2 "cannot enter $_cr_workdir"
fi
_cr_ended='_cr_rc=$?; [ "$_cr_rc" -ne 0 ] || _cr_rc=2
    echo "clusterrun: node $_cr_node: setup ended the shell (exit?) with status $_cr_rc" >&2'
if [ -n "$_cr_setup" ]; then trap "$_cr_ended; sleep 1; exit \$_cr_rc" EXIT; eval "$_cr_setup"; trap - EXIT; fi
if [ "$_cr_checks" = preflight ]; then
    if ! command -v "$_cr_python" >/dev/null 2>&1; then
        _cr_fail 127 "python not found: $_cr_python (the hosts file's python:, or PATH)"; fi
    [ -f "$1" ] || _cr_fail 2 "the script $1 does not exist in $(pwd)"
    _cr_torch='import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'
    "$_cr_python" -c "$_cr_torch" || _cr_fail 2 "torch is not installed for $_cr_python"
fi
_cr_tmp=${TMPDIR:-/tmp}
_cr_logs=$(mktemp -d "$_cr_tmp/clusterrun-torchrun.XXXXXX") ||
    _cr_fail 2 "cannot make a directory for torchrun's logs in $_cr_tmp (free space there, or set TMPDIR)"
trap : HUP INT TERM
"$_cr_python" -m """ + TORCHRUN_MODULE + r""" --node-rank="$SLURM_NODEID" --nnodes="$SLURM_NNODES" """
               r"""--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --nproc-per-node="$_cr_nproc" """
               r"""--rdzv-backend=static --max-restarts=0 --redirects=3 --tee=3 --log-dir="$_cr_logs" "$@"
_cr_rc=$?
rm -rf "$_cr_logs"
exit "$_cr_rc"
""")
TASK_NAME = "clusterrun-node"  # $0 of the task's shell: what ps shows
FAILURE_MARK = re.compile(r"^clusterrun: node \S+: (.*)$")  # the task's line when it fails before torchrun
# torchrun's --tee copies each rank's lines, whole, to its own output with this tag (the one the
# agent's merged logs carry over SSH): the ranks of a node share srun's pipe, and unbuffered
# Python writes a line and its newline apart, so untagged output would interleave mid-line.
RANK_PREFIX_VAR, RANK_PREFIX = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:"
PORT_BASE, PORT_SPAN = 20000, 20000  # the master port when none is given: one per job id, as Lightning does
NOT_IN_ALLOCATION_HINT = ("run it inside an allocation: `salloc -N2 clusterrun up --from-slurm train.py`, or in a "
                          "batch script (`clusterrun export --sbatch HOSTS.yaml train.py` writes one)")
_GPU_COUNT = re.compile(r"(?:^|:)(\d+)$")  # "4", "a100:4" (SLURM_GPUS_PER_NODE), "gpu:a100:4"
_NODE_GRES = re.compile(r"^\s*Nodes=(\S+) .*\bGRES=(\S*)", re.MULTILINE)  # scontrol show job -d
_GPU_GRES = re.compile(r"gpu(?::[^:(]+)?:(\d+)(?:\(|$)")  # gpu:2(IDX:0-1), gpu:a100:2(IDX:0-1)
_COUNTS = re.compile(r"(\d+)(?:\(x(\d+)\))?")  # one part of Slurm's "2(x3),1": 2, three times


@frozen
class Allocation:
    """The Slurm job clusterrun runs in: its id, its nodes in Slurm's order, the GPUs per node
    (None: Slurm gave none, or did not say), the CPUs asked for per task (``-c``), if any, the
    tasks per node, in the nodes' order, where tasks were asked for (``-n``, ``--ntasks-per-node``),
    and the GPUs of each node by name, where ``scontrol show job -d`` said (``node_gpus``)."""

    job_id: str
    nodes: tuple[str, ...]
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    tasks_per_node: tuple[int, ...] | None = None
    node_gpus: Mapping[str, int] | None = None

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
    asked = any(env.get(name) for name in ("SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS"))
    tasks = env.get("SLURM_TASKS_PER_NODE", "") if asked else ""
    return Allocation(job_id=job_id, nodes=nodes, gpus_per_node=_gpus(env),
                      cpus_per_task=int(cpus) if cpus.isdigit() and int(cpus) > 0 else None,
                      tasks_per_node=slurm_counts(tasks, len(nodes), "SLURM_TASKS_PER_NODE") if tasks else None)


def slurm_counts(text: str, nnodes: int, name: str) -> tuple[int, ...]:
    """One count per node from Slurm's compressed form (``2(x3),1`` is 2, 2, 2, 1); ``ConfigError``
    naming the variable ``name`` where it is malformed or not one count per node."""
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNTS.fullmatch(part.strip())
        if match is None:
            raise ConfigError(f"{name}={text!r}: cannot read {part!r} (Slurm writes counts as 2(x3),1)",
                              key="--from-slurm", hint="run `up --from-slurm` in the allocation's own environment")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != nnodes:
        raise ConfigError(f"{name}={text!r} gives {len(counts)} counts for {nnodes} nodes", key="--from-slurm",
                          hint="run `up --from-slurm` in the allocation's own environment")
    return tuple(counts)


def gpus_by_node(details: str) -> dict[str, int]:
    """Each node's GPUs from ``scontrol show job -d`` (``Nodes=sim[1-2] ... GRES=gpu:a100:2(IDX:0-1)``);
    none where it names no GPU (or could not be read: ``details`` empty)."""
    found: dict[str, int] = {}
    for nodes, gres in _NODE_GRES.findall(details):
        count = sum(int(m.group(1)) for item in gres.split(",") if (m := _GPU_GRES.match(item)))
        if count:
            try:
                found.update(dict.fromkeys(expand(nodes), count))
            except NodeSetError:
                continue
    return found


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


def node_nprocs(allocation: Allocation, spec: ClusterSpec | None) -> tuple[tuple[int, ...], str]:
    """Processes per node, in the allocation's order, and where they come from: one per GPU Slurm
    allocated (each node's as scontrol said, else the same on every node as the variables say);
    else the hosts file's ``nproc``/``gpus`` of the host named like the node (of the template host
    for a node it does not name); else the tasks per node asked of Slurm (``-n``,
    ``--ntasks-per-node``); else 1."""
    nodes = allocation.nodes
    if allocation.node_gpus and all(allocation.node_gpus.get(node) for node in nodes):
        return tuple(allocation.node_gpus[node] for node in nodes), "one per GPU Slurm allocated on the node"
    if allocation.gpus_per_node:
        return (allocation.gpus_per_node,) * len(nodes), "one per GPU Slurm allocated"
    if spec is not None and spec.hosts:
        template = template_host(spec, nodes[0])
        by_name = {h.host: h.nproc for h in spec.hosts}
        return tuple(by_name.get(node, template.nproc) for node in nodes), "the hosts file's nproc"
    if allocation.tasks_per_node:
        return allocation.tasks_per_node, "the tasks per node asked of Slurm"
    return (1,) * len(nodes), "1 per node: no GPUs, hosts file or tasks given"


def nproc_word(nodes: Sequence[str], nprocs: Sequence[int]) -> str:
    """The task's NPROC argument: the one count, or ``NODE=COUNT`` for each node where they differ."""
    if len(set(nprocs)) == 1:
        return str(nprocs[0])
    return " ".join(f"{node}={n}" for node, n in zip(nodes, nprocs, strict=True))


def setup_text(commands: Sequence[str]) -> str:
    """The hosts file's ``setup`` as the task's shell runs it (``eval``, before torchrun, in the same
    shell, so that ``source venv/bin/activate`` holds): each command in turn; the first that fails
    fails the node with its status, naming which it was."""
    lines = []
    for i, command in enumerate(commands):
        lines += [command.rstrip("\n"), '_cr_rc=$?; if [ "$_cr_rc" -ne 0 ]; then _cr_fail "$_cr_rc" "setup[' + str(i)
                  + '] exited with status $_cr_rc"; fi']
    return "\n".join(lines)


def refuse_sync(spec: ClusterSpec, hosts: Sequence[HostSpec]) -> None:
    """``sync:`` under Slurm is refused (``ConfigError`` at the first host that has one): the sync
    copies over SSH connections, which Slurm's launch does not open, and a Slurm cluster's nodes
    share a file system."""
    for host in hosts:
        if host.sync is not None:
            raise ConfigError(f"host {host.host} has `sync: {host.sync}`, which --from-slurm does not do: it opens no "
                              "SSH connection to copy over, and Slurm's nodes read the job's files from their shared "
                              "file system", path=spec.path,
                              line=host.line, key="sync",
                              hint="pass --no-sync (the files are already there), or copy them first, then "
                              "leave sync: out of the file given to --slurm-hosts")


@frozen
class SlurmStep:
    """The job step ``up --from-slurm`` runs: the ``srun`` argv and the environment it needs
    (Slurm passes srun's environment on to every task: ``--export=ALL``), each node's process count
    (``nprocs``, in the nodes' order) and where it came from; the job it runs (``job_id``, the
    step's Slurm name, ``name``, the script and its arguments)."""

    job_id: str
    name: str
    script: str
    script_args: tuple[str, ...]
    argv: tuple[str, ...]
    env: Mapping[str, str]
    nodes: tuple[str, ...]
    nprocs: tuple[int, ...]
    master_addr: str
    master_port: int
    nproc_source: str = ""

    @property
    def world_size(self) -> int:
        return sum(self.nprocs)


def launch_plan(step: SlurmStep) -> LaunchPlan:
    """The step as the plan a consumer (the printer) knows: node ranks in Slurm's order, global
    ranks packed node after node as torchrun's static rendezvous assigns them."""
    firsts = [sum(step.nprocs[:i]) for i in range(len(step.nodes))]
    nodes = tuple(NodeLaunch(rank=i, host=HostSpec(host=host, nproc=n), nproc=n, first_rank=first, argv=step.argv,
                             env=step.env, cwd=None)
                  for i, (host, n, first) in enumerate(zip(step.nodes, step.nprocs, firsts, strict=True)))
    return LaunchPlan(job_id=step.job_id, name=step.name, master_addr=step.master_addr, master_port=step.master_port,
                      nodes=nodes, script=step.script, script_args=step.script_args)


def task_argv(python: str, nproc: str, script: str, script_args: Sequence[str], *, workdir: str | None = None,
              setup: Sequence[str] = (), preflight: bool = True) -> tuple[str, ...]:
    """What each task runs: ``TASK_SCRIPT`` with the job's values as arguments; in bash where there
    is a ``setup`` (what it is written for over SSH too), else in sh; the preflight unless not ``preflight``."""
    # torchrun drops one "--" right after the script; protect an argument list that starts with one.
    guard = ("--",) if tuple(script_args[:1]) == ("--",) else ()
    return ("bash" if setup else "sh", "-c", TASK_SCRIPT, TASK_NAME, python, nproc, workdir or "", setup_text(setup),
            "preflight" if preflight else "none", script, *guard, *script_args)


def srun_options(nnodes: int, *, name: str) -> tuple[str, ...]:
    """srun's options: one task per node on every node, the whole step killed when one task fails,
    each output line labelled with its task (= node) number."""
    return (f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label",
            f"--job-name={name}")


def build_step(allocation: Allocation, spec: ClusterSpec | None, script: str, script_args: Sequence[str], *,
               name: str | None, python: str, env_overrides: Mapping[str, str], cwd: str | None,
               no_sync: bool = False, preflight: bool = True) -> SlurmStep:
    """The step for ``allocation``: every node of it, the hosts file's first host as the template
    (its nproc per node), a new job (``name``: ``--name``, else the script's); ``ConfigError`` for a
    ``sync:`` unless ``no_sync``."""
    host = template_host(spec, allocation.nodes[0])
    if spec is not None and not no_sync:
        refuse_sync(spec, [host, *(h for h in spec.hosts if h.host in allocation.nodes)])
    nprocs, source = node_nprocs(allocation, spec)
    master_port = (spec.master_port if spec is not None and spec.master_port else None) or allocation.master_port
    master_addr = (spec.master_addr if spec is not None else None) or allocation.nodes[0]
    env = node_env(dataclasses.replace(host, gpus=None), env_overrides)
    env.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), RANK_PREFIX_VAR: RANK_PREFIX})
    # srun no longer takes -c from SLURM_CPUS_PER_TASK (Slurm 22.05): without it, torchrun and all
    # its workers would share one CPU where Slurm confines tasks to theirs
    cpus = (f"--cpus-per-task={allocation.cpus_per_task}",) if allocation.cpus_per_task else ()
    task = task_argv(host.python or python, nproc_word(allocation.nodes, nprocs), script, script_args,
                     workdir=host.workdir or cwd, setup=host.setup, preflight=preflight)
    jname = job_name(name, script)
    job_id = new_job_id(jname)
    argv = ("srun", f"--jobid={allocation.job_id}", f"--nodelist={fold(list(allocation.nodes))}", *cpus,
            *srun_options(len(allocation.nodes), name=job_id), *task)
    return SlurmStep(job_id=job_id, name=jname, script=script, script_args=tuple(script_args), argv=argv, env=env,
                     nodes=allocation.nodes, nprocs=nprocs, master_addr=master_addr, master_port=master_port,
                     nproc_source=source)


def sbatch_script(spec: ClusterSpec, script: str, script_args: Sequence[str], *, name: str,
                  env_overrides: Mapping[str, str], hosts_file: str) -> str:
    """A batch script that runs the job of ``spec`` under Slurm, as ``up`` would over SSH: as many
    nodes as hosts, their ``nproc`` (where they differ, exactly those hosts, each its own count) and
    GPUs, the environment (secrets only by name: the file never holds a value of one), the first
    host's ``setup`` and preflight in each task, torchrun per node with the rendezvous on the first node."""
    refuse_sync(spec, spec.hosts)
    host = spec.hosts[0]
    gpus = {len(h.gpus or ()) for h in spec.hosts}
    if len(gpus) > 1:
        odd = next(h for h in spec.hosts if len(h.gpus or ()) != len(host.gpus or ()))
        raise ConfigError(f"Slurm's --gpus-per-node is one count for every node; {host.host} has "
                          f"{len(host.gpus or ())} GPUs, {odd.host} has {len(odd.gpus or ())}", path=spec.path,
                          line=odd.line, key="gpus", hint="give every host the same number of gpus (nproc may differ)")
    nprocs = [h.nproc for h in spec.hosts]
    names = [h.host for h in spec.hosts]
    lines = ["#!/bin/bash", f"# Written by `clusterrun export --sbatch` from {hosts_file}; submit with: sbatch FILE",
             f"#SBATCH --job-name={name}", f"#SBATCH --nodes={len(spec.hosts)}", "#SBATCH --ntasks-per-node=1"]
    if len(set(nprocs)) > 1:  # each count goes to its host by Slurm node name: those hosts, and no others
        lines += [f"# the hosts' nproc differ ({nproc_word(names, nprocs)}): exactly these nodes",
                  f"#SBATCH --nodelist={fold(names)}"]
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
    task = task_argv(host.python or "python3", nproc_word(names, nprocs), script, script_args, workdir=host.workdir,
                     setup=host.setup)
    # srun and its options; the task's shell; its interpreter, nproc, workdir, setup, checks; the script
    groups = [("srun", *srun_options(len(spec.hosts), name=name)), task[:4], task[4:9], task[9:]]
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
