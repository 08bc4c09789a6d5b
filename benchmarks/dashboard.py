"""Dashboard under a flood: key-to-effect latency and memory while 8 nodes print 50,000 lines/s.

    python benchmarks/dashboard.py [--nodes 8] [--rate 50000] [--seconds 20] [--presses 200]

The app (clusterrun/tui/) runs headless under Textual's Pilot, fed by a stand-in for the
session whose thread emits the orchestrator's events — ``LogLines`` batches every 10 ms for every
node, RATE lines/s in total — exactly as the session's thread does for a real job (the transport
is left out: this measures the dashboard). While the flood runs, the benchmark presses keys
that change what is shown — a node's number (its ring replaces the log view) or `a` (all nodes
merged) — and measures from the key press to the moment the app shows the new view and every
message queued until then has been handled (p50, p99, max). Keys are delivered as the terminal
driver delivers them (Pilot.press also waits for the CPU to go idle, which never happens under a
flood). Baseline in the same run: the same presses without any flood. RSS is sampled every
second; it must level off once the rings are full (they are bounded). The collector's pauses
during the presses are timed too (``gc.callbacks``): a key that arrives during a full collection
waits for it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from textual import events  # noqa: E402

from clusterrun.core.events import AttemptStarted, LogLines, NodeState, NodeStateChanged  # noqa: E402
from clusterrun.tui import Dashboard  # noqa: E402


class Flood:
    """Stands in for ``clusterrun.life.session.Session``: emits a job's start, then log lines at ``rate``."""

    job_id = "flood-20261122-000000-beef"
    owner = False
    busy = False
    failed_start = False
    detached = False
    result = None
    error = None

    def __init__(self, nodes: int, rate: float) -> None:
        self.nodes = nodes
        self.rate = rate
        self.emit: Any = lambda event: None
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flood")

    @property
    def running(self) -> bool:
        return not self._stop.is_set()

    def begin(self) -> None:
        self.emit(AttemptStarted(None, job_id=self.job_id, name="flood", attempt=1, master_addr="10.0.0.1",
                                 master_port=29500, world_size=self.nodes * 8,
                                 nodes=tuple((f"gpu-{i}", 8, "0,1,2,3,4,5,6,7") for i in range(self.nodes))))
        for rank in range(self.nodes):
            self.emit(NodeStateChanged(rank, host=f"gpu-{rank}", state=NodeState.RUNNING))
        if self.rate:
            self._thread.start()

    def _run(self) -> None:
        tick = 0.01
        per_batch = max(1, round(self.rate * tick / self.nodes))
        began = time.monotonic()
        n = 0
        while not self._stop.is_set():
            for rank in range(self.nodes):
                lines = tuple(f"[rank{rank * 8 + n % 8}]:step {n + i} loss 0.{(n + i) % 9973:04d} "
                              f"lr 0.001 tokens/s 181234 grad-norm 1.0{i % 10}" for i in range(per_batch))
                self.emit(LogLines(rank, host=f"gpu-{rank}", lines=lines))
                self.sent += per_batch
            n += per_batch
            wait = began + (n / per_batch) * tick - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    def kill(self) -> None:
        self._stop.set()

    def restart(self) -> None:
        pass

    def detach(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def press(app: Dashboard, key: str) -> None:
    """A key as the terminal driver delivers it (Pilot.press also waits for the CPU to go idle,
    which never happens under a flood)."""
    event = events.Key(key, key if len(key) == 1 else None)
    event.set_sender(app)
    assert app._driver is not None  # noqa: SLF001
    app._driver.send_message(event)  # noqa: SLF001


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Pauses:
    """The garbage collector's pauses by generation, timed with ``gc.callbacks`` while installed."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._began = 0.0

    def __enter__(self) -> Pauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.by_generation[info["generation"]].append(time.perf_counter() - self._began)


async def measure(nodes: int, rate: float, seconds: float, presses: int) -> dict[str, Any]:
    flood = Flood(nodes, rate)
    app = Dashboard(flood)  # type: ignore[arg-type]
    delays: list[float] = []
    rss: list[float] = []
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause(0.5)
        with Pauses() as pauses:
            began = time.monotonic()
            next_sample = began
            keys = [str(i % nodes + 1) if i % 3 else "a" for i in range(presses)]
            interval = seconds / presses
            for i, key in enumerate(keys):
                want: int | None = None if key == "a" else int(key) - 1
                if app._view == want:  # noqa: SLF001 - the benchmark looks at what the app shows
                    key, want = "a", None
                    if app._view is None:  # noqa: SLF001
                        key, want = "1", 0
                start = time.perf_counter()
                press(app, key)
                while app._view != want:  # noqa: SLF001
                    await asyncio.sleep(0.0005)
                await pilot._wait_for_screen()  # noqa: SLF001 - every message queued until now has been handled
                delays.append(time.perf_counter() - start)
                now = time.monotonic()
                if now >= next_sample:
                    rss.append(rss_mb())
                    next_sample = now + 1.0
                await asyncio.sleep(max(0.0, began + (i + 1) * interval - time.monotonic()))
            elapsed = time.monotonic() - began
        shown = sum(row.log.count for row in app.board.nodes)
        flood.kill()
        await pilot.press("q")
    return {"delays": delays, "rss": rss, "sent": flood.sent, "shown": shown, "elapsed": elapsed,
            "pauses": pauses.by_generation}


def describe(name: str, result: dict[str, Any]) -> str:
    d = sorted(result["delays"])
    p99 = d[min(len(d) - 1, round(0.99 * len(d)) - 1)]
    rss = result["rss"]
    return (f"| {name} | {result['sent'] / result['elapsed']:.0f} | {statistics.median(d) * 1000:.1f} "
            f"| {p99 * 1000:.1f} | {d[-1] * 1000:.1f} | {rss[0]:.0f} → {max(rss):.0f} → {rss[-1]:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rate", type=float, default=50_000, help="log lines per second, all nodes together")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--presses", type=int, default=200)
    args = parser.parse_args()
    quiet = asyncio.run(measure(args.nodes, 0, min(args.seconds, 5), min(args.presses, 50)))
    flood = asyncio.run(measure(args.nodes, args.rate, args.seconds, args.presses))
    print(f"{args.nodes} nodes; {args.presses} key presses over {args.seconds:.0f} s; ring 10,000 lines per node\n")
    print("| run | lines/s fed | key to effect p50 (ms) | p99 (ms) | max (ms) | RSS first → max → last (MB) |")
    print("|---|---|---|---|---|---|")
    print(describe("no flood (baseline)", quiet))
    print(describe(f"flood of {args.rate:.0f} lines/s", flood))
    d = sorted(flood["delays"])
    p99 = d[min(len(d) - 1, round(0.99 * len(d)) - 1)]
    print("\nGarbage collections during the flood's presses (generation: count, pause p50 / max ms):")
    for generation, times in flood["pauses"].items():
        t = sorted(times) or [0.0]
        print(f"  {generation}: {len(times)}, {statistics.median(t) * 1000:.1f} / {t[-1] * 1000:.1f}")
    print(f"\nTarget: p99 ≤ 100 ms under the flood: {p99 * 1000:.0f} ms → {'met' if p99 <= 0.1 else 'NOT met'}")


if __name__ == "__main__":
    main()
