"""Notifications: the job's ``notify`` command, run on this controller once per event.

The events are read off the job's record, never off a process's memory: an attempt that ended
``failed`` or ``succeeded``, an attempt after the first (``restarted``), a node recorded hung
(``hung``, once per hang). ``send_due`` runs the command for every event of ``notify.on`` the
record shows and ``JobRecord.notified`` does not list, and is called by whoever brings the record
up to date: the job's owner (the foreground ``up`` or its monitor, ``runner.Runner``) and a
command that reconciles a job nobody owned (``attempt.refresh``). So a controller SIGKILLed
before it could notify leaves the event to the next owner.

Each event is claimed in the record (under its lock) before its command starts: it is sent **at
most once**, and exactly once unless the process dies between the claim and the start of the
command (a window of a fork); a command that fails is reported, not retried. The command gets
``CLUSTERRUN_JOB``, ``CLUSTERRUN_EVENT``, ``CLUSTERRUN_STATE`` (and ``CLUSTERRUN_ATTEMPT``,
``CLUSTERRUN_NODE`` for ``hung``) in its environment and the job's ``ps --json`` entry on stdin;
it runs through ``/bin/sh -c`` in the job's directory, in a session of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clusterrun.errors import StateError
from clusterrun.joblist import job_json
from clusterrun.jobs import JobRecord, JobStore
from clusterrun.watch import Notify

WAIT = 60.0  # seconds a command may run before it is reported as still running (it is not killed)


@dataclass(frozen=True)
class Due:
    """One event the record shows: its ``key`` in ``JobRecord.notified``, its name, where."""

    key: str
    event: str
    attempt: int
    node: int | None = None


def hung(attempt: int, node: int, since: float) -> Due:
    """The event of node ``node`` hung since ``since``: one per hang (a node may hang again later)."""
    return Due(f"{attempt}:hung:{node}:{since:.0f}", "hung", attempt, node)


def due(record: JobRecord) -> list[Due]:
    """Every event the record shows that was not sent yet (whatever ``notify.on`` says)."""
    found = []
    for a in record.attempts:
        if a.attempt > 1:
            found.append(Due(f"{a.attempt}:restarted", "restarted", a.attempt))
        if str(a.state) in ("failed", "succeeded"):
            found.append(Due(f"{a.attempt}:{a.state}", str(a.state), a.attempt))
    found += [hung(record.attempt, n.rank, n.hung_since) for n in record.nodes if n.hung_since is not None]
    return [d for d in found if d.key not in record.notified]


def send_due(store: JobStore, record: JobRecord, note: Callable[[str], None] | None = None, *,
             also: Sequence[Due] = ()) -> list[str]:
    """Claim and send the events of ``record`` (as on disk) that ``notify.on`` asks for, and those
    of ``also`` (an event the record may not show yet); their keys. ``note`` hears of a command
    that could not start or failed."""
    spec = Notify.from_json(record.notify)
    if spec is None or not any(d.event in spec.on for d in [*due(record), *also]):
        return []
    claimed: list[Due] = []

    def claim(rec: JobRecord) -> None:
        claimed.clear()
        for d in {d.key: d for d in [*due(rec), *also] if d.key not in rec.notified}.values():
            if d.event in spec.on:
                rec.notified.append(d.key)
                claimed.append(d)

    try:
        record = store.update(record.job_id, claim)
    except StateError as exc:
        if note is not None:
            note(f"notification not sent: {exc.render()}")
        return []
    for d in claimed:
        run(spec.command, record, d, note)
    return [d.key for d in claimed]


def run(command: str, record: JobRecord, event: Due, note: Callable[[str], None] | None = None) -> None:
    """Start ``command`` for ``event``; a thread reports its failure through ``note``."""
    env = dict(os.environ, CLUSTERRUN_JOB=record.job_id, CLUSTERRUN_EVENT=event.event,
               CLUSTERRUN_STATE=str(record.state), CLUSTERRUN_ATTEMPT=str(event.attempt))
    if event.node is not None:
        env["CLUSTERRUN_NODE"] = str(event.node)
    cwd = record.local_cwd if os.path.isdir(record.local_cwd) else None
    try:
        with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: a command that never reads it cannot block us
            stdin.write(json.dumps(dict(job_json(record), event=event.event)).encode())
            stdin.seek(0)
            proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=stdin, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    except OSError as exc:
        if note is not None:
            note(f"notify command for {event.event} could not start: {exc}")
        return

    def wait() -> None:
        try:
            _, err = proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            if note is not None:
                note(f"notify command for {event.event} still runs after {WAIT:.0f} s (pid {proc.pid})")
            return
        if proc.returncode and note is not None:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            note(f"notify command for {event.event} exited {proc.returncode}: {last[0]}".rstrip(": "))

    threading.Thread(target=wait, name="clusterrun-notify", daemon=True).start()


__all__ = ["Due", "due", "hung", "run", "send_due"]
