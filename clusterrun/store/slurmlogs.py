"""The logs of a job of ``up --from-slurm``, kept on the machine that ran it.

Under Slurm every node's output comes through the one ``srun`` to the ``up`` that runs it, so that
``up`` writes each node's lines (``LogLines``, srun's label taken off, the ``[rankN]:`` tags kept)
into the job's directory in the agent's layout (``clusterrun.agent``'s docstring)::

    $XDG_STATE_HOME/clusterrun/jobs/<job>/node<N>/attempt<K>/output.log    the node's lines, appended
                                                           /output.times  ``<offset> <ns>`` per write

the same directory a local agent would use for that job, and the same files ``logs`` reads over
SSH: byte offsets, ``--tail``, ``--rank`` (by the tags), ``--attempt`` and the interleaving by
write time work alike. ``read_chunks`` reads them for ``logs``; ``SlurmFollower`` follows them for
``logs -f`` while the record says the job runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from clusterrun.agent.follow import Times, tail_offset
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import (
    Event,
    JobFinished,
    JobResult,
    JobState,
    LogLines,
    NodeExited,
    NodeResult,
    NodeState,
    RootCause,
)
from clusterrun.core.protocol import LogChunk
from clusterrun.store.jobs import JobRecord, JobStore

POLL = 0.1  # how often ``logs -f`` looks for new lines in the files (the agent's follow: 0.05 s)
CHUNK = 1 << 20


def node_dir(store: JobStore, job_id: str, rank: int, attempt: int) -> Path:
    """Where node ``rank``'s log of ``attempt`` is kept (the agent's layout under the job's directory)."""
    return store.dir(job_id) / f"node{rank}" / f"attempt{attempt}"


class LogFiles:
    """An ``emit`` consumer that appends each node's lines to its ``output.log`` and notes when
    (``output.times``). Lifecycle: ``LogFiles(store, job_id, attempt)`` → events → ``close()``.
    A write that fails (a full disk) is said once on ``warn`` and the job runs on."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, warn: Callable[[str], None]) -> None:
        self.store, self.job_id, self.attempt = store, job_id, attempt
        self._warn = warn
        self._files: dict[int, tuple[int, int]] = {}  # rank -> (output.log, output.times) fds
        self._failed = False

    def _open(self, rank: int) -> tuple[int, int]:
        if rank not in self._files:
            folder = node_dir(self.store, self.job_id, rank, self.attempt)
            old = os.umask(0o077)
            try:
                folder.mkdir(parents=True, exist_ok=True)
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
                self._files[rank] = (os.open(folder / "output.log", flags, 0o600),
                                     os.open(folder / "output.times", flags, 0o600))
            finally:
                os.umask(old)
        return self._files[rank]

    def __call__(self, event: Event) -> None:
        if not isinstance(event, LogLines) or event.node is None or self._failed:
            return
        data = "".join(f"{line}\n" for line in event.lines).encode("utf-8", "surrogateescape")
        try:
            log, times = self._open(event.node)
            offset = os.fstat(log).st_size
            os.write(times, b"%d %d\n" % (offset, time.time_ns()))
            os.write(log, data)
        except OSError as exc:
            self._failed = True
            self._warn(f"cannot keep the logs of job {self.job_id} in {self.store.dir(self.job_id)}: "
                       f"{exc.strerror or exc}; from here on they are only shown, not kept")

    def close(self) -> None:
        for log, times in self._files.values():
            os.close(log)
            os.close(times)
        self._files.clear()


def read_chunks(store: JobStore, record: JobRecord, rank: int, attempt: int,
                tail: int | None = None) -> Iterator[LogChunk]:
    """Node ``rank``'s log of ``attempt`` as written so far (from its last ``tail`` lines if
    given), in chunks of whole lines, with when they were written; the last line of an ended
    job even without its newline. A node that has written nothing has no file: no chunk."""
    folder = node_dir(store, record.job_id, rank, attempt)
    path = folder / "output.log"
    ended = record.finished or record.attempt > attempt
    try:
        offset = tail_offset(str(path), tail) if tail is not None else 0
        with open(path, "rb") as f:
            f.seek(offset)
            times = Times(str(folder / "output.times"))
            while data := f.read(CHUNK):
                cut = len(data) if ended and len(data) < CHUNK else data.rfind(b"\n") + 1
                if not cut:  # a partial last line of a running job: not yet
                    return
                f.seek(offset + cut)
                yield LogChunk(offset, offset + cut, data[:cut].decode("utf-8", "surrogateescape"),
                               tuple((a, b) for a, b in times.covering(offset, offset + cut)))
                offset += cut
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ClusterrunError(f"cannot read {path}: {exc.strerror or exc}") from exc


# what the record of a Slurm job keeps of its root cause (``slurm.root_cause``, written by its ``up``)
ROOT_CAUSE_FIELDS = ("node", "host", "rank", "local_rank", "exit_code", "signal", "last_lines", "message", "pid")


def result_of(record: JobRecord) -> JobResult:
    """The ended job's outcome as its record keeps it (what ``logs -f`` and ``attach`` end with)."""
    nodes = tuple(NodeResult(n.rank, n.host, NodeState(n.state), exit_code=n.exit_code, signal=n.signal,
                             error=n.error) for n in record.nodes)
    kept = (record.slurm or {}).get("root_cause")
    cause = None
    if isinstance(kept, dict) and record.attempts and record.attempts[-1].root_cause:  # of this attempt
        cause = RootCause(node=int(kept["node"]), host=str(kept["host"]), rank=kept.get("rank"),
                          local_rank=kept.get("local_rank"), exit_code=kept.get("exit_code"),
                          signal=kept.get("signal"), last_lines=tuple(kept.get("last_lines") or ()),
                          message=str(kept.get("message") or ""), pid=kept.get("pid"))
    return JobResult(record.job_id, nodes, root_cause=cause,
                     interrupted="clusterrun down" if record.state is JobState.STOPPED else None)


class SlurmFollower:
    """``logs -f`` and ``attach`` of a Slurm job: its nodes' files followed until its record says it
    ended. Lifecycle: create → ``run()`` (the ``JobResult``, or None once ``detach()`` was called) →
    ``close()``. ``reload``: the record as it is now (brought up to date where its ``up`` is gone);
    ``offsets``: where to start in each node's file (else its last ``tail`` lines, else its start)."""

    def __init__(self, store: JobStore, record: JobRecord, emit: Callable[[Event], None], *, attempt: int,
                 ranks: Sequence[int], tail: int | None, reload: Callable[[], JobRecord],
                 offsets: Mapping[int, int] | None = None) -> None:
        self.store, self.record, self.attempt = store, record, attempt
        self._emit, self._reload, self.ranks = emit, reload, list(ranks)
        self._detached = threading.Event()
        self.offsets = {rank: 0 for rank in self.ranks}
        if offsets is not None:  # where a viewer left off (attach)
            self.offsets.update({rank: offsets.get(rank, 0) for rank in self.ranks})
        for rank in self.ranks if offsets is None else ():
            path = node_dir(store, record.job_id, rank, attempt) / "output.log"
            self.offsets[rank] = tail_offset(str(path), tail) if tail is not None and path.exists() else 0

    def detach(self) -> None:
        self._detached.set()

    def close(self) -> None:
        self._detached.set()

    def run(self) -> JobResult | None:
        while True:
            record = self._reload()
            ended = record.finished or record.attempt > self.attempt  # read what the files hold, then stop
            for rank in self.ranks:
                self._read(record if ended else self.record, rank)
            if ended:  # its end as a follower over SSH says it (the printer's summary, the dashboard's)
                if record.attempt != self.attempt:
                    return None
                result = result_of(record)
                for node in result.nodes:
                    self._emit(NodeExited(node.node, result=node))
                self._emit(JobFinished(None, result=result))
                return result
            unwatched = (record.slurm or {}).get("unwatched")
            if unwatched:
                raise ClusterrunError(f"job {record.job_id}: {unwatched}",
                                      hint=f"`clusterrun down {record.job_id}` stops it")
            if self._detached.wait(POLL):
                return None

    def _read(self, record: JobRecord, rank: int) -> None:
        folder = node_dir(self.store, record.job_id, rank, self.attempt)
        ended = record.finished or record.attempt > self.attempt
        try:
            f = open(folder / "output.log", "rb")  # noqa: SIM115 - read in chunks below
        except FileNotFoundError:
            return
        with f:
            f.seek(self.offsets[rank])
            while data := f.read(CHUNK):
                cut = len(data) if ended and len(data) < CHUNK else data.rfind(b"\n") + 1
                if not cut:
                    return
                f.seek(self.offsets[rank] + cut)
                lines = data[:cut].decode("utf-8", "surrogateescape").removesuffix("\n").split("\n")
                self.offsets[rank] += cut
                self._emit(LogLines(rank, host=record.nodes[rank].host, lines=tuple(lines)))
