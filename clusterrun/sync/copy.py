"""Copy the local project directory to every host's ``workdir`` before a job starts.

Lifecycle of one run: ``scan()`` the local directory once (``.gitignore`` files and
``sync_exclude`` honoured, ``.git`` left out) → per host, in parallel, on the agent that probed it:
``sync_stat`` of every path → ``diff()`` → ``sync_hash`` where only the mtime differs → the
changes → a ``SyncReport``. A second run copies only what changed: same size and mtime is taken
as unchanged, a file whose size is the same but whose mtime differs is compared by sha256 (equal:
only its mtime and mode are set). Nothing is ever deleted on the host.

What to change is decided in ``synctree``, for every host alike; what carries the files' bytes is
``synccarriers.carrier()``: the agent's ``sync_put`` (the bytes follow the request on its stdin),
unless the host holds other versions of enough of the files (``DELTA_MIN``) and both ends have
rsync: then this machine's **rsync** (to an SSH host through ``rsh.py`` and a command channel on
the connection already open, its paths inside rsync's protocol); this module drives them per host
(``HostSync``) and reports. Directories,
symlinks and mode/mtime-only changes always go through the agent. Files are written to a
temporary name and renamed, with their permission bits and mtime.

Any failure (no space, read-only, no permission, a directory where a file goes) is an error of
that host naming the path, raised for all hosts together (``HostsUnavailable``) before anything
starts.

Exclude patterns: the ``.gitignore`` files of the directory (each for its own directory and
below), after ``.git`` (left out by default) and before ``sync_exclude`` (anchored at the synced
directory; they win); the syntax supported is in ``clusterrun.sync.excludes``. Not read:
``.git/info/exclude`` and git's global ``core.excludesFile``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from clusterrun.agent.wire import SyncHashRequest, SyncPutRequest, SyncStatRequest, Written
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, ClusterrunError, ConfigError, HostsUnavailable, TransportError
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import RemoteEntry, SyncStat, decode, decode_sync_hashes, decode_sync_stat
from clusterrun.sync import rsh
from clusterrun.sync.carriers import RSYNC_CODES, RemotePipe, carrier, local_rsync
from clusterrun.sync.tree import CHUNK, Changes, LocalEntry, Manifest, diff, file_hash, scan, settle
from clusterrun.transports import AgentSession, Transport

BATCH_BYTES = 32 << 20  # the data of one sync_put: the agent answers (and reports a failure) after each
BATCH_FILES = 2000
STAT_BATCH = 5000  # paths per sync_stat / sync_hash request


# ------------------------------------------------------------------------------------ per host


@frozen
class SyncProgress:
    """How far one host's sync is: ``phase`` is ``compare``, ``copy`` or ``done``."""

    rank: int
    host: str
    phase: str
    files_done: int = 0
    files_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0


@frozen
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
    via: str = ""  # what carried the files' data: ``rsync`` or ``agent`` (see ``carrier``)
    note: str = ""  # why ``via`` is not the first choice, where that was a surprise

    def describe(self, timed: bool = True) -> str:
        """What was copied (or would be); ``timed``: and in how many seconds."""
        if self.same_dir:
            return f"{self.root} is the synced directory itself: nothing to copy"
        how = f" by {self.via}" if self.copied and self.via else ""
        if self.dry_run:
            return (f"would copy {self.copied} file(s) ({human(self.bytes)}{how}) and set mode/mtime of "
                    f"{self.touched}, make or change {self.other} directories/symlinks, {self.unchanged} unchanged, "
                    f"to {self.root}")
        text = f"{self.copied} file(s) copied ({human(self.bytes)}{how}{f'; {self.note}' if self.note else ''})"
        if self.touched:
            text += f", {self.touched} with only mode/mtime set"
        if self.other:
            text += f", {self.other} directories/symlinks made or changed"
        return text + f", {self.unchanged} unchanged, to {self.root}" + (f" in {self.seconds:.1f} s" if timed else "")


def human(size: float) -> str:
    """Bytes in decimal units, as the progress bar (rich) shows them."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


Progress = Callable[[SyncProgress], None]


class _RsyncUnusable(ClusterrunError):
    """rsync could not start talking to the host's rsync (a protocol mismatch, such as a login
    shell that prints text): nothing was copied by it, another carrier may still work."""


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
                 progress: Progress | None = None, *, dry_run: bool = False, transport: Transport | None = None,
                 rsync: str | None = None) -> None:
        self.rank = rank
        self.host = host
        self.session = session
        self.transport = transport  # its ``files`` says what may carry the data besides ``session``
        self.rsync = rsync  # this machine's
        self.manifest = manifest
        self.progress = progress or (lambda p: None)
        self.dry_run = dry_run
        self.root = host.workdir or "."

    def _tell(self, phase: str, files: tuple[int, int] = (0, 0), size: tuple[int, int] = (0, 0)) -> None:
        self.progress(SyncProgress(self.rank, self.host.host, phase, files[0], files[1], size[0], size[1]))

    def changes(self) -> tuple[Changes, bool, SyncStat]:
        """What to send, whether the workdir is the source itself, and what the host said of its
        workdir (its absolute path, its rsync)."""
        self._tell("compare")
        paths = [e.path for e in self.manifest.entries]
        entries: dict[str, RemoteEntry] = {}
        found = SyncStat(root=self.root, exists=False, entries={})
        for i in range(0, max(len(paths), 1), STAT_BATCH):
            found = decode_sync_stat(self.host.host, self.session.call(
                SyncStatRequest(root=self.root, paths=paths[i:i + STAT_BATCH])))
            if (found.exists and found.boot_id == _local_boot_id() and found.boot_id
                    and (found.dev, found.ino) == (self.manifest.dev, self.manifest.ino)):
                return Changes(), True, found
            entries.update(found.entries)
        changes = diff(self.manifest.entries, entries)
        if changes.compare:
            wanted = [e.path for e in changes.compare]
            remote: dict[str, str] = {}
            for i in range(0, len(wanted), STAT_BATCH):
                remote.update(decode_sync_hashes(self.host.host, self.session.call(
                    SyncHashRequest(root=self.root, paths=wanted[i:i + STAT_BATCH]))))
            local = {e.path: h for e in changes.compare if (h := self._local_hash(e)) is not None}
            changes = settle(changes, local, remote)
        return changes, False, found

    def run(self) -> SyncReport:
        started = time.monotonic()
        changes, same, found = self.changes()
        files = [e for e in changes.put if e.kind == "f"]
        others = [e for e in changes.put if e.kind != "f"]
        total = sum(e.size for e in files)
        via = carrier(self.transport.files if self.transport else None, self.rsync, found.rsync,
                      changes.revised) if files else "agent"
        report = SyncReport(self.rank, self.host.host, self.manifest.root, found.root, copied=len(files), bytes=total,
                            touched=len(changes.touch), other=len(others), unchanged=changes.unchanged,
                            same_dir=same, dry_run=self.dry_run, via="" if same else via)
        if self.dry_run or same:
            self._tell("done", (0, 0), (0, 0))
            return report
        done = [0, 0]  # files, bytes sent
        self._tell("copy", (0, len(files)), (0, total))
        # Directories, symlinks and mode/mtime changes: the agent, always (one request, no data).
        first: list[dict[str, object]] = [self._entry(e, data=False) for e in others + changes.touch]
        if (via != "agent" or not files) and (first or not found.exists):  # the workdir is made here too
            self._put(SyncPutRequest(root=self.root, root_mode=self.manifest.mode, entries=first), [])
            first = []
        if via == "rsync":
            try:
                self._rsync(files, found, done, total)
            except _RsyncUnusable as exc:  # e.g. a shell that prints: the agent copes with it
                via, report = "agent", replace(report, via="agent", note=f"rsync could not start ({exc.message})")
        if via == "agent" and files:
            for i, batch in enumerate(_batches(files)):
                request = SyncPutRequest(root=self.root, root_mode=self.manifest.mode,
                                         entries=(first if i == 0 else []) + [self._entry(e, data=True) for e in batch])
                self._put(request, self._data(batch, done, len(files), total))
        self._tell("done", (len(files), len(files)), (total, total))
        return replace(report, seconds=time.monotonic() - started)

    # ----------------------------------------------------------------------------- rsync

    def _rsync(self, files: Sequence[LocalEntry], found: SyncStat, done: list[int], total: int) -> None:
        """Copy ``files`` with this machine's rsync: to a local host's workdir directly, to an SSH
        host through ``rsh.py`` and a command channel on the connection already open."""
        assert self.rsync is not None and self.transport is not None
        with tempfile.TemporaryDirectory(prefix="clusterrun-rsync-") as tmp:  # 0700: the socket is ours alone
            listing = os.path.join(tmp, "files")
            with open(listing, "wb") as f:
                f.write(b"".join(os.fsencode(e.path) + b"\0" for e in files))
            # --ignore-times: the files listed are those that differ (rsync's own check would skip
            # one whose size and mtime second are the same); it still sends only their deltas.
            argv = [self.rsync, "--perms", "--times", "--ignore-times", "--no-implied-dirs", f"--files-from={listing}",
                    "--from0", "--out-format=%l %n", f"{self.manifest.root}/"]
            remote: RemotePipe | None = None
            if self.transport.files == "local":
                argv.append(f"{found.root}/")
            else:
                assert found.rsync is not None
                remote = RemotePipe(self.transport, os.path.join(tmp, "socket"), found.rsync)
                argv[1:1] = ["--protect-args", f"--rsync-path={found.rsync}",
                             f"--rsh={shlex.join([sys.executable, '-S', rsh.__file__, remote.path])}"]
                argv.append(f"clusterrun:{found.root}/")  # the host part goes to rsh.py, which ignores it
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as exc:
                raise AgentError(self.host.host, f"cannot run {self.rsync}: {exc.strerror or exc}") from None
            with proc:
                errors: list[bytes] = []
                reader = threading.Thread(target=lambda: errors.extend(proc.stderr or ()), daemon=True)
                reader.start()
                if remote is not None:
                    remote.serve(proc)
                for line in proc.stdout or ():
                    size, _, _name = line.decode(errors="replace").partition(" ")
                    if size.isdigit():
                        done[0] += 1
                        done[1] += int(size)
                        self._tell("copy", (done[0], len(files)), (done[1], total))
                code = proc.wait()
                reader.join(timeout=10)
            status, remote_err = remote.result() if remote is not None else (0, "")
        if code != 0:
            # The host's rsync says what went wrong on its stderr (a full disk: "rsync: [receiver]
            # write failed on PATH: No space left on device (28)"); this one's mostly follows from it.
            said = [line.strip() for line in remote_err.splitlines()] + [
                line.decode(errors="replace").strip() for line in errors]
            cause = next((line for line in said if "is your shell clean" in line), None) or next(
                (line for line in said if line.startswith("rsync:")), None) or next(
                (line for line in said if line), f"the remote command ended with {status}")
            if code in (2, 5) and done[0] == 0:
                raise _RsyncUnusable(f"exit {code}: {cause}")
            raise AgentError(self.host.host, f"by rsync (exit {code}): {cause}",
                             hint=RSYNC_CODES.get(code, "see rsync's message above"))

    def _put(self, request: SyncPutRequest, data: Iterable[bytes]) -> int:
        """Send a ``sync_put`` (its files' bytes after it); how many files the agent wrote."""
        return decode(self.host.host, Written, self.session.call_with_data(request, data), "sync_put answer").written

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
    rsync = local_rsync()

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
            return HostSync(rank, spec.hosts[rank], session, manifest, tell, dry_run=dry_run, transport=transport,
                            rsync=rsync).run()
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
                reports[rank] = parallel.result(future)
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


__all__ = ["HostSync", "SyncProgress", "SyncReport", "human", "source_of", "sync_hosts"]
