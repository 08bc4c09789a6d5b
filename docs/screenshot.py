"""Take docs/dashboard.svg from the real app: a real two-node DDP training on this machine.

    python docs/screenshot.py

Starts `examples/train.py` on hosts/local.yaml with `up -d` (its own controller state in a
temporary directory), opens the dashboard on it with Textual's Pilot, waits until the job has
ended, shows all nodes merged and saves the screen as SVG. The job's state and logs are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    home = Path(tempfile.mkdtemp(prefix="clusterrun-shot-"))
    os.environ["XDG_STATE_HOME"] = str(home)
    hosts = home / "hosts.yaml"
    job = ""
    hosts.write_text((ROOT / "hosts" / "local.yaml").read_text() + f"state_dir: {home / 'hosts'}\n")
    try:
        started = subprocess.run([sys.executable, "-m", "clusterrun", "up", "-d", "--name", "demo", str(hosts),
                                  "examples/train.py", "--", "--epochs", "2"],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
        job = started.stdout.strip()
        asyncio.run(shoot(job, ROOT / "docs" / "dashboard.svg"))
    finally:
        if job:
            subprocess.run([sys.executable, "-m", "clusterrun", "down", job], cwd=ROOT, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


async def shoot(job: str, target: Path) -> None:
    from clusterrun.life.session import Session
    from clusterrun.store.jobs import JobStore
    from clusterrun.tui import Dashboard

    store = JobStore()
    app = Dashboard(Session(store, store.load(job), lambda event: None, tail=200))
    async with app.run_test(size=(120, 36)) as pilot:
        deadline = time.monotonic() + 120
        while not app.board.finished and time.monotonic() < deadline:
            await pilot.pause(0.2)
        await pilot.press("a")
        await pilot.pause(0.5)
        app.save_screenshot(filename=target.name, path=str(target.parent))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
