"""The hosts' ``setup`` commands, run on every node before anything of the attempt starts, watched.

``run(job, emit)`` runs every node's ``setup`` in parallel, each in the agent that probed its
host (which keeps the environment it made and its output for the attempt's start), all or
nothing as the probe (``Job.all_or_none``): ``checks`` for every attempt, after the sync and
before the preflight (a next attempt's before the running one is stopped: a failing setup leaves
it running), ``Job.prepare`` where it is asked to. Each agent then says how the job's interpreter
runs in setup's environment (``hostchecks.after_setup``): the preflight checks that one and
torchrun's argv suits it (``Job.set_up``), or the node is refused. While some still run, ``emit`` hears
which (a ``JobNote``, at ``FIRST`` seconds, then every ``EVERY``): ``node 3 (gpu04): setup runs
for 45 s (killed at 10 min); nodes 0-2 ready``. A node's setup that runs longer than
``setup_timeout`` (the hosts file's, or ``up --setup-timeout``; 10 minutes by default) is killed
by its host's agent and fails the start: ``HostsUnavailable`` naming the node, its host and the
last lines of the setup's output; nothing starts anywhere. The start-up watch's clock
(``startup_timeout``) starts after the setup. A host's output may quote the job's secret values:
``redacted`` masks them in its errors.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from clusterrun.agent.wire import SetupAnswer, node_request
from clusterrun.config.environment import redact
from clusterrun.core.errors import AgentError
from clusterrun.core.events import JobNote
from clusterrun.core.protocol import decode
from clusterrun.core.ranges import ranges_text
from clusterrun.run.hostchecks import after_setup
from clusterrun.run.plan import NodeLaunch, with_flags
from clusterrun.run.startwatch import nodes_text, seconds_text

if TYPE_CHECKING:
    from clusterrun.run.hosts import Emit, JobHosts

FIRST, EVERY = 10.0, 30.0  # seconds: the first note of a setup still running, then one this often
Wait = Callable[[threading.Event, float], bool]  # waits at most that long for the event (tests pass a fake)


def redacted(exc: AgentError, launch: NodeLaunch, secret_env: Collection[str]) -> AgentError:
    """``exc`` without the job's secret values: a failing setup's output may quote them."""
    message = redact(exc.message, launch.env, secret_env)
    return exc if message == exc.message else AgentError(exc.host, message, hint=exc.hint)


def progress_text(hosts: Mapping[int, str], running: Collection[int], seconds: float, timeout: float) -> str:
    """``node 3 (gpu04): setup runs for 45 s (killed at 10 min 0 s); nodes 0-2 ready``."""
    ranks = sorted(running)
    ready = [r for r in sorted(hosts) if r not in running]
    text = f"{nodes_text(ranks, hosts)}: setup runs for {seconds_text(seconds)} (killed at {seconds_text(timeout)})"
    return text + (f"; {'node' if len(ready) == 1 else 'nodes'} {ranges_text(ready)} ready" if ready else "")


def setup_node(job: JobHosts, rank: int, if_cwd: bool = False) -> NodeLaunch | None:
    """Run node ``rank``'s setup in the agent that probed its host, then look at the job's
    interpreter in the environment it made (``hostchecks.after_setup``): its launch with
    torchrun's argv for that interpreter, or None where it did not run (``if_cwd``: not while the
    workdir is missing). ``AgentError`` naming the node when the setup fails or leaves no
    interpreter that can run the job."""
    _, agent, probe = job.probed(rank)
    plan = job.plan
    if plan is None or agent is None or probe is None:
        raise RuntimeError("setup before the probe")
    launch = plan.nodes[rank]
    request = node_request("setup", job=job.job_id, node=rank, attempt=job.attempt, state_dir=job.spec.state_dir,
                           setup=list(launch.host.setup), env=dict(launch.env), cwd=launch.cwd,
                           setup_timeout=job.spec.watch.setup_timeout, python=launch.argv[0], if_cwd=if_cwd)
    try:
        answer = decode(launch.host.host, SetupAnswer, agent.call(request), "setup answer")
    except AgentError as exc:
        raise redacted(AgentError(exc.host, f"node {rank}: {exc.message}", hint=exc.hint), launch,
                       job.spec.secret_env) from None
    if answer.skipped:
        job.setup_skipped[rank] = answer.skipped
    if answer.python is None:
        return None
    label, probe, refused = after_setup(launch.argv[0], probe, answer.python)
    if refused is not None:
        raise AgentError(launch.host.host, f"node {rank}: {refused.detail}", hint=refused.fix)
    job.set_up[rank] = label
    launch = with_flags(plan, rank, probe.torchrun_flags)
    job.set_up_node(rank, probe, launch)
    return launch


def run(job: JobHosts, emit: Emit | None = None, *, if_cwd: Collection[int] = (), now: Callable[[], float] = time.time,
        wait: Wait = lambda event, seconds: event.wait(seconds)) -> None:
    """Run ``setup`` on every node that has some, in parallel, telling ``emit`` which still run;
    ``HostsUnavailable`` naming every node whose setup failed, ran out of time or left no
    interpreter that can run the job. On the nodes of ``if_cwd`` (a dry run whose sync would make
    the workdir) not while the workdir is missing (``job.setup_skipped``). Then ``job.plan`` has
    torchrun's argv as each node's interpreter after setup takes it; ``job.set_up``: the nodes
    whose checks see setup's environment."""
    plan = job.plan
    if plan is None:
        raise RuntimeError("setup before the plan")
    ranks = [n.rank for n in plan.nodes if n.host.setup]
    if not ranks:
        return
    hosts = {n.rank: n.host.host for n in plan.nodes}
    started, running, ended = now(), set(ranks), threading.Event()

    def one(rank: int) -> NodeLaunch | None:
        try:
            return setup_node(job, rank, rank in if_cwd)
        finally:
            running.discard(rank)

    def watch() -> None:
        pause = FIRST
        while not wait(ended, pause):
            left = set(running)
            if left and emit is not None:
                emit(JobNote(None, text=progress_text(hosts, left, now() - started, job.spec.watch.setup_timeout)))
            pause = EVERY

    watcher = threading.Thread(target=watch, name="clusterrun-setup-watch", daemon=True)
    watcher.start()
    try:
        launches = dict(zip(ranks, job.all_or_none(one, ranks), strict=True))
    finally:
        ended.set()
        watcher.join()
    job.plan = dataclasses.replace(plan, nodes=tuple(launches.get(n.rank) or n for n in plan.nodes))


__all__ = ["EVERY", "FIRST", "progress_text", "redacted", "run", "setup_node"]
