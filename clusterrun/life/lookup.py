"""What ``ps JOB`` shows of a job beside its record: every node's host asked at once (status and GPUs).

``ps JOB`` (text and ``--json``) and the web page's job view both look through ``look``, so the
two show the same nodes, stop guarantees and GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import NodeGpus
from clusterrun.core.frozen import frozen
from clusterrun.life.lifecycle import node_statuses
from clusterrun.life.recorder import record_reachability
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened


@frozen
class Look:
    """A job as its hosts showed it: the record (with which hosts could be reached), each reached
    node's ``status`` answer, each unreached node's error, and the GPUs read."""

    record: JobRecord
    statuses: Mapping[int, Mapping[str, Any]]
    errors: Mapping[int, ClusterrunError]
    gpus: Mapping[int, NodeGpus]


def look(store: JobStore, job: Opened) -> Look:
    """Ask every node's host about the job's current attempt (a Slurm job has no agent: its record
    is all there is) and note in the record which hosts could not be reached."""
    record = job.record
    gpus: dict[int, NodeGpus] = {}
    try:
        answers = node_statuses(job, gpus) if record.engine != "slurm" else {}
    except ClusterrunError:  # the recorded hosts file cannot be read: the record alone is shown
        answers = {}
    record = record_reachability(store, record, answers)  # a host that did not answer: since when
    return Look(record, {rank: a for rank, a in answers.items() if not isinstance(a, ClusterrunError)},
                {rank: a for rank, a in answers.items() if isinstance(a, ClusterrunError)}, gpus)
