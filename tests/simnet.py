"""The simulated hosts' plumbing (tests/simhosts.py): ``ip`` and its namespaces, free subnets and
ports, processes read from /proc, host keys, sshd's version. Each is a small wrapper over one tool."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

PREFIX = "crsim"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
IP = shutil.which("ip") or "/usr/sbin/ip"


class SimHostError(RuntimeError):
    """A simulated host could not be set up or torn down; the message says which and shows its log."""


def _ip_batch(lines: list[str], force: bool = False) -> None:
    argv = [IP, *(["-force"] if force else []), "-batch", "-"]
    done = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, check=False)
    if done.returncode != 0 and not force:
        raise SimHostError(f"ip -batch failed: {done.stderr.strip()}")


def _ip_json(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run([IP, "-j", *args, "show"], capture_output=True, text=True, check=False).stdout
    return json.loads(out or "[]")  # type: ignore[no-any-return]


def _netns_names() -> set[str]:
    return {netns["name"] for netns in _ip_json("netns")}


def _free_subnet(prefix: str = "10.77") -> int:
    """The first k whose ``prefix``.k.0/24 overlaps no address or route of the root namespace."""
    used = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for link in _ip_json("-4", "addr") for a in link.get("addr_info", [])]
    used += [ipaddress.ip_network(r["dst"], strict=False) for r in _ip_json("-4", "route") if r["dst"] != "default"]
    for k in range(1, 255):
        if not any(ipaddress.ip_network(f"{prefix}.{k}.0/24").overlaps(net) for net in used):
            return k
    raise SimHostError(f"no free /24 left in {prefix}.0.0/16")


def children() -> dict[int, list[int]]:
    """Parent pid → child pids, from /proc/*/stat (this kernel has no /proc/PID/task/TID/children)."""
    found: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            ppid = int(proc_bytes(f"/proc/{entry}/stat").rsplit(b")", 1)[1].split()[1])
            found.setdefault(ppid, []).append(int(entry))
    return found


def proc_bytes(path: str) -> bytes:
    """A /proc file's bytes, read with the os module's calls: a test may have patched ``open`` while
    the leak check (tests/leaks.py) looks at its children."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _passwd(home: Path, shell: str | None) -> str:
    """/etc/passwd with the current user's home (and shell, if given) replaced."""
    lines = []
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[2] == str(os.getuid()):
            fields[5] = str(home)
            fields[6] = shell or fields[6]
        lines.append(":".join(fields) + "\n")
    return "".join(lines)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _listening(pid: int, port: int) -> bool:
    """True if a TCP socket listens on ``port`` in the network namespace of process ``pid``."""
    try:
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(f[1].endswith(f":{port:04X}") and f[3] == "0A" for f in map(str.split, table))


def _keygen(paths: list[Path]) -> None:
    """Generate an ed25519 key pair at each path, all at once."""
    argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", PREFIX, "-f"]
    running = [subprocess.Popen([*argv, str(path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for path in paths]
    errors = [proc.communicate()[1].strip() for proc in running]
    if any(proc.returncode for proc in running):
        raise SimHostError(f"ssh-keygen failed: {[error for error in errors if error]}")


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


@functools.cache
def _sshd_version() -> tuple[int, int]:
    out = subprocess.run([SSHD, "-V"], capture_output=True, text=True, check=False).stderr
    found = re.search(r"OpenSSH_(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0, 0)
