"""The watch over a running job, as settings: the start-up and hang watch (``Watch``) and the
notifications (``Notify``), from the hosts file (``setup_timeout``, ``startup_timeout``,
``hang_after``, ``on_hang``, ``notify``) and ``up``'s options; a leaf that imports only ``durations`` of the package.

The policies themselves live where the facts are: each host's monitor records when its node's
ranks went quiet (``agent/hangwatch.py``), the orchestrator's loop applies the start-up timeout and
decides from every node's silence that the job hangs (``run/hangwatch.py``), and the job's owner
(``runner.Runner``) acts on a hang and runs the notifications (``notify.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterrun.core.durations import parse_duration
from clusterrun.core.durations import show_duration as duration_text
from clusterrun.core.frozen import frozen

SETUP_TIMEOUT = 600.0  # seconds a node's setup commands may run before its host's agent kills them
STARTUP_TIMEOUT = 300.0  # seconds every node gets to start its workers (gloo's own wait is 30 minutes)
HANG_AFTER = 1800.0  # seconds without output from any rank after which the job is hung
ON_HANG = ("stack", "restart", "nothing")
EVENTS = ("failed", "succeeded", "hung", "restarted")  # what a notification may be sent for



@frozen
class Watch:
    """How the job is watched: ``startup_timeout`` for every node to start its workers (after it
    the job fails, naming the nodes that still wait; counted once every node's setup ended);
    ``hang_after`` seconds without output from any rank make the job hung (None: never); ``on_hang``
    what the job's owner does then; ``setup_timeout`` for each node's ``setup`` commands (``setups.py``);
    ``progress`` the hosts file's own pattern of a progress line (None: the known formats,
    ``agent/progress.py``)."""

    startup_timeout: float = STARTUP_TIMEOUT
    hang_after: float | None = HANG_AFTER
    on_hang: str = "stack"
    setup_timeout: float = SETUP_TIMEOUT
    progress: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"startup_timeout": self.startup_timeout, "hang_after": self.hang_after, "on_hang": self.on_hang,
                "setup_timeout": self.setup_timeout, "progress": self.progress}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Watch:
        if not data:
            return cls()
        hang = data.get("hang_after", HANG_AFTER)
        return cls(startup_timeout=float(data.get("startup_timeout") or STARTUP_TIMEOUT),
                   hang_after=None if hang is None else float(hang), on_hang=str(data.get("on_hang") or "stack"),
                   setup_timeout=float(data.get("setup_timeout") or SETUP_TIMEOUT),
                   progress=str(data["progress"]) if data.get("progress") else None)


@frozen
class Notify:
    """A local command the job's owner runs once per event of ``on`` (see ``notify.py``)."""

    command: str
    on: tuple[str, ...] = EVENTS

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "on": list(self.on)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Notify | None:
        if not data or not data.get("command"):
            return None
        return cls(command=str(data["command"]), on=tuple(str(e) for e in data.get("on") or EVENTS))


__all__ = ["EVENTS", "ON_HANG", "Notify", "Watch", "duration_text", "parse_duration"]
