"""The benchmarks' paramiko baseline (benchmarks/logs.py): one remote command per host, read the
way the best paramiko client would, to measure what paramiko itself costs beside OpenSSH.

    _paramiko_tail.py HOSTS_FILE COMMAND0 [COMMAND1 ...]   COMMANDk runs on the hosts file's host k
                                                          (``-``: nothing on that host)

One connection per host, made by clusterrun's SSH transport (its ssh_config resolution, keys,
known_hosts, ciphers, window and packet sizes) in threads, as clusterrun connects; then one
thread reads every channel through a selector on the channels' ``fileno()`` and writes each
complete line to stdout as it arrives (a host's lines never cut by another's). EOF on stdin sends
EOF to every command (``tail ... & read _; kill $!`` then ends); the reader ends when every
channel has ended: exit 0 if every command exited 0, else 1. Its CPU time goes to stderr.
"""

from __future__ import annotations

import os
import resource
import selectors
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterrun.config.hostsfile import load_cluster  # noqa: E402
from clusterrun.transports.ssh import MAX_PACKET, SSHTransport  # noqa: E402
from clusterrun.transports.sshhosts import SSHOptions  # noqa: E402
from clusterrun.transports.sshlib import paramiko  # noqa: E402

STDIN = "stdin"


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main() -> int:
    spec = load_cluster(sys.argv[1])
    pairs = [(host, command) for host, command in zip(spec.hosts, sys.argv[2:], strict=False) if command != "-"]
    commands = [command for _, command in pairs]
    transports = [SSHTransport(host, SSHOptions(ssh_config=spec.ssh_config)) for host, _ in pairs]

    def open_channel(k: int) -> paramiko.Channel:
        # The transport's own channel (its window and packet sizes, its connection made as for a
        # job); nothing public hands one out for an arbitrary command.
        return transports[k]._channel(commands[k])[1]

    try:
        with ThreadPoolExecutor(len(commands)) as pool:
            channels = list(pool.map(open_channel, range(len(commands))))
        began = time.monotonic()
        selector = selectors.DefaultSelector()
        for channel in channels:
            channel.settimeout(0.0)  # the selector says when; a recv never waits
            selector.register(channel.fileno(), selectors.EVENT_READ, channel)
        try:
            selector.register(sys.stdin.fileno(), selectors.EVENT_READ, STDIN)
        except PermissionError:  # epoll refuses /dev/null and files: no stdin to wait for
            for channel in channels:
                channel.shutdown_write()
        partial = {id(channel): b"" for channel in channels}
        out = sys.stdout.fileno()
        open_count = len(channels)
        while open_count:
            for key, _ in selector.select():
                channel = key.data
                if channel is STDIN:
                    if not os.read(key.fd, 4096):  # the benchmark closed our stdin: end the commands
                        selector.unregister(key.fd)
                        for each in channels:
                            if not each.closed:
                                each.shutdown_write()
                    continue
                while channel.recv_stderr_ready():  # stderr also wakes the fileno; nothing expected there
                    sys.stderr.buffer.write(channel.recv_stderr(65536))
                try:
                    data = channel.recv(MAX_PACKET * 4)
                except TimeoutError:
                    continue
                if not data:
                    selector.unregister(key.fd)
                    open_count -= 1
                    continue
                cut = data.rfind(b"\n") + 1
                if cut:
                    write_all(out, partial[id(channel)] + data[:cut])
                    partial[id(channel)] = data[cut:]
                else:
                    partial[id(channel)] += data
        codes = [channel.recv_exit_status() for channel in channels]
        used = resource.getrusage(resource.RUSAGE_SELF)  # every thread's, paramiko's included
        print(f"_paramiko_tail.py: cpu {used.ru_utime + used.ru_stime:.2f} s (user {used.ru_utime:.2f}, "
              f"sys {used.ru_stime:.2f}), {time.monotonic() - began:.1f} s after the channels opened",
              file=sys.stderr, flush=True)
        if any(codes):
            print(f"_paramiko_tail.py: exit statuses {codes}", file=sys.stderr)
        return 1 if any(codes) else 0
    finally:
        for transport in transports:
            transport.close()


if __name__ == "__main__":
    sys.exit(main())
