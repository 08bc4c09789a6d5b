"""rsync's remote shell for a sync over the controller's own SSH connection (clusterrun.sync.copy).

rsync runs ``python -S rsh.py SOCKET HOST COMMAND...``: this sends COMMAND (the remote rsync's
argv, as one JSON line) to the controller listening on the Unix socket SOCKET, then copies its
stdin to the socket and the socket to its stdout until both ends are done. The controller runs
the command on the host over the SSH connection it already has open (``Transport.pipe``). Run
by path with ``-S``: nothing but the standard library, no site, no clusterrun import.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print("usage: rsh.py SOCKET HOST COMMAND...", file=sys.stderr)
        return 2
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(argv[1])
    peer.sendall(json.dumps(argv[3:]).encode() + b"\n")

    def upstream() -> None:
        try:
            while data := os.read(0, 1 << 18):
                peer.sendall(data)
            peer.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=upstream, daemon=True).start()
    while data := peer.recv(1 << 18):
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]
    return 0  # rsync reads the remote side's exit from its protocol; the controller has the status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
