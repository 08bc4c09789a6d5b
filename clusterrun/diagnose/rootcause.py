"""Find the root cause of a failed job from what the nodes printed and recorded (pure code).

the node agent tags each worker line with ``[rankN]:`` (``agent.RankLogs``) and torchrun, when a
worker fails, prints a report with ``rank : N (local_rank: M)`` and ``exitcode : X (pid: P)``
for every failed worker, whether or not the script uses ``@record``. The agent records when each
worker process ended. The root cause is the failed worker that ended first across the cluster;
a rank whose collective failed because a peer went away counts after the others, and failures of
nodes that clusterrun itself stopped only count when nothing else failed (unless they came before
the stop reached the node's host, by its clock). A known
failure signature (``signatures.SIGNATURES``) adds its cause and fix to the root cause.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from clusterrun.core.events import OomEvidence, RootCause, unreachable_text
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import HostState, KernelOom, NodeStatus
from clusterrun.diagnose.signatures import explain, printed_its_own, transient_start

_RANK_LINE = re.compile(r"^\[rank(\d+)\]:(.*)$", re.DOTALL)
_REPORT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_REPORT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_TAG_AT_START = re.compile(r"\[rank\d+\]:")
# A collective failed because a peer's process or connection went away: a consequence of the peer's failure
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|remote process exited|caused by a remote worker crashing",
                        re.IGNORECASE)
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b.*|^[A-Za-z_][\w.]*: .+")
TAIL_LINES = 20


def split_rank(line: str) -> tuple[int | None, str]:
    """``"[rank3]:hello"`` → ``(3, "hello")``; lines of torchrun itself → ``(None, line)``."""
    found = _RANK_LINE.match(line)
    if not found:
        return None, line
    rank, text = int(found.group(1)), found.group(2)
    inner = f"[rank{rank}]:"  # torch tags a worker's uncaught traceback itself; drop the repeat
    if text.startswith(inner):
        text = text[len(inner):].removeprefix(" ")
    return rank, text


def undoubled(lines: tuple[str, ...]) -> tuple[str, ...]:
    """``lines`` with torch's own ``[rankN]:`` tag right after ours shown once (``[rank1]:[rank1]:x``
    → ``[rank1]:x``); the same tuple when no line has it."""
    if not any("]:[rank" in line for line in lines):
        return lines
    out = []
    for line in lines:
        rank, text = split_rank(line)
        out.append(line if rank is None or "]:[rank" not in line else f"[rank{rank}]:{text}")
    return tuple(out)


@frozen
class RankFailure:
    """A rank's end as torchrun's failure report, or the host's monitor, recorded it."""

    local_rank: int | None
    exit_code: int | None  # negative: the signal that killed it (torchrun's form); None: not read
    pid: int | None

    def cause(self, node: int, host: str, rank: int, tail: tuple[str, ...]) -> RootCause:
        code = self.exit_code
        return RootCause(node=node, host=host, rank=rank, local_rank=self.local_rank,
                         exit_code=code if code is None or code >= 0 else None,
                         signal=-code if code is not None and code < 0 else None,
                         last_lines=tail, message=exception_message(tail), pid=self.pid)


@dataclass
class NodeLog:
    """What one node printed, as far as a diagnosis needs it: tails per rank and torchrun's
    failure report. Feed it lines in order."""

    tail: int = TAIL_LINES
    rank_tails: dict[int, deque[str]] = field(default_factory=dict)
    node_tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    failures: dict[int, RankFailure] = field(default_factory=dict)  # by rank
    _pending_rank: tuple[int, int] | None = None

    def feed(self, lines: Iterable[str], text: str | None = None) -> None:
        """Read ``lines`` (a batch, in order); ``text``: the same lines each ended by a newline,
        where the caller has them so (the one-rank check then reads it instead of joining them)."""
        if isinstance(lines, (tuple, list)) and lines:
            if self._one_rank(lines, text):
                return
            if len(lines) > 4 * self.tail:
                lines = self._worth_reading(lines)
        for line in lines:
            rank, text = split_rank(line)
            if rank is not None:
                self.rank_tails.setdefault(rank, deque(maxlen=self.tail)).append(text)
                continue
            self.node_tail.append(line)
            found = _REPORT_RANK.match(line)
            if found:
                self._pending_rank = (int(found.group(1)), int(found.group(2)))
                continue
            found = _REPORT_EXIT.match(line)
            if found and self._pending_rank is not None:
                rank, local = self._pending_rank
                self.failures[rank] = RankFailure(local, int(found.group(1)), int(found.group(2)) or None)
                self._pending_rank = None

    def _one_rank(self, lines: Sequence[str], text: str | None = None) -> bool:
        """Whether every line of ``lines`` (``text``: joined, each ended by a newline) is one
        rank's, as most of a flow is (one process a node); if so its last ``tail`` lines are kept,
        found without a pattern matched on each line."""
        found = _TAG_AT_START.match(lines[0])
        if found is None or not lines[-1].startswith(found.group()):  # most batches of several ranks: no join
            return False
        tag = found.group()
        if text is None:
            text = "\n".join(lines)
        if text.count("\n" + tag) != len(lines) - 1 or "]:[rank" in text:  # torch's doubled tag: split_rank's
            return False
        kept = self.rank_tails.setdefault(int(tag[5:-2]), deque(maxlen=self.tail))
        last = "\n".join(lines[-self.tail:])
        kept.extend(last[len(tag):].replace("\n" + tag, "\n").split("\n"))
        return True

    def _worth_reading(self, lines: Sequence[str]) -> Sequence[str]:
        """Of a long batch, the lines that can change what is kept: when every line is a rank's,
        each rank's last ``tail`` (found from the end); else all (torchrun's own lines are all
        read). A flood feeds millions of lines: only the batch's end is read line by line; that
        the lines before it are all of the ranks found there is counted by ``str.count``."""
        text = "\n" + "\n".join(lines)
        left: dict[str, int] = {}  # by tag, `[rank03]:` apart from `[rank3]:`: lines still wanted
        wanted, kept = 0, []
        pos = len(text)  # text[pos] is the newline before lines[at]
        for at in range(len(lines) - 1, -1, -1):
            pos -= len(lines[at]) + 1
            found = _TAG_AT_START.match(lines[at])
            if found is None:
                return lines
            tag = found.group()
            if tag not in left:
                left[tag] = self.tail
                wanted += self.tail
            if left[tag]:
                left[tag] -= 1
                wanted -= 1
                kept.append(at)
                if not wanted and sum(text.count("\n" + t, 0, pos) for t in left) == at:
                    break  # every line before is of these ranks, whose last lines are kept
        return [lines[at] for at in reversed(kept)]

    def lines(self) -> list[str]:
        """The last lines kept: each rank's tagged ``[rankN]:`` again, then torchrun's."""
        tagged = [f"[rank{rank}]:{line}" for rank, lines in sorted(self.rank_tails.items()) for line in lines]
        return [*tagged, *self.node_tail]


def exception_message(lines: Iterable[str]) -> str:
    """The last line that looks like ``SomeError: message``, or ``""``."""
    found = ""
    for line in lines:
        stripped = line.strip()
        if stripped and _EXCEPTION.match(stripped) and not stripped.startswith(("File ", "Traceback")):
            found = stripped
    return found


def find_root_cause(
    hosts: Mapping[int, str],
    logs: Mapping[int, NodeLog],
    states: Mapping[int, NodeStatus],
    stopped_by_us: set[int],
) -> RootCause | None:
    """The first failure across the cluster, from each node's log and final agent state.

    ``states`` are the agents' reports of their state files (exit code, signal, the workers and
    when each died, when torchrun ended); ``stopped_by_us`` are nodes that clusterrun stopped (fail-fast or the
    user), whose failures are consequences unless nothing else failed.
    """
    candidates: list[tuple[int, float, RootCause]] = []
    for node, state in states.items():
        if state.exit_code in (0, None) and not state.error and state.state is not HostState.LOST:
            continue
        log = logs.get(node) or NodeLog()
        secondary = 2 if node in stopped_by_us else 0
        if (state.exit_unknown or state.state is HostState.LOST) and not log.failures:
            # No exit status, nothing of torchrun's failure report: the node was lost, not failed. Only
            # a node lost before any stop is a cause (a lost node after ours is the stop's doing).
            when = state.away_since or state.ended_at or float("inf")
            if state.unanswered:  # our stop never reached its host: its loss is not the stop's doing
                secondary = 0
            elif state.degraded and secondary:  # stopped by us, but its records had stopped (a full disk):
                # whether it failed before the stop is unknown; as uncertain as a rank that failed because a
                # peer went away, and before it
                secondary, when = 1, -1.0
            candidates.append((secondary, when, RootCause(
                node=node, host=hosts[node], rank=None, local_rank=None, exit_code=None, signal=None,
                last_lines=tuple(log.node_tail), message=lost_text(state), pid=state.torchrun_pid, lost=True)))
            continue
        died = {w.pid: w.died for w in state.workers}
        died_by_rank = {w.rank: w.died for w in state.workers}
        failures = log.failures or (ranks_failed(state) if state.exit_learned else {})
        for rank, failure in failures.items():
            when = (died.get(failure.pid) if failure.pid else None) or died_by_rank.get(rank) or state.ended_at \
                or float("inf")
            tail = tuple(log.rank_tails.get(rank, ()))
            candidates.append((max(_ours(secondary, when, state), _after_a_peer(tail)), when,
                               failure.cause(node, hosts[node], rank, tail)))
        if not failures:
            tail = tuple(log.node_tail)
            node_code = state.exit_code
            sig = state.signal
            message = state.error or exception_message(tail)
            # its torchrun's report unseen (a viewer that attached after it): its first failed rank's death
            when = min((w.died for w in state.workers if w.exit_code and w.died), default=None) \
                or state.ended_at or float("inf")
            candidates.append((max(_ours(secondary, when, state), _after_a_peer(tail)), when, RootCause(
                node=node, host=hosts[node], rank=None, local_rank=None,
                exit_code=None if sig else node_code, signal=sig, last_lines=tail, message=message,
                pid=state.torchrun_pid)))
    if not candidates:
        return None
    candidates.sort(key=lambda c: (c[0], c[1], c[2].node))
    root = candidates[0][2]
    if root.signal == SIGKILL:
        root = replace(root, oom=oom_evidence(root.pid, states[root.node].oom))
    return replace(root, explanation=explain(root, hosts, {node: log.lines() for node, log in logs.items()}))


SIGKILL = 9


def _ours(secondary: int, when: float, state: NodeStatus) -> int:
    """``secondary`` (2: a node we stopped), but 0 for a failure that came before our stop reached its
    host: the node failed by itself while its end was still on its way to us."""
    return 0 if secondary == 2 and state.stop_at is not None and when < state.stop_at else secondary


def _after_a_peer(tail: tuple[str, ...]) -> int:
    """1 where the rank's last lines say a collective failed because a peer went away: it may end
    before the peer that failed (whose interpreter still shuts down), so it ranks after real failures."""
    return 1 if any(_PEER_GONE.search(line) for line in tail[-6:]) else 0


def ranks_failed(state: NodeStatus) -> dict[int, RankFailure]:
    """The failed ranks as the host's monitor recorded them, for a node whose torchrun printed no
    failure report: it was stopped at once after its rank failed, or nobody reaped it
    (``exit_learned`` says which). The monitor names the first (``failed_rank``): its exit may be unread."""
    named = [w for w in state.workers if w.rank is not None and w.rank == state.failed_rank]
    failed = named or [w for w in state.workers if w.rank is not None and w.exit_code]
    return {w.rank: RankFailure(w.local_rank, w.exit_code, w.pid or None) for w in failed if w.rank is not None}


def lost_text(state: NodeStatus) -> str:
    """How a node was lost, as far as the controller and its host can tell: when the host went
    away (the controller lost contact just before the host said so) and whether it restarted."""
    if state.away_since is None:
        return state.error or "its agent and torchrun vanished without an exit status"
    went = f"the host went away at {clock(state.away_since)}"
    if state.unanswered:
        return f"{went} and has not answered since ({state.error or 'cannot connect'})"
    if state.rebooted:
        return f"{went}; its boot id changed (it restarted)"
    return f"{went}; when it came back none of the job's processes was left ({state.error or 'no exit status'})"


def clock(timestamp: float) -> str:
    """``12:20:52Z`` (UTC; the date too when it is not today's, as ``unreachable_text`` says it)."""
    return unreachable_text(timestamp, time.time()).removeprefix("unreachable since ")


def oom_evidence(pid: int | None, report: KernelOom | None) -> OomEvidence:
    """What a node's kernel said of the OOM kill of ``pid`` (the root cause's process): the
    kernel's line naming it, or why there is none; the attempt's cgroup's count of OOM kills."""
    if report is None:
        return OomEvidence(pid=pid, recorded=False)
    mine = None if report.pid_namespace or pid is None else next((k for k in report.kills if k.pid == pid), None)
    counted = OomEvidence(
        pid=pid, others=tuple(f"{k.pid} ({k.comm})" if k.comm else str(k.pid) for k in report.kills if k is not mine),
        overwritten=report.overwritten, cgroup_kills=report.cgroup_oom_kills, cgroup_events=report.cgroup_events,
        cgroup_error=report.cgroup_error)
    if mine is None:
        return replace(counted, unreadable=report.kmsg_error, pid_namespace=report.pid_namespace)
    return replace(counted, line=mine.line or mine.summary, constraint=mine.constraint,
                   memcg=mine.oom_memcg if mine.constraint == "CONSTRAINT_MEMCG" else None)


def transient_start_failure(root: RootCause | None, logs: Mapping[int, NodeLog]) -> str | None:
    """Why the job's failure was a known transient start-up failure, or None: the signature that
    explains the root cause is one marked ``transient_start`` in ``signatures.SIGNATURES`` and no
    rank had printed a line of its own."""
    why = transient_start(root.explanation if root is not None else None)
    if why is None:
        return None
    if any(printed_its_own(lines) for log in logs.values() for lines in log.rank_tails.values()):
        return None
    return why
