"""``attach`` to a job of ``up --from-slurm`` in the dashboard: srun's output is read only by the
``up`` that runs the step, so a viewer follows the log files that ``up`` keeps (``slurmlogs``) and
the record it writes; K stops the step as ``down`` does (``scancel`` on it, found by its name among
the user's steps) and that ``up`` records the end, which the view then shows. Detaching leaves the
job to its ``up``."""

from __future__ import annotations

import threading

from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import JobNote, NodeState, NodeStateChanged
from clusterrun.life.attempt import attempt_event
from clusterrun.life.lifecycle import save_seen
from clusterrun.run.plan import plan_from_json
from clusterrun.slurm.job import SlurmSession, refresh, slurm_of
from clusterrun.slurm.run import mark_stopped, my_steps, step_gone, stop_step
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened
from clusterrun.store.slurmlogs import SlurmFollower


def stop_by_name(record: JobRecord, grace: float) -> str:
    """The record's running step stopped as ``down`` stops it (its allocation marked, so that its
    ``up`` records the job stopped); what happened, in words."""
    steps = [s for s in my_steps() if s.name == record.job_id]
    if not steps:
        return (f"job {record.job_id}: its Slurm step cannot be found here (`squeue --steps --me`); "
                f"`scancel {slurm_of(record).get('step') or slurm_of(record).get('job')}` where Slurm is")
    mark_stopped(steps[0].step.split(".")[0], record.job_id)
    return stop_step(steps[0].step, grace, step_gone(steps[0].step))


class SlurmView(SlurmSession):
    """A viewer of a running Slurm job (``attach``): create → ``subscribe`` → ``begin()`` (the
    files followed in a thread from ``offsets``) → ``kill()`` / ``detach()`` → ``wait()``."""

    supports = frozenset({"kill", "detach"})

    def __init__(self, store: JobStore, job: Opened, offsets: dict[int, int]) -> None:
        record = job.record
        super().__init__(store, record, plan_from_json(record.plan, job.spec()))
        self._follower = SlurmFollower(store, record, self.emit, attempt=record.attempt,
                                       ranks=range(len(record.nodes)), tail=None, offsets=offsets,
                                       reload=lambda: refresh(store, store.load(record.job_id)))

    def _follow(self) -> None:
        record = self.record
        self.emit(attempt_event(self.plan, record.attempt, record))
        for node in record.nodes:
            self.emit(NodeStateChanged(node.rank, host=node.host, state=NodeState(node.state)))
        try:
            self.result = self._follower.run()
        except ClusterrunError as exc:  # its `up` is gone: the view shows why
            self.error = exc
            return
        finally:
            save_seen(self.store, record.job_id, record.attempt, self._follower.offsets)

    def kill(self) -> None:
        if self.running and not self.busy:
            self.busy = True
            threading.Thread(target=lambda: self.emit(JobNote(None, text=stop_by_name(self.record, self.record.grace))),
                             daemon=True, name="scancel").start()

    def detach(self) -> None:
        self.detached = True
        self._follower.detach()
        self.wait(timeout=10)
