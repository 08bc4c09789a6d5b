"""``follow``: a node's log and state as a stream, resumable by byte offset."""

from __future__ import annotations

import os
import time

from .codec import emit, last_emit
from .monitor import ensure_monitor
from .procs import PidHandle, job_alive, pin
from .records import load_state, lost, read_state
from .serve import answer_aside, aside_ready
from .waker import IDLE_CHECK, IN_MODIFY, IN_MOVED_TO, Waker
from .wire import HEARTBEAT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, BinaryIO

    from .wire import FollowRequest


# How often at most ``follow`` reads new bytes of the node's log unless the request says
# (``interval``: the controller shares a budget of messages a second among its nodes); the
# supervisor's MERGE_INTERVAL is its counterpart: under a steady flow a line's latency from the
# worker to the controller is about the sum of the two, plus the network (docs/benchmarks.md).
# Without inotify it is also the polling interval; with it, the wait ends at an event or after
# IDLE_CHECK seconds, and the first lines after a pause are read at once.
POLL_INTERVAL = 0.05
INTERVALS = (0.005, 0.5)  # the intervals a request may ask for
# The liveness checks (is the supervisor, the survivor or torchrun still there; a monitor started
# if none is) run at most this often, and at once when a pinned process ended: each reads /proc,
# which cost more than the read of the log (~1 ms under load; 16 agents at 50 reads a second).
CHECK_EVERY = IDLE_CHECK / 2


def tail_offset(path: str, lines: int, end: int | None = None) -> int:
    """The byte offset where the last ``lines`` complete lines of the file at ``path`` begin
    (of those before byte ``end``, if given)."""
    with open(path, "rb") as f:
        pos, found = f.seek(0, os.SEEK_END), 0
        if end is not None:
            pos = min(pos, max(0, end))
        # A partial last line has no newline, so it is not counted among the ``lines``.
        while pos > 0:
            size = min(1 << 16, pos)
            pos -= size
            f.seek(pos)
            block = f.read(size)
            at = len(block)
            while (at := block.rfind(b"\n", 0, at)) >= 0:
                found += 1  # the newline ending the found-th complete line from the end
                if found > lines:
                    return pos + at + 1
        return 0


class Times:
    """The entries of ``output.times`` (``RankLogs.note_time``) that cover a range of the log,
    read as the file grows: ``[[offset, ns], ...]``, the first one at or before the range. Used
    in a ``with``, it keeps the file open between reads (``follow``: an open per read of the log
    cost as much as the read)."""

    def __init__(self, path: str) -> None:
        self.path, self.read = path, 0
        self.entries: list[list[int]] = []
        self.keep = False
        self.file: BinaryIO | None = None

    def covering(self, start: int, end: int) -> list[list[int]]:
        try:
            if self.file is None:
                self.file = open(self.path, "rb")  # noqa: SIM115 - closed below or on __exit__
            self.file.seek(self.read)
            data = self.file.read()
        except OSError:  # none (an attempt of an older agent, or no line yet)
            data = b""
        finally:
            if not self.keep:
                self.__exit__()
        cut = data.rfind(b"\n") + 1
        self.read += cut
        for line in data[:cut].splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
                self.entries.append([int(fields[0]), int(fields[1])])
        before = [e for e in self.entries if e[0] <= start]
        shown = before[-1:] + [e for e in self.entries if start < e[0] < end]
        self.entries = [e for e in self.entries if e[0] >= end] + shown[-1:]  # what later ranges need
        self.entries.sort()
        return shown

    def __enter__(self) -> Times:
        self.keep = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _state_version(state_path: str, degraded_path: str) -> tuple[int, ...] | None:
    """What tells a new state: the state file is replaced by a rename; a ``degraded`` marker changes
    what is sent too, also once its reason is written (seen empty, between its creation and the
    write, it says less). None while there is no state file."""
    try:
        seen = os.stat(state_path)
    except OSError:
        return None
    return (seen.st_ino, seen.st_mtime_ns, seen.st_size, *(_marker_version(degraded_path) or ()))


def _marker_version(path: str) -> tuple[int, int] | None:
    """The ``degraded`` marker's size and modification time; None while there is none."""
    try:
        seen = os.stat(path)
    except OSError:
        return None
    return seen.st_size, seen.st_mtime_ns


def op_follow(req: FollowRequest) -> None:
    folder, state = load_state(req)
    log_path = os.path.join(folder, "output.log")
    if req.tail is not None:
        offset = tail_offset(log_path, req.tail)
    else:
        offset = req.offset
        if req.before:  # a viewer's scrollback: the lines just before where it resumes
            offset = tail_offset(log_path, req.before, end=offset)
    want_logs, once = req.logs, req.once
    asks = req.asks  # while stdin is open: a stop may come on it (answered here, between two reads)
    if asks:
        aside_ready()
    interval = POLL_INTERVAL if req.interval is None else min(max(req.interval, INTERVALS[0]), INTERVALS[1])
    state_path = os.path.join(folder, "state.json")
    degraded_path = os.path.join(folder, "degraded")
    last_seen = None
    waker: Waker | None = None
    pins: dict[tuple[int, int | None], PidHandle | None] = {}  # the supervisor and torchrun, by pidfd
    times = Times(os.path.join(folder, "output.times"))
    with open(log_path, "rb") as log, times:
        if not want_logs:
            offset = log.seek(0, os.SEEK_END)
        log.seek(offset)
        pending = b""
        last_data = 0.0  # when a read last found new bytes: the next one waits ``interval`` after it
        checked = 0.0  # when the liveness checks last ran (CHECK_EVERY)
        resumed = False  # this follow started a monitor for the attempt (``ensure_monitor``)
        while True:
            now = time.monotonic()
            chunk = log.read(1 << 20) if want_logs else b""
            if chunk or not want_logs:  # (without the log: the wakes by its writes are batched alike)
                last_data = now
                data = pending + chunk
                cut = data.rfind(b"\n") + 1
                if cut:
                    emit({"t": "log", "offset": offset, "next": offset + cut,
                          "times": times.covering(offset, offset + cut),
                          "data": data[:cut]})
                    offset += cut
                pending = data[cut:]
                if len(chunk) == 1 << 20:
                    continue
            version = _state_version(state_path, degraded_path)
            if version != last_seen:
                last_seen = version
                state = read_state(folder) or state
                if state.get("state") != "exited" and os.path.exists(os.path.join(folder, "stop")):
                    # A stop is under way (its file comes before any signal): the ranks it kills did not fail
                    state = dict(state, stop_requested=True)
                emit({"t": "state", "state": state})
            ended = state.get("state") == "exited"
            check = not ended and now - checked >= CHECK_EVERY
            if check:
                checked = now
                if not resumed:  # once: a monitor that could not record the end (a full disk) is not started again
                    before = state.get("supervisor")
                    state = ensure_monitor(folder, state)
                    resumed = state.get("supervisor") != before
            if check and not job_alive(state):
                # Read the state again: the supervisor may have written its last word and exited
                # since the read above. Only if it still says nothing is the node lost.
                state = read_state(folder) or state
                ended = True
                if state.get("state") != "exited":
                    state = lost(state)
            if ended:
                rest = pending + log.read() if want_logs else b""
                if rest:
                    emit({"t": "log", "offset": offset, "next": offset + len(rest),
                          "times": times.covering(offset, offset + len(rest)),
                          "data": rest})
                emit({"t": "end", "state": state})
                break
            if once:
                emit({"t": "eof", "next": offset, "state": state})
                break
            if time.monotonic() - last_emit[0] >= HEARTBEAT:
                emit({"t": "beat"})
            if waker is None:
                waker = Waker()
                waker.watch(folder, IN_MODIFY | IN_MOVED_TO)  # output.log appended, state.json replaced
            _pin_job(state, pins)
            if waker.reliable:
                timeout = min(IDLE_CHECK, HEARTBEAT - (time.monotonic() - last_emit[0]))
            else:
                timeout = interval
            ready = waker.wait(timeout, [h.fd for h in pins.values() if h is not None and h.fd >= 0]
                               + ([0] if asks else []))
            if asks and 0 in ready:
                asks = answer_aside()
                if not asks:  # stdin ended: the controller is gone (no transport half-closes it), so is
                    break  # whoever read this; a follow that went on could start a supervisor again
                continue  # the stop changed the state: it goes out at once, the end after it
            for key, handle in pins.items():
                if handle is not None and handle.fd in ready:  # it ended: do not wait on it again
                    handle.close()
                    pins[key] = None
                    checked = 0.0  # and look at once whether anything of the job is left
            left = last_data + interval - time.monotonic()
            # Woken again soon after lines (a flow): read in batches; after a pause, or for a new
            # state (a failure, a stop, the end: the lines before it come with it), at once
            if left > 0 and _state_version(state_path, degraded_path) == last_seen:
                time.sleep(left)
    if waker is not None:
        waker.close()
    for handle in pins.values():
        if handle is not None:
            handle.close()


def _pin_job(state: dict[str, Any], pins: dict[tuple[int, int | None], PidHandle | None]) -> None:
    """Pidfds of the supervisor and torchrun that ``state`` names (once each), so that a wait
    wakes when one of them ends even if it could not write its last state (SIGKILL)."""
    for entry in (state.get("survivor"), state.get("supervisor"), state.get("torchrun")):
        if entry and entry.get("pid") and (entry["pid"], entry.get("start_time")) not in pins:
            pins[(entry["pid"], entry.get("start_time"))] = pin(entry["pid"], entry.get("start_time"))
