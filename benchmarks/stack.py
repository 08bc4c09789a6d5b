"""`clusterrun stack` on N simulated hosts × R ranks, beside the usual script: ssh to every host
at once and `py-spy dump` each rank there in turn (what OLMo-style "py-spy on all ranks" scripts do),
on paramiko's terms (tests/simhosts.py ``PARAMIKO_TERMS``).

The ranks are real Python processes started by the stdlib stand-in for torchrun
(tests/_support/fake_torchrun.py, through an interpreter shim): every rank sleeps in ``wait()``
but rank 7, which sleeps in ``load()``. Each figure is the wall time of the whole command (its
Python start-up included), median of ``--repeat`` (min–max); clusterrun's must show the two groups.
``clusterrun ps JOB`` beside them asks every host's agent for its status over the same
connections: what ``stack`` costs before py-spy runs; ``clusterrun --help``, the controller's
start alone.

    python benchmarks/stack.py --hosts 8 --ranks 4 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.simhosts import PARAMIKO_TERMS, SimCluster, close_on_signals  # noqa: E402

RANKS_SCRIPT = '''import os, time
def load():
    time.sleep(3600)
def wait():
    time.sleep(3600)
print("rank", os.environ["RANK"], "ready", flush=True)
load() if os.environ["RANK"] == "7" else wait()
'''


def clusterrun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


CPU: dict[str, list[float]] = {}  # the command's own CPU seconds (user + system, its children's), by label


def timed(run: object, label: str = "") -> tuple[float, object]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    out = run()  # type: ignore[operator]
    seconds = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if label:
        CPU.setdefault(label, []).append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return seconds, out


def _spread(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.2f} ({min(seconds):.2f}–{max(seconds):.2f})"


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    beside = Path(sys.executable).with_name("py-spy")  # a venv's, whose bin need not be on PATH
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    folder = Path(tempfile.mkdtemp(prefix="crbench-stack-"))
    script = folder / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    shim = folder / "python"
    shim.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then\n    shift 2\n'
                    f'    exec {sys.executable} {ROOT / "tests/_support/fake_torchrun.py"} "$@"\nfi\n'
                    f'exec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    (folder / "py-spy").symlink_to(py_spy)  # found beside the job's interpreter, as a venv's would be
    env = dict(os.environ, XDG_STATE_HOME=str(folder / "xdg"))
    cluster = SimCluster.start(args.hosts)
    job = None
    try:
        hosts = folder / "hosts.yaml"
        hosts.write_text("\n".join([f"state_dir: {folder / 'state'}", f"ssh_config: {cluster.ssh_config}",
                                    "defaults:", f"  python: {shim}", f"  workdir: {folder}",
                                    f"  nproc: {args.ranks}", "hosts:", *(f"  - host: {h.name}"
                                                                          for h in cluster.hosts)]) + "\n")
        up = clusterrun(env, "up", "-d", str(hosts), str(script))
        if up.returncode != 0:
            raise SystemExit(up.stderr)
        job = up.stdout.strip()
        world = args.hosts * args.ranks
        expected = f"ranks 0-6,8-{world - 1}: wait at ranks.py:5 · rank 7: load at ranks.py:3"
        deadline = time.monotonic() + 120
        while (first := clusterrun(env, "stack", job)).stdout.splitlines()[:1] != [expected]:
            if time.monotonic() > deadline:
                raise SystemExit(f"the ranks were not all found:\n{first.stdout}{first.stderr}")
            time.sleep(0.5)
        ours, theirs, status, start = [], [], [], []
        pattern = shlex.quote(f"^{sys.executable} -u {script}")
        remote = f"for p in $(pgrep -f {pattern}); do {folder / 'py-spy'} dump --pid $p; done"
        for _ in range(args.repeat):
            seconds, out = timed(lambda: clusterrun(env, "stack", job), "stack")
            assert out.stdout.startswith(expected), out.stdout  # type: ignore[attr-defined]
            ours.append(seconds)
            seconds, out = timed(lambda: clusterrun(env, "ps", job), "ps")
            assert out.returncode == 0, out.stderr  # type: ignore[attr-defined]
            status.append(seconds)
            seconds, out = timed(lambda: clusterrun(env, "--help"), "help")
            start.append(seconds)

            def ssh_all() -> list[str]:
                argvs = [cluster.ssh_argv(h.name, remote, terms=PARAMIKO_TERMS) for h in cluster.hosts]
                procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for argv in argvs]
                return [p.communicate()[0] for p in procs]

            seconds, outs = timed(ssh_all)
            dumped = sum(text.count("Thread ") for text in outs)  # type: ignore[attr-defined]
            assert dumped == world, f"ssh + py-spy dumped {dumped} of {world} ranks"
            theirs.append(seconds)
        print("| hosts × ranks | clusterrun stack (s) | ssh + py-spy per rank (s) | clusterrun ps JOB (s) | "
              "clusterrun --help (s) |")
        print(f"| {args.hosts} × {args.ranks} | {_spread(ours)} | {_spread(theirs)} | {_spread(status)} | "
              f"{_spread(start)} |")
        print("controller CPU, median (ms): " + ", ".join(f"{label} {statistics.median(v) * 1000:.0f}"
                                                           for label, v in CPU.items()))
    finally:
        if job is not None:
            clusterrun(env, "down", job)
        cluster.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
