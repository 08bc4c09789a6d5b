"""Agent benchmark: what reaches a host per connection, and what an agent's start costs there.

Measured in the same run, against the agent as it was sent before it became a package (one
source file, ``clusterrun/agent.py`` at ``--baseline``, sent whole on every connection with its
loader, its compiled code cached on the host):

- bytes: the zip, the loader, and the bytes one session writes to its agent for a probe on first
  contact (the zip sent) and later (only the loader and the hash), beside the old preamble;
- CPU: the interpreter's user + system time for one agent that answers one probe, median of
  --repeat runs with a warm cache (``python -S -c BOOTSTRAP``, by ``wait4``), for the old agent,
  the package, and the package with the ``json`` module instead of json's C parts (``_json``).

    python benchmarks/agent.py [--repeat 30] [--baseline e89f2f7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clusterrun.agent import BOOTSTRAP  # noqa: E402
from clusterrun.transports.base import agent_command, request_line  # noqa: E402
from clusterrun.transports.bundle import AGENT_DIR, AgentBundle, agent_bundle, build_zip  # noqa: E402


def cpu_of(argv: list[str], stdin: bytes, env: dict[str, str], handshake: AgentBundle | None = None) -> float:
    """CPU seconds (user + system) of one agent process answering what ``stdin`` asks."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    if handshake is not None:  # the loader's have/need first, as a session does it
        proc.stdin.write(handshake.preamble())
        proc.stdin.flush()
        word = proc.stdout.readline()
        if b"need" in word:
            proc.stdin.write(handshake.zip)
    proc.stdin.write(stdin)
    proc.stdin.close()
    answer = proc.stdout.read()
    proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert b'"ok": true' in answer, answer[:300]
    return usage.ru_utime + usage.ru_stime


def old_agent(baseline: str) -> tuple[bytes, str]:
    """The preamble of the agent before it was a package, and its BOOTSTRAP."""
    source = subprocess.run(["git", "show", f"{baseline}:clusterrun/agent.py"], cwd=ROOT, check=True,
                            capture_output=True).stdout
    namespace: dict[str, object] = {"__name__": "old_agent"}
    exec(compile(source, "old_agent", "exec"), namespace)
    loader = str(namespace["LOADER"]).encode()
    import hashlib

    preamble = (b"%d\n" % len(loader) + loader
                + b"%s %d\n" % (hashlib.sha256(source).hexdigest().encode(), len(source)) + source)
    return preamble, str(namespace["BOOTSTRAP"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--baseline", default="e89f2f7", help="a commit whose clusterrun/agent.py is one file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    try:
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache")}
        probe = request_line({"op": "probe", "free_port": False, "state_dir": str(work / "state")})
        bundle = agent_bundle()
        old_preamble, old_bootstrap = old_agent(args.baseline)
        copy = work / "agent"  # the package with json's C parts turned off
        shutil.copytree(AGENT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
        codec = copy / "codec.py"
        codec.write_text(codec.read_text().replace("JSON_C_CHECKED = ((3, 8), (3, 13))",
                                                   "JSON_C_CHECKED = ((0, 0), (0, 0))"))
        import hashlib

        plain_zip = build_zip(copy)
        plain = AgentBundle(zip=plain_zip, sha256=hashlib.sha256(plain_zip).hexdigest(), loader=bundle.loader)

        first = len(bundle.preamble()) + len(bundle.zip) + len(probe)
        later = len(bundle.preamble()) + len(probe)
        print(f"agent zip: {len(bundle.zip)} bytes ({len(list(AGENT_DIR.glob('*.py')))} modules, "
              f"{sum(p.stat().st_size for p in AGENT_DIR.glob('*.py'))} bytes of source); loader {len(bundle.loader)}")
        print(f"bytes sent per connection, a probe: first contact {first}, later {later}; "
              f"before (one file, every time): {len(old_preamble) + len(probe)}")

        runs: dict[str, list[float]] = {"before: one file (_json)": [], "package (_json)": [], "package (json)": []}
        new_argv, old_argv = agent_command(sys.executable), [sys.executable, "-S", "-c", old_bootstrap]
        assert BOOTSTRAP in new_argv
        for _ in range(2):  # warm the caches: install and compile each version once
            cpu_of(old_argv, old_preamble + probe, env)
            cpu_of(new_argv, probe, env, bundle)
            cpu_of(new_argv, probe, env, plain)
        for _ in range(args.repeat):  # interleaved, so that a busy moment falls on all alike
            runs["before: one file (_json)"].append(cpu_of(old_argv, old_preamble + probe, env))
            runs["package (_json)"].append(cpu_of(new_argv, probe, env, bundle))
            runs["package (json)"].append(cpu_of(new_argv, probe, env, plain))
        for name, values in runs.items():
            print(f"CPU of one agent answering a probe, {name}: median {statistics.median(values) * 1000:.1f} ms, "
                  f"min {min(values) * 1000:.1f} ms ({len(values)} runs)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
