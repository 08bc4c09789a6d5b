"""``down``: a job's verified stop on every host, and what it verified, for every consumer that stops one.

``clusterrun down JOB`` and the web page's stop both call ``down`` and judge its ``Downed`` the same
way (``verdict``), so the page can never call a job stopped that ``down`` would not.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from clusterrun.config.nodesets import FOLD_PAST, fold
from clusterrun.core.errors import StateError
from clusterrun.core.events import JobState, StopReport
from clusterrun.core.frozen import frozen
from clusterrun.life.attempt import stop
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.views.printer import not_stopped_text


class Verdict(str, Enum):
    """How a ``down`` ended: ``down``'s exit code follows from it (``cli.manage``)."""

    ALREADY = "already"  # the job had ended before; its hosts confirm nothing is left
    STOPPED = "stopped"  # stopped, nothing it could see left (verified by cgroup, or swept)
    LEFT = "left"  # a process of the job would not die
    UNREACHABLE = "unreachable"  # a host could not be reached: the job may still run there
    UNRECORDED = "unrecorded"  # stopped, but the controller's state directory could not record it


@frozen
class Downed:
    """What a ``down`` did: each node's stop report, the state the job had already ended in (None
    while it ran) and the error that kept the stop out of the record, if any."""

    job_id: str
    nnodes: int
    reports: Mapping[int, StopReport]
    ended: JobState | None = None
    unrecorded: StateError | None = None

    @property
    def verdict(self) -> Verdict:
        reports = self.reports.values()
        if self.ended is not None and all(r.ok and not r.killed for r in reports) and self.unrecorded is None:
            return Verdict.ALREADY
        if any(r.error for r in reports):
            return Verdict.UNREACHABLE
        if any(r.left for r in reports):
            return Verdict.LEFT
        return Verdict.UNRECORDED if self.unrecorded is not None else Verdict.STOPPED

    @property
    def ok(self) -> bool:
        """Nothing the stop could see of the job is left on any host, and the record says so."""
        return self.verdict in (Verdict.ALREADY, Verdict.STOPPED)

    def summary(self) -> str | None:
        """``down``'s last line: what was verified, or why the job may still run (None: nothing to add)."""
        verdict = self.verdict
        if verdict is Verdict.ALREADY:
            return f"job {self.job_id} already finished ({self.ended}); nothing to stop"
        if verdict is Verdict.UNREACHABLE:
            return not_stopped_text(self.job_id, [(r.node, r.host) for r in self.reports.values() if r.error])
        if verdict is Verdict.LEFT:
            return None  # each node's report names what is left
        swept = [r.host for r in self.reports.values() if not r.complete]
        if swept:  # what that means is said once, after the first such host's line (``printer.stop_caveat``)
            on = fold(swept) if self.nnodes > FOLD_PAST else ", ".join(swept)
            return f"job {self.job_id} stopped; nothing it could see is left (no cgroup on {on})"
        return f"job {self.job_id} stopped; nothing of it is left on any host (verified by cgroup)"


def down(store: JobStore, job: Opened, grace: float | None = None) -> Downed:
    """Stop the job's current attempt on every host, verified (``attempt.stop``, the one stop
    path); a finished job too, whose hosts then confirm that nothing of it is left."""
    record = job.record
    ended = record.state if record.finished else None
    reports, unrecorded = stop(store, record, grace, spec=job.spec(), by="down")
    return Downed(record.job_id, len(record.nodes), reports, ended=ended, unrecorded=unrecorded)
