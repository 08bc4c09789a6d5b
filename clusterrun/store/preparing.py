"""Jobs that ``up`` is still checking: connecting, syncing, running the hosts' ``setup:``, the
preflight. Such a job has no record yet (a refused start records nothing), so ``up`` leaves a note
here that ``ps`` lists while that ``up`` lives: which job, and what it said last ("node 3 (gpu04):
setup runs for 45 s ...").

Lifecycle: ``Preparing(job_id, name, hosts)`` (written) → ``say(text)`` any number of times →
``close()`` (removed: the record takes over, or nothing started). A note whose ``up`` died is
removed by the next ``live()``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from clusterrun.core.errors import StateError
from clusterrun.core.frozen import frozen
from clusterrun.store.jobs import private_dirs, process_alive, process_id, state_home, write_atomic


def folder() -> Path:
    return state_home() / "preparing"


@frozen
class Entry:
    job_id: str
    name: str
    hosts: tuple[str, ...]
    since: float  # wall clock: when up began its checks
    said: str  # what up said last ("connecting to the hosts and checking them" at first)


class Preparing:
    """``up``'s note of the job it is checking (0600 in a 0700 folder, written whole); never fatal:
    a note that cannot be written only leaves ``ps`` without it."""

    def __init__(self, job_id: str, name: str, hosts: list[str]) -> None:
        self.path = folder() / f"{job_id}.json"
        self.data = {"job_id": job_id, "name": name, "hosts": hosts, "since": time.time(),
                     "said": "connecting to the hosts and checking them", "owner": process_id()}
        self._write()

    def say(self, text: str) -> None:
        self.data["said"] = text
        self._write()

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass

    def _write(self) -> None:
        try:
            private_dirs(self.path.parent)
            write_atomic(self.path, json.dumps(self.data).encode())
        except (OSError, StateError):
            pass


def live() -> list[Entry]:
    """The jobs being checked by an ``up`` that still runs, oldest first; notes of dead ones removed."""
    found = []
    try:
        paths = sorted(folder().glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            owner = str(data["owner"])
            entry = Entry(str(data["job_id"]), str(data["name"]), tuple(map(str, data["hosts"])),
                          float(data["since"]), str(data["said"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours to judge
        if not process_alive(owner):
            try:
                path.unlink()
            except OSError:
                pass
            continue
        found.append(entry)
    return sorted(found, key=lambda e: e.since)


__all__ = ["Entry", "Preparing", "live"]
