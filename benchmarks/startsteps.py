"""Host CPU per step of `up`'s start, on one simulated host: what each exchange costs the host.

The host's sshd (and everything it starts) is in a cpuacct cgroup; the benchmark drives the SSH
transport as `up` does (connect, one agent session: probe, route, inspect, reach, listen and
unlisten, a `start` of `sleep 1` and its first 0.5 s, then close) and reads the cgroup between the
steps. Beside it, in the same run: `ssh HOST true` and `ssh HOST python -S -c pass` (OpenSSH's
client), whole. The first repeat installs the agent's zip on the host (its first contact) and is
left out of the medians. Needs root.

    python benchmarks/startsteps.py [--repeat 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clusterrun.agent.wire import (  # noqa: E402
    InspectRequest,
    ListenRequest,
    ProbeRequest,  # noqa: E402
    ReachRequest,
    StartRequest,
    UnlistenRequest,
)
from clusterrun.config.hostsfile import HostSpec  # noqa: E402
from clusterrun.core.protocol import decode_probe  # noqa: E402
from clusterrun.run.interfaces import route_request  # noqa: E402
from clusterrun.transports import transport_for  # noqa: E402
from tests.simhosts import SimCluster, close_on_signals  # noqa: E402


def main() -> None:
    close_on_signals()  # a SIGTERM or SIGHUP closes the simulated hosts too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    group = Path(f"/sys/fs/cgroup/cpuacct/crbench-steps-{os.getpid()}")
    group.mkdir()

    def used() -> float:
        return int((group / "cpuacct.usage").read_text()) / 1e6

    cluster = SimCluster.start(1)
    steps: dict[str, list[float]] = {}
    try:
        host = cluster.hosts[0]
        (group / "cgroup.procs").write_text(str(host.pid))
        state = str(cluster.dir / "state")
        for i in range(args.repeat):
            transport = transport_for(HostSpec(host=host.name, python=sys.executable, workdir=str(ROOT)),
                                      ssh_config=str(cluster.ssh_config))
            marks = [("", used())]
            transport.connect()
            marks.append(("connect, key exchange, authentication (sshd)", used()))
            session = transport.session()
            port = decode_probe(host.name, session.call(ProbeRequest(state_dir=state, free_port=True))).port or 9
            marks.append(("session, shell, Python, agent, probe", used()))
            session.call(route_request(0, host.address, port, [host.address]))
            marks.append(("route", used()))
            session.call(InspectRequest(cwd=str(ROOT), paths=[".", "tests/_support/counter.py"], state_dir=state))
            marks.append(("inspect", used()))
            session.call(ReachRequest(addr=host.address, port=port, token="t", timeout=5))
            marks.append(("reach (nobody listens: refused)", used()))
            session.call(ListenRequest(port=port, token="t"))
            session.call(UnlistenRequest(port=port))
            marks.append(("listen and unlisten (node 0)", used()))
            session.call(StartRequest(job=f"steps-{os.getpid()}-{i}", node=0, attempt=1, state_dir=state,
                                      argv=["sleep", "1"]))
            marks.append(("start, until its answer (agent, survivor, monitor, sleep)", used()))
            subprocess.run(["sleep", "0.5"], check=True)
            marks.append(("the job's first 0.5 s (survivor, monitor)", used()))
            session.close()
            transport.close()
            subprocess.run(["sleep", "0.8"], check=True)  # the session's processes and the job have exited
            marks.append(("closing", used()))
            for (_, before), (name, after) in zip(marks, marks[1:], strict=False):
                steps.setdefault(name, []).append(after - before)
            for name, command in (("ssh HOST true (all of it)", ["true"]),
                                  ("ssh HOST python -S -c pass (all of it)", [sys.executable, "-S", "-c", "pass"])):
                before = used()
                subprocess.run(cluster.ssh_argv(host.name, *command), check=True)
                steps.setdefault(name, []).append(used() - before)
    finally:
        cluster.close()
        group.rmdir()
    print(f"host CPU per step (ms), median of {args.repeat - 1} (the first, which installs the agent, left out)")
    print("| step | host CPU (ms) |\n|---|---|")
    for name, values in steps.items():
        print(f"| {name} | {statistics.median(values[1:]):.1f} |")


if __name__ == "__main__":
    main()
