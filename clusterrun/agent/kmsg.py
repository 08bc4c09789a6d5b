"""The kernel's OOM kills and hardware errors: /dev/kmsg records parsed, and ``KernelLog``, read by the supervisor."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


KMSG = "/dev/kmsg"


KMSG_RECORD = 8192  # a read of /dev/kmsg returns one whole record; a shorter buffer fails (EINVAL)


KMSG_DRAIN = 10000  # records read at most per drain (a kernel flooding its log does not hold the supervisor)


OOM_KILLS_KEPT = 16  # the newest OOM kills kept (of any process: which are the job's is decided later)


INIT_PID_NS = "pid:[4026531836]"  # PROC_PID_INIT_INO: the host's own PID namespace, whose PIDs the kernel logs


def kmsg_text(record: bytes) -> str | None:
    """The message of one /dev/kmsg record if the kernel wrote it, else None.

    A record is ``PRIO,SEQ,USEC,FLAGS;TEXT`` and a newline, then continuation lines `` KEY=VALUE``.
    PRIO's facility (``PRIO >> 3``) is 0 for the kernel's own messages only: what a process
    writes to /dev/kmsg gets LOG_USER or its own, so it cannot pass for an OOM kill."""
    head, sep, rest = record.partition(b";")
    prio = head.split(b",", 1)[0]
    if not sep or not prio.isdigit() or int(prio) >> 3 != 0:
        return None
    return rest.split(b"\n", 1)[0].decode("utf-8", "replace")


def oom_kill_of(text: str) -> dict[str, Any] | None:
    """What one of the kernel's OOM lines says of its victim, None for any other line.

    ``Out of memory: Killed process PID (COMM) total-vm:...`` (``Memory cgroup out of memory: ...``
    when a cgroup's limit was reached; ``Killed process PID (COMM) ...`` alone before Linux 5.1)
    gives ``{pid, comm, line}``; ``oom-kill:constraint=C,...,oom_memcg=M,task_memcg=T,task=COMM,pid=PID,uid=U``
    gives ``{pid, comm, summary, constraint, oom_memcg, task_memcg}`` (``summary``: the line)."""
    if text.startswith("oom-kill:"):
        body = text[len("oom-kill:"):]
        pid_at = body.rfind(",pid=")
        task_at = body.rfind("task=", 0, pid_at)
        pid = body[pid_at + 5:].split(",", 1)[0]
        if pid_at < 0 or task_at < 0 or not pid.isdigit():
            return None
        found: dict[str, Any] = {"pid": int(pid), "comm": body[task_at + 5:pid_at], "summary": text}
        for item in body[:task_at].split(","):
            key, _, value = item.partition("=")
            if key in ("constraint", "oom_memcg", "task_memcg"):
                found[key] = value
        return found
    at = text.find("Killed process ")
    if at < 0 or (at > 0 and not (text[:at].endswith(": ") and "out of memory" in text[:at].lower())):
        return None
    pid, _, after = text[at + len("Killed process "):].partition(" ")
    if not pid.isdigit():
        return None
    end = after.find(") total-vm:")
    end = end if end >= 0 else after.rfind(")")
    return {"pid": int(pid), "comm": after[1:end] if after.startswith("(") and end > 0 else "", "line": text}


# The Xids of a GPU or its board (ECC, row remapping, NVLink, fallen off the bus, GSP), not of a
# program (13, 31, 43: an exception or a bad address of the job's own): NVIDIA's Xid catalogue.
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
HARDWARE_LINES_KEPT = 8


def hardware_error_of(text: str) -> str | None:
    """The line if it is the kernel's word of a failing machine: a GPU's hardware Xid
    (``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``), a machine check
    (``mce: [Hardware Error]: ...``) or an uncorrectable memory error (``EDAC MC0: 1 UE ...``)."""
    at = text.find("NVRM: Xid (")
    if at >= 0:
        number = text[at:].partition("): ")[2].split(",", 1)[0].strip()
        return text if number.isdigit() and int(number) in HARDWARE_XIDS else None
    if "[Hardware Error]" in text:
        return text
    edac = text.find("EDAC MC")
    return text if edac >= 0 and " UE " in text[edac:] else None


def kmsg_problem(path: str, exc: OSError) -> str:
    """Why the kernel's log cannot be read, in words, with what reading it needs."""
    why = f"{path}: {os.strerror(exc.errno or 0)}"
    if exc.errno in (1, 13):  # EPERM, EACCES
        try:
            with open("/proc/sys/kernel/dmesg_restrict", "rb") as f:
                restrict = f.read().decode().strip()
        except OSError:
            restrict = "?"
        why += f" (kernel.dmesg_restrict = {restrict}: reading it needs root or CAP_SYSLOG)"
    return why


def cgroup_oom_kills(cgroup: str) -> tuple[int | None, str | None]:
    """``oom_kill`` of the cgroup's ``memory.events`` (how many processes in it or below any OOM
    killer killed), or None and why it cannot be read (the memory controller not enabled there)."""
    path = os.path.join(cgroup, "memory.events")
    try:
        with open(path, "rb") as f:
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None, (f"{path} does not exist: the memory controller is not enabled for that cgroup (it is not "
                      "in cgroup.subtree_control above it, or is bound to a cgroup v1 hierarchy)")
    except OSError as exc:
        return None, f"{path}: {os.strerror(exc.errno or 0)}"
    for line in data.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value), None
    return None, f"{path} has no oom_kill line"


class KernelLog:
    """The kernel's OOM kills from the moment it was opened on: create → drain() ... → report() → close().

    Reads /dev/kmsg without blocking, from its end when opened (``SEEK_END``): each read returns
    one record, EAGAIN when none is left, EPIPE when records were overwritten in the kernel's
    ring buffer before they were read (the next read goes on with the oldest left). Reading needs
    root or CAP_SYSLOG where ``kernel.dmesg_restrict`` is 1: ``error`` then says so."""

    def __init__(self, path: str = KMSG) -> None:
        self.path, self.fd = path, -1
        self.error: str | None = None
        self.overwritten = False
        self.kills: dict[int, dict[str, Any]] = {}  # pid → what the kernel's lines said of it, oldest first
        self.keep: set[int] = set()  # the job's PIDs known so far: their kills are the last to be dropped
        self.hardware: list[str] = []  # the newest lines of a failing machine (``hardware_error_of``)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError as exc:
            self.error = kmsg_problem(path, exc)
            self.close()

    def drain(self) -> None:
        """Read every record written since the last drain."""
        for _ in range(KMSG_DRAIN):
            if self.fd < 0:
                return
            try:
                record = os.read(self.fd, KMSG_RECORD)
            except BlockingIOError:
                return
            except BrokenPipeError:
                self.overwritten = True
                continue
            except OSError as exc:
                self.error = kmsg_problem(self.path, exc)
                self.close()
                return
            if not record:
                return
            self.feed(record)

    def feed(self, record: bytes) -> None:
        text = kmsg_text(record)
        if text is not None and hardware_error_of(text) is not None:
            self.hardware = [*self.hardware, text][-HARDWARE_LINES_KEPT:]
        found = oom_kill_of(text) if text is not None else None
        if found is None:
            return
        entry = self.kills.pop(found["pid"], {})  # both lines of one kill make one entry, the newest
        entry.update(found)
        self.kills[found["pid"]] = entry
        while len(self.kills) > OOM_KILLS_KEPT:
            others = [pid for pid in self.kills if pid not in self.keep]
            del self.kills[others[0] if others else next(iter(self.kills))]

    def report(self, cgroup: str | None) -> dict[str, Any]:
        """``state.json``'s ``oom``: the OOM kills since it was opened and the cgroup's count."""
        self.drain()
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = INIT_PID_NS
        kills, cgroup_error = (cgroup_oom_kills(cgroup) if cgroup else
                               (None, "no cgroup of its own for this attempt"))
        return {"kmsg": self.path, "kmsg_error": self.error, "overwritten": self.overwritten,
                "kills": list(self.kills.values()), "pid_namespace": pid_ns != INIT_PID_NS,
                "cgroup_events": os.path.join(cgroup, "memory.events") if cgroup else None,
                "cgroup_oom_kills": kills, "cgroup_error": cgroup_error, "hardware": list(self.hardware)}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
