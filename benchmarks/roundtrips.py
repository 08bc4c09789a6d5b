"""Round trips on one host's way from TCP connect to "torchrun started", measured, not counted.

The controller reaches one simulated host through a TCP proxy on this machine that holds every
chunk for D/2 in each direction (D per round trip; the TCP handshake itself is not delayed).
`up --no-tui` of that one host (node 0: every exchange is on the critical path) and `ssh HOST
true` (the floor) are timed with D = 0 and D = 1 s; (t_D - t_0) / D is the number of round trips
after the TCP handshake. Trees given as arguments (`git archive REV`) are measured in the same
run. Needs root (simulated hosts).

    python benchmarks/roundtrips.py [--repeat 3] [TREE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fanout  # noqa: E402

from tests.simhosts import SimCluster, close_on_signals  # noqa: E402

DELAY = [0.0]  # seconds per round trip, read by the proxy for each chunk


def serve_proxy(target: tuple[str, int], port: list[int], ready: threading.Event) -> None:
    """Forward a local port to ``target``, each chunk held DELAY/2 (in order) each way."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(65536):
                if DELAY[0]:
                    loop.call_later(DELAY[0] / 2, writer.write, data)  # equal delays keep the order
                else:
                    writer.write(data)
            await asyncio.sleep(DELAY[0])
        except OSError:
            pass
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target_reader, target_writer = await asyncio.open_connection(*target)
        await asyncio.gather(pipe(reader, target_writer), pipe(target_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("trees", nargs="*", type=Path)
    args = parser.parse_args()
    cluster = SimCluster.start(1)
    try:
        host = cluster.hosts[0]
        port: list[int] = []
        ready = threading.Event()
        threading.Thread(target=serve_proxy, args=((host.address, host.port), port, ready), daemon=True).start()
        ready.wait()
        folder = cluster.dir / "bench"
        folder.mkdir()
        fanout.PYTHON = fanout.make_stub(folder)
        key = " ".join((cluster.dir / host.name / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        known = folder / "known_hosts"
        known.write_text(f"[127.0.0.1]:{port[0]} {key}\n")
        config = folder / "ssh_config"
        config.write_text(cluster.ssh_config.read_text()
                          .replace(f"HostName {host.address}", "HostName 127.0.0.1")
                          .replace(f"Port {host.port}", f"Port {port[0]}")
                          .replace(f"UserKnownHostsFile {cluster.known_hosts}", f"UserKnownHostsFile {known}"))
        hosts = folder / "hosts.yaml"
        hosts.write_text(f"state_dir: {folder / 'state'}\nssh_config: {config}\nmaster:\n  addr: {host.address}\n"
                         f"defaults:\n  python: {fanout.PYTHON}\n  workdir: {ROOT}\n  nproc: 1\n"
                         f"hosts:\n  - host: {host.name}\n")

        def up(tree: Path) -> float:
            env = dict(os.environ, XDG_STATE_HOME=str(folder / "xdg"), PYTHONPATH=str(tree))
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            began, took = time.monotonic(), None
            proc = subprocess.Popen([sys.executable, "-m", "clusterrun", "up", "--no-tui", str(hosts),
                                     str(fanout.SCRIPT), "0", "0"], env=env, cwd=tree, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            for line in proc.stderr or ():
                if ": started attempt " in line and took is None:
                    took = time.monotonic() - began
            if proc.wait() != 0 or took is None:
                raise SystemExit(f"up of {tree} failed")
            return took

        def ssh_true() -> float:
            began = time.monotonic()
            subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", host.name, "true"], check=True)
            return time.monotonic() - began

        tools = {f"up ({tree})": (lambda tree=tree: up(tree)) for tree in [ROOT, *args.trees]}
        tools["ssh HOST true"] = ssh_true
        for tree in [ROOT, *args.trees]:
            up(tree)  # the host's agent cache warm for each tree
        seconds: dict[tuple[str, float], float] = {}
        for delay in (0.0, 1.0):
            DELAY[0] = delay
            for name, run in tools.items():
                seconds[name, delay] = statistics.median(run() for _ in range(args.repeat))
        for name in tools:
            print(f"{name}: {seconds[name, 0.0]:.2f} s; {seconds[name, 1.0]:.2f} s at 1 s a round trip: "
                  f"{seconds[name, 1.0] - seconds[name, 0.0]:.1f} round trips after the TCP handshake")
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
