"""Run a ``SlurmStep`` (``clusterrun.slurm.step``): the one ``srun`` in the foreground, its labelled
output turned into the same events as a job over SSH, ``scancel`` as the stop.

Lifecycle: create → ``start()`` (srun in a session of its own: a terminal's Ctrl-C reaches this
process, which stops the step, and not srun directly) → ``run()`` (reads srun's output until it
ends; returns the ``JobResult``). ``request_stop()`` may be called from a signal handler: from a
thread, it stops the step (``stop_step``: ``scancel --signal=TERM``, then ``scancel`` after the
grace; the step found by its name, the clusterrun job id), and Slurm signals every process of it,
on every node. ``down`` stops a step from elsewhere the same way, found among the user's steps
(``my_steps``, which ``ps`` lists too), and marks the allocation so that ``run()`` reports it stopped.

Slurm is the supervisor here: no agent, no detaching, no cgroup of clusterrun's; srun gets
SIGTERM should this process die (and ends the step), as a step ends with its allocation. Each node's
outcome comes from srun's own report (``srun: error: HOST: task N: Exited with exit code C``);
a node srun does not name ended with exit code 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from clusterrun.core.events import (
    Event,
    JobFinished,
    JobNote,
    JobResult,
    LogLines,
    NodeExited,
    NodeResult,
    NodeState,
    NodeStateChanged,
    RootCause,
)
from clusterrun.core.frozen import frozen
from clusterrun.diagnose.rootcause import NodeLog
from clusterrun.slurm.step import FAILURE_MARK, Allocation, SlurmStep, allocation_from_env, gpus_by_node

Emit = Callable[[Event], None]
PR_SET_PDEATHSIG = 1  # prctl(2)
STOPPED_MARK = "clusterrun-down:"  # the allocation's comment once `down` stopped a step of it
LAST_LINES = 20  # of a failed node, for the root cause
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")  # srun --label: "0: text", padded for 10 tasks and more
_TASK_END = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (Exited with exit code (\d+)|.+)$")
_SIGNALS = {"Killed": signal.SIGKILL, "Terminated": signal.SIGTERM, "Aborted": signal.SIGABRT,
            "Segmentation fault": signal.SIGSEGV, "Interrupt": signal.SIGINT}


@frozen
class TaskEnd:
    """One line of srun's report of a task that did not exit 0."""

    node: int
    host: str
    exit_code: int | None
    signal: int | None
    text: str


def parse_task_end(line: str) -> list[TaskEnd]:
    """The tasks a line of srun's names (``task 1``, ``tasks 0-2``, ``tasks 0,3``), or none."""
    match = _TASK_END.match(line)
    if match is None:
        return []
    host, tasks, how, code = match.groups()
    nodes: list[int] = []
    for part in tasks.split(","):
        first, _, last = part.partition("-")
        nodes += range(int(first), int(last or first) + 1)
    sig = _SIGNALS.get(how.strip())
    return [TaskEnd(node=n, host=host, exit_code=int(code) if code is not None else None,
                    signal=int(sig) if sig is not None else None, text=how) for n in nodes]


def step_of(squeue_lines: Sequence[str], name: str) -> str | None:
    """``JOBID.STEPID`` of the step called ``name`` in ``squeue --steps --format='%i %j'`` output."""
    for line in squeue_lines:
        words = line.split()
        if len(words) >= 2 and words[1] == name:
            return words[0]
    return None


@frozen
class StepInfo:
    """A running step as squeue lists it: ``JOBID.STEPID``, its name, its nodes, how long it has run."""

    step: str
    name: str
    nodes: str = ""
    elapsed: str = ""


def slurm_here(environ: Mapping[str, str]) -> bool:
    """Whether this machine may reach a Slurm cluster: its client and a configuration (``SLURM_CONF``, the
    usual file, a configless node's cache, or an allocation's variables); ``ps`` asks squeue only then."""
    return shutil.which("squeue", path=environ.get("PATH")) is not None and (
        any(name in environ for name in ("SLURM_CONF", "SLURM_JOB_ID"))
        or any(os.path.exists(p) for p in ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/run/slurm/conf")))


def my_steps(environ: Mapping[str, str] | None = None) -> list[StepInfo]:
    """This user's running steps, as squeue lists them (none where ``slurm_here`` is not so)."""
    if not slurm_here(os.environ if environ is None else environ):
        return []
    try:
        done = subprocess.run(["squeue", "--steps", "--me", "--noheader", "--format=%i %j %N %M"],
                              capture_output=True, text=True, check=False, env=environ)
    except OSError:
        return []
    return [StepInfo(*words[:4]) for words in map(str.split, done.stdout.splitlines()) if len(words) >= 2]


def step_gone(step: str, environ: Mapping[str, str] | None = None) -> Callable[[float], bool]:
    """``ended`` for ``stop_step`` from elsewhere: whether squeue stops listing ``step`` within the time."""
    def ended(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(s.step == step for s in my_steps(environ)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        return True
    return ended


def allocation_here(environ: Mapping[str, str]) -> Allocation:
    """The allocation ``environ`` describes (``ConfigError`` outside one), with each node's GPUs as
    ``scontrol show job -d`` says: Slurm's variables do not say them for ``--gres=gpu:N`` nor per
    node for ``--gpus=N``. Without scontrol's answer, what the variables say."""
    allocation = allocation_from_env(environ)
    try:
        done = subprocess.run(["scontrol", "show", "job", "-d", allocation.job_id], capture_output=True, text=True,
                              check=False, env=dict(environ), timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return allocation
    gpus = gpus_by_node(done.stdout) if done.returncode == 0 else {}
    return dataclasses.replace(allocation, node_gpus=gpus) if gpus else allocation


def find_step(job_id: str, name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The running step of Slurm job ``job_id`` named ``name``, asked of squeue; None if none."""
    done = subprocess.run(["squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i %j"],
                          capture_output=True, text=True, check=False, env=environ)
    return step_of(done.stdout.splitlines(), name) if done.returncode == 0 else None


def cancel_step(step: str, signal_name: str | None = None) -> tuple[bool, str]:
    """``scancel STEP`` (with ``signal_name``: only send it that signal): whether it was accepted,
    and what scancel said."""
    how = [f"--signal={signal_name}"] if signal_name else []
    try:
        done = subprocess.run(["scancel", *how, step], capture_output=True, text=True, check=False)
    except OSError as exc:
        return False, f"scancel could not run: {exc}"
    return done.returncode == 0, (done.stderr or done.stdout).strip()


def stop_step(step: str, grace: float, ended: Callable[[float], bool]) -> str:
    """The stop of a step, here and in ``down``: SIGTERM to every task (torchrun stops its workers),
    then, if ``ended(grace)`` says it has not ended within ``grace`` seconds, the step cancelled (a
    SIGKILL to all its processes, on every node). What happened, as a note."""
    ok, said = cancel_step(step, "TERM")
    if ok and ended(grace):
        return f"scancel --signal=TERM {step}: the step ended within the grace"
    ok, said = cancel_step(step)
    return f"scancel {step}: " + ("the step is cancelled on every node" if ok else f"failed: {said}")


def mark_stopped(slurm_job: str, name: str, environ: Mapping[str, str] | None = None) -> None:
    """Leave ``down``'s word on the allocation (its comment), where the ``up`` following the step looks."""
    with contextlib.suppress(OSError):  # no mark: `up` reports the ranks' ends as they are
        subprocess.run(["scontrol", "update", f"JobId={slurm_job}", f"Comment={STOPPED_MARK}{name}"],
                       capture_output=True, check=False, env=environ)


def was_stopped(slurm_job: str, name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``down`` stopped the step ``name`` of ``slurm_job`` (``mark_stopped``)."""
    try:
        done = subprocess.run(["squeue", f"--jobs={slurm_job}", "--noheader", "--format=%k"], capture_output=True,
                              text=True, check=False, env=environ)
    except OSError:  # no squeue (a stand-in for srun): nobody can have marked it
        return False
    return f"{STOPPED_MARK}{name}" in done.stdout


class SlurmRun:
    """One ``up --from-slurm``: create → ``start()`` → ``run()``; ``request_stop()`` at any time."""

    def __init__(self, step: SlurmStep, *, job_id: str, slurm_job: str, emit: Emit, grace: float = 10.0,
                 environ: Mapping[str, str] | None = None) -> None:
        self.step = step
        self.grace = grace
        self.job_id = job_id
        self.slurm_job = slurm_job
        self._emit = emit
        self._env = {**(os.environ if environ is None else environ), **step.env}
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop_reason: str | None = None
        self._stopper: threading.Thread | None = None
        self._ends: dict[int, TaskEnd] = {}
        self._first_failure: int | None = None
        self._logs = {n: NodeLog(tail=LAST_LINES) for n in range(len(step.nodes))}

    def start(self) -> None:
        self._proc = subprocess.Popen(self.step.argv, env=self._env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        self._emit(JobNote(None, text=f"srun started {len(self.step.nodes)} tasks in Slurm job {self.slurm_job} "
                                      f"(srun pid {self._proc.pid}); the step is named {self.job_id}"))
        for node, host in enumerate(self.step.nodes):
            self._emit(NodeStateChanged(node, host=host, state=NodeState.RUNNING))

    def request_stop(self, reason: str) -> None:
        """Cancel the step (from a thread: safe in a signal handler); the second call does nothing."""
        if self._stop_reason is not None:
            return
        self._stop_reason = reason
        self._stopper = threading.Thread(target=self._cancel, name="scancel", daemon=True)
        self._stopper.start()

    def _cancel(self) -> None:
        step = find_step(self.slurm_job, self.job_id, self._env)
        if step is None:  # not created yet, or already over: srun itself ends what it started
            if self._proc is not None and self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
            return
        self._emit(JobNote(None, text=stop_step(step, self.grace, self._srun_ended)))

    def _srun_ended(self, timeout: float) -> bool:
        try:
            return self._proc is not None and self._proc.wait(timeout=timeout) is not None
        except subprocess.TimeoutExpired:
            return False

    def run(self) -> JobResult:
        """Follow srun's output until it ends, then the result of every node."""
        if self._proc is None or self._proc.stdout is None:
            raise RuntimeError("start() first")
        with self._proc.stdout:
            for batch in _batches(self._proc.stdout.fileno()):
                self._take(batch)
        code = self._proc.wait()
        if self._stopper is not None:
            self._stopper.join()
        elif code != 0 and was_stopped(self.slurm_job, self.job_id, self._env):
            self._stop_reason = "clusterrun down"
        result = self._result(code)
        for node in result.nodes:
            self._emit(NodeExited(node.node, result=node))
        self._emit(JobFinished(None, result=result))
        return result

    def _take(self, lines: list[str]) -> None:
        """Emit ``lines`` as log lines of their nodes, in order; srun's own lines as notes."""
        run: list[str] = []
        node: int | None = None
        for line in lines:
            match = _LABEL.match(line)
            mine = int(match.group(1)) if match and int(match.group(1)) < len(self.step.nodes) else None
            if mine != node and run:
                self._flush(node, run)
                run = []
            node = mine
            if mine is not None and match is not None:
                run.append(match.group(2))
                self._logs[mine].feed([match.group(2)])
            else:
                run.append(line)
                for end in parse_task_end(line):
                    if end.node < len(self.step.nodes):
                        self._ends.setdefault(end.node, end)
                        if self._first_failure is None and end.exit_code:
                            self._first_failure = end.node
        if run:
            self._flush(node, run)

    def _flush(self, node: int | None, lines: list[str]) -> None:
        if node is None:
            for line in lines:
                self._emit(JobNote(None, text=line))
        else:
            self._emit(LogLines(node, host=self.step.nodes[node], lines=tuple(lines)))

    def _result(self, code: int) -> JobResult:
        stopped = self._stop_reason is not None
        nodes = []
        for node, host in enumerate(self.step.nodes):
            end = self._ends.get(node)
            if end is None:
                state = NodeState.STOPPED if stopped and code != 0 else NodeState.SUCCEEDED
                nodes.append(NodeResult(node, host, state, exit_code=0 if state is NodeState.SUCCEEDED else None))
            elif end.exit_code is not None:
                state = NodeState.STOPPED if stopped else NodeState.FAILED
                nodes.append(NodeResult(node, host, state, exit_code=end.exit_code))
            else:  # signalled: by our stop, or by srun's --kill-on-bad-exit after another node failed
                state = NodeState.STOPPED if stopped or self._first_failure is not None else NodeState.FAILED
                nodes.append(NodeResult(node, host, state, signal=end.signal, error=end.text))
        if code != 0 and not stopped and all(n.ok for n in nodes):  # srun failed before any task ran
            nodes = [NodeResult(n.node, n.host, NodeState.FAILED, error=f"srun exited with {code}") for n in nodes]
        return JobResult(self.job_id, tuple(nodes), root_cause=self._root_cause(), interrupted=self._stop_reason)

    def _root_cause(self) -> RootCause | None:
        """The first node srun saw fail; there, the rank torchrun's failure report names, with its
        last lines (torchrun's own when no rank is named)."""
        node = self._first_failure
        if node is None:
            return None
        log, host = self._logs[node], self.step.nodes[node]
        for rank, failure in log.failures.items():
            return failure.cause(node, host, rank, tuple(log.rank_tails.get(rank, ())))
        lines = tuple(log.lines())
        before = next((m.group(1) for line in reversed(lines) if (m := FAILURE_MARK.match(line))), "")
        return RootCause(node=node, host=host, rank=None, local_rank=None, exit_code=self._ends[node].exit_code,
                         signal=None, last_lines=lines, message=before)


def _die_with_parent() -> None:
    """In srun, before its exec: SIGTERM when this process dies, which srun answers by ending the
    step. Under Slurm nothing outlives its controller unseen, as nothing outlives salloc."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _batches(fd: int) -> Iterator[list[str]]:
    """Whole lines from ``fd`` as they arrive, as many as one read brings; a last partial line at the end."""
    pending = b""
    while chunk := os.read(fd, 65536):
        pending += chunk
        *whole, pending = pending.split(b"\n")
        if whole:
            yield [line.decode("utf-8", "replace").rstrip("\r") for line in whole]
    if pending:
        yield [pending.decode("utf-8", "replace")]
