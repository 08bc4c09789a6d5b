"""A real Slurm (Debian's slurm-wlm 22.05 and munge) on simulated hosts, for integration tests.

Lifecycle: ``SlurmCluster.start(sim)`` on a started ``SimCluster`` (hosts ``sim1``…) → ``client_env()`` for
``salloc``/``srun``/``sbatch``/``scancel`` run from the test → ``close()`` (then the ``SimCluster``'s own close).
One ``munged`` in the test's namespace serves every host through its socket on the shared filesystem;
``slurmctld`` runs on the first host, one ``slurmd`` on each (NodeName = its hostname), each in its host's
namespaces; all state, logs and pid files under one temp dir. The recipe and its pitfalls are in the
guide this follows (proctrack/linuxproc, task/none, ``CgroupPlugin=cgroup/v1`` for hosts without a cgroup
filesystem): see docs/slurm.md's "Tests".
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.simhosts import SimCluster, SimHost, unavailable

SUPPORT = Path(__file__).parent / "_support"
PACKAGES = ("slurm-wlm:slurmctld", "munge:munged")
PREFIX = "crslurm"  # temp dirs crslurm-<pid of the test process>-...: sweep_stale finds those of dead ones
READY_TIMEOUT = 60.0
_IGNORED = re.compile(r"pmix", re.IGNORECASE)  # without libpmix every daemon says so; harmless here

CONF = """\
ClusterName=crtest
SlurmctldHost={h0}({a0})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket.2
StateSaveLocation={state}/ctld
SlurmctldPidFile={state}/ctld/slurmctld.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdSpoolDir={state}/%n/spool
SlurmdPidFile={state}/%n/slurmd.pid
SlurmdLogFile={state}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MailProg=/bin/true
{gres}{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def install() -> None:
    """slurm-wlm and munge with apt when missing (no daemon started: tests/_support/install_sshd.sh)."""
    if all(shutil.which(c) or os.path.exists(f"/usr/sbin/{c}") for c in ("slurmctld", "slurmd", "munged")):
        return
    done = subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), *PACKAGES], capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        unavailable(f"could not install slurm-wlm and munge: {done.stdout[-2000:]}{done.stderr[-2000:]}")


@dataclass
class Daemon:
    """A daemon the fixture started: the pid this namespace sees, its command name, its launcher."""

    name: str
    pid: int
    comm: str
    launcher: subprocess.Popen[bytes]
    log: Path


@dataclass
class SlurmCluster:
    """slurmctld + a slurmd per simulated host + one munged: ``start`` → ``client_env`` → ``close``."""

    sim: SimCluster
    state: Path
    daemons: list[Daemon] = field(default_factory=list)
    gpus: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    @property
    def socket(self) -> Path:
        return self.state / "munge" / "munge.socket.2"

    def client_env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @classmethod
    def start(cls, sim: SimCluster, gpus: Mapping[str, int] | None = None) -> SlurmCluster:
        """``gpus``: GPUs per host name, each a plain file under the state dir (Slurm's gres/gpu needs
        only a path per device under task/none): jobs see SLURM_GPUS_ON_NODE and scontrol's GRES."""
        if not sim.isolated:
            unavailable(f"Slurm needs a network namespace per host: {sim.fallback_reason}")
        install()
        sweep_stale()
        state = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-"))
        state.chmod(0o755)
        cluster = cls(sim=sim, state=state, gpus=dict(gpus or {}))
        try:
            cluster._start()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _start(self) -> None:
        munge = self.state / "munge"
        munge.mkdir(mode=0o755)  # munged refuses a socket dir that others cannot traverse
        subprocess.run(["mungekey", "-c", "-k", str(munge / "munge.key")], check=True, capture_output=True)
        log = munge / "munged.out"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["munged", "-F", f"--socket={self.socket}", f"--key-file={munge / 'munge.key'}",
                                     f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}",
                                     f"--seed-file={munge / 'munged.seed'}"],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        self.daemons.append(Daemon("munged", proc.pid, "munged", proc, log))
        self._wait(self._munge_ok, "munged", self.daemons[-1])
        hosts = self.sim.hosts
        cpus = os.cpu_count() or 1
        gres = {h.name: f" Gres=gpu:{self.gpus[h.name]}" if self.gpus.get(h.name) else "" for h in hosts}
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus}{gres[h.name]} State=UNKNOWN"
                          for h in hosts)
        (self.state / "ctld").mkdir()
        self.conf.write_text(CONF.format(h0=hosts[0].name, a0=hosts[0].address, state=self.state, nodes=nodes,
                                         gres="GresTypes=gpu\n" if self.gpus else ""))
        devices = []
        for name, count in self.gpus.items():
            files = [self.state / f"gpu-{name}-{i}" for i in range(count)]
            for f in files:
                f.write_text("")
            devices.append(f"NodeName={name} Name=gpu File={','.join(map(str, files))}")
        if devices:
            (self.state / "gres.conf").write_text("\n".join(devices) + "\n")
        (self.state / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self._daemon(hosts[0], "slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], self.state / "slurmctld.out")
        for host in hosts:
            (self.state / host.name / "spool").mkdir(parents=True)
            self._daemon(host, "slurmd", ["slurmd", "-D", "-f", str(self.conf)], self.state / host.name / "slurmd.out")
        self._wait(lambda: self._idle() >= len(hosts), f"{len(hosts)} idle nodes", None)

    def _daemon(self, host: SimHost, comm: str, argv: list[str], log: Path) -> None:
        """``argv`` in ``host``'s namespaces; the daemon is nsenter's child (it forks into the PID namespace)."""
        enter = ["nsenter", f"--target={host.pid}", "--net", "--pid", "--mount", "--uts"]
        with open(log, "wb") as out:
            launcher = subprocess.Popen([*enter, *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, env={**os.environ, "SLURM_CONF": str(self.conf)})
        deadline = time.monotonic() + 10
        while not (children := _children(launcher.pid)):
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{comm} on {host.name} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.01)
        self.daemons.append(Daemon(f"{comm} on {host.name}", children[0], comm, launcher, log))

    def _munge_ok(self) -> bool:
        cred = subprocess.run(["munge", "-S", str(self.socket), "-n"], capture_output=True, check=False)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge", "-S", str(self.socket)], input=cred.stdout, capture_output=True,
                              check=False).returncode == 0

    def _idle(self) -> int:
        done = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], capture_output=True, text=True,
                              env=self.client_env(), check=False)
        return len(set(done.stdout.split())) if done.returncode == 0 else 0

    def _wait(self, ready: Callable[[], bool], what: str, daemon: Daemon | None) -> None:
        """Poll ``ready`` every 0.1 s; fail at once with a daemon's first error when it exits meanwhile."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not ready():
            for d in self.daemons if daemon is None else [daemon]:
                if d.launcher.poll() is not None:
                    raise RuntimeError(f"{d.name} exited: {_first_error(d.log)}")
            if time.monotonic() > deadline:
                states = subprocess.run(["sinfo", "-N", "-o", "%N %T"], capture_output=True, text=True,
                                        env=self.client_env(), check=False)
                raise RuntimeError(f"{what} not ready after {READY_TIMEOUT:.0f} s: {states.stdout}{states.stderr}")
            time.sleep(0.1)

    def close(self) -> None:
        """SIGTERM every daemon (by the pid recorded, its command name checked), SIGKILL what is left after 3 s."""
        for daemon in reversed(self.daemons):
            _signal(daemon, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for daemon in reversed(self.daemons):
            while _alive(daemon) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(daemon):
                _signal(daemon, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.launcher.wait(timeout=5)
        self.daemons.clear()
        shutil.rmtree(self.state, ignore_errors=True)


def sweep_stale() -> None:
    """What a test process that died before its teardown left: its state dirs, and the munged
    serving them (slurmctld and slurmd died with their simulated hosts: ``simhosts.sweep_stale``)."""
    def dead(name: str) -> bool:
        found = re.match(rf"{PREFIX}-(\d+)-", name)
        return found is not None and not os.path.exists(f"/proc/{found[1]}")

    stale = [p for p in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*") if dead(p.name)]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if _comm(int(entry)) == "munged" and any(f"--socket={p}/".encode() in a for p in stale for a in argv):
                os.kill(int(entry), signal.SIGKILL)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def _alive(daemon: Daemon) -> bool:
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{daemon.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z" and _comm(daemon.pid) == daemon.comm
    return False


def _signal(daemon: Daemon, sig: int) -> None:
    if _alive(daemon):
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon.pid, sig)


def _first_error(log: Path) -> str:
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if re.search(r"error|fatal", line) and not _IGNORED.search(line):
                return line
        return log.read_text(errors="replace")[-2000:]
    return f"(no log at {log})"


@pytest.fixture
def slurm_cluster(sim_cluster: Callable[..., SimCluster]) -> Iterator[SlurmCluster]:
    """A two-node Slurm on simulated hosts sim1, sim2 (no cgroup filesystem in them: proctrack/linuxproc)."""
    sim = sim_cluster(2, cgroup=False)
    cluster = SlurmCluster.start(sim)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm_gpu_cluster(sim_cluster: Callable[..., SimCluster]) -> Iterator[SlurmCluster]:
    """``slurm_cluster`` with GPUs for Slurm to hand out (plain files as devices): 2 on sim1, 1 on sim2."""
    cluster = SlurmCluster.start(sim_cluster(2, cgroup=False), gpus={"sim1": 2, "sim2": 1})
    try:
        yield cluster
    finally:
        cluster.close()
