"""A stdlib stand-in for torchrun (``python -m torch.distributed.run``), for the tests that need its process
tree but not torch: the same processes, files and exit status, without its 2 s of importing torch per node.

What clusterrun relies on, as torchrun does it (torch/distributed/elastic): the static rendezvous (node 0
listens on the master port, every node tells it its ``--nproc-per-node``, each learns its first global rank);
``--nproc-per-node`` workers, each in a session of its own, with RANK, LOCAL_RANK, WORLD_SIZE, ... and its
stdout and stderr in ``$PET_LOG_DIR/<run id>/attempt_0/<local rank>/std{out,err}.log`` with ``--redirects=3``
(else torchrun's own stdout and stderr), with ``--tee=3`` also copied to those, each line tagged
(``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``);
SIGTERM, SIGINT and SIGQUIT sent on to every worker's process group, SIGKILL after ``--shutdown-timeout``;
the first worker to fail stops the others, and its failure report (``rank : N (local_rank: M)``,
``exitcode : X (pid: P)``) goes to stderr. Exit status 0 when every worker succeeded, else 1.

Used through ``fake_python`` (``tests/conftest.py``): an interpreter that runs this for ``-m
torch.distributed.run`` and is the real one for everything else (the agent, the scripts).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

MONITOR_INTERVAL = 0.1

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's ``--name=value`` options, and the script with its arguments (one ``--`` after it dropped)."""
    options: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            script_args = argv[i + 1:]
            return options, [arg, *(script_args[1:] if script_args[:1] == ["--"] else script_args)]
        name, _, value = arg[2:].partition("=")
        options[name.replace("_", "-")] = value
    sys.exit("fake_torchrun: no script given")


def rendezvous(addr: str, port: int, nnodes: int, node_rank: int, nproc: int) -> tuple[list[int], object]:
    """Every node's nproc, by node rank: node 0 collects them on ``port``, the others ask it. Node 0 keeps
    the port (returned) for the job's life, as torchrun's TCPStore does: no other job is handed it meanwhile."""
    if node_rank == 0:
        server = socket.create_server(("", port))
        own = socket.create_connection(("127.0.0.1", port))  # torchrun's TCPStore master is its own client too
        own.sendall(f"0 {nproc}\n".encode())
        nprocs, peers = {}, []
        while len(nprocs) < nnodes:
            peer, _ = server.accept()
            rank, n = map(int, peer.makefile().readline().split())
            nprocs[rank] = n
            peers.append(peer)
        answer = (" ".join(str(nprocs[r]) for r in range(nnodes)) + "\n").encode()
        for peer in peers:
            with peer:
                peer.sendall(answer)
        return [nprocs[r] for r in range(nnodes)], (server, own)
    while True:  # node 0 may not listen yet, as torchrun's TCPStore client retries
        try:
            with socket.create_connection((addr, port), timeout=5) as conn:
                conn.settimeout(None)
                conn.sendall(f"{node_rank} {nproc}\n".encode())
                return [int(n) for n in conn.makefile().readline().split()], None
        except (TimeoutError, ConnectionRefusedError, ValueError):
            time.sleep(0.1)


def line_prefix(rank: int, local: int) -> str:
    """``--tee``'s tag of a worker's lines: ``$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` filled in, as torchrun does."""
    template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if not template:
        return f"[default{local}]:"
    filled = template.replace("${rank}", str(rank)).replace("${local_rank}", str(local))
    return filled.replace("${role_name}", "default")


def tee(stream: IO[bytes], path: str, tag: bytes, dst: IO[bytes]) -> None:
    """A worker's stream into its log file, and each whole line tagged to ``dst`` (``--tee``)."""
    with stream, open(path, "wb") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            dst.write(tag + line)
            dst.flush()


def main() -> int:
    options, (script, *script_args) = parse(sys.argv[1:])
    nnodes, nproc = int(options.get("nnodes", "1")), int(options.get("nproc-per-node", "1"))
    node_rank, grace = int(options.get("node-rank", "0")), int(options.get("shutdown-timeout", "30"))
    addr, port = options.get("master-addr", "127.0.0.1"), int(options.get("master-port", "29500"))
    interval = float(options.get("monitor-interval", MONITOR_INTERVAL))
    workers: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}  # pid → local rank, process
    signalled: list[int] = []  # stopped by a signal: torchrun raises SignalException, no failure report

    def kill_all(sig: int) -> None:
        for _, proc in workers.values():
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def on_signal(signum: int, frame: object) -> None:
        if not workers:
            sys.exit(1)  # still in the rendezvous: nothing started
        print(f"fake_torchrun: received {signal.Signals(signum).name}, stopping the workers", file=sys.stderr)
        signalled.append(signum)
        kill_all(signum)
        signal.alarm(grace)

    for sig in HANDLED:
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGALRM, lambda *_: kill_all(signal.SIGKILL))
    nprocs, _store = rendezvous(addr, port, nnodes, node_rank, nproc)
    spawn_gate = os.environ.get("FAKE_TORCHRUN_SPAWN_GATE")  # a test's: the workers start once this file exists
    while spawn_gate and not os.path.exists(spawn_gate):
        time.sleep(0.02)
    first, world = sum(nprocs[:node_rank]), sum(nprocs)
    # torchrun's --log-dir, else $PET_LOG_DIR, else a new /tmp/torchelastic_* that nobody removes
    log_root = options.get("log-dir") or os.environ.get("PET_LOG_DIR") or tempfile.mkdtemp(prefix="torchelastic_")
    os.makedirs(log_root, exist_ok=True)  # torchrun makes a missing --log-dir
    run_id = options.get("rdzv-id") or "none"
    run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=log_root)
    tees: list[threading.Thread] = []
    for local in range(nproc):
        folder = os.path.join(run_dir, "attempt_0", str(local))
        os.makedirs(folder)
        env = {**os.environ, "RANK": str(first + local), "LOCAL_RANK": str(local), "GROUP_RANK": str(node_rank),
               "ROLE_RANK": str(first + local), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc),
               "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
        command = [script, *script_args] if "no-python" in options else [sys.executable, "-u", script, *script_args]
        if options.get("redirects") == "3" and options.get("tee") == "3":  # the files, and tagged lines on our own
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            tag = line_prefix(first + local, local).encode()
            for stream, name, dst in ((proc.stdout, "stdout", sys.stdout.buffer), (proc.stderr, "stderr",
                                                                                   sys.stderr.buffer)):
                tees.append(threading.Thread(target=tee, args=(stream, os.path.join(folder, f"{name}.log"), tag, dst)))
                tees[-1].start()
        elif options.get("redirects") == "3":
            out, err = (open(os.path.join(folder, f"{name}.log"), "wb") for name in ("stdout", "stderr"))
            with out, err:
                proc = subprocess.Popen(command, env=env, stdout=out,
                                        stderr=err, start_new_session=True)
        else:  # torchrun's default: the workers write to torchrun's own stdout and stderr (srun's, under Slurm)
            proc = subprocess.Popen(command, env=env, start_new_session=True)
        workers[proc.pid] = (local, proc)
    failed: tuple[int, int, int] | None = None  # local rank, exit code, pid of the first worker to fail
    left = set(workers)
    while left:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(interval)  # torchrun polls its workers so (its --monitor-interval)
            continue
        if pid not in left:
            continue
        left.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        workers[pid][1].returncode = code
        if code != 0 and failed is None and not signalled:
            failed = (workers[pid][0], code, pid)
            kill_all(signal.SIGTERM)
            signal.alarm(grace)
    for thread in tees:
        thread.join()
    if failed is not None:
        local, code, pid = failed
        print(f"fake_torchrun: ChildFailedError:\n{script} FAILED\nRoot Cause (first observed failure):\n[0]:\n"
              f"  host      : {socket.gethostname()}\n  rank      : {first + local} (local_rank: {local})\n"
              f"  exitcode  : {code} (pid: {pid})", file=sys.stderr, flush=True)
    return 1 if failed is not None or signalled or any(p.returncode for _, p in workers.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
