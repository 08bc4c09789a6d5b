"""The fake hosts' state: each ``FakeHost`` (reachable, its boot, what its doctor checks find) and
the ``FakeNode`` attempts started on it (log, state file), with what a test scripts on them:
``node.write()`` / ``.exit()`` / ``.vanish()``, ``host.drop()`` / ``.restore()`` / ``.reboot()``.
``transports.fake.FakeCluster`` holds them by name; ``transports.fakeagent`` answers from them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clusterrun.core.protocol import PROTOCOL

if TYPE_CHECKING:
    from clusterrun.transports.fake import FakeCluster

Key = tuple[str, int, int]  # job, node, attempt
pids = itertools.count(1000)


@dataclass
class FakeNode:
    """One attempt of one node on a fake host: its log and its state file."""

    key: Key
    host: FakeHost
    argv: list[str]
    env: dict[str, str]
    log: bytearray = field(default_factory=bytearray)
    state: dict[str, Any] = field(default_factory=dict)
    sent_to: int = 0  # the end of the log that the last follow has handed out
    gone: bool = False  # its processes vanished without a word (SIGKILLed with the supervisor)
    stops: int = 0  # stop requests received
    leave_on_stop: list[dict[str, Any]] = field(default_factory=list)  # processes a stop cannot kill
    outlives_grace: bool = False  # torchrun does not end on SIGTERM (a worker ignores it): SIGKILLed after the grace
    stop_exit_code: int | None = None  # torchrun's exit code when a stop's SIGTERM ends it (a real one exits 1)
    spec: dict[str, Any] = field(default_factory=dict)  # what its spec.json holds (for ``jobs`` and ``remove``)
    stacks: list[dict[str, Any]] = field(default_factory=list)  # its ranks' as ``stack`` answers them (RankStack)
    contained: bool = False  # in a cgroup: a stop is verified by it, an end empties and removes it

    def write(self, data: bytes | str) -> None:
        """The job prints ``data``."""
        with self.host.cluster.changed:
            self.log += data.encode() if isinstance(data, str) else data
            self.host.cluster.changed.notify_all()

    def exit(self, code: int = 0, *, signal: int | None = None, oom: dict[str, Any] | None = None) -> None:
        """torchrun ends with ``code`` (or was killed by ``signal``); ``oom``: what the supervisor
        read of the kernel's OOM kills (the state's ``oom``)."""
        with self.host.cluster.changed:
            self.state = dict(self.state, state="exited", exit_code=None if signal else code, signal=signal,
                              ended_at=self.host.cluster.now(), **({"oom": oom} if oom is not None else {}),
                              **({"cgroup_removed": True} if self.contained else {}))
            self.host.cluster.changed.notify_all()

    def fail_rank(self, rank: int, code: int = 1) -> None:
        """A worker (global ``rank``) exits ``code`` while torchrun still runs: the monitor records it."""
        with self.host.cluster.changed:
            workers = [dict(w, died=self.host.cluster.now(), exit_code=code) if w["rank"] == rank else w
                       for w in self.state.get("workers") or []]
            self.state = dict(self.state, workers=workers)
            self.host.cluster.changed.notify_all()

    def degrade(self, reason: str) -> None:
        """Its supervisor cannot write its state any more (a full disk): the agent says ``degraded``."""
        with self.host.cluster.changed:
            self.state = dict(self.state, degraded=reason)
            self.host.cluster.changed.notify_all()

    def start_workers(self, *ranks: int) -> None:
        """torchrun has started its workers (the rendezvous completed): the supervisor records them."""
        with self.host.cluster.changed:
            workers = [{"pid": next(pids), "rank": r, "local_rank": i, "died": None} for i, r in enumerate(ranks)]
            self.state = dict(self.state, workers=workers)
            self.host.cluster.changed.notify_all()

    def rendezvous(self, joined: bool) -> None:
        """Its torchrun is (not) connected to the master port yet, before its workers start."""
        with self.host.cluster.changed:
            self.state = dict(self.state, rdzv_joined=joined)
            self.host.cluster.changed.notify_all()

    def quiet(self, since: float | None) -> None:
        """Its ranks wrote nothing since ``since``, for ``hang_after`` at least (the host's watch); None: they wrote."""
        with self.host.cluster.changed:
            self.state = dict(self.state, quiet_since=since)
            self.host.cluster.changed.notify_all()

    def report_progress(self, progress: dict[str, Any]) -> None:
        """The host read this training progress from rank 0's output (``agent/progress.py``'s JSON)."""
        with self.host.cluster.changed:
            self.state = dict(self.state, progress=progress)
            self.host.cluster.changed.notify_all()

    def stop_asked(self, by: str = "clusterrun") -> None:
        """Another controller's stop is under way here (its ``stop`` file): the agent says ``stop_requested``,
        and ``stopped_by`` once the node has ended."""
        with self.host.cluster.changed:
            self.state = dict(self.state, stop_requested=True, stopped_by=by)
            self.host.cluster.changed.notify_all()

    def vanish(self) -> None:
        """Its supervisor and torchrun are killed without a word (the agent then says ``lost``)."""
        with self.host.cluster.changed:
            self.gone = True
            self.host.cluster.changed.notify_all()

    @property
    def running(self) -> bool:
        return (self.state.get("state") in ("starting", "running") and not self.gone
                and self.state.get("boot_id") == self.host.boot_id)


@dataclass
class FakeHost:
    """One fake machine: reachable or not, its boot id, the nodes started on it."""

    name: str
    cluster: FakeCluster
    reachable: bool = True
    boot_id: str = "boot-1"
    start_error: str | None = None  # the next start fails with this
    setup_error: str | None = None  # every ``setup`` request fails with this (a broken ``setup:``)
    setup_output: str | None = None  # what a start's ``setup`` prints (None: the fake logs nothing of it)
    after_setup: dict[str, Any] | None = None  # the job's interpreter after setup (wire.JobPython; None: as probed)
    setup_blocks: bool = False  # a ``setup`` waits while this is set, then fails at its setup_timeout as the agent's
    python: str = "3.11.7"
    protocol: int = PROTOCOL
    torch: str | None = "2.13.0"
    connects: int = 0  # connection attempts, reachable or not
    close_error: Exception | None = None  # closing a session raises this (a transport's untranslated fault)
    # the answer to ``route``, or a function of the master's address giving it (default: its own machine, eth0)
    network: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None
    _epoch: int = 0  # bumped by drop(): streams of an older epoch are cut
    # what `inspect`, `listen` and `reach` find (the doctor's checks; see doctor.py)
    missing: set[str] = field(default_factory=set)  # paths (as asked, "." for the workdir) that are missing
    clock_offset: float = 0.0  # its clock against the controller's
    disk_free: int = 100 << 30
    torch_cuda: str | None = None
    nccl: str | None = None
    torch_devices: int = 0
    torch_error: str | None = None  # `import torch` fails with this
    modules_missing: set[str] = field(default_factory=set)  # top-level imports of the script it cannot find
    gpu_list: str | None = None  # nvidia-smi -L; None: no nvidia-smi
    gpu_apps: str = ""
    gpu_query: str | None = None  # what nvidia-smi --query-gpu prints (``gpus``); None: no nvidia-smi
    gpu_problem: str = ""  # its nvidia-smi fails so (``gpus`` answers this problem)
    logind: str = ""
    ports_taken: set[int] = field(default_factory=set)  # ports a listen cannot open
    firewalled: bool = False  # other hosts' connections to its listeners time out

    def drop(self) -> None:
        """The network to this host fails: open streams break, new connections are refused."""
        with self.cluster.changed:
            self.reachable = False
            self._epoch += 1
            self.cluster.changed.notify_all()

    def restore(self) -> None:
        with self.cluster.changed:
            self.reachable = True
            self.cluster.changed.notify_all()

    def reboot(self) -> None:
        """The machine restarts: every job process on it is gone without a word."""
        with self.cluster.changed:
            self.boot_id = f"boot-{int(self.boot_id.split('-')[1]) + 1}"
            self._epoch += 1
            self.cluster.changed.notify_all()
