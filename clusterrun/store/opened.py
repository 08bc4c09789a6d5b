"""A job as one command opened it: its record, and the hosts file that record keeps, parsed once.

A command (or a long-running reader: the web server, ``logs -f``, the dashboard) opens a job
once and carries the ``Opened`` to every function that needs the record or the hosts; none of
them parses the recorded hosts file again. The text a record keeps never changes during the
job's life (a restart changes the spares in use, recorded per attempt), so a newer record of the
same job (``with_record``) keeps the parse: only an attempt's spares are put in place anew.
"""

from __future__ import annotations

import dataclasses
import threading

from clusterrun.config.hostsfile import ClusterSpec, load_cluster_text
from clusterrun.config.watch import Notify, Watch
from clusterrun.store.jobs import JobRecord


class Opened:
    """A job's record and its hosts file, parsed at most once.

    create (``Opened(record)``) → ``spec()`` (parsed at the first call; a ``ConfigError`` if the
    recorded text cannot be read) → ``with_record(newer)`` as the record is read again, sharing the
    parse (a reader's threads too). Nothing to close."""

    __slots__ = ("_parsed", "_specs", "record")

    def __init__(self, record: JobRecord, _parsed: _Parsed | None = None) -> None:
        self.record = record
        self._parsed = _parsed or _Parsed()
        self._specs: dict[int, ClusterSpec] = {}  # by attempt, its spares in place

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def spec(self, attempt: int | None = None) -> ClusterSpec:
        """The hosts file as it was when the job started (relative paths in it are the job's cwd's),
        with the watch and notifications ``up``'s options made of it (the record's), and the spares in
        use in ``attempt`` (default: the current one) in the places of the hosts they replaced."""
        attempt = self.record.attempt if attempt is None else attempt
        spec = self._specs.get(attempt)
        if spec is None:
            spec = self._specs[attempt] = self._parsed.of(self.record).with_spares(self.record.swaps(attempt))
        return spec

    def with_record(self, record: JobRecord) -> Opened:
        """The same job as ``record`` (read later) says it: the parsed hosts file is shared."""
        if record.job_id != self.record.job_id or record.hosts_text != self.record.hosts_text:
            return Opened(record)
        return Opened(record, self._parsed)


class _Parsed:
    """The one parse of a job's recorded hosts file, shared by the ``Opened`` of its later records."""

    __slots__ = ("_lock", "_spec")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spec: ClusterSpec | None = None  # with ``up``'s watch and notifications, no spares in place

    def of(self, record: JobRecord) -> ClusterSpec:
        with self._lock:
            if self._spec is None:
                spec = load_cluster_text(record.hosts_text, record.hosts_file)
                if record.watch:
                    spec = dataclasses.replace(spec, watch=Watch.from_json(record.watch),
                                               notify=Notify.from_json(record.notify))
                self._spec = spec
            return self._spec
