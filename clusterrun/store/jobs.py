"""Jobs on the controller: one directory per job, the record in it, and who owns the job now.

Layout (directories 0700, files 0600)::

    $XDG_STATE_HOME/clusterrun/jobs/<job id>/      (default ~/.local/state/clusterrun/...)
        job.json      the record (``JobRecord``): the hosts file as it was read, the script and
                      its arguments, the plan of the current attempt, every attempt, and the last
                      known state of every node; rewritten atomically under ``record.lock``
        owner.lock    an ``flock`` held by the one process that follows the job and applies its
                      policy (fail-fast): the foreground ``up``, or the job's monitor
        monitor.log   what the monitor printed
        hang-<attempt>.txt  what the ranks were doing when that attempt last hung (``on_hang: stack``)
        monitor.pid   the last monitor's pid and start time (clock ticks since boot)

The owner lock is what makes a job survive its controller: when the owner dies, the kernel drops
the lock, and the next ``ps``, ``logs`` or ``attach`` finds the job without an owner, reconciles
its state from the hosts and starts a monitor (``spawn_monitor``) that takes the lock over.
A lock taken by ``up`` is handed to the monitor it starts by inheritance, so no moment passes
without an owner.

Every ``OSError`` met reading or writing here becomes a ``StateError`` naming the path and the
fix (``state_error``); a job directory whose record could not be written is removed again. A
record that exists but cannot be used (empty, truncated, not JSON, of a newer ``RECORD_VERSION``,
unreadable) is a ``DamagedRecord``: ``scan`` lists it beside the good ones and ``resolve`` finds
it by its id, so that every command can name it and ``rm`` can remove it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterrun.core.errors import DamagedRecord, JobNotFound, StateError
from clusterrun.core.events import JobState, NodeState
from clusterrun.core.frozen import frozen

OWNER_FD_VAR = "CLUSTERRUN_OWNER_FD"
RECORD_VERSION = 1  # of job.json, raised when its fields change: a newer one is refused, not misread (none: 1)


def state_error(path: Path | str, exc: OSError, doing: str) -> StateError:
    """The ``StateError`` for ``exc``, met trying to ``doing`` (e.g. "write") ``path``."""
    where = state_home()
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = f"free some space there, or set XDG_STATE_HOME to a directory with room (now: {where.parent})"
    else:
        hint = f"make {where} writable, or set XDG_STATE_HOME to a writable directory"
    return StateError(str(path), f"cannot {doing} {path}: {exc.strerror or exc}", hint=hint)


@contextmanager
def _state(path: Path | str, doing: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise state_error(path, exc, doing) from exc


def state_home() -> Path:
    """``$XDG_STATE_HOME/clusterrun``, by default ``~/.local/state/clusterrun``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "clusterrun"


def private_dirs(path: Path) -> None:
    """``path`` and the parents it lacks made for this user alone (0700): the state holds jobs' commands and logs."""
    old = os.umask(0o077)
    try:
        path.mkdir(parents=True, exist_ok=True)
    finally:
        os.umask(old)


@dataclass
class NodeRecord:
    """The last known state of one node of the current attempt."""

    rank: int
    host: str
    state: NodeState = NodeState.STARTING
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None
    seen: int = 0  # bytes of the node's log a viewer (up, attach) has shown; attach resumes here
    # when this controller first failed to reach the node's host (wall clock), None once it answers
    unreachable_since: float | None = None
    hung_since: float | None = None  # its ranks wrote nothing and used no CPU since (the host's hang watch)


@dataclass
class AttemptRecord:
    attempt: int
    started: float
    master_port: int
    state: JobState = JobState.STARTING
    ended: float | None = None
    root_cause: str | None = None
    cause: str | None = None  # a known failure signature's cause and fix (``events.Explanation``)
    fix: str | None = None
    restart: str | None = None  # who restarted this attempt: "policy", "start-up", "requested" (on_hang), "user"
    replaced: dict[str, str] | None = None  # the hosts that spares took the place of in this attempt: host → spare
    # When each phase of the attempt's start was over (time.time()), ``life.phases.PHASES``: a restart's
    # from its last attempt's failure seen; every attempt's nodes started and joined.
    phases: dict[str, float] | None = None


@dataclass
class JobRecord:
    """Everything the controller keeps about one job (``job.json``)."""

    job_id: str
    name: str
    created: float
    hosts_file: str
    hosts_text: str
    script: str
    script_args: list[str]
    env_overrides: dict[str, str]
    local_cwd: str
    grace: float
    ssh_config: str | None
    plan: dict[str, Any]
    attempt: int = 1
    state: JobState = JobState.STARTING
    unreachable_timeout: float | None = None  # --unreachable-timeout: silence that counts as a loss
    retry_startup: bool = True  # retry a known transient start-up failure once (--no-retry-startup)
    adopted: bool = False  # made from its hosts' state (`--hosts`): no monitor for it here until a restart here
    max_restarts: int | None = None  # up --max-restarts (None: the hosts file's restart.max)
    restart_at: float | None = None  # while ``restarting``: when the next attempt starts (time.time())
    watch: dict[str, Any] = field(default_factory=dict)  # watch.Watch: the hosts file's with up's options applied
    notify: dict[str, Any] | None = None  # watch.Notify, the same
    notified: list[str] = field(default_factory=list)  # the notifications claimed (notify.py: each once)
    notices: dict[str, dict[str, Any]] = field(default_factory=dict)  # by key: notify.Notice, who sends, how it went
    attempts: list[AttemptRecord] = field(default_factory=list)
    nodes: list[NodeRecord] = field(default_factory=list)
    engine: str = "ssh"  # what runs the job: "ssh" (agents on the hosts) or "slurm" (one srun, slurmjob.py)
    slurm: dict[str, Any] | None = None  # the allocation and step of a Slurm job (slurmjob.slurm_of)
    progress: dict[str, Any] | None = None  # events.Progress: the training's, last read (kept across attempts)
    version: int = RECORD_VERSION

    @property
    def finished(self) -> bool:
        return JobState(self.state).is_terminal

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in self.nodes]

    def swaps(self, attempt: int | None = None) -> dict[str, str]:
        """The hosts of the hosts file that ran on a spare in ``attempt`` (default: the current one)
        by then: the file's host → the host in its place (``ClusterSpec.with_spares``)."""
        in_use: dict[str, str] = {}
        for a in self.attempts:
            if attempt is not None and a.attempt > attempt:
                break
            for old, new in (a.replaced or {}).items():
                file_host = next((k for k, v in in_use.items() if v == old), old)
                in_use[file_host] = new
        return in_use

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: that deep-copies the plan on every write of the record.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        # An attempt without spares or phases is written as before: older clusterruns read it.
        data["attempts"] = [{k: v for k, v in vars(a).items() if k not in ("replaced", "phases") or v}
                            for a in self.attempts]
        data["nodes"] = [dict(vars(n)) for n in self.nodes]
        if self.engine == "ssh" and self.slurm is None:  # a job over SSH written as before: older clusterruns read it
            del data["engine"], data["slurm"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobRecord:
        data = dict(data)
        data["state"] = JobState(data.get("state", JobState.STARTING))
        data["attempts"] = [AttemptRecord(**dict(a, state=JobState(a.get("state", JobState.STARTING))))
                            for a in data.get("attempts", [])]
        data["nodes"] = [NodeRecord(**dict(n, state=NodeState(n.get("state", NodeState.STARTING))))
                         for n in data.get("nodes", [])]
        return cls(**data)


SLURM = "slurm"  # JobRecord.engine of a job of up --from-slurm ("ssh" for every other)


def is_slurm(record: JobRecord) -> bool:
    """A job of ``up --from-slurm`` (one srun, no agent on its nodes), told without Slurm's modules."""
    return record.engine == SLURM


def restart_pending(record: JobRecord, now: float | None = None) -> bool:
    """Whether a ``restart`` of this Slurm job stopped its step and has yet to record the next
    attempt (``slurm["restarting"]``, written before the stop): until its deadline, and only while
    its process lives where that can be seen (this machine)."""
    mark = (record.slurm or {}).get("restarting")
    if not mark or (time.time() if now is None else now) >= float(mark.get("until") or 0):
        return False
    ident = mark.get("process")
    return mark.get("host") != socket.gethostname() or not isinstance(ident, str) or process_alive(ident)


class JobStore:
    """The job directories under ``root`` (``state_home()/jobs`` unless given)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or state_home() / "jobs"

    def dir(self, job_id: str) -> Path:
        return self.root / job_id

    def _ensure_root(self) -> None:
        private_dirs(self.root)

    def create(self, record: JobRecord) -> None:
        """Make the job's directory and write its record; on failure, leave no directory behind."""
        with _state(self.root, "create"):
            self._ensure_root()
        path = self.dir(record.job_id)
        with _state(path, "create"):
            path.mkdir(mode=0o700)
        try:
            self._write(record)
        except StateError:
            shutil.rmtree(path, ignore_errors=True)  # made just now (mkdir fails on an existing one)
            raise

    def load(self, job_id: str) -> JobRecord:
        """The job's record. Raises ``JobNotFound`` if it has none, ``DamagedRecord`` if it cannot
        be used, ``StateError`` if it cannot be read for another reason."""
        path = self.dir(job_id) / "job.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if (self.dir(job_id) / "owner.lock").exists():  # made after the record: the record was deleted
                raise DamagedRecord(job_id, str(path), "missing: the job's directory has no job.json") from None
            raise JobNotFound(f"no job {job_id!r}", hint="`clusterrun ps` lists the jobs") from None
        except PermissionError as exc:
            raise DamagedRecord(job_id, str(path), f"unreadable: {exc.strerror}",
                                hint=f"make it yours and readable (`chown $USER {path}; chmod 600 {path}`)") from None
        except OSError as exc:
            raise state_error(path, exc, "read") from exc
        return parse_record(job_id, path, data)

    def _write(self, record: JobRecord) -> None:
        # No indent: json's C encoder handles only compact output, and it is many times faster.
        write_atomic(self.dir(record.job_id) / "job.json", json.dumps(record.to_json(), sort_keys=True).encode())

    def hang_report(self, job_id: str, attempt: int) -> Path:
        """Where the report of the attempt's last hang is (``diagnose.hangreport``), if it was taken."""
        return self.dir(job_id) / f"hang-{attempt}.txt"

    def save_hang_report(self, job_id: str, attempt: int, text: str) -> Path:
        """Write the attempt's hang report (replacing an earlier hang's); its path."""
        path = self.hang_report(job_id, attempt)
        write_atomic(path, text.encode())
        return path

    @contextmanager
    def _locked(self, job_id: str, name: str) -> Iterator[None]:
        path = self.dir(job_id) / name
        with _state(path, "open"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def update(self, job_id: str, change: Callable[[JobRecord], None]) -> JobRecord:
        """Read the record, apply ``change`` to it and write it back, atomically and serialised."""
        with self._locked(job_id, "record.lock"):
            record = self.load(job_id)
            change(record)
            self._write(record)
            return record

    def scan(self) -> tuple[list[JobRecord], list[DamagedRecord]]:
        """Every job with a record: the readable ones oldest first, and the damaged ones by id."""
        records, damaged = [], []
        with _state(self.root, "list"):
            entries = list(self.root.iterdir()) if self.root.is_dir() else []
        for entry in entries:
            if (entry / "job.json").is_file() or (entry / "owner.lock").exists():
                try:
                    records.append(self.load(entry.name))
                except DamagedRecord as exc:
                    damaged.append(exc)
                except JobNotFound:  # removed meanwhile
                    continue
        return sorted(records, key=lambda r: (r.created, r.job_id)), sorted(damaged, key=lambda d: d.job_id)

    def all(self) -> list[JobRecord]:
        """Every job with a readable record, oldest first (``scan`` also gives the damaged ones)."""
        return self.scan()[0]

    def resolve(self, ref: str) -> str:
        """The job id ``ref`` names (``find``), without the note on which job a reused name means."""
        return self.find(ref).job_id

    def find(self, ref: str) -> Found:
        """The job ``ref`` names: an id, a ``--name`` or a unique id prefix. A name several jobs have
        had means the one of them that has not ended (``up`` lets only one run under a name), else
        the newest; ``Found.note`` then says which. An id prefix that matches several jobs is refused
        with their ids, as docker does. A damaged record is found by its id or a prefix of it (its
        name cannot be read)."""
        records, damaged = self.scan()
        if any(r.job_id == ref for r in records) or any(d.job_id == ref for d in damaged):
            return Found(ref)
        named = [r for r in records if r.name == ref]
        if named:
            return by_name(ref, named)
        prefixed = {r.job_id: f"{r.job_id} ({r.state})" for r in records if r.job_id.startswith(ref)}
        prefixed |= {d.job_id: f"{d.job_id} (damaged)" for d in damaged if d.job_id.startswith(ref)}
        if len(prefixed) == 1:
            return Found(next(iter(prefixed)))
        if prefixed:
            raise _ambiguous_ids(ref, list(prefixed.values()), f"{len(prefixed)} jobs")
        raise JobNotFound(f"no job matches {ref!r}", hint="`clusterrun ps` lists the jobs")

    def remove(self, job_id: str) -> None:
        """Delete the job's directory (its record, locks and monitor log). The caller has checked
        that the job has ended and nobody owns it."""
        with _state(self.dir(job_id), "remove"):
            with contextlib.suppress(FileNotFoundError):  # first: no `ps` meanwhile takes the rest for damaged
                os.unlink(self.dir(job_id) / "owner.lock")
            shutil.rmtree(self.dir(job_id))

    def named(self, name: str) -> list[JobRecord]:
        """The jobs called ``name`` (their ``--name``), oldest first."""
        return [r for r in self.all() if r.name == name]

    # ----------------------------------------------------------------------------- ownership

    def try_own(self, job_id: str) -> int | None:
        """Take the job's owner lock without waiting: its fd, or None if another process owns the job."""
        path = self.dir(job_id) / "owner.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            try:  # a read-only state directory: an flock works on a file opened for reading too
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                raise state_error(path, exc, "open") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def wait_own(self, job_id: str, timeout: float) -> int | None:
        """Take the owner lock, waiting up to ``timeout`` seconds for the current owner to let go."""
        deadline = time.monotonic() + timeout
        while True:
            fd = self.try_own(job_id)
            if fd is not None or time.monotonic() > deadline:
                return fd
            time.sleep(0.1)

    @staticmethod
    def release(fd: int) -> None:
        """Let go of an owner lock taken with ``try_own``/``wait_own``."""
        os.close(fd)

    def owned(self, job_id: str) -> bool:
        """Whether a live process owns the job."""
        fd = self.try_own(job_id)
        if fd is None:
            return True
        os.close(fd)
        return False

    def note_monitor(self, job_id: str) -> None:
        """Record the calling process as the job's monitor (``monitor.pid``: pid and start time)."""
        write_atomic(self.dir(job_id) / "monitor.pid", f"{process_id()}\n".encode())

    def spawn_monitor(self, job_id: str, owner_fd: int | None = None) -> bool:
        """Start the job's monitor in the background; it takes over ``owner_fd`` (a held owner lock)
        or takes the lock itself. False if the job has an owner already."""
        fd = owner_fd if owner_fd is not None else self.try_own(job_id)
        if fd is None:
            return False
        os.set_inheritable(fd, True)
        log = str(self.dir(job_id) / "monitor.log")
        env = dict(os.environ, **{OWNER_FD_VAR: str(fd)})
        with _state(log, "start the job's monitor with its log in"):
            pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "clusterrun", "_monitor", job_id], env,
                                 file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                               (os.POSIX_SPAWN_OPEN, 1, log,
                                                os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
                                               (os.POSIX_SPAWN_DUP2, 1, 2)],
                                 setsid=True)
        os.close(fd)  # the monitor holds the lock now (an flock belongs to the open file, which it shares)
        os.waitpid(pid, 0)  # it forks again at once (see monitor.daemonize), so this returns quickly
        return True


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_id(pid: int | None = None) -> str:
    """A process (this one by default) told apart from a later one of the same pid: "pid start",
    its start time in clock ticks since boot; "pid" alone where there is no /proc."""
    pid = os.getpid() if pid is None else pid
    fields = _stat(pid)
    return f"{pid} {fields[19]}" if fields is not None and len(fields) > 19 else str(pid)


def process_alive(ident: str) -> bool:
    """Whether the process ``process_id`` named still runs (not a zombie, not a later one of its pid)."""
    pid = int(ident.split()[0])
    fields = _stat(pid)
    if fields is not None:
        return fields[0] != "Z" and process_id(pid) == ident
    if os.path.isdir("/proc/self"):
        return False
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@frozen
class Found:
    """The job a reference names, and, for a name several jobs have had, one line saying which."""

    job_id: str
    note: str | None = None


def by_name(name: str, named: list[JobRecord]) -> Found:
    """Of the jobs called ``name`` (oldest first): the newest that has not ended, else the newest."""
    running = [r for r in named if not r.finished]
    chosen = (running or named)[-1]
    if len(named) == 1:
        return Found(chosen.job_id)
    which = (f"the one of {len(named)} jobs of that name that has not ended" if running
             else f"the newest of {len(named)} jobs of that name, all ended")
    return Found(chosen.job_id, f"{name!r} is job {chosen.job_id} ({chosen.state}), {which} "
                                "(`clusterrun ps -a` lists them by id)")


def _ambiguous_ids(ref: str, jobs: list[str], what: str) -> JobNotFound:
    shown = list(reversed(jobs[-10:]))  # newest first
    more = f", and {len(jobs) - 10} older" if len(jobs) > 10 else ""
    return JobNotFound(f"{ref!r} is ambiguous: it matches {what}: {', '.join(shown)}{more}",
                       hint="name the job by its id, or a prefix of the id that only it has")


def parse_record(job_id: str, path: Path, data: bytes) -> JobRecord:
    """Job ``job_id``'s record from the bytes of its ``job.json``; ``DamagedRecord`` saying what is
    wrong with them (and where) when they are not a record this clusterrun can use."""
    def damaged(reason: str, hint: str | None = None) -> DamagedRecord:
        return DamagedRecord(job_id, str(path), reason, hint=hint)

    if not data.strip():
        raise damaged(f"empty: {len(data)} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise damaged(f"not UTF-8 at byte {exc.start} of {len(data)}") from None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:  # its pos counts characters; the message says bytes
        raise damaged(f"not JSON at byte {len(text[:exc.pos].encode())} of {len(data)}: {exc.msg}") from None
    if not isinstance(fields, dict):
        raise damaged(f"not a job record: a JSON {type(fields).__name__}, not an object")
    version = fields.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise damaged(f"not a job record: version {version!r}")
    if version > RECORD_VERSION:
        raise damaged(f"record version {version}, written by a newer clusterrun; this one reads version "
                      f"{RECORD_VERSION}", hint="use the clusterrun that wrote it (or upgrade this one)")
    if fields.get("job_id") != job_id:
        raise damaged(f"not this job's record: it names job {fields.get('job_id')!r}")
    try:
        return JobRecord.from_json(fields)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if unknown:
            raise damaged(f"unknown field {unknown.group(1)!r} (written by a newer clusterrun?)",
                          hint="use the clusterrun that wrote it (or upgrade this one)") from None
        raise damaged(f"not a job record: {exc}") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write a temporary file (0600, a random name: a home shared between machines sees their pids
    collide), fsync, rename over ``path``."""
    with _state(path, "write"):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise state_error(path, exc, "write") from exc
        raise
