"""The host's part of the hang watch, ``QuietWatch``: since when the node's ranks have written
nothing, recorded once that lasted ``hang_after`` (``quiet_since`` in state.json). Whether the job
hangs is decided by its owner from every node's ``quiet_since`` (``clusterrun/hangwatch.py``):
usually only rank 0 prints, so a node's own silence says nothing while another node's ranks print.
Also what the start-up watch reads of torchrun (``joined_store``, ``master_port``)."""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable


def joined_store(pid: int, port: int) -> bool:
    """Whether process ``pid`` (torchrun) holds an established TCP connection to ``port`` (the
    master's store, which torchrun's rendezvous goes through; node 0's torchrun connects to its
    own store too): its node has joined the rendezvous."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return False
    if not inodes:  # no socket at all: no need to read the host's tables
        return False
    for table in ("tcp", "tcp6"):  # of the process's own network namespace
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()  # sl local_address rem_address st ... inode (the 10th)
            if len(cols) > 9 and cols[3] == "01" and cols[9] in inodes and int(cols[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def master_port(argv: list[str]) -> int | None:
    """``--master-port=N`` of torchrun's command line (``plan.torchrun_argv`` writes it so)."""
    for arg in argv:
        if arg.startswith("--master-port=") and arg[14:].isdigit():
            return int(arg[14:])
    return None


class QuietWatch:
    """The silence of a node's ranks, sampled at the monitor's scans: once nothing was written
    (``written``: the bytes of the ranks' output read so far, partial lines included, and of the
    node's log) for ``hang_after`` seconds (monotonic) while a worker lives, the node is quiet since
    its last output (``quiet_since``, wall clock); its next output, or no living worker (starting,
    ending, torchrun restarting them), ends that. Only the crossings are news, so the state file
    is written twice per silence, never once per line. CPU is no sign of life here: gloo's and
    NCCL's threads poll, and CUDA spins, in ranks that wait for ever.

    create (with the ``quiet_since`` a monitor before this one recorded) → ``sample(alive,
    written)`` at each scan, True when ``quiet_since`` changed."""

    def __init__(self, hang_after: float | None, quiet_since: float | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.hang_after = hang_after
        self.clock = clock
        self.wall = wall
        self.written: int | None = None  # at the last sample; None: no worker was alive
        self.active_at = 0.0  # monotonic time the log last grew (or a worker was first seen)
        self.quiet_since = quiet_since  # wall clock

    def sample(self, alive: bool, written: int) -> bool:
        if not self.hang_after:
            return False
        now = self.clock()
        if not alive:
            self.written = None
            return self._set(None)
        if self.written is None and self.quiet_since is not None:  # resumed: quiet as recorded
            self.written, self.active_at = written, now - max(0.0, self.wall() - self.quiet_since)
            return False
        if written != self.written:
            self.written, self.active_at = written, now
            return self._set(None)
        if self.quiet_since is None and now - self.active_at >= self.hang_after:
            return self._set(self.wall() - (now - self.active_at))
        return False

    def _set(self, since: float | None) -> bool:
        changed = (since is None) != (self.quiet_since is None)
        self.quiet_since = since
        return changed
