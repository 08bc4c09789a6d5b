"""The owner's loop over a job on this controller: follow it, restart it by policy, hand it over.

Exactly one process owns a running job at a time (``jobs.JobStore``'s owner lock): the foreground
``up`` (stream or dashboard) or the job's background monitor. The owner follows the job, applies
fail-fast, keeps the record (``recorder.Recorder``), restarts a failed attempt (a known transient
start-up failure once; any failure as the job's ``restart:`` policy allows, after a backoff) through
``attempt.restart`` (the checks, the verified stop, the start, as every attempt), and either sees
the job end or hands it over to a monitor (which resumes a backoff where it was). The attempt's
life itself (checks, start, stop) is ``attempt.py``'s, its recorded state ``recorder.py``'s; this
module is the loop around it:

- ``Runner``: start (or adopt) an attempt, ``follow()`` it to its end with the record kept and
  the restarts applied; ``request_stop()`` and ``request_hand_over()`` are safe from signal
  handlers and other threads, and ``hand_over()`` (in the owner's thread, after ``follow()``
  returned None) gives the lock to a monitor with what was shown saved. What the owner knows
  and wants (asked to stop or hand over, started, the last decision) is one value, ``state``
  (``owner.Owner``), replaced whole at each change; the dashboard reads it, never a copy.
- ``run_monitor()``: the background owner (``clusterrun _monitor``).

Lifecycle of a ``Runner``: ``Runner(store, record, job, owner_fd, emit)`` → ``start()`` (a new
job) → ``follow()`` → ``hand_over()`` if it returned None → ``close()``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.config.restarts import COUNTED, RestartPolicy
from clusterrun.core import timings
from clusterrun.core.errors import ClusterrunError, ConfigError, HostsUnavailable
from clusterrun.core.events import (
    AttemptRestarting,
    AttemptTimed,
    Event,
    EveryNodeJoined,
    JobFinished,
    JobHung,
    JobNote,
    JobResult,
    JobState,
    NodeExited,
    NodeState,
    RankFailed,
    StartupExpired,
    hung_text,
)
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import HostState, NodeStatus
from clusterrun.diagnose.rootcause import transient_start_failure
from clusterrun.life import lifecycle, notify, spares
from clusterrun.life.attempt import Cancelled, NextAttempt, restart, start, stop, verified_ended
from clusterrun.life.gate import plan_to_start
from clusterrun.life.lifecycle import follower, per_node, save_seen, stacks_of, status_of, stop_job
from clusterrun.life.owner import Asked, Owner
from clusterrun.life.recorder import Recorder, Retry, give_up, mark_failed_start
from clusterrun.run.orchestrator import Emit, Job
from clusterrun.run.stops import StopOrder
from clusterrun.store.jobs import OWNER_FD_VAR, JobRecord, JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.lent import TransportPool

LOOK_APART = 3.0  # seconds between the two looks at a hung job's ranks: long enough for a stack to move


@frozen
class Clock:
    """The owner's time during a backoff (tests pass a fake one): ``now()`` is wall-clock seconds,
    ``wait(event, seconds)`` waits at most that long for ``event``; ``poll`` is how often the
    record is read for a ``down`` from elsewhere, ``show`` how often the countdown is shown."""

    now: Callable[[], float] = time.time
    wait: Callable[[threading.Event, float], object] = lambda event, seconds: event.wait(seconds)
    poll: float = 1.0
    show: float = 10.0
    rng: random.Random = dataclasses.field(default_factory=random.Random)


def run_monitor(store: JobStore, job_id: str, emit: Emit, clock: Clock | None = None) -> int:
    """Own the job until it ends, in the background: follow its nodes' states (not their logs),
    apply fail-fast and the restarts (a backoff under way resumes), keep the record. Started by
    ``JobStore.spawn_monitor``."""
    fd_text = os.environ.pop(OWNER_FD_VAR, "")
    fd = int(fd_text) if fd_text.isdigit() else store.try_own(job_id)
    if fd is None:
        return 0  # somebody else owns the job
    record = store.load(job_id)
    if record.finished:
        notify.send_due(store, record)  # its end was recorded by an owner that died before notifying
        return 0
    store.note_monitor(job_id)
    os.chdir(record.local_cwd)
    runner = Runner.adopt(store, record, fd, emit, follow_logs=False, retry_startup=record.retry_startup, clock=clock)
    if record.state is JobState.STOPPING:  # a stop was asked for and its stopper died: carry it out
        runner.request_stop("stopped by an earlier command")
    try:
        if record.state == "starting":
            _finish_start(record, runner)
        runner.follow()
    except HostsUnavailable as exc:  # the missing nodes could not be started: the others wait in vain
        stop_job(record, spec=runner.spec)
        mark_failed_start(store, job_id, record.attempt, exc)
    finally:
        runner.close()
    return 0


def _finish_start(record: JobRecord, runner: Runner) -> None:
    """Start the nodes that a controller which died during ``start`` never reached (from the
    plan in the record), so that the job can still run: the other nodes wait for them."""
    answers = per_node(record, lambda t, rank: status_of(t, record, rank), spec=runner.spec)
    absent = [rank for rank, answer in answers.items()
              if isinstance(answer, NodeStatus) and answer.state is HostState.ABSENT]
    if absent:
        try:
            runner.job.resume(plan_to_start(record, runner.spec))  # the record's plan holds secret values masked
        except ConfigError as exc:
            raise HostsUnavailable([exc]) from exc
        runner.start(absent)


def stop_for(event: Event) -> StopOrder | None:
    """The stop an owner orders for what its attempt's nodes report, if any: a node that failed or
    was lost stops the others after it (fail-fast); nodes that started no workers within
    ``startup_timeout`` fail the attempt, the others are stopped (the start-up watch). A node fails
    as soon as its host saw a rank exit non-zero (``RankFailed``), before torchrun has ended."""
    failed = isinstance(event, NodeExited) and event.result.state in (NodeState.FAILED, NodeState.LOST)
    host = event.result.host if isinstance(event, NodeExited) else event.host if isinstance(event, RankFailed) else ""
    if event.node is not None and (failed or isinstance(event, RankFailed)):
        return StopOrder(f"node {event.node} ({host}) failed", after=event.node,
                         by=f"fail-fast after node {event.node} failed")
    if isinstance(event, StartupExpired):
        return StopOrder(f"start-up watch: {event.cause.message}", late=event, by="the start-up watch")
    return None


def history(record: JobRecord) -> str:
    """The job's attempts in one line, for the summary: ``attempts: 1 failed after 12 s (torchrun on
    node 1 (h1): exit code 1), restarted · 2 succeeded after 40 s``."""
    parts = []
    for a in record.attempts:
        took = f" after {a.ended - a.started:.0f} s" if a.ended is not None else ""
        cause = f" ({a.root_cause.splitlines()[0]})" if a.root_cause and a.state is not JobState.SUCCEEDED else ""
        spares = "".join(f" on {new} for {old}" for old, new in (a.replaced or {}).items())
        by = " by the user" if a.restart == "user" else ""
        parts.append(f"{a.attempt} {a.state}{took}{spares}{cause}" + (f", restarted{by}" if a.restart else ""))
    return "attempts: " + " · ".join(parts)


class Runner:
    """The owner's loop over one job (see the module docstring)."""

    def __init__(self, store: JobStore, record: JobRecord, job: Job, owner_fd: int, emit: Emit | None = None, *,
                 retry_startup: bool = True, policy: RestartPolicy | None = None, clock: Clock | None = None,
                 spec: ClusterSpec | None = None, started: bool = False) -> None:
        self.store = store
        self.record = record
        self._spec = spec
        self.job = job
        self.owner_fd: int | None = owner_fd
        self.retry_startup = retry_startup
        self.policy = policy if policy is not None else self.spec.restart.with_max(record.max_restarts)
        self.clock = clock or Clock()
        self._listeners: list[Emit] = [emit] if emit is not None else []
        self.recorder = Recorder(store, record.job_id, job.attempt, record)
        job.subscribe(self._on_job_event)
        self._state = Owner(started=started)  # changed only by ``_move``, under ``_lock``
        self._lock = threading.Lock()
        # Requests of signal handlers and other threads, taken in by the next ``_move``: a signal
        # handler puts (``SimpleQueue.put`` is reentrant) and never waits for the lock.
        self._requests: queue.SimpleQueue[tuple[Asked, str | None]] = queue.SimpleQueue()
        self._wake = threading.Event()  # a stop or a hand-over asked for during a backoff
        self._phases: dict[str, float] = {}  # the next attempt's, from this one's failure (``timings.mark``)
        # The hosts' transports, kept from the first restart on: each next attempt's checks, start and
        # follower use the connections the last one's follower held, not new ones, and its checks and
        # start the agents that followed it to its end (``transports.lent``).
        self._transports = TransportPool(lifecycle.transport_factory(record))

    @classmethod
    def create(cls, store: JobStore, record: JobRecord, job: Job, emit: Emit | None = None, *,
               retry_startup: bool = True, policy: RestartPolicy | None = None) -> Runner:
        """The owner of a new job, checked and not yet started (``checks.check_new``): its record is
        created first (a job nobody could find again must not run: ``StateError``) and owned here."""
        store.create(record)
        owner = store.try_own(record.job_id)
        if owner is None:  # cannot happen to a job created just now, unless its directory is shared
            raise ClusterrunError(f"job {record.job_id} is owned by another process already")
        return cls(store, record, job, owner, emit, retry_startup=retry_startup, policy=policy)

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def spec(self) -> ClusterSpec:
        """The job's hosts file as its record has it (``Opened.spec``), parsed once for this owner:
        the same for every attempt (a restart changes the script's arguments, never the file)."""
        if self._spec is None:
            self._spec = Opened(self.record).spec()
        return self._spec

    @classmethod
    def adopt(cls, store: JobStore, record: JobRecord, owner_fd: int, emit: Emit | None = None, *,
              follow_logs: bool = True, offsets: dict[int, int] | None = None, retry_startup: bool = True,
              clock: Clock | None = None, spec: ClusterSpec | None = None) -> Runner:
        """The owner of a job started earlier (a monitor), following its current
        attempt; ``spec``: its recorded hosts file, if the caller has parsed it already."""
        spec = spec or Opened(record).spec()
        job = follower(record, None, owner=True, follow_logs=follow_logs, offsets=offsets, spec=spec)
        return cls(store, record, job, owner_fd, emit, retry_startup=retry_startup, clock=clock, spec=spec,
                   started=True)

    @property
    def state(self) -> Owner:
        """What this owner knows and wants now (the requests made so far taken in): one value."""
        return self._move(lambda state: state)[1]

    def _move(self, change: Callable[[Owner], Owner]) -> tuple[Owner, Owner]:
        """Take in the queued requests, in order, then ``change``: the state before ``change`` and
        after. Never from a signal handler (it waits for the lock): those put requests only."""
        with self._lock:
            before = self._state
            while True:
                try:
                    asked, reason = self._requests.get_nowait()
                except queue.Empty:
                    break
                before = before.ask(asked, reason)
            self._state = after = change(before)
        return before, after

    def recorded(self) -> JobRecord:
        """The job's record as this owner's last write left it: read once per command and carried
        (the owner alone writes it; a ``down`` from elsewhere is what the backoff polls for)."""
        self.recorder.flush()
        return self.recorder.record or self.record

    def subscribe(self, listener: Emit) -> None:
        """Hand every event of the job, of this attempt and the next ones, to ``listener`` too."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Emit) -> None:
        self._listeners.remove(listener)

    def _on_job_event(self, event: Event) -> None:
        """What the followed attempt reports: into the record first, then to the listeners. Its end
        is decided here, in the owner's thread (restart or not), then recorded in one write with
        that decision (``Recorder.finish``): the record is never read or written to decide."""
        if isinstance(event, JobFinished):
            if self._phases:
                timings.mark(self._phases, "stopped")
            self.recorder.finish(event.result, self._decide_end(event.result))
        else:
            self.recorder(event)
        self.emit(event)
        if isinstance(event, EveryNodeJoined) and (phases := self.recorded().attempts[-1].phases):
            self.emit(AttemptTimed(None, attempt=self.job.attempt, began=self.recorded().attempts[-1].started,
                                   phases=tuple(phases.items())))
        if isinstance(event, StartupExpired):
            self._move(lambda state: state.blamed(event.nodes))  # a host's failure (``spares``)
        order = stop_for(event)
        if order is not None:
            if not order.asked:
                timings.mark(self._phases, "failed")
            self.job.stop(order)  # the first order decides: a stop under way is not replaced

    def emit(self, event: Event) -> None:
        if isinstance(event, JobFinished) and self.recorder.restarting:
            event = dataclasses.replace(event, restarting=True)  # an attempt's end, not the job's
        for listener in list(self._listeners):
            listener(event)
        if isinstance(event, JobHung) and event.since is not None:
            self.on_hang(event.since)

    def note(self, text: str) -> None:
        self.emit(JobNote(None, text=text))

    def on_hang(self, since: float) -> None:
        """The job hangs (no rank wrote anything for ``hang_after``): notify, then what ``on_hang``
        says. ``stack``: look at every rank twice and save the report (``diagnose.hangreport``), in
        a thread of its own, so that the loop follows on meanwhile; ``restart``: the report too,
        then, if no rank wrote meanwhile, stop this attempt, and ``follow()`` starts the next;
        ``nothing``: only the notification."""
        record = self.recorded()  # what came before the hang (the job running) is in the record it sends
        notify.send_due(self.store, record, self.note, also=[notify.hung(record.attempt, since)])
        action = self.job.spec.watch.on_hang
        where = f"the job is {hung_text(since, time.time())}"
        if action == "restart" and self.state.asked is Asked.FOLLOW:
            refused = self.policy.hang_refusal(_restarts(record), self.clock.now())
            if refused is not None:  # the same budget as a failure's: a job that keeps hanging is not restarted
                self.note(f"{where}: not restarting: {refused}")
                return
        elif action != "stack":
            return
        self.note(f"looking at every rank's stacks twice, {LOOK_APART:g} s apart, for the hang report")
        threading.Thread(target=self._report_hang, args=(record, since, where if action == "restart" else None),
                         daemon=True, name="hang-report").start()

    def _report_hang(self, record: JobRecord, since: float, restart: str | None) -> None:
        """Take the ranks' stacks twice, save the hang report in the job's directory, say where;
        then, given ``restart`` (how the hang is worded), restart the job unless a rank wrote meanwhile
        or most ranks' stacks moved (``HangReport.working``)."""
        from clusterrun.diagnose.hangreport import HangReport  # not on `up`'s path to the start

        try:
            answers = stacks_of(record, looks=2, apart=LOOK_APART, spec=self.spec)
            report = HangReport.of(answers, {n.rank: n.host for n in record.nodes}, since, LOOK_APART)
            now = self.recorded()  # a line written meanwhile ended the hang in the record
            if now.attempt != record.attempt or all(n.hung_since != since for n in now.nodes):
                self.note("a rank wrote while the hung ranks were looked at: no hang report"  # a mix of both
                          + (", no restart" if restart else ""))
                return
            path = self.store.save_hang_report(record.job_id, record.attempt, "\n".join(report.render()) + "\n")
        except ClusterrunError as exc:
            self.note(f"could not look at the hung ranks: {exc.render()}")
        else:
            self.note(f"hang report: {report.summary()}; in {path}")
            if restart is not None and report.working:  # a restart would throw the ranks' work away
                self.note(f"{restart}: not restarting: {report.working_text()}")
                return
        if restart is not None and self.state.asked is Asked.FOLLOW:
            self.note(f"{restart}: restarting the job as attempt {self.job.attempt + 1} (on_hang: restart)")
            self.request_restart(f"on_hang: restart: {restart}")

    def start(self, ranks: Sequence[int] | None = None) -> None:
        """Start every node of the prepared job (``ranks``: those of its recorded attempt that were
        never started); on failure the record says so and the nodes that started were stopped
        again (``HostsUnavailable``), and this owner's state that its start failed."""
        self._move(Owner.start)
        try:
            start(self.job, self.emit, self.recorder, first=True, ranks=ranks)
        except HostsUnavailable:
            self._move(lambda state: state.start(failed=True))
            raise

    def request_stop(self, reason: str) -> None:
        """Stop the job on every host (verified); ``follow()`` then returns its result. Safe from
        signal handlers and other threads."""
        self._requests.put((Asked.STOP, reason))
        self._wake.set()
        self.job.request_stop(reason)

    def request_restart(self, reason: str) -> None:
        """Stop the current attempt (verified) and restart the whole job at once as the next
        attempt (``on_hang: restart``, which checked the restart budget first; the reason is the
        attempt's root cause). Safe from other threads (not from a signal handler); a stop or a
        hand-over asked for first wins."""
        before, _after = self._move(lambda state: state.ask(Asked.RESTART, reason))
        if before.asked.asks(Asked.RESTART):
            self.job.request_stop(reason, by="on_hang")

    def request_hand_over(self) -> None:
        """Make ``follow()`` return None soon, so that ``hand_over()`` can give the job to a monitor
        (a stop asked for first is carried out all the same, unless the job is left meanwhile).
        Safe from signal handlers and other threads."""
        self._requests.put((Asked.HAND_OVER, None))
        self._wake.set()
        self.job.detach()

    def follow(self) -> JobResult | None:
        """Follow the job until it ends (then its result) or a hand-over was requested (None).
        A failed attempt that the owner decided to restart (``_decide_end``: recorded ``restarting``)
        is restarted after its backoff, visibly, and followed in turn."""
        while True:
            # Each attempt followed, from its start: what is due (``restarted``, a previous owner's unsent events).
            notify.send_due(self.store, self.recorded(), self.note)
            try:
                result = self.job.run()
            except OSError:
                if self.job.detached:  # the terminal went away while a line was being shown
                    return None
                raise
            finally:
                save_seen(self.store, self.job_id, self.job.attempt, self.job.offsets)
            if result is None:
                return None
            record = self.recorded()
            notify.send_due(self.store, record, self.note)  # the attempt's end
            if record.attempt != self.job.attempt or record.state is not JobState.RESTARTING:
                refused = self.state.refused
                if refused is not None and self.policy.max > 0 and result.interrupted is None \
                        and record.state in (JobState.FAILED, JobState.LOST):
                    self.emit(JobNote(None, text=f"not restarting: {refused}"))
                if len(record.attempts) > 1:
                    self.emit(JobNote(None, text=history(record)))
                return result
            due = self._backoff(record)
            if due is None:
                state = self.state
                if state.asked is Asked.HAND_OVER:
                    return None  # the monitor resumes the wait
                stopped = state.reason if state.asked is Asked.STOP else None
                return self._ended(dataclasses.replace(result, interrupted=stopped or "stopped during the backoff"))
            replace = self.state.replace
            if replace:
                self.note(f"the attempt lost {spares.why(result, list(replace))}")
            host = bool(spares.failed_hosts(result, self.state.late))  # else reachability, inspection, port
            self._transports.adopt(self.job.lend_transports(), idle=self.job.idle_agents())
            try:
                record = restart(self.store, due, self.emit, owner_fd=self.owner_fd, full_preflight=host,
                                 automatic=True, recorded=self.spec, replace=replace, recheck=not host,
                                 phases=self._phases, verified=verified_ended(result),
                                 transports=self._transports.lend)
            except Cancelled:
                return self._ended(dataclasses.replace(result, interrupted="stopped during the backoff"))
            except ClusterrunError as exc:
                self.emit(JobNote(None, text=f"could not restart: {exc.render()}"))
                give_up(self.store, self.job_id, record.attempt, exc.render())
                return self._ended(result)
            self._spec = self.spec.with_spares(replace)  # the spares in use in the places of the lost hosts
            self._follow_attempt(record)
            _before, state = self._move(Owner.next_attempt)
            if state.asked is Asked.STOP:
                self.job.request_stop(state.reason or "stop requested")
            elif state.asked is Asked.HAND_OVER:
                self.job.detach()

    def _ended(self, result: JobResult) -> JobResult:
        """The job ends where its restart would have begun: ``result`` said as the job's end (the
        attempt's end was said as a restart's: ``emit``), unless a ``restart`` from elsewhere took it."""
        try:
            now = self.store.load(self.job_id)
        except ClusterrunError:
            now = None
        if now is not None and now.attempt > self.job.attempt:
            self.note(f"the job was restarted from elsewhere as attempt {now.attempt}; its new owner follows it")
            return result
        self.recorder.restarting = False
        self.emit(JobFinished(None, result=result))
        return result

    def _follow_attempt(self, record: JobRecord) -> None:
        """Follow ``record``'s current attempt from now on (a restart started it), with the same
        listeners, hosts file and owner lock: the job keeps its one owner."""
        self.job.close()
        self.record, self._phases = record, {}  # its own failure's phases, if any, are the next attempt's
        self.recorder = Recorder(self.store, record.job_id, record.attempt, record)
        self.job = follower(record, None, owner=True, follow_logs=self.job.follow_logs,
                            reconnect=self.job.reconnect, spec=self.spec, transports=self._transports.lend)
        self.job.subscribe(self._on_job_event)

    def restart_by_user(self, attempt: NextAttempt, reason: str, stopped: Callable[[], None]) -> JobRecord:
        """The user's restart (the dashboard's R) of the job this process owns, its checks passed
        (``attempt``): the attempt followed is stopped for ``reason`` (``follow()`` returns its
        result; ``stopped`` waits for that), the next one is started under this owner's lock
        (``NextAttempt.replace``: the verified stop of every node first) and followed by this owner.
        Raises ``ClusterrunError`` when the next attempt could not be started."""
        self.request_stop(reason)
        stopped()
        record = attempt.replace(self.store, owner_fd=self.owner_fd)
        self.restarted(record, reason)
        return record

    def restarted(self, record: JobRecord, reason: str) -> None:
        """The user's restart, whose stop was asked for ``reason``, stopped the attempt this owner
        followed and started ``record``'s: follow the new attempt. A stop asked for meanwhile for
        another reason (the dashboard's K) stops the new attempt, as ``follow()`` goes on."""
        self._wake.clear()  # the restart's stop is done: it must not cut a later backoff short
        _before, state = self._move(lambda state: state.restarted(reason))
        self._follow_attempt(record)
        if state.asked is Asked.STOP:
            self.job.request_stop(state.reason or "stop requested")

    def begin_user_restart(self) -> bool:
        """The user's restart (the dashboard's R) begins, unless one is under way already (False):
        ``restarted`` or ``end_user_restart`` ends it."""
        before, _after = self._move(Owner.begin_user_restart)
        return not before.user_restart

    def end_user_restart(self) -> None:
        """The user's restart was refused or failed: another may be asked for."""
        self._move(Owner.end_user_restart)

    def _decide_end(self, result: JobResult) -> Retry | None:
        """Whether the attempt that ended badly (``result``) while starting or running is restarted:
        ``_decide`` on the record as it is now (what the nodes reported before is in it)."""
        self._move(lambda state: state.decided(refused=None))
        end = JobState.of_nodes(n.state for n in result.nodes)
        if end not in (JobState.FAILED, JobState.LOST) and result.interrupted is None:
            return None
        record = self.recorded()
        if record.attempt != self.recorder.attempt or record.state not in (JobState.STARTING, JobState.RUNNING):
            return None  # a stop came first (it decides), or a newer attempt started
        return self._decide(record, result)

    def _decide(self, record: JobRecord, result: JobResult) -> Retry | None:
        """Whether the failed current attempt of ``record`` is restarted (recorded ``restarting``
        in the write that ends it): a known transient start-up failure of the first attempt once,
        at once; else as the restart policy allows, after its backoff. Never after the user's stop."""
        state = self.state
        if state.asked is Asked.STOP:
            return None  # the user's stop is never restarted
        if result.interrupted is not None:
            asked = state.reason is not None and result.interrupted == state.reason  # request_restart's stop
            return Retry("requested", self.clock.now(), result.interrupted) if asked else None
        if self.retry_startup and record.attempt == 1:
            why = transient_start_failure(result.root_cause, self.job.logs)
            if why is not None:
                self._move(lambda state: state.decided(startup_failure=why))
                return Retry("start-up", self.clock.now(), f"failed at start-up: {why}")
        made = _restarts(record)
        code = result.root_cause.exit_code if result.root_cause is not None else None
        refused = self.policy.refusal(made, code, self.clock.now())
        if refused is not None:
            self._move(lambda state: state.decided(refused=refused))
            return None
        refused, replace = self._spares_for(record, result)
        self._move(lambda state: state.decided(refused=refused, spares=replace))
        if refused is not None:
            return None
        cause = result.root_cause.describe() if result.root_cause is not None else "a node failed"
        return Retry("policy", self.clock.now() + self.policy.delay(len(made) + 1, self.clock.rng), cause)

    def _spares_for(self, record: JobRecord, result: JobResult) -> tuple[str | None, dict[str, str]]:
        """The spares that take the places of the hosts the attempt lost (``spares.pick``), or why
        it is not restarted: a lost host with no spare left is not tried again and again."""
        out = spares.failed_hosts(result, self.state.late)
        if not out:
            return None, {}
        try:
            return None, spares.pick(self.spec, record, out)
        except ConfigError as exc:
            return f"the attempt lost {spares.why(result, out)} and " + (
                exc.message if self.spec.spares else "the hosts file lists no spares (`spares:`)"), {}

    def _backoff(self, record: JobRecord) -> JobRecord | None:
        """Wait until the next attempt of the ``restarting`` job is due (then its record as last
        polled), counting down. The wait ends early (None) for a stop asked of this owner (carried
        out and recorded, the one stop path), a ``down`` from elsewhere (the record is no longer
        ``restarting``: it is polled for that) or a hand-over."""
        failed = record.attempts[-1]
        kind = failed.restart or "policy"
        reason = (self.state.startup_failure if kind == "start-up" else None) or failed.root_cause or "failed"
        at = record.restart_at if record.restart_at is not None else self.clock.now()
        made = sum(1 for a in record.attempts if a.restart in COUNTED)
        shown: float | None = None
        waited = False
        while True:
            now = self.clock.now()
            if shown is None or (kind == "policy" and now - shown >= self.clock.show):
                shown = now
                self.emit(AttemptRestarting(None, job_id=self.job_id, attempt=record.attempt + 1,
                                            failed=record.attempt, at=at, remaining=max(0.0, at - now), kind=kind,
                                            restart=made, most=self.policy.max if kind == "policy" else None,
                                            reason=reason))
            asked = self.state.asked
            if asked is Asked.STOP:
                stop(self.store, record, spec=self.spec)
                return None
            if asked is Asked.HAND_OVER:
                return None
            polled = self.store.load(self.job_id)
            if polled.state is not JobState.RESTARTING:
                return None
            if now >= at:
                if waited and "failed" in self._phases:  # else the checks' phase would hold the wait
                    timings.mark(self._phases, "waited")
                return polled
            waited = True
            self.clock.wait(self._wake, min(at - now, self.clock.poll))

    def hand_over(self) -> None:
        """Give the job to a background monitor: what the nodes reported and what was shown are in
        the record first, then the owner lock passes on without a moment unowned."""
        self.recorder.flush()
        save_seen(self.store, self.job_id, self.job.attempt, self.job.offsets)
        if self.owner_fd is not None:
            self.store.spawn_monitor(self.job_id, self.owner_fd)
            self.owner_fd = None

    def close(self) -> None:
        self.job.close()
        self._transports.close()


def _restarts(record: JobRecord) -> list[float]:
    """When each restart counted against the budget was made (the attempt it ended)."""
    return [a.ended or a.started for a in record.attempts[:-1] if a.restart in COUNTED]


__all__ = ["Asked", "Runner", "run_monitor", "stop_for"]
