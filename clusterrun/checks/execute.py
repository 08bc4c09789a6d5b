"""``clusterrun exec``: one command on every host at once, its output prefixed by host (pdsh's way).

Each host's command runs over its transport's ``pipe`` (the SSH connection ``up`` would use, with
the same host-key rules; a child process for a local host), stdin at end of file, stderr merged
into stdout so that the lines keep their order. The argv travels as data: ``remote_command`` joins
it with ``shlex.join`` for a POSIX ``sh`` and hands that text over base64-encoded, so the line the
host's login shell sees holds no character that bash, fish or tcsh would read differently.
With ``job_env`` the command runs as the node's job would (``run_request``): the host's agent
runs it in the ``workdir`` with the job's environment, secrets and ``setup`` applied, all of
which travel on the agent's stdin (``run`` in ``clusterrun.agent``); secret values are masked in
what it prints. A host's outcome is data (``HostOutcome``); ``summary`` names the hosts that failed
(pdsh's ``-S``).
"""

from __future__ import annotations

import base64
import contextlib
import shlex
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from clusterrun.agent.wire import RunMessage, RunRequest
from clusterrun.config.environment import redact
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.config.nodesets import fold
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, ClusterrunError, HostError, TransportError
from clusterrun.core.frozen import frozen
from clusterrun.run.plan import node_env
from clusterrun.transports import Transport
from clusterrun.transports.base import AgentStream

__all__ = ["HostOutcome", "exec_on_hosts", "remote_command", "run_request", "summary"]

MAX_PARALLEL = 64  # connections opened at once, as pdsh's default fanout (32) and more


@frozen
class HostOutcome:
    """How the command ended on one host: its exit status, or why it could not run there."""

    host: str
    status: int | None = None  # None: the command did not run, or ended without a status
    error: str | None = None
    unreachable: bool = False  # the host could not be reached at all

    @property
    def ok(self) -> bool:
        return self.status == 0

    def describe(self) -> str:
        if self.error is not None:
            return self.error
        return f"exit {self.status}"


def remote_command(argv: Sequence[str]) -> str:
    """The command line for the host's login shell: ``sh`` decodes ``argv`` (``shlex.join``) and runs
    it; a command the host does not have is ``NAME: command not found``, status 127 (sh's own words
    would name its ``eval``)."""
    name = shlex.quote(argv[0]) if argv else "''"
    script = (f"command -v {name} >/dev/null 2>&1 || {{ printf '%s: command not found\\n' {name}; exit 127; }}\n"
              + shlex.join(argv))
    encoded = base64.b64encode(script.encode("utf-8", "surrogateescape")).decode("ascii")
    return f"sh -c 'exec 2>&1; eval \"$(echo {encoded} | base64 -d)\"'"


def run_request(spec: ClusterSpec, host: HostSpec, argv: Sequence[str], local_cwd: str) -> RunRequest:
    """``argv`` as node ``host``'s job would run (``plan.build_plan``): in its workdir (this directory
    for a local host without one), with its environment (``spec`` resolved: ``env_file`` and
    ``forward_env`` read) and after its ``setup``."""
    cwd = host.workdir or (local_cwd if host.transport == "local" else None)
    return RunRequest(argv=list(argv), env=node_env(host, {}), cwd=cwd, setup=list(host.setup) or None,
                      setup_timeout=spec.watch.setup_timeout)


def _run(transport: Transport, command: str, line: Callable[[str, str], None]) -> HostOutcome:
    ours, theirs = socket.socketpair()
    ours.shutdown(socket.SHUT_WR)  # the command's stdin: at its end at once
    got: list[tuple[int, str]] = []
    failed: list[ClusterrunError] = []

    def pipe() -> None:
        try:
            got.append(transport.pipe(command, theirs))
        except ClusterrunError as exc:
            failed.append(exc)
        finally:
            theirs.close()  # the end of the output, however the command ended

    worker = threading.Thread(target=pipe, daemon=True, name=f"exec-{transport.name}")
    worker.start()
    with ours, ours.makefile("rb") as output:
        for raw in output:
            line(transport.name, raw.rstrip(b"\n").decode("utf-8", "surrogateescape"))
    worker.join()
    if failed:
        return HostOutcome(transport.name, error=_text(failed[0]), unreachable=isinstance(failed[0], TransportError))
    status, tail = got[0]
    if status < 0:
        return HostOutcome(transport.name, error="the connection ended before the command's exit status came"
                           + (f": {tail.strip()}" if tail.strip() else ""))
    return HostOutcome(transport.name, status)


def _text(error: ClusterrunError) -> str:
    """The error without the host's name in front (the summary puts it there), with its hint."""
    if isinstance(error, HostError):
        return error.message + (f" ({error.hint})" if error.hint else "")
    return error.render()


def _run_as_job(transport: Transport, request: RunRequest, line: Callable[[str, str], None],
                secret_env: Sequence[str]) -> HostOutcome:
    """``request`` in the host's agent: its output line by line, its secret values masked."""
    env = request.env or {}
    stream = transport.stream(request)
    with contextlib.closing(stream):
        return _lines_of(transport.name, stream, line, env, secret_env)


def _lines_of(host: str, stream: AgentStream, line: Callable[[str, str], None], env: Mapping[str, str],
              secret_env: Sequence[str]) -> HostOutcome:
    """The ``run`` stream's output to ``line``, whole lines (a chunk may end mid-line), until its end."""
    pending = b""
    for raw in stream:
        if raw.get("ok") is False:
            raise AgentError(host, redact(str(raw.get("error") or "the command could not run"), env, secret_env))
        try:
            message = RunMessage.from_json(raw, "run message")
        except ValueError as exc:
            raise AgentError(host, f"the agent answered {raw!r}: {exc}") from None
        if message.t == "out":
            *lines, pending = (pending + message.data.encode("utf-8", "surrogateescape")).split(b"\n")
            for text in lines:
                line(host, redact(text.decode("utf-8", "surrogateescape"), env, secret_env))
        elif message.t == "end":
            if pending:
                line(host, redact(pending.decode("utf-8", "surrogateescape"), env, secret_env))
            return HostOutcome(host, message.status)
    return HostOutcome(host, error="the connection ended before the command's exit status came")


def _one(transport: Transport, command: str | RunRequest, line: Callable[[str, str], None],
         secret_env: Sequence[str] = ()) -> HostOutcome:
    try:
        transport.connect()
        if isinstance(command, RunRequest):
            return _run_as_job(transport, command, line, secret_env)
        return _run(transport, command, line)
    except TransportError as exc:
        return HostOutcome(transport.name, error=_text(exc), unreachable=True)
    except ClusterrunError as exc:
        return HostOutcome(transport.name, error=_text(exc))
    except NotImplementedError:
        return HostOutcome(transport.name, error="this host's transport cannot run commands")
    finally:
        transport.close()


def exec_on_hosts(spec: ClusterSpec, argv: Sequence[str], factory: Callable[[HostSpec], Transport],
                  line: Callable[[str, str], None], *, job_env: bool = False,
                  local_cwd: str = "") -> list[HostOutcome]:
    """Run ``argv`` on every host of ``spec`` in parallel; ``line(host, text)`` gets each output
    line as it comes (from several threads: it must be safe to call concurrently). With
    ``job_env``, as each node's job would run it (``run_request``; ``spec`` resolved first). The
    outcomes in the file's order. Interrupted (Ctrl-C), it closes every connection before it lets go."""
    command = remote_command(argv)
    transports = [factory(host) for host in spec.hosts]
    pool = ThreadPoolExecutor(max_workers=min(len(transports), MAX_PARALLEL))
    try:
        futures = [pool.submit(_one, transport, run_request(spec, transport.host, argv, local_cwd) if job_env
                               else command, line, spec.secret_env) for transport in transports]
        return [parallel.result(f) for f in futures]
    except BaseException:
        for transport in transports:  # ends the commands' channels: their threads return
            transport.close()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def summary(outcomes: Sequence[HostOutcome]) -> list[str]:
    """The per-host report after the output: one line per failed host, then the count and who."""
    failed = [o for o in outcomes if not o.ok]
    lines = [f"{o.host}: {o.describe()}" for o in failed]
    if failed:
        lines.append(f"{len(failed)} of {len(outcomes)} hosts failed: {fold([o.host for o in failed])}")
    else:
        lines.append(f"the command succeeded on all {len(outcomes)} hosts")
    return lines
