"""A job's life as one state machine: every change of a job's recorded state goes through ``transition``.

The states are ``events.JobState`` (kept there: every consumer reads them); the changes that move
them are ``Change``; ``TABLE`` lists every legal ``(state, change) → state`` and ``transition``
raises ``IllegalTransition`` on any other. The state is persisted in the job's record together
with the attempt it belongs to (``JobRecord.attempt``): news of an older attempt never moves it.
::

    (new job, restart, start-up retry)
        start ──→ starting ──all-running──→ running ──succeeded / failed / lost──→ (that end)
                     │  └──start-failed──→ failed      │
                     └────────────stop────────────────┴──→ stopping ─stop-verified─→ stopped
                                                                    └stop-unverified→ running
    an end (succeeded, failed, stopped, lost) ──start──→ starting   (the next attempt)
    starting / running ──retry──→ restarting ──start──→ starting   (a failure restarted by policy)
                                      ├──stop──→ stopping ──stop-verified──→ stopped
                                      └──give-up──→ failed   (the restart could not be carried out)

A running attempt is never started again: ``start`` is legal only from an end, so a restart
goes through ``stopping`` and a verified ``stopped`` first. Once ``stopping``, what the follower
sees of the nodes (they fail or vanish as they are killed) does not decide the end: the stop
does, and a ``stopped`` job stays stopped (the follower's late news is absorbed by every end).
A hand-over (``up`` gives the job to its monitor) changes the job's owner, not its state.
A failure the restart policy (or the start-up retry) restarts is recorded ``restarting``, not
``failed``, in the same change: ``wait`` never sees an end that is not one; a ``down`` (or the
user's ``restart``) during the backoff moves the job to ``stopped`` (its attempt stays ``failed``),
from which no automatic restart starts (``start`` after a retry is taken only from ``restarting``:
``attempt.NextAttempt.replace(automatic=True)``).
A node's hang changes no job state either (``NodeState.HUNG`` is a view of a running node, as
``unreachable``): the owner's ``on_hang: restart`` is a requested restart (``Runner.request_restart``),
and a node that never starts its workers within ``startup_timeout`` ends the attempt ``failed``.
"""

from __future__ import annotations

from enum import Enum

from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import JobState

S = JobState


class Change(str, Enum):
    """What happened to the job's current attempt (the events of the state machine)."""

    START = "start"  # a new attempt is being started (up, restart, the start-up retry)
    ALL_RUNNING = "all-running"  # every node of the attempt runs
    START_FAILED = "start-failed"  # a host could not start its node (the others were stopped again)
    SUCCEEDED = "succeeded"  # every node ended, all with exit 0 (the follower's word)
    FAILED = "failed"  # every node ended, one of them non-zero
    LOST = "lost"  # every node ended, one's processes vanished (supervisor killed, host rebooted)
    STOP = "stop"  # a verified stop was asked for (down, Ctrl-C, the dashboard's K, restart)
    STOP_VERIFIED = "stop-verified"  # the hosts confirmed nothing of the attempt is left
    STOP_UNVERIFIED = "stop-unverified"  # a host could not be reached, or something is left: it may run
    RETRY = "retry"  # every node ended, one badly, and the owner restarts the job (restart policy, start-up retry)
    GIVE_UP = "give-up"  # a restart could not be carried out (its checks refused, the failed attempt not stopped)


_ENDS = (S.SUCCEEDED, S.FAILED, S.STOPPED, S.LOST)
_OUTCOME = {Change.SUCCEEDED: S.SUCCEEDED, Change.FAILED: S.FAILED, Change.LOST: S.LOST}

TABLE: dict[tuple[JobState, Change], JobState] = {
    (S.STARTING, Change.ALL_RUNNING): S.RUNNING,
    (S.STARTING, Change.START_FAILED): S.FAILED,
    **{(S.STARTING, c): end for c, end in _OUTCOME.items()},  # a node may end before all run
    **{(S.RUNNING, c): end for c, end in _OUTCOME.items()},
    **{(live, Change.STOP): S.STOPPING for live in (S.STARTING, S.RUNNING, S.STOPPING)},
    **{(live, Change.STOP_VERIFIED): S.STOPPED for live in (S.STARTING, S.RUNNING, S.STOPPING)},
    (S.STOPPING, Change.STOP_UNVERIFIED): S.RUNNING,  # it may still run: the next ps asks the hosts
    (S.STOPPING, Change.ALL_RUNNING): S.STOPPING,  # a stop during the start
    (S.STOPPING, Change.START_FAILED): S.STOPPED,  # the start failed while stopping: nothing runs
    **{(S.STOPPING, c): S.STOPPING for c in _OUTCOME},  # nodes killed by the stop: the stop decides
    **{(end, Change.START): S.STARTING for end in _ENDS},
    **{(live, Change.RETRY): S.RESTARTING for live in (S.STARTING, S.RUNNING)},
    (S.STOPPING, Change.RETRY): S.STOPPING,  # a stop was asked for: it decides, nothing restarts
    (S.RESTARTING, Change.START): S.STARTING,
    (S.RESTARTING, Change.STOP): S.STOPPING,  # `down` during the backoff: no attempt starts
    (S.RESTARTING, Change.STOP_VERIFIED): S.STOPPED,
    (S.RESTARTING, Change.GIVE_UP): S.FAILED,
    # the failed attempt's late news (a reconcile of its ended nodes) leaves the backoff as it is
    **{(S.RESTARTING, c): S.RESTARTING for c in (*_OUTCOME, Change.STOP_UNVERIFIED, Change.ALL_RUNNING,
                                                 Change.START_FAILED, Change.RETRY)},
    # An attempt ends once: late news (the follower's, a second stop) leaves the end as it is.
    **{(end, c): end for end in _ENDS for c in (*_OUTCOME, Change.STOP, Change.STOP_VERIFIED,
                                                  Change.STOP_UNVERIFIED, Change.ALL_RUNNING, Change.START_FAILED,
                                                  Change.RETRY, Change.GIVE_UP)},
}


class IllegalTransition(ClusterrunError):
    """A change that cannot happen in the job's state (e.g. starting an attempt while one runs)."""

    def __init__(self, state: JobState, change: Change) -> None:
        super().__init__(f"a job that is {state} cannot {change.value}")
        self.state = state
        self.change = change


def transition(state: JobState | str, change: Change) -> JobState:
    """The state after ``change``; raises ``IllegalTransition`` for a move the table does not list."""
    try:
        return TABLE[(JobState(state), change)]
    except KeyError:
        raise IllegalTransition(JobState(state), change) from None


def outcome(end: JobState) -> Change:
    """The change that reports nodes ended in ``end`` (``JobState.of_nodes``'s verdict)."""
    if end is S.STOPPED:
        return Change.STOP_VERIFIED
    return next(c for c, s in _OUTCOME.items() if s is end)


__all__ = ["TABLE", "Change", "IllegalTransition", "JobState", "outcome", "transition"]
