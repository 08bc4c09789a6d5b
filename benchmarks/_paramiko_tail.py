"""The benchmarks' paramiko baseline (benchmarks/logs.py): one remote command per host, read the
way the best paramiko client would, to measure what paramiko itself costs beside OpenSSH.

    _paramiko_tail.py [--threads] [--switch-interval S] HOSTS_FILE COMMAND0 [COMMAND1 ...]
                                        COMMANDk runs on the hosts file's host k (``-``: nothing on that host)

One connection per host, made by clusterrun's SSH transport (its ssh_config resolution, keys,
known_hosts, ciphers, window and packet sizes) in threads, as clusterrun connects; then one
thread reads every channel through a selector on the channels' ``fileno()`` and writes each
complete line to stdout as it arrives (a host's lines never cut by another's). With --threads,
clusterrun's controller's shape without clusterrun: a thread per channel blocks in ``recv``,
keeps a host's complete lines and puts them on one bounded ``queue.Queue``, which the main thread
empties onto stdout (as each node's follower thread feeds the job's loop, run/follower.py);
--switch-interval sets ``sys.setswitchinterval`` (clusterrun's followers: 0.0005, cli/follow.py).
EOF on stdin sends EOF to every command (``tail ... & read _; kill $!`` then ends); the reader
ends when every channel has ended: exit 0 if every command exited 0, else 1. Its CPU time goes to
stderr, the whole process's and the reading threads' own (paramiko's transport threads: the rest).
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import selectors
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterrun.config.hostsfile import load_cluster  # noqa: E402
from clusterrun.transports.ssh import MAX_PACKET, SSHTransport  # noqa: E402
from clusterrun.transports.sshhosts import SSHOptions  # noqa: E402
from clusterrun.transports.sshlib import paramiko  # noqa: E402

STDIN = "stdin"
QUEUED = 256  # places in the threads' queue, as the job's inbox (run/inbox.py)
WRITTEN = [0]  # chunks written to stdout (one a host's complete lines): the CPU per chunk


def write_all(fd: int, data: bytes) -> None:
    WRITTEN[0] += 1
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def whole_lines(partial: bytes, data: bytes) -> tuple[bytes, bytes]:
    """The complete lines of ``partial`` + ``data`` (b"" if none yet), and what is left after them."""
    cut = data.rfind(b"\n") + 1
    return (partial + data[:cut], data[cut:]) if cut else (b"", partial + data)


def cpu() -> float:
    """The whole process's CPU seconds so far, every thread's."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def end_commands(channels: list[paramiko.Channel]) -> None:
    for channel in channels:
        if not channel.closed:
            channel.shutdown_write()


def read_selecting(channels: list[paramiko.Channel], out: int) -> dict[str, float]:
    """Every channel read by this thread through a selector; {thread: CPU seconds spent reading}."""
    main_began = time.thread_time()
    selector = selectors.DefaultSelector()
    for channel in channels:
        channel.settimeout(0.0)  # the selector says when; a recv never waits
        selector.register(channel.fileno(), selectors.EVENT_READ, channel)
    try:
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ, STDIN)
    except PermissionError:  # epoll refuses /dev/null and files: no stdin to wait for
        end_commands(channels)
    partial = {id(channel): b"" for channel in channels}
    open_count = len(channels)
    while open_count:
        for key, _ in selector.select():
            channel = key.data
            if channel is STDIN:
                if not os.read(key.fd, 4096):  # the benchmark closed our stdin: end the commands
                    selector.unregister(key.fd)
                    end_commands(channels)
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
            lines, partial[id(channel)] = whole_lines(partial[id(channel)], data)
            if lines:
                write_all(out, lines)
    return {"main": time.thread_time() - main_began}


def read_threaded(channels: list[paramiko.Channel], out: int) -> dict[str, float]:
    """A thread per channel blocking in ``recv`` puts complete lines on one queue; this thread
    writes them; {thread: CPU seconds spent reading}."""
    main_began = time.thread_time()
    inbox: queue.Queue[bytes | None] = queue.Queue(QUEUED)
    used: dict[str, float] = {}

    def reader(k: int, channel: paramiko.Channel) -> None:
        partial = b""
        try:
            while data := channel.recv(MAX_PACKET * 4):
                lines, partial = whole_lines(partial, data)
                if lines:
                    inbox.put(lines)
        finally:
            used[f"reader{k}"] = time.thread_time()
            inbox.put(None)

    def stdin_watch() -> None:  # EOF on stdin (or none at all: /dev/null) ends the commands
        while os.read(sys.stdin.fileno(), 4096):
            pass
        end_commands(channels)

    for channel in channels:
        channel.settimeout(None)  # block in recv, as a follower does
    threads = [threading.Thread(target=reader, args=(k, c), name=f"reader{k}", daemon=True)
               for k, c in enumerate(channels)]
    threading.Thread(target=stdin_watch, name="stdin", daemon=True).start()
    for thread in threads:
        thread.start()
    open_count = len(channels)
    while open_count:
        chunk = inbox.get()
        if chunk is None:
            open_count -= 1
        else:
            write_all(out, chunk)
    for thread in threads:
        thread.join()
    for channel in channels:
        while channel.recv_stderr_ready():  # nothing expected there
            sys.stderr.buffer.write(channel.recv_stderr(65536))
    return {"main": time.thread_time() - main_began, "readers": sum(used.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", action="store_true", help="a reader thread per channel and a queue")
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval(S) before reading")
    parser.add_argument("hosts")
    parser.add_argument("commands", nargs="+")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    spec = load_cluster(args.hosts)
    pairs = [(host, command) for host, command in zip(spec.hosts, args.commands, strict=False) if command != "-"]
    commands = [command for _, command in pairs]
    transports = [SSHTransport(host, SSHOptions(ssh_config=spec.ssh_config)) for host, _ in pairs]

    def open_channel(k: int) -> paramiko.Channel:
        # The transport's own channel (its window and packet sizes, its connection made as for a
        # job); nothing public hands one out for an arbitrary command.
        return transports[k]._channel(commands[k])[1]

    try:
        with ThreadPoolExecutor(len(commands)) as pool:
            channels = list(pool.map(open_channel, range(len(commands))))
        began, before = time.monotonic(), cpu()
        threads = (read_threaded if args.threads else read_selecting)(channels, sys.stdout.fileno())
        codes = [channel.recv_exit_status() for channel in channels]
        used = resource.getrusage(resource.RUSAGE_SELF)  # every thread's, paramiko's included
        reading = cpu() - before
        split = ", ".join(f"{name} {seconds:.2f}" for name, seconds in threads.items())
        print(f"_paramiko_tail.py: cpu {used.ru_utime + used.ru_stime:.2f} s (user {used.ru_utime:.2f}, "
              f"sys {used.ru_stime:.2f}); {reading:.2f} s of it reading ({split}, paramiko's transport threads "
              f"{reading - sum(threads.values()):.2f}), {WRITTEN[0]} chunks written, "
              f"{time.monotonic() - began:.1f} s after the channels opened",
              file=sys.stderr, flush=True)
        if any(codes):
            print(f"_paramiko_tail.py: exit statuses {codes}", file=sys.stderr)
        return 1 if any(codes) else 0
    finally:
        for transport in transports:
            transport.close()


if __name__ == "__main__":
    sys.exit(main())
