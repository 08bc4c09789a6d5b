"""Copy the local project directory to every host's ``workdir`` before a job starts.

Lifecycle of one run: ``scan()`` the local directory once (``.gitignore`` files and
``sync_exclude`` honoured, ``.git`` left out) → per host, in parallel, on the agent that probed it:
``sync_stat`` of every path → ``diff()`` → ``sync_hash`` where only the mtime differs →
``sync_put`` in batches, the files' bytes following each request on the agent's stdin (over SSH:
the connection already open, one channel) → a ``SyncReport``. A second run copies only what
changed: same size and mtime is taken as unchanged, a file whose size is the same but whose mtime
differs is compared by sha256 (equal: only its mtime and mode are set). Files are written to a
temporary name and renamed, with their permission bits and mtime; directories get their mode;
symlinks are copied as symlinks. Nothing is ever deleted on the host.

Any failure (no space, read-only, no permission, a directory where a file goes) is an error of
that host naming the path, raised for all hosts together (``HostsUnavailable``) before anything
starts.

Exclude patterns: the ``.gitignore`` files of the directory (each for its own directory and
below), after ``.git`` (left out by default) and before ``sync_exclude`` (anchored at the synced
directory; they win); the syntax supported is in ``clusterrun.excludes``. Not read:
``.git/info/exclude`` and git's global ``core.excludesFile``.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from clusterrun.config import ClusterSpec, HostSpec
from clusterrun.errors import AgentError, ClusterrunError, ConfigError, HostsUnavailable, TransportError
from clusterrun.excludes import Excludes
from clusterrun.protocol import RemoteEntry, decode_sync_hashes, decode_sync_stat
from clusterrun.transports import AgentSession, Transport

CHUNK = 1 << 20
BATCH_BYTES = 32 << 20  # the data of one sync_put: the agent answers (and reports a failure) after each
BATCH_FILES = 2000
STAT_BATCH = 5000  # paths per sync_stat / sync_hash request


# ---------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class LocalEntry:
    """A path to copy: ``f`` file, ``d`` directory or ``l`` symlink (``target``)."""

    path: str
    kind: str
    size: int = 0
    mtime_ns: int = 0
    mode: int = 0o644
    target: str | None = None


@dataclass(frozen=True)
class Manifest:
    root: str
    entries: tuple[LocalEntry, ...]
    mode: int  # the directory's own
    dev: int
    ino: int
    hashes: dict[tuple[str, int, int], str | None] = field(default_factory=dict, compare=False)  # sha256 cache

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries if e.kind == "f")

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "f")


def scan(root: str, patterns: Sequence[str] = ()) -> Manifest:
    """Every directory, file and symlink below ``root`` that is not excluded, sorted by path.
    Raises ``ConfigError`` if ``root`` is not a readable directory."""
    try:
        top = os.stat(root)
    except OSError as exc:
        raise ConfigError(f"the directory to sync, {root}, cannot be read: {exc.strerror}", key="sync",
                          hint="`sync:` is relative to the hosts file's directory, `--sync DIR` to the current "
                          "one") from None
    if not stat.S_ISDIR(top.st_mode):
        raise ConfigError(f"the directory to sync, {root}, is not a directory", key="sync")
    entries: list[LocalEntry] = []

    def walk(folder: str, rel: str, rules: Excludes) -> None:
        try:
            with open(os.path.join(folder, ".gitignore"), encoding="utf-8", errors="replace") as f:
                rules = rules.below(rel, f.read())
        except OSError:
            pass
        try:
            items = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise ConfigError(f"cannot read {folder}: {exc.strerror}", key="sync") from None
        for item in items:
            path = f"{rel}/{item.name}" if rel else item.name
            try:
                info = item.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            is_dir = stat.S_ISDIR(info.st_mode)
            if rules.excluded(path, is_dir):
                continue
            mode = stat.S_IMODE(info.st_mode)
            if is_dir:
                entries.append(LocalEntry(path, "d", mode=mode))
                walk(item.path, path, rules)
            elif stat.S_ISREG(info.st_mode):
                entries.append(LocalEntry(path, "f", info.st_size, info.st_mtime_ns, mode))
            elif stat.S_ISLNK(info.st_mode):
                entries.append(LocalEntry(path, "l", mode=mode, target=os.readlink(item.path)))
            # sockets, fifos and devices are not copied

    walk(root, "", Excludes.of(patterns))
    return Manifest(root, tuple(entries), stat.S_IMODE(top.st_mode), top.st_dev, top.st_ino)


# -------------------------------------------------------------------------------------- diff


@dataclass
class Changes:
    """What one host needs: ``put`` (dirs, links and files with their data), ``touch`` (files whose
    content is the same: mode and mtime only) and ``compare`` (same size, other mtime: hash them)."""

    put: list[LocalEntry] = field(default_factory=list)
    touch: list[LocalEntry] = field(default_factory=list)
    compare: list[LocalEntry] = field(default_factory=list)
    unchanged: int = 0


def diff(local: Sequence[LocalEntry], remote: Mapping[str, RemoteEntry]) -> Changes:
    """Compare the local entries with what the host has at their paths."""
    changes = Changes()
    for entry in local:
        there = remote.get(entry.path)
        if there is None or there.kind != entry.kind:
            changes.put.append(entry)
        elif entry.kind == "d":
            if there.mode != entry.mode:
                changes.put.append(entry)  # chmod only
            else:
                changes.unchanged += 1
        elif entry.kind == "l":
            if there.target != entry.target:
                changes.put.append(entry)
            else:
                changes.unchanged += 1
        elif there.size != entry.size:
            changes.put.append(entry)
        elif there.mtime_ns != entry.mtime_ns:
            changes.compare.append(entry)
        elif there.mode != entry.mode:
            changes.touch.append(entry)
        else:
            changes.unchanged += 1
    return changes


def settle(changes: Changes, local_hashes: Mapping[str, str], remote_hashes: Mapping[str, str]) -> Changes:
    """``changes`` with its ``compare`` list decided: equal hashes → ``touch``, else ``put``."""
    put, touch = list(changes.put), list(changes.touch)
    for entry in changes.compare:
        if local_hashes.get(entry.path) is not None and local_hashes.get(entry.path) == remote_hashes.get(entry.path):
            touch.append(entry)
        else:
            put.append(entry)
    return Changes(put=sorted(put, key=lambda e: e.path), touch=touch, compare=[], unchanged=changes.unchanged)


def file_hash(path: str) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ per host


@dataclass(frozen=True)
class SyncProgress:
    """How far one host's sync is: ``phase`` is ``compare``, ``copy`` or ``done``."""

    rank: int
    host: str
    phase: str
    files_done: int = 0
    files_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass(frozen=True)
class SyncReport:
    """What one host's sync did."""

    rank: int
    host: str
    source: str
    root: str
    copied: int = 0  # files written
    bytes: int = 0  # their bytes
    touched: int = 0  # files whose content was already there: mode and mtime set
    other: int = 0  # directories made or chmod'ed, symlinks made
    unchanged: int = 0
    same_dir: bool = False  # the workdir is the source directory itself (a local host): nothing to do
    seconds: float = 0.0
    dry_run: bool = False  # what would be copied; nothing was

    def describe(self) -> str:
        if self.same_dir:
            return f"{self.root} is the synced directory itself: nothing to copy"
        if self.dry_run:
            return (f"would copy {self.copied} file(s) ({human(self.bytes)}) and set mode/mtime of {self.touched}, "
                    f"make or change {self.other} directories/symlinks, {self.unchanged} unchanged, to {self.root}")
        text = f"{self.copied} file(s) copied ({human(self.bytes)})"
        if self.touched:
            text += f", {self.touched} with only mode/mtime set"
        if self.other:
            text += f", {self.other} directories/symlinks made or changed"
        return text + f", {self.unchanged} unchanged, to {self.root} in {self.seconds:.1f} s"


def human(size: float) -> str:
    """Bytes in decimal units, as the progress bar (rich) shows them."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


Progress = Callable[[SyncProgress], None]


class _Aborted(ClusterrunError):
    """The data of a local file could not be sent as announced (the session is closed)."""


def _local_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class HostSync:
    """One host's sync over one agent session: ``run()`` → ``SyncReport``."""

    def __init__(self, rank: int, host: HostSpec, session: AgentSession, manifest: Manifest,
                 progress: Progress | None = None, *, dry_run: bool = False) -> None:
        self.rank = rank
        self.host = host
        self.session = session
        self.manifest = manifest
        self.progress = progress or (lambda p: None)
        self.dry_run = dry_run
        self.root = host.workdir or "."

    def _tell(self, phase: str, files: tuple[int, int] = (0, 0), size: tuple[int, int] = (0, 0)) -> None:
        self.progress(SyncProgress(self.rank, self.host.host, phase, files[0], files[1], size[0], size[1]))

    def changes(self) -> tuple[Changes, bool, str]:
        """What to send, whether the workdir is the source itself, and the workdir's absolute path."""
        self._tell("compare")
        paths = [e.path for e in self.manifest.entries]
        entries: dict[str, RemoteEntry] = {}
        root = self.root
        for i in range(0, max(len(paths), 1), STAT_BATCH):
            found = decode_sync_stat(self.host.host, self.session.call(
                {"op": "sync_stat", "root": self.root, "paths": paths[i:i + STAT_BATCH]}))
            root = found.root
            if (found.exists and found.boot_id == _local_boot_id() and found.boot_id
                    and (found.dev, found.ino) == (self.manifest.dev, self.manifest.ino)):
                return Changes(), True, root
            entries.update(found.entries)
        changes = diff(self.manifest.entries, entries)
        if changes.compare:
            wanted = [e.path for e in changes.compare]
            remote: dict[str, str] = {}
            for i in range(0, len(wanted), STAT_BATCH):
                remote.update(decode_sync_hashes(self.host.host, self.session.call(
                    {"op": "sync_hash", "root": self.root, "paths": wanted[i:i + STAT_BATCH]})))
            local = {e.path: h for e in changes.compare if (h := self._local_hash(e)) is not None}
            changes = settle(changes, local, remote)
        return changes, False, root

    def run(self) -> SyncReport:
        started = time.monotonic()
        changes, same, root = self.changes()
        files = [e for e in changes.put if e.kind == "f"]
        others = [e for e in changes.put if e.kind != "f"]
        total = sum(e.size for e in files)
        report = SyncReport(self.rank, self.host.host, self.manifest.root, root, copied=len(files), bytes=total,
                            touched=len(changes.touch), other=len(others), unchanged=changes.unchanged,
                            same_dir=same, dry_run=self.dry_run)
        if self.dry_run or same:
            self._tell("done", (0, 0), (0, 0))
            return report
        done = [0, 0]  # files, bytes sent
        self._tell("copy", (0, len(files)), (0, total))
        first: list[dict[str, object]] = [self._entry(e, data=False) for e in others + changes.touch]
        batches = list(_batches(files))
        if not batches:
            batches = [[]]
        for i, batch in enumerate(batches):
            request = {"op": "sync_put", "root": self.root, "root_mode": self.manifest.mode,
                       "entries": (first if i == 0 else []) + [self._entry(e, data=True) for e in batch]}
            self.session.call_with_data(request, self._data(batch, done, len(files), total))
        self._tell("done", (len(files), len(files)), (total, total))
        return _with_seconds(report, time.monotonic() - started)

    def _local_hash(self, entry: LocalEntry) -> str | None:
        """The file's sha256, computed once for all hosts (the manifest's cache)."""
        key = (entry.path, entry.size, entry.mtime_ns)
        if key not in self.manifest.hashes:
            self.manifest.hashes[key] = file_hash(os.path.join(self.manifest.root, entry.path))
        return self.manifest.hashes[key]

    @staticmethod
    def _entry(e: LocalEntry, data: bool) -> dict[str, object]:
        item: dict[str, object] = {"path": e.path, "kind": e.kind, "mode": e.mode}
        if e.kind == "f":
            item.update(size=e.size, mtime_ns=e.mtime_ns, data=data)
        if e.kind == "l":
            item["target"] = e.target
        return item

    def _data(self, batch: Sequence[LocalEntry], done: list[int], files: int, total: int) -> Iterator[bytes]:
        """``_file_data`` in pieces of at least ``CHUNK`` bytes: one send per small file would cost
        a channel write (and an SSH packet) each."""
        pending: list[bytes] = []
        size = 0
        for block in self._file_data(batch, done):
            pending.append(block)
            size += len(block)
            if size >= CHUNK:
                yield b"".join(pending)
                pending, size = [], 0
                self._tell("copy", (done[0], files), (done[1], total))
        if pending:
            yield b"".join(pending)
        self._tell("copy", (done[0], files), (done[1], total))

    def _file_data(self, batch: Sequence[LocalEntry], done: list[int]) -> Iterator[bytes]:
        """The bytes of ``batch``, exactly ``size`` per file: a file that shrank or vanished since
        the scan ends the session (the agent then discards the partial file) and fails the host."""
        for entry in batch:
            path = os.path.join(self.manifest.root, entry.path)
            left = entry.size
            try:
                with open(path, "rb") as f:
                    while left > 0:
                        block = f.read(min(CHUNK, left))
                        if not block:
                            break
                        left -= len(block)
                        done[1] += len(block)
                        yield block
            except OSError as exc:
                self.session.close()
                raise _Aborted(f"cannot read {path}: {exc.strerror or exc}") from None
            if left:
                self.session.close()
                raise _Aborted(f"{path} changed while it was being copied", hint="run again once it is written")
            done[0] += 1


def _with_seconds(report: SyncReport, seconds: float) -> SyncReport:
    from dataclasses import replace
    return replace(report, seconds=seconds)


def _batches(files: Sequence[LocalEntry]) -> Iterator[list[LocalEntry]]:
    batch: list[LocalEntry] = []
    size = 0
    for entry in files:
        if batch and (size + entry.size > BATCH_BYTES or len(batch) >= BATCH_FILES):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.size
    if batch:
        yield batch


# --------------------------------------------------------------------------------- all hosts


def source_of(spec: ClusterSpec, host: HostSpec, override: str | None = None) -> str | None:
    """The local directory to sync to ``host``: ``override`` (``--sync``, relative to the current
    directory) or the host's ``sync:`` (relative to the hosts file's directory); None for neither."""
    if override is not None:
        return os.path.abspath(os.path.expanduser(override))
    if host.sync is None:
        return None
    return os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(spec.path)), os.path.expanduser(host.sync)))


def sync_hosts(spec: ClusterSpec, agents: Sequence[tuple[Transport, AgentSession | None]],
               progress: Progress | None = None, *, override: str | None = None,
               dry_run: bool = False) -> dict[int, SyncReport]:
    """Sync every host that has a source (``sync:`` or ``override``), in parallel, each on its
    agent; raise ``HostsUnavailable`` naming every host that failed (the others are synced)."""
    wanted = {rank: src for rank, host in enumerate(spec.hosts)
              if (src := source_of(spec, host, override)) is not None}
    if not wanted:
        return {}
    for rank in wanted:
        if spec.hosts[rank].workdir is None:
            raise ConfigError(f"--sync needs a workdir for host {spec.hosts[rank].host!r}", path=spec.path,
                              key=f"hosts[{rank}].workdir", hint="set `workdir:` for every host (or in defaults)")
    manifests: dict[tuple[str, tuple[str, ...]], Manifest] = {}
    for rank, src in wanted.items():
        key = (src, spec.hosts[rank].sync_exclude)
        if key not in manifests:
            manifests[key] = scan(src, key[1])
    lock = threading.Lock()

    def tell(p: SyncProgress) -> None:
        if progress is not None:
            with lock:
                progress(p)

    def one(rank: int) -> SyncReport:
        transport, session = agents[rank]
        own = session is None
        if session is None:
            transport.connect()
            session = transport.session()
        try:
            manifest = manifests[(wanted[rank], spec.hosts[rank].sync_exclude)]
            return HostSync(rank, spec.hosts[rank], session, manifest, tell, dry_run=dry_run).run()
        finally:
            if own:
                session.close()

    reports: dict[int, SyncReport] = {}
    errors: list[ClusterrunError] = []
    pool = ThreadPoolExecutor(max_workers=min(32, len(wanted)), thread_name_prefix="clusterrun-sync")
    try:
        futures = {rank: pool.submit(one, rank) for rank in wanted}
        for rank, future in futures.items():
            host = spec.hosts[rank].host
            try:
                reports[rank] = future.result()
            except AgentError as exc:
                exc.message = f"sync to {spec.hosts[rank].workdir} failed: {exc.message}"
                errors.append(exc)
            except _Aborted as exc:
                errors.append(AgentError(host, f"sync failed: {exc.message}", hint=exc.hint))
            except ClusterrunError as exc:
                errors.append(exc)
            except OSError as exc:
                errors.append(TransportError(host, f"sync failed: {exc}"))
    finally:  # Ctrl-C: do not wait here for the copies (closing the connections ends them)
        pool.shutdown(wait=False, cancel_futures=True)
    if errors:
        raise HostsUnavailable(errors)
    return reports


__all__ = ["Changes", "Excludes", "HostSync", "LocalEntry", "Manifest", "SyncProgress", "SyncReport", "diff",
           "scan", "settle", "source_of", "sync_hosts"]
