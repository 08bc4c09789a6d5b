"""How long a failing attempt waits for a host its stop could not reach, and what it says meanwhile.

A stop that cannot reach a host leaves its node unknown: its processes may run on (a cut cable) or
be gone (a dead machine). The attempt is ending anyway, so the owner waits a bounded time for the
host to answer (``--unreachable-timeout``, else ``WAIT``), says so at once and every ``SAY_EVERY``
seconds, then counts the node lost: the attempt ends, and the owner decides what comes next
(a spare in its place, or the end of the restarts).
"""

from __future__ import annotations

from collections.abc import Callable

from clusterrun.core.events import JobNote

WAIT = 60.0  # seconds, where --unreachable-timeout is not given
SAY_EVERY = 30.0


class UnreachableWait:
    """The nodes whose stop could not reach their host: ``begin`` each, ``step`` on every tick
    (the notes said), ``due`` the nodes whose wait is over, ``end`` a node that answered."""

    def __init__(self, limit: float | None, emit: Callable[[JobNote], None]) -> None:
        self.limit = limit if limit is not None else WAIT
        self.emit = emit
        self._since: dict[int, tuple[str, float, float]] = {}  # rank → host, began, last said

    def begin(self, rank: int, host: str, error: str, now: float) -> None:
        if rank not in self._since:
            self._since[rank] = (host, now, now)
            self.emit(JobNote(rank, text=f"node {rank} ({host}) cannot be reached to stop it ({error}): waiting up "
                                         f"to {self.limit:g} s for it, then it counts as lost"))

    def end(self, rank: int) -> None:
        self._since.pop(rank, None)

    @property
    def pending(self) -> bool:
        """Whether a node is waited for (``due`` and its notes change with time)."""
        return bool(self._since)

    def due(self, now: float) -> list[int]:
        """The nodes waited for ``limit`` seconds (no longer waited for); the others' notes said."""
        over = [rank for rank, (_, began, _) in self._since.items() if now - began >= self.limit]
        for rank, (host, began, said) in list(self._since.items()):
            if rank in over:
                del self._since[rank]
            elif now - said >= SAY_EVERY:
                self._since[rank] = (host, began, now)
                self.emit(JobNote(rank, text=f"node {rank} ({host}) still cannot be reached: "
                                             f"{self.limit - (now - began):.0f} s more, then it counts as lost"))
        return over

    def lost_text(self) -> str:
        # the root cause says when the host went away (``rootcause.lost_text``)
        return f"cannot be reached; its stop could not be verified in {self.limit:g} s"


__all__ = ["SAY_EVERY", "WAIT", "UnreachableWait"]
