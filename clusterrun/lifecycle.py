"""A job's life after ``up``: its record, its monitor, ``ps`` reconciliation, ``down`` and ``restart``.

Every function here works from the job's record (``jobs.JobRecord``) and talks to the hosts
through the same transports and node agent as ``up``; none of them prints. The CLI turns their
results into text and exit codes.

The policies of the job's owner (follow, fail-fast, restart, hand-over to the background monitor)
are in ``runner.py``, built from the pieces here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from clusterrun.config import ClusterSpec, load_cluster_text
from clusterrun.environment import MASK, mask_env, resolve, unmask
from clusterrun.errors import ClusterrunError, ConfigError, HostsUnavailable, StateError, TransportError
from clusterrun.events import (
    AttemptStarted,
    Event,
    JobFinished,
    JobNote,
    JobResult,
    JobState,
    NodeExited,
    NodeLink,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    StopReport,
)
from clusterrun.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord
from clusterrun.orchestrator import Emit, Job, Reconnect, node_state_of
from clusterrun.plan import LaunchPlan, node_env, plan_from_json, plan_to_json
from clusterrun.protocol import End, Eof, HostState, LogChunk, NodeStatus, decode_follow, decode_status
from clusterrun.sync import sync_hosts
from clusterrun.transports import Transport, transport_for


def new_record(plan: LaunchPlan, *, hosts_file: str, hosts_text: str, env_overrides: dict[str, str],
               local_cwd: str, ssh_config: str | None, unreachable_timeout: float | None = None,
               retry_startup: bool = True) -> JobRecord:
    """The record of a job about to start its first attempt."""
    return JobRecord(
        job_id=plan.job_id, name=plan.name, created=time.time(), hosts_file=os.path.abspath(hosts_file),
        hosts_text=hosts_text, script=plan.script, script_args=list(plan.script_args),
        env_overrides=mask_env(env_overrides, plan.secret_env), local_cwd=local_cwd, grace=plan.grace,
        ssh_config=ssh_config,
        plan=plan_to_json(plan), attempt=1, unreachable_timeout=unreachable_timeout, retry_startup=retry_startup,
        attempts=[AttemptRecord(1, started=time.time(), master_port=plan.master_port)],
        nodes=[NodeRecord(n.rank, n.host.host) for n in plan.nodes],
    )


def plan_to_start(record: JobRecord) -> LaunchPlan:
    """The recorded plan of the current attempt with its secret values again, for starting nodes
    that were never started (the record holds them masked): read now, as ``start_attempt`` does.
    Raises ``ConfigError`` for one that cannot be found."""
    spec, _notes = resolve(spec_of(record), os.environ)
    overrides = unmask(record.env_overrides, os.environ, "--env")
    plan = plan_from_json(record.plan, spec)
    nodes = []
    for node in plan.nodes:
        fresh = node_env(node.host, overrides)
        env = dict(node.env)
        for name, value in node.env.items():
            if value == MASK:
                if name not in fresh:
                    raise ConfigError(f"{name}: its value is secret, so it was not kept on this machine, and it is "
                                      "no longer found (forward_env, env_file)", key="env",
                                      hint=f"export {name}=... (or restore the env_file) and run this again")
                env[name] = fresh[name]
        nodes.append(dataclasses.replace(node, env=env))
    return dataclasses.replace(plan, nodes=tuple(nodes))


def spec_of(record: JobRecord) -> ClusterSpec:
    """The hosts file as it was when the job started (relative paths in it are the job's cwd's)."""
    return load_cluster_text(record.hosts_text, record.hosts_file)


def transport_factory(record: JobRecord) -> Callable[..., Transport]:
    return partial(transport_for, ssh_config=record.ssh_config)


def job_state(result: JobResult) -> JobState | None:
    """The job's state in its record from how it ended; None while a node may still run (its
    host could not be reached: the next ``ps`` asks it again)."""
    return JobState.of_nodes(n.state for n in result.nodes)


class Recorder:
    """An ``emit`` consumer that keeps the job's record up to date (and nothing else)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int) -> None:
        self.store = store
        self.job_id = job_id
        self.attempt = attempt
        self._pending: list[Callable[[JobRecord], None]] = []
        self._idle = threading.Condition()
        self._writer: threading.Thread | None = None

    def _submit(self, change: Callable[[JobRecord], None]) -> None:
        """Queue ``change`` for the record. A writer thread applies what is queued in one write
        and exits when nothing is left: the threads that emit events never wait for the disk, and
        32 nodes starting at once make a few writes of the record, not 128. It is not a daemon:
        the process does not exit before the record is written."""
        with self._idle:
            self._pending.append(change)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_all, name=f"record-{self.job_id}")
                self._writer.start()

    def _write_all(self) -> None:
        while True:
            with self._idle:
                batch, self._pending = self._pending, []
                if not batch:
                    self._writer = None
                    self._idle.notify_all()
                    return

            def change(record: JobRecord, batch: list[Callable[[JobRecord], None]] = batch) -> None:
                for each in batch:
                    each(record)

            try:
                self.store.update(self.job_id, change)
            except (OSError, ClusterrunError) as exc:  # the record is gone or damaged: say so, go on
                text = exc.render() if isinstance(exc, ClusterrunError) else str(exc)
                print(f"clusterrun: cannot update the record of job {self.job_id}: {text}", file=sys.stderr)

    def flush(self) -> None:
        """Return once every change submitted so far is in the record."""
        with self._idle:
            while self._writer is not None:
                self._idle.wait()

    def _node(self, rank: int, **changes: Any) -> None:
        def change(record: JobRecord) -> None:
            if record.attempt != self.attempt:
                return  # a newer attempt has started: this one's news is history
            node = record.nodes[rank]
            for key, value in changes.items():
                setattr(node, key, value)
            now = JobState.of_nodes(n.state for n in record.nodes)
            if record.state == JobState.STARTING and now is JobState.RUNNING:
                record.state = record.attempts[-1].state = JobState.RUNNING

        self._submit(change)

    def _link(self, rank: int, *, up: bool, since: float) -> None:
        def change(record: JobRecord) -> None:
            if record.attempt == self.attempt:
                node = record.nodes[rank]
                node.unreachable_since = None if up else node.unreachable_since or since

        self._submit(change)

    def __call__(self, event: Event) -> None:
        if event.node is not None and isinstance(event, NodeStarted):
            self._node(event.node, pid=event.pid)
        elif event.node is not None and isinstance(event, NodeStateChanged):
            self._node(event.node, state=event.state)
        elif event.node is not None and isinstance(event, NodeExited):
            r = event.result
            self._node(event.node, state=r.state, exit_code=r.exit_code, signal=r.signal, error=r.error)
            self._link(event.node, up=r.state is not NodeState.UNREACHABLE, since=time.time())
        elif event.node is not None and isinstance(event, NodeLink):
            self._link(event.node, up=event.up, since=event.since or time.time())
        elif isinstance(event, JobFinished):
            self.finish(event.result)

    def finish(self, result: JobResult) -> None:
        state = job_state(result)

        def change(record: JobRecord) -> None:
            if record.attempt != self.attempt or state is None:
                return
            record.state = state
            attempt = record.attempts[-1]
            attempt.state, attempt.ended = record.state, time.time()
            failed = record.state in (JobState.FAILED, JobState.LOST)
            attempt.root_cause = result.root_cause.describe() if result.root_cause and failed else None
            explained = result.root_cause.explanation if result.root_cause and failed else None
            attempt.cause, attempt.fix = (explained.cause, explained.fix) if explained else (None, None)

        self._submit(change)
        self.flush()


def fan_out(*emits: Emit) -> Emit:
    def emit(event: Event) -> None:
        for each in emits:
            each(event)

    return emit


def attempt_event(plan: LaunchPlan, attempt: int, record: JobRecord | None = None) -> AttemptStarted:
    """What a consumer needs to know of an attempt's plan, as an event (with when the attempt
    started and ended, as ``record`` says)."""
    times = next((a for a in record.attempts if a.attempt == attempt), None) if record is not None else None
    nodes = []
    for launch in plan.nodes:
        gpus = launch.env.get("CUDA_VISIBLE_DEVICES")
        nodes.append((launch.host.host, launch.nproc, gpus if gpus else None))
    return AttemptStarted(None, job_id=plan.job_id, name=plan.name, attempt=attempt,
                          master_addr=plan.master_addr, master_port=plan.master_port,
                          world_size=plan.world_size, nodes=tuple(nodes),
                          started=times.started if times is not None else None,
                          ended=times.ended if times is not None else None)


def follower(record: JobRecord, emit: Emit | None, *, fail_fast: bool, follow_logs: bool, attempt: int | None = None,
             offsets: dict[int, int] | None = None, tail: int | None = None,
             ranks: Sequence[int] | None = None, reconnect: Reconnect | None = None, scrollback: int = 0) -> Job:
    """A ``Job`` that follows an attempt of the recorded job (the current one unless given);
    ``scrollback``: with ``offsets``, first the last lines before them (``LogLines(earlier=True)``)."""
    spec = spec_of(record)
    plan = plan_from_json(record.plan, spec)
    job = Job(spec, record.script, record.script_args, job_id=record.job_id, name=record.name, emit=emit,
              grace=record.grace, attempt=attempt or record.attempt, transport_factory=transport_factory(record),
              fail_fast=fail_fast, follow_logs=follow_logs, offsets=offsets, tail=tail, ranks=ranks,
              reconnect=reconnect or Reconnect(give_up_after=record.unreachable_timeout if fail_fast else None),
              scrollback=scrollback)
    job.resume(plan)
    return job


# -------------------------------------------------------------------------------- the monitor


def daemonize() -> None:
    """Fork once more so that the monitor is no session leader (it can never get a terminal) and
    the process that started it can reap the intermediate at once."""
    if os.fork() > 0:
        os._exit(0)


# ------------------------------------------------------------------------------------ status


def per_node(record: JobRecord, call: Callable[[Transport, int], Any],
              ranks: Sequence[int] | None = None) -> dict[int, Any]:
    """``call(transport, rank)`` on every node in parallel; an exception is returned as the value."""
    spec = spec_of(record)
    factory = transport_factory(record)
    ranks = list(range(len(spec.hosts))) if ranks is None else list(ranks)
    transports = {rank: factory(spec.hosts[rank]) for rank in ranks}

    def one(rank: int) -> Any:
        try:
            transports[rank].connect()
            return call(transports[rank], rank)
        except ClusterrunError as exc:
            return exc
        except OSError as exc:
            return ClusterrunError(f"{spec.hosts[rank].host}: {exc}")
        finally:
            transports[rank].close()

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(ranks)))) as pool:
        return dict(zip(ranks, pool.map(one, ranks), strict=True))


def request(record: JobRecord, rank: int, op: str, attempt: int | None = None, **extra: Any) -> dict[str, Any]:
    return {"op": op, "job": record.job_id, "node": rank, "attempt": attempt or record.attempt,
            "state_dir": record.plan.get("state_dir"), **extra}


def status_of(transport: Transport, record: JobRecord, rank: int) -> NodeStatus:
    """What node ``rank``'s agent says of the current attempt (``absent`` if never started)."""
    answer = transport.call(request(record, rank, "status"))
    return decode_status(transport.name, answer.get("state"), "status answer's state")


def node_statuses(record: JobRecord) -> dict[int, Any]:
    """Every node's ``status`` answer for the current attempt, or the error that kept it away."""
    return per_node(record, lambda t, rank: t.call(request(record, rank, "status")))


NOT_STARTED = (NodeState.PENDING, NodeState.CONNECTING, NodeState.STARTING)
GONE = ("its host has no state of it any more (the state directory was deleted?): whether it still runs is not "
        "known; `clusterrun down` looks for its processes")


def reconcile(store: JobStore, record: JobRecord) -> JobRecord:
    """Ask every host how the current attempt is doing and write that into the record.

    Only for a job that has no owner (the owner keeps the record itself). A host that cannot be
    reached leaves its node as it was, with the error noted (and since when: ``note_reachable``);
    so does a host that has no state of a node that was started (``GONE``)."""
    answers = per_node(record, lambda t, rank: status_of(t, record, rank))
    now = time.time()

    def change(rec: JobRecord) -> None:
        if rec.attempt != record.attempt:
            return
        for rank, answer in answers.items():
            node = rec.nodes[rank]
            note_reachable(node, answer, now)
            if isinstance(answer, ClusterrunError):
                why = "unreachable" if isinstance(answer, TransportError) else "no answer"
                node.error = f"{why}: {answer.render()}"
                continue
            if answer.state is HostState.ABSENT and (node.pid is not None or node.state not in NOT_STARTED):
                node.error = GONE  # it was started: never shown pending again, nor ended, on this word alone
                continue
            node.state = node_state_of(answer)
            node.pid = answer.torchrun_pid or node.pid
            node.exit_code, node.signal = answer.exit_code, answer.signal
            node.error = answer.error or ("neither the supervisor nor torchrun runs any more"
                                          if node.state is NodeState.LOST else None)
        new = JobState.of_nodes(NodeState.UNREACHABLE if isinstance(answers.get(n.rank), ClusterrunError)
                                else n.state for n in rec.nodes)
        if new is None or not new.is_terminal:  # pending nodes were never started: the monitor starts them
            if new is JobState.RUNNING:
                rec.state = new
            return
        rec.state = rec.attempts[-1].state = new
        rec.attempts[-1].ended = rec.attempts[-1].ended or time.time()

    return store.update(record.job_id, change)


def note_reachable(node: NodeRecord, answer: object, now: float) -> None:
    """Keep in ``node`` since when its host could not be reached (``answer``: a status answer, or
    the error that kept it away; only a ``TransportError`` says the host is unreachable), from the
    first failure on, until the host answers."""
    if isinstance(answer, TransportError):
        node.unreachable_since = node.unreachable_since or now
    elif not isinstance(answer, ClusterrunError):
        node.unreachable_since = None


def record_reachability(store: JobStore, record: JobRecord, answers: dict[int, Any]) -> JobRecord:
    """What every node's status call (``node_statuses``) said of reaching its host, into the
    record (written only when that changes it); a record that cannot be written is changed in
    memory only, for what is shown now."""
    now = time.time()

    def change(rec: JobRecord) -> None:
        if rec.attempt == record.attempt:
            for rank, answer in answers.items():
                if rank < len(rec.nodes):
                    note_reachable(rec.nodes[rank], answer, now)

    preview = JobRecord.from_json(record.to_json())
    change(preview)
    if [n.unreachable_since for n in preview.nodes] == [n.unreachable_since for n in record.nodes]:
        return record
    try:
        return store.update(record.job_id, change)
    except StateError:
        return preview


def refresh(store: JobStore, record: JobRecord) -> JobRecord:
    """The record made current: if the job is unfinished and nobody owns it, reconcile it with
    its hosts and start a monitor for it (fail-fast resumes), unless it was adopted from its hosts
    (``discover``): the controller that started it may still be watching it."""
    if record.finished or store.owned(record.job_id):
        return record
    record = reconcile(store, record)
    if not record.finished and not record.adopted:
        store.spawn_monitor(record.job_id)
    return record


def read_log(record: JobRecord, rank: int, attempt: int, tail: int | None = None) -> Iterator[str]:
    """Node ``rank``'s log of ``attempt`` as written so far (from its last ``tail`` lines if
    given), in chunks of whole lines (the last one may lack its newline)."""
    spec = spec_of(record)
    transport = transport_factory(record)(spec.hosts[rank])
    where: dict[str, Any] = {"offset": 0} if tail is None else {"tail": tail}
    try:
        transport.connect()
        for raw in transport.stream(request(record, rank, "follow", attempt=attempt, once=True, **where)):
            message = decode_follow(transport.name, raw)
            if isinstance(message, LogChunk):
                yield message.data
            elif isinstance(message, (End, Eof)):
                return
    finally:
        transport.close()


def read_logs(record: JobRecord, ranks: Sequence[int], attempt: int, tail: int | None = None,
              budget: int = 64 * 2**20) -> Iterator[tuple[int, str | ClusterrunError]]:
    """The logs of several nodes, node after node, each read from its host in a thread of its own
    while the nodes before it are printed. Yields ``(rank, chunk)`` (see ``read_log``), or
    ``(rank, error)`` once for a node whose host failed. What is read ahead waits while the chunks
    held for all nodes together exceed ``budget`` characters; the node being printed may always
    hold one chunk, so it never waits for the others (each reader thread also has one in hand)."""
    done = object()
    queues: dict[int, deque[tuple[Any, int]]] = {rank: deque() for rank in ranks}
    held = {rank: 0 for rank in ranks}
    total = 0
    current = ranks[0] if ranks else None
    cancelled = False
    changed = threading.Condition()

    def put(rank: int, item: Any, size: int = 0) -> None:
        nonlocal total
        with changed:
            while size and total + size > budget and not (rank == current and not held[rank]) and not cancelled:
                changed.wait()
            queues[rank].append((item, size))
            held[rank] += size
            total += size
            changed.notify_all()

    def read(rank: int) -> None:
        try:
            for lines in read_log(record, rank, attempt, tail):
                put(rank, lines, len(lines))
                if cancelled:
                    return
        except ClusterrunError as exc:
            put(rank, exc)
        put(rank, done)

    threads = [threading.Thread(target=read, args=(rank,), daemon=True, name=f"logs-node{rank}") for rank in ranks]
    for thread in threads:
        thread.start()
    try:
        for rank in ranks:
            with changed:
                current = rank
                changed.notify_all()
            while True:
                with changed:
                    while not queues[rank]:
                        changed.wait()
                    item, size = queues[rank].popleft()
                    held[rank] -= size
                    total -= size
                    changed.notify_all()
                if item is done:
                    break
                yield rank, item
    finally:
        with changed:
            cancelled = True
            changed.notify_all()


# ------------------------------------------------------------------------------- down, restart


def stop_job(record: JobRecord, *, grace: float | None = None) -> dict[int, StopReport]:
    """The agent's verified stop of the current attempt on every node, in parallel."""
    wait = record.grace if grace is None else grace
    answers = per_node(record, lambda t, rank: t.call(request(record, rank, "stop", grace=wait)))
    reports = {}
    for rank, answer in answers.items():
        host = record.nodes[rank].host
        if isinstance(answer, ClusterrunError):
            reports[rank] = StopReport(rank, host, error=answer.render())
        else:
            reports[rank] = StopReport.from_answer(rank, host, answer)
    return reports


def mark_stopped(store: JobStore, record: JobRecord, reports: dict[int, StopReport]) -> JobRecord:
    """Record a verified stop; nodes whose stop failed keep their state (they may still run)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt != record.attempt:
            return
        for rank, report in reports.items():
            if report.ok and rec.nodes[rank].state not in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST):
                rec.nodes[rank].state = NodeState.STOPPED
        if all(r.ok for r in reports.values()) and not rec.finished:
            rec.state = rec.attempts[-1].state = JobState.STOPPED
            rec.attempts[-1].ended = time.time()

    return store.update(record.job_id, change)


def mark_failed_start(store: JobStore, job_id: str, attempt: int, error: ClusterrunError) -> None:
    """The attempt could not start on every host (those that started were stopped again)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt:
            rec.state = rec.attempts[-1].state = JobState.FAILED
            rec.attempts[-1].ended = time.time()
            rec.attempts[-1].root_cause = f"could not start: {error.render()}"

    store.update(job_id, change)


def save_seen(store: JobStore, job_id: str, attempt: int, offsets: dict[int, int]) -> None:
    """Remember how much of each node's log a viewer has shown, for the next ``attach``."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt:
            for rank, offset in offsets.items():
                rec.nodes[rank].seen = max(rec.nodes[rank].seen, offset)

    store.update(job_id, change)


def start_attempt(store: JobStore, record: JobRecord, emit: Emit | None) -> JobRecord:
    """Start the job again, as attempt ``record.attempt + 1``, with the same hosts file, script,
    arguments and environment (a new master port where ``auto`` and the old one is taken).

    ``env_file`` and ``forward_env`` are read again, here and now, and secret ``--env`` values
    (masked in the record) are taken from this process's environment (``environment.unmask``);
    a secret of the last attempt that is no longer found is a ``ConfigError`` (nothing starts).

    The caller holds the owner lock and has verified that nothing of the last attempt runs."""
    spec, notes = resolve(spec_of(record), os.environ)
    overrides = unmask(record.env_overrides, os.environ, "--env")
    plan_to_start(record)  # refuses to start without a secret the last attempt had
    for note in notes:
        if emit is not None:
            emit(JobNote(None, text=f"warning: {note}"))
    attempt = record.attempt + 1
    job = Job(spec, record.script, record.script_args, job_id=record.job_id, name=record.name, emit=emit,
              env_overrides=overrides, local_cwd=record.local_cwd, grace=record.grace, attempt=attempt,
              transport_factory=transport_factory(record))
    try:
        plan = job.prepare()
        for rank, report in sorted(sync_hosts(spec, job.agents).items()):  # `sync:` of the hosts file, if any
            if emit is not None:
                emit(JobNote(None, text=f"sync node{rank} {report.host}: {report.describe()}"))

        def begin(rec: JobRecord) -> None:
            rec.attempt, rec.plan, rec.state = attempt, plan_to_json(plan), JobState.STARTING
            rec.adopted = False  # this controller starts the attempt: it owns it (and monitors it)
            rec.attempts.append(AttemptRecord(attempt, started=time.time(), master_port=plan.master_port))
            rec.nodes = [NodeRecord(n.rank, n.host.host) for n in plan.nodes]

        record = store.update(record.job_id, begin)
        if emit is not None:  # before its nodes' start: a dashboard shows them as the new attempt's
            emit(attempt_event(plan, attempt, record))
        recorder = Recorder(store, record.job_id, attempt)
        job.subscribe(recorder)
        try:
            job.start()
        except HostsUnavailable as exc:
            mark_failed_start(store, record.job_id, attempt, exc)
            raise
    finally:
        job.close()
    recorder.flush()  # the nodes' pids and states, before the record is read back
    return store.load(record.job_id)


def remove_on_hosts(record: JobRecord) -> dict[int, dict[str, Any] | ClusterrunError]:
    """Delete every node's state and logs of the job on its host (the agent's ``remove``, which
    refuses while anything of the job runs there): each node's answer, or the error."""
    return per_node(record, lambda t, rank: t.call(request(record, rank, "remove")))
