"""What carries a sync's bytes to a host (``carrier()``), and rsync's way there over SSH (``RemotePipe``).

The agent's ``sync_put``, unless the host holds other versions of enough of the files (``DELTA_MIN``)
and both ends have rsync: then this machine's rsync (to an SSH host through ``rsh.py`` and a command
channel on the connection already open). SFTP is no carrier: slower than the agent in every case
measured (docs/benchmarks.md, Sync).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading

from clusterrun.transports import Transport

SAFE_WORD = re.compile(r"[A-Za-z0-9_.,:=/+-]+")  # a word that every login shell passes unchanged
# rsync only where the host holds other versions of this many bytes of the files to send: its delta
# then spares more than it costs to start (about what sending 2.5 MB whole costs). 4 hosts
# (docs/benchmarks.md, Sync): one small file 0.22-0.23 s by the agent, 0.34-0.35 by rsync; 4 KB
# changed in a 10 MB file 0.60-0.66 and 0.37-0.39; a whole tree alike, the agent with less CPU.
DELTA_MIN = 4 * 2**20
# rsync's exit codes that have a fix to name (its man page, EXIT VALUES)
RSYNC_CODES = {
    11: "the host's disk may be full or the workdir not writable: check `df` and the permissions there",
    12: "the connection or the host's rsync ended early: see its message; `clusterrun doctor` checks the host",
    23: "some files could not be written: see rsync's message",
    24: "a file vanished while it was being copied: run again once the directory is still",
}


def carrier(files: str | None, local_rsync: str | None, remote_rsync: str | None, revised: int) -> str:
    """What carries the files' data to a host whose transport reaches its files ``files``
    (``Transport.files``), where it holds other versions of ``revised`` bytes of them: ``rsync``
    where ``revised`` reaches ``DELTA_MIN`` and both ends have it (a local host: this machine's rsync
    alone), else the agent's ``sync_put``. A host's rsync whose path a login shell could misread
    (spaces, quotes) is not used."""
    if revised < DELTA_MIN:
        return "agent"
    if files == "local":
        return "rsync" if local_rsync else "agent"
    if files == "ssh":
        return "rsync" if local_rsync and remote_rsync and SAFE_WORD.fullmatch(remote_rsync) else "agent"
    return "agent"


def local_rsync() -> str | None:
    return shutil.which("rsync")


class RemotePipe:
    """The controller's end of ``rsh.py``: a Unix socket on which rsync's remote shell asks for
    one command, the remote rsync's, which runs on the host over ``transport.pipe``."""

    def __init__(self, transport: Transport, path: str, rsync: str) -> None:
        self.transport = transport
        self.path = path
        self.rsync = rsync
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.listener.settimeout(0.2)
        self._result: tuple[int, str] = (-1, "rsync never started its remote shell")
        self._thread: threading.Thread | None = None

    def serve(self, proc: subprocess.Popen[bytes]) -> None:
        """Answer rsync's one connection in a thread, until rsync (``proc``) ends."""
        def run() -> None:
            try:
                while proc.poll() is None:
                    try:
                        conn, _ = self.listener.accept()
                    except TimeoutError:
                        continue
                    with conn:
                        conn.settimeout(None)
                        self._result = self._one(conn)
                    return
            finally:
                self.listener.close()

        self._thread = threading.Thread(target=run, daemon=True, name=f"rsync-{self.transport.name}")
        self._thread.start()

    def _one(self, conn: socket.socket) -> tuple[int, str]:
        line = b""
        while not line.endswith(b"\n") and len(line) < 65536:
            piece = conn.recv(1)  # byte by byte: what follows the line is rsync's protocol
            if not piece:
                return -1, "rsync's remote shell sent no command"
            line += piece
        try:
            words = json.loads(line)
        except ValueError:
            words = None
        # Only the remote rsync's server, its words safe in any login shell (fish, tcsh): with
        # --protect-args the paths travel inside rsync's protocol, not on this command line.
        if (not isinstance(words, list) or len(words) < 2 or words[:2] != [self.rsync, "--server"]
                or not all(isinstance(w, str) and SAFE_WORD.fullmatch(w) for w in words)):
            return -1, f"refused to run {str(words)[:200]} for rsync"
        return self.transport.pipe(" ".join(words), conn)

    def result(self) -> tuple[int, str]:
        """The remote command's exit status (-1: none) and the end of its stderr."""
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self._result


__all__ = ["RSYNC_CODES", "SAFE_WORD", "RemotePipe", "carrier", "local_rsync"]
