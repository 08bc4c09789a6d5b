"""What the owner of a job knows and wants, as one value: ``Owner``, replaced whole at each change.

The ``Runner`` (``runner.py``) holds one ``Owner`` and changes it only under its lock, in
``Runner._move``; the requests of signal handlers and other threads (a stop, a hand-over) are put
on a queue that the next change takes in first, in the order they came, so that a signal handler
never waits for the lock. Everything here is pure: a change is a function ``Owner → Owner``.

The job's recorded state (starting, running, restarting, ...) is not here: it is the record's,
moved by ``jobstate.transition`` (``recorder.py``). ``Owner`` holds what only the owner knows:
what it was asked (``Asked``), whether it has started its attempt, and what it decided of the
attempt that ended (why it was not restarted; which spares take the lost hosts' places).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum

from clusterrun.core.frozen import frozen


class Asked(str, Enum):
    """What the owner was asked to do with the job it follows. A stop wins over everything and
    stays; a hand-over over a restart; a restart is asked only of an owner that just follows,
    and done once the next attempt runs::

        following ──request_restart──→ restart ──(next attempt started)──→ following
            │                             │
            ├──request_hand_over──→ hand-over ←──┘
            └──────request_stop──→ stop ←── (from any)
    """

    FOLLOW = "following"
    RESTART = "restart"  # stop this attempt and start the next at once (``on_hang: restart``)
    HAND_OVER = "hand-over"  # give the job to a monitor: ``follow()`` returns None
    STOP = "stop"  # the user's verified stop: ``follow()`` returns the stopped result

    def asks(self, other: Asked) -> bool:
        """Whether ``other`` is taken over this one: a stop always (its latest reason counts), a
        hand-over over a restart, a restart over following only."""
        return other is Asked.STOP or _RANK[other] > _RANK[self]


_RANK = {Asked.FOLLOW: 0, Asked.RESTART: 1, Asked.HAND_OVER: 2, Asked.STOP: 3}


@frozen
class Owner:
    """The owner's own state (see the module docstring). Lifecycle: ``Owner(started=False)`` for a
    new job (``Owner()`` for one adopted running) → ``start`` → ``ask``/``decided``/``blamed`` while
    an attempt runs → ``next_attempt`` (a restart of its own) or ``restarted`` (the user's)."""

    asked: Asked = Asked.FOLLOW
    reason: str | None = None  # the stop's or the restart's, as the attempt's end names it
    started: bool = True  # the owner started (or adopted) its attempt: false until ``Runner.start``
    start_failed: bool = False  # its start failed (``HostsUnavailable``): nothing runs
    user_restart: bool = False  # the user's restart (the dashboard's R) is under way: one at a time
    refused: str | None = None  # why the attempt that ended was not restarted by the policy
    startup_failure: str | None = None  # the known transient start-up failure that was retried
    spares: tuple[tuple[str, str], ...] = ()  # the next attempt's spares, in the places of the hosts lost
    late: tuple[int, ...] = ()  # the nodes the start-up watch blamed in this attempt

    def ask(self, asked: Asked, reason: str | None = None) -> Owner:
        """With ``asked`` taken if it goes over what was asked before (``Asked.asks``)."""
        if not self.asked.asks(asked):
            return self
        return dataclasses.replace(self, asked=asked, reason=self.reason if reason is None else reason)

    def start(self, failed: bool = False) -> Owner:
        return dataclasses.replace(self, started=True, start_failed=failed)

    def decided(self, *, refused: str | None = None, startup_failure: str | None = None,
                spares: Mapping[str, str] | None = None) -> Owner:
        """What was decided of the attempt that ended: ``refused`` replaces the last refusal, the
        others are kept unless given."""
        return dataclasses.replace(
            self, refused=refused,
            startup_failure=self.startup_failure if startup_failure is None else startup_failure,
            spares=self.spares if spares is None else tuple(spares.items()))

    def blamed(self, nodes: tuple[int, ...]) -> Owner:
        """The start-up watch blamed ``nodes``: a host whose node never joined is a host's failure."""
        return dataclasses.replace(self, late=nodes)

    def next_attempt(self) -> Owner:
        """The owner's restart started the next attempt: a restart asked for is done, the spares
        are in use; a stop or a hand-over asked for meanwhile stays, for the new attempt."""
        asked, reason = (Asked.FOLLOW, None) if self.asked is Asked.RESTART else (self.asked, self.reason)
        return dataclasses.replace(self, asked=asked, reason=reason, spares=(), late=())

    def begin_user_restart(self) -> Owner:
        return dataclasses.replace(self, user_restart=True)

    def end_user_restart(self) -> Owner:
        """The user's restart was refused or failed: the attempt followed (if any) goes on as it was."""
        return dataclasses.replace(self, user_restart=False)

    def restarted(self, reason: str | None = None) -> Owner:
        """The user's restart, whose stop was asked for ``reason``, stopped the attempt followed and
        started the next: that stop is done; a stop asked for another reason meanwhile (the
        dashboard's K) stays, for the new attempt. Its hosts nobody has blamed yet (what was decided
        of the old attempt, its spares too, does not carry over)."""
        stays = self.asked is Asked.STOP and self.reason != reason
        return dataclasses.replace(self, asked=self.asked if stays else Asked.FOLLOW,
                                   reason=self.reason if stays else None, user_restart=False, spares=(), late=())

    @property
    def replace(self) -> dict[str, str]:
        """The spares by the host whose place each takes, as ``attempt.restart`` takes them."""
        return dict(self.spares)


__all__ = ["Asked", "Owner"]
