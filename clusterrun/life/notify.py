"""Notifications: the job's ``notify`` command, run on this controller once per event.

The events are read off the job's record, never off a process's memory: an attempt that ended
``failed`` or ``succeeded``, an attempt after the first (``restarted``), the job recorded hung
(``hung``, once per hang: its nodes' ``hung_since``). ``send_due`` sends every event of
``notify.on`` the record shows and has not sent, and is called by whoever brings the record up to
date: the job's owner (the foreground ``up`` or its monitor, ``runner.Runner``) and a command that
reconciles a job nobody owned (``recorder.refresh``). So a controller SIGKILLed before it could
notify leaves the event to the next one.

Each event has a stable id, ``<job>:<key>`` (``CLUSTERRUN_EVENT_ID``; keys ``1:failed``,
``2:restarted``, ``1:hung:1764100000``), and a ``Notice`` in the record (``JobRecord.notices``):
``claimed`` by a process (``jobs.process_id``: pid and start time), then ``sent`` (the command
exited 0) or ``failed`` (its exit status and the last line of its stderr). Whoever finds an event
due claims it under the record's lock and starts its sender (``clusterrun _notify``, ``sender``):
a process of its own session that takes the claim over (only if it is still the starter's: a
successor may have taken it meanwhile), runs the command, waits for it and records how it ended.
So the claimant lives as long as the command. A claim whose claimant died before recording the
end is claimed again by the next process that looks, and the command runs again with the same id.
Hence **exactly once** when no process dies; when a sender dies while its command runs, **one
repeat with the same id** (a receiver can drop it); never lost. A command that fails is recorded
and reported once, not retried; an event whose senders died ``TRIES`` times is given up.

The command gets ``CLUSTERRUN_JOB``, ``CLUSTERRUN_EVENT``, ``CLUSTERRUN_EVENT_ID``,
``CLUSTERRUN_STATE`` and ``CLUSTERRUN_ATTEMPT`` in its environment and the job's ``ps --json``
entry on stdin (with ``event`` and ``event_id``); it runs through ``/bin/sh -c`` in the job's
directory, in a session of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from clusterrun.config.watch import Notify
from clusterrun.core.errors import ClusterrunError, StateError
from clusterrun.core.frozen import frozen
from clusterrun.store.jobjson import record_json
from clusterrun.store.jobs import JobRecord, JobStore, process_alive, process_id

WAIT = 60.0  # seconds a command may run before its starter says it still runs (it is not killed)
TRIES = 3  # senders that may die with an event's command before it is given up


@frozen
class Due:
    """One event the record shows: its ``key`` in ``JobRecord.notices``, its name, its attempt."""

    key: str
    event: str
    attempt: int


@frozen
class Notice:
    """How one event's notification went: ``by`` the process that sends it (``jobs.process_id``),
    ``state`` claimed → sent | failed, the command's exit ``code``, ``error`` (its last line of
    stderr, or why it was not sent), ``tries`` (senders started)."""

    by: str
    state: str = "claimed"
    code: int | None = None
    error: str = ""
    tries: int = 1

    @property
    def orphaned(self) -> bool:
        """Claimed by a process that died before it recorded the command's end."""
        return self.state == "claimed" and not process_alive(self.by)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Notice:
        return cls(**data)


def event_id(job_id: str, key: str) -> str:
    """The event's id, the same for every try: ``CLUSTERRUN_EVENT_ID``."""
    return f"{job_id}:{key}"


def hung(attempt: int, since: float) -> Due:
    """The event of the job hung since ``since``: one per hang (a job may hang again later)."""
    return Due(f"{attempt}:hung:{since:.0f}", "hung", attempt)


def notices(record: JobRecord) -> dict[str, Notice]:
    return {key: Notice.from_json(value) for key, value in record.notices.items()}


def _open(record: JobRecord, d: Due) -> bool:
    """Whether event ``d`` is still to be sent: never claimed, or its sender died with it."""
    if d.key not in record.notified:
        return True
    notice = record.notices.get(d.key)  # none: claimed by a clusterrun before notices (taken as sent)
    return notice is not None and Notice.from_json(notice).orphaned


def due(record: JobRecord, also: Sequence[Due] = ()) -> list[Due]:
    """Every event the record shows (and those of ``also``) not sent yet, whatever ``notify.on`` says."""
    found = []
    for a in record.attempts:
        if a.attempt > 1:
            found.append(Due(f"{a.attempt}:restarted", "restarted", a.attempt))
        if str(a.state) in ("failed", "succeeded"):
            found.append(Due(f"{a.attempt}:{a.state}", str(a.state), a.attempt))
    found += [hung(record.attempt, since) for since in sorted({n.hung_since for n in record.nodes
                                                              if n.hung_since is not None})]
    return [d for d in {d.key: d for d in [*found, *also]}.values() if _open(record, d)]


def claim(store: JobStore, record: JobRecord, also: Sequence[Due] = ()) -> tuple[JobRecord, list[Due]]:
    """Claim, for this process, the due events of ``record`` (as on disk) that ``notify.on`` asks
    for: the record as written and the events this process must now send."""
    spec = Notify.from_json(record.notify)
    claimed: list[Due] = []
    if spec is None or not any(d.event in spec.on for d in due(record, also)):
        return record, claimed
    me = process_id()

    def change(rec: JobRecord) -> None:
        claimed.clear()
        for d in due(rec, also):
            if d.event not in spec.on:
                continue
            old = rec.notices.get(d.key)
            tries = Notice.from_json(old).tries if old is not None else 0
            if old is not None and tries >= TRIES:  # not retried forever
                rec.notices[d.key] = dict(old, state="failed", error=f"{tries} senders died while its command ran")
                continue
            if d.key not in rec.notified:
                rec.notified.append(d.key)
            rec.notices[d.key] = dataclasses.asdict(Notice(me, tries=tries + 1))
            claimed.append(d)

    return store.update(record.job_id, change), claimed


def send_due(store: JobStore, record: JobRecord, note: Callable[[str], None] | None = None, *,
             also: Sequence[Due] = ()) -> list[str]:
    """Claim and send the events of ``record`` (as on disk) that ``notify.on`` asks for, and those
    of ``also`` (an event the record may not show yet); their keys. ``note`` hears of a command
    that could not start or failed."""
    try:
        record, claimed = claim(store, record, also)
    except StateError as exc:
        if note is not None:
            note(f"notification not sent: {exc.render()}")
        return []
    for d in claimed:
        start(store, record, d, note)
    return [d.key for d in claimed]


def start(store: JobStore, record: JobRecord, event: Due, note: Callable[[str], None] | None = None) -> None:
    """Start the sender of ``event``, claimed by this process; a thread reports its failure through ``note``."""
    ident = event_id(record.job_id, event.key)
    env = dict(os.environ, CLUSTERRUN_JOB=record.job_id, CLUSTERRUN_EVENT=event.event, CLUSTERRUN_EVENT_ID=ident,
               CLUSTERRUN_STATE=str(record.state), CLUSTERRUN_ATTEMPT=str(event.attempt))
    swaps = next((a.replaced for a in record.attempts if a.attempt == event.attempt), None)
    if swaps and event.event == "restarted":  # the attempt runs on spares: `host=spare ...`
        env["CLUSTERRUN_REPLACED"] = " ".join(f"{old}={new}" for old, new in swaps.items())
    argv = [sys.executable, "-m", "clusterrun", "_notify", "--root", str(store.root), record.job_id, event.key,
            process_id()]
    claim_made = record.notices[event.key]["tries"]  # this claim: this process may claim the event again later
    try:
        with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: a command that never reads it cannot block us
            stdin.write(json.dumps(dict(record_json(record), event=event.event, event_id=ident)).encode())
            stdin.seek(0)
            proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                    start_new_session=True)
    except OSError as exc:
        _ended(store, record.job_id, event.key, process_id(), None, f"its sender could not start: {exc}")
        if note is not None:
            note(f"notify command for {event.event} could not start: {exc}")
        return

    def wait() -> None:
        try:
            _, err = proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            if note is not None:
                note(f"notify command for {event.event} still runs after {WAIT:.0f} s (sender pid {proc.pid})")
            _, err = proc.communicate()  # then its end, reaped: a monitor that lives for days keeps no zombies
        try:
            found = store.load(record.job_id).notices.get(event.key)
        except ClusterrunError:  # the job was removed meanwhile (`rm`), or its record cannot be read
            return
        notice = Notice.from_json(found) if found is not None else None
        if (notice is not None and notice.state == "claimed" and notice.by == process_id()
                and notice.tries == claim_made):  # its sender never took over
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            notice = _ended(store, record.job_id, event.key, notice.by, None,
                            f"its sender exited {proc.returncode}: {last[0]}".rstrip(": "))
        if note is not None and notice is not None and notice.state == "failed":
            note(f"notify command for {event.event} {failure_text(notice)}")

    threading.Thread(target=wait, name="clusterrun-notify", daemon=True).start()


def failure_text(notice: Notice) -> str:
    """How a failed notification ended: ``exited 7: <its last line of stderr>``, or why it was not sent."""
    how = f"exited {notice.code}" if notice.code is not None else "was not sent"
    return f"{how}: {notice.error}".rstrip(": ")


def _ended(store: JobStore, job_id: str, key: str, by: str, code: int | None, error: str) -> Notice | None:
    """Record the end of ``key``'s command, if ``by`` still holds the claim: the notice as written."""
    def change(rec: JobRecord) -> None:
        old = rec.notices.get(key)
        if old is not None and old["by"] == by:
            rec.notices[key] = dict(old, state="sent" if code == 0 else "failed", code=code, error=error)

    try:
        found = store.update(job_id, change).notices.get(key)
    except StateError:
        return None  # left claimed by a process that exits: the next one to look sends it again
    return Notice.from_json(found) if found is not None else None


def sender(store: JobStore, job_id: str, key: str, starter: str) -> int:
    """``clusterrun _notify``: take over the claim of ``key`` from ``starter`` (unless another
    process took it meanwhile), run the job's notify command with this process's stdin and
    environment, and record how it ended."""
    me = process_id()

    def take(rec: JobRecord) -> None:
        old = rec.notices.get(key)
        if old is not None and old["state"] == "claimed" and old["by"] == starter:
            rec.notices[key] = dict(old, by=me)

    record = store.update(job_id, take)
    spec = Notify.from_json(record.notify)
    if spec is None or record.notices.get(key, {}).get("by") != me:
        return 0  # somebody else sends it
    cwd = record.local_cwd if os.path.isdir(record.local_cwd) else None
    try:
        done = subprocess.run(["/bin/sh", "-c", spec.command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              cwd=cwd, check=False)
    except OSError as exc:
        _ended(store, job_id, key, me, None, f"could not start: {exc}")
        return 1
    last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    _ended(store, job_id, key, me, done.returncode, last[0] if done.returncode else "")
    return 0


__all__ = ["TRIES", "Due", "Notice", "claim", "due", "event_id", "failure_text", "hung", "notices", "send_due",
           "sender", "start"]
