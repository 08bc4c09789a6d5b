"""The exceptions clusterrun raises, in one tree.

    ClusterrunError                 base; every error renders a readable report
    ├── ConfigError(path, line, key)  the hosts file or a command-line value is wrong
    ├── HostError(host)               about one host; renders as "host: message"
    │   ├── TransportError            reaching the host failed
    │   │   ├── ConnectError          unreachable, refused, timed out, connection lost
    │   │   ├── AuthError             the host refused our credentials
    │   │   └── HostKeyError          the host key is unknown or changed
    │   └── AgentError                the node agent on the host failed
    │       └── ProtocolError         ... or answered what this controller cannot read (protocol.py)
    ├── HostsUnavailable(errors)      some hosts cannot run the job: one error per host; nothing started
    ├── JobNotFound                   no job, or more than one, matches the id, name or prefix given
    ├── StateError(path)              the controller's job records cannot be read or written there
    │   └── DamagedRecord(job_id)     ... or one job's record is not one this controller can read
    └── NotStopped(reports)           a restart refused: a node could not be verified stopped (attempt.py)

Node failures during a run are data (``NodeResult.error``, a ``JobResult``); only the edge turns a
failed ``JobResult`` into an outcome: ``cli`` into an exit code. This module imports nothing
of the package.
"""

from __future__ import annotations


class ClusterrunError(Exception):
    """Base class: a message, and an optional hint saying what to do about it."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self) -> str:
        """The report shown to the user: the message, then the hint on its own line."""
        text = self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text

    def one_line(self) -> str:
        """``render()`` on one line, for a node's status: the hint after a semicolon."""
        return self.render().replace("\n  hint: ", "; ")


class ConfigError(ClusterrunError):
    """The hosts file (or a value given on the command line) is invalid.

    Rendered as ``hosts.yaml:7: hosts[1].gpus: expected ..., got 'four'``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.path = path
        self.line = line
        self.key = key

    def render(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path + (f":{self.line}" if self.line is not None else "") + ": "
        if self.key:
            where += f"{self.key}: "
        text = where + self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class HostError(ClusterrunError):
    """Something went wrong on or with one ``host``; rendered as ``host: message``."""

    def __init__(self, host: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.host = host

    def render(self) -> str:
        text = f"{self.host}: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class TransportError(HostError):
    """Reaching ``host`` failed."""


class ConnectError(TransportError):
    """The host is unreachable, refused the connection, timed out, or the connection was lost."""


class AuthError(TransportError):
    """The host refused our credentials."""


class HostKeyError(TransportError):
    """The host's key is unknown or does not match the one recorded."""


class AgentError(HostError):
    """The node agent on ``host`` failed, or its answer could not be understood."""


class JobNotFound(ClusterrunError):
    """No job, or more than one, matches what the user typed (an id, a ``--name``, an id prefix)."""


class StateError(ClusterrunError):
    """The controller's own state (job records under ``$XDG_STATE_HOME/clusterrun``) cannot be
    read or written at ``path``: a read-only or full file system, a quota, no permission. Made
    from the ``OSError`` in one place (``jobs.state_error``)."""

    def __init__(self, path: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class DamagedRecord(StateError):
    """Job ``job_id``'s record at ``path`` exists but cannot be used: ``reason`` says why (empty,
    not JSON at byte N, written by a newer clusterrun, unreadable). The job is still listed, by its
    id, so that ``clusterrun rm`` can remove it; the hint says how."""

    def __init__(self, job_id: str, path: str, reason: str, *, hint: str | None = None) -> None:
        rm = f"remove it with `clusterrun rm {job_id}` (processes of the job that still run are not touched; " \
             "`clusterrun ps --hosts HOSTS.yaml` adopts them again)"
        super().__init__(path, f"damaged record: {path} ({reason})", hint=f"{hint}, or {rm}" if hint else rm)
        self.job_id = job_id
        self.reason = reason


class HostsUnavailable(ClusterrunError):
    """Some hosts cannot run the job, so nothing was started anywhere. Renders one line per host."""

    def __init__(self, errors: list[ClusterrunError]) -> None:
        super().__init__(f"{len(errors)} host(s) cannot run the job; nothing was started")
        self.errors = list(errors)

    def render(self) -> str:
        return "\n".join([self.message, *(e.render() for e in self.errors)])
