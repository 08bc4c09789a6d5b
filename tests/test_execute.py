"""clusterrun exec: the command on every host at once, output by host, a summary of the failures."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from clusterrun.checks.execute import HostOutcome, exec_on_hosts, remote_command, summary
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core.errors import ConnectError
from clusterrun.transports.base import AgentSession, Transport
from tests import clirun
from tests.conftest import ROOT, wait_for
from tests.simhosts import SimCluster, unavailable

SUPPORT = ROOT / "tests" / "_support"
HOSTILE = ["'; touch /tmp/clusterrun-pwned #", "$(id)", "`id`", "a\nb", "x y", '"q"', "!!", "%h", "back\\slash", "é"]


class ScriptedTransport(Transport):
    """A host whose command prints ``lines`` and exits ``status``; ``unreachable`` refuses to connect."""

    def __init__(self, host: HostSpec, lines: list[bytes], status: int, unreachable: bool = False) -> None:
        super().__init__(host)
        self.lines, self.status, self.unreachable = lines, status, unreachable
        self.commands: list[str] = []

    @property
    def python(self) -> str:
        return "python3"

    def connect(self) -> None:
        if self.unreachable:
            raise ConnectError(self.name, "connection refused")

    def session(self) -> AgentSession:
        raise NotImplementedError

    def pipe(self, command: str, peer: socket.socket) -> tuple[int, str]:
        self.commands.append(command)
        assert peer.recv(1) == b""  # the command's stdin is at its end
        for line in self.lines:
            peer.sendall(line)
        return self.status, ""


def spec_of(*names: str) -> ClusterSpec:
    return ClusterSpec(path="hosts.yaml", hosts=tuple(HostSpec(host=n) for n in names))


def test_outcomes_in_file_order_and_the_summary_names_the_failed_hosts() -> None:
    behaviour = {"n1": ([b"one\n", b"two"], 0, False), "n2": ([b"bad\n"], 3, False), "n3": ([], 0, False),
                 "n4": ([], 0, True)}
    made: dict[str, ScriptedTransport] = {}

    def factory(host: HostSpec) -> Transport:
        made[host.host] = ScriptedTransport(host, *behaviour[host.host])
        return made[host.host]

    seen: list[tuple[str, str]] = []
    outcomes = exec_on_hosts(spec_of("n1", "n2", "n3", "n4"), ["echo", "x y"], factory,
                             lambda host, text: seen.append((host, text)))
    assert outcomes == [HostOutcome("n1", 0), HostOutcome("n2", 3), HostOutcome("n3", 0),
                        HostOutcome("n4", error="connection refused", unreachable=True)]
    assert sorted(seen) == [("n1", "one"), ("n1", "two"), ("n2", "bad")]
    assert {t.commands[0] for t in made.values() if t.commands} == {remote_command(["echo", "x y"])}
    assert summary(outcomes) == ["n2: exit 3", "n4: connection refused", "2 of 4 hosts failed: n[2,4]"]
    assert summary(outcomes[:1]) == ["the command succeeded on all 1 hosts"]


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_the_remote_command_gives_sh_the_words_as_they_were(shell: str) -> None:
    """What a login shell gets: the argv comes out whole, the shell interprets nothing of it."""
    if shutil.which(shell) is None:
        unavailable(f"no {shell} here")
    line = remote_command([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *HOSTILE])
    done = subprocess.run([shell, "-c", line], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == json.dumps(HOSTILE)
    assert not Path("/tmp/clusterrun-pwned").exists()


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_command_the_host_lacks_is_command_not_found_in_plain_words(shell: str) -> None:
    if shutil.which(shell) is None:
        unavailable(f"no {shell} here")
    for name in ("no-such-tool-here", "it's $(id)"):
        done = subprocess.run([shell, "-c", remote_command([name, "-L"])], capture_output=True, text=True, timeout=30)
        assert (done.returncode, done.stdout, done.stderr) == (127, f"{name}: command not found\n", "")


def clusterrun(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return clirun.clusterrun(*args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


def test_exec_on_local_hosts(tmp_path: Path) -> None:
    (tmp_path / "hosts.yaml").write_text("defaults: {transport: local}\nhosts: [local-1, 'local-[2-3]']\n")
    done = clusterrun("exec", "hosts.yaml", "--", "sh", "-c", "printf '%s\\033[2J\\n' \"$0\"; echo err >&2; exit 0",
                      "x y", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(f"local-{h}: {t}" for h in "123" for t in ("x y\\x1b[2J", "err"))
    assert done.stderr == "clusterrun: exec: the command succeeded on all 3 hosts\n"
    done = clusterrun("exec", "-x", "local-1", "hosts.yaml", "--", "sh", "-c", "exit 5", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["clusterrun: exec: local-2: exit 5", "clusterrun: exec: local-3: exit 5",
                                        "clusterrun: exec: 2 of 2 hosts failed: local-[2-3]"]
    done = clusterrun("exec", "-w", "local-1", "hosts.yaml", "--", "nvidia-smi-not-here", "-L", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, "local-1: nvidia-smi-not-here: command not found\n")
    assert done.stderr.splitlines()[0] == "clusterrun: exec: local-1: exit 127"


JOB_ENV = 'pwd; echo "$GREETING|${FROM_SETUP-}|${API_TOKEN-}|${CUDA_VISIBLE_DEVICES-}"; echo "token=$API_TOKEN" >&2'


def test_exec_with_the_job_env_runs_in_the_workdir_with_env_secrets_and_setup(tmp_path: Path) -> None:
    """--job-env: as the job would run (workdir, env, env_file's secret, gpus, setup); the secret's value is
    masked in the output; without it, the login directory and environment."""
    work, here = tmp_path / "work", tmp_path / "here"
    work.mkdir()
    here.mkdir()
    (here / "secrets.env").write_text("API_TOKEN=tok-12345678\n")
    (here / "hosts.yaml").write_text(
        "env_file: secrets.env\n"
        f"defaults: {{transport: local, workdir: {work}, env: {{GREETING: hi there}},\n"
        "           setup: ['export FROM_SETUP=yes; echo noise from setup']}\n"
        "hosts: [local-1, {host: local-2, gpus: [3]}]\n")
    done = clusterrun("exec", "--job-env", "hosts.yaml", "--", "sh", "-c", JOB_ENV, cwd=here)
    assert done.returncode == 0, done.stderr
    expected = [f"{work}", "hi there|yes|****|", "token=****"]
    assert sorted(done.stdout.splitlines()) == sorted([f"local-1: {t}" for t in expected] + [
        f"local-2: {t}" for t in (f"{work}", "hi there|yes|****|3", "token=****")])
    assert "tok-12345678" not in done.stdout + done.stderr
    plain = clusterrun("exec", "hosts.yaml", "--", "sh", "-c", JOB_ENV, cwd=here)
    assert plain.returncode == 0, plain.stderr
    assert sorted(plain.stdout.splitlines()) == sorted(f"local-{i}: {t}" for i in (1, 2) for t in (here, "|||",
                                                                                                 "token="))
    missing = clusterrun("exec", "--job-env", "-w", "local-1", "hosts.yaml", "--", "nvidia-smi-not-here", cwd=here)
    assert (missing.returncode, missing.stdout) == (1, "local-1: nvidia-smi-not-here: command not found\n")


def test_exec_with_the_job_env_says_which_hosts_setup_failed(tmp_path: Path) -> None:
    (tmp_path / "hosts.yaml").write_text("defaults: {transport: local, setup: ['echo why; exit 3']}\n"
                                         "hosts: ['local-[1-2]']\n")
    done = clusterrun("exec", "--job-env", "hosts.yaml", "--", "touch", "ran", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert "clusterrun: exec: local-1: setup failed with status 3" in done.stderr and "  | why" in done.stderr
    assert done.stderr.splitlines()[-1] == "clusterrun: exec: 2 of 2 hosts failed: local-[1-2]"
    assert not (tmp_path / "ran").exists()


@pytest.fixture(scope="module")
def fish_and_tcsh() -> dict[str, str]:
    subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "tcsh", "fish"], check=True, capture_output=True)
    found = {name: shutil.which(name) for name in ("tcsh", "fish")}
    assert all(found.values()), f"could not install {found}"
    return {name: str(path) for name, path in found.items()}


@pytest.mark.integration
def test_exec_on_four_simulated_hosts_one_failing(sim_cluster: Callable[..., SimCluster], tmp_path: Path,
                                                 fish_and_tcsh: dict[str, str]) -> None:
    cluster = sim_cluster(4, login_shell={"sim2": fish_and_tcsh["fish"], "sim3": fish_and_tcsh["tcsh"]})
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"ssh_config: {cluster.ssh_config}\nhosts: ['sim[1-4]']\n")
    script = 'echo "$(hostname) $1"; [ "$(hostname)" != sim3 ] || exit 7'
    done = clusterrun("exec", str(hosts), "--", "sh", "-c", script, "-", "it's $(id)", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"sim{i}: sim{i} it's $(id)" for i in range(1, 5)]
    assert done.stderr.splitlines() == ["clusterrun: exec: sim3: exit 7", "clusterrun: exec: 1 of 4 hosts failed: sim3"]
    # -x, and words that bash, fish (sim2) and tcsh (sim3) would each read differently if they read them
    printer = "import sys, json; print(json.dumps(sys.argv[1:]))"
    done = clusterrun("exec", "-x", "sim4", str(hosts), "--", sys.executable, "-c", printer, *HOSTILE, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"sim{i}: {json.dumps(HOSTILE)}" for i in (1, 2, 3)]


@pytest.mark.integration
def test_exec_with_the_job_env_over_ssh_whatever_the_login_shell(sim_cluster: Callable[..., SimCluster],
                                                                 tmp_path: Path, fish_and_tcsh: dict[str, str]) -> None:
    """The job's environment travels on the agent's stdin: fish (sim2) and tcsh (sim3) change nothing of it."""
    cluster = sim_cluster(3, login_shell={"sim2": fish_and_tcsh["fish"], "sim3": fish_and_tcsh["tcsh"]})
    (tmp_path / "secrets.env").write_text("API_TOKEN=tok-12345678\n")
    (tmp_path / "hosts.yaml").write_text(
        f"ssh_config: {cluster.ssh_config}\nenv_file: secrets.env\n"
        f"defaults: {{python: {sys.executable}, workdir: /tmp, env: {{ODD: \"it's $(id) `x` !!\"}},\n"
        "           setup: ['export FROM_SETUP=yes']}\n"
        "hosts: ['sim[1-3]']\n")
    script = 'echo "$(pwd) $ODD|$FROM_SETUP|$API_TOKEN"'
    done = clusterrun("exec", "--job-env", "hosts.yaml", "--", "sh", "-c", script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"sim{i}: /tmp it's $(id) `x` !!|yes|****" for i in (1, 2, 3)]
    missing = clusterrun("exec", "--job-env", "hosts.yaml", "--", "nvidia-smi", cwd=tmp_path)
    assert sorted(missing.stdout.splitlines()) == [f"sim{i}: nvidia-smi: command not found" for i in (1, 2, 3)]
    assert missing.returncode == 1 and "clusterrun: exec: 3 of 3 hosts failed: sim[1-3]" in missing.stderr


@contextmanager
def exec_interrupted(folder: Path, token: str, *options: str) -> Iterator[subprocess.Popen[str]]:
    """``exec`` of a command that prints ``started`` and sleeps, on ``folder``'s hosts.yaml, with
    Python's SIGINT handler as on a terminal; the caller reads the lines and sends SIGINT."""
    main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from clusterrun.cli import main; sys.argv[0] = 'clusterrun'; main()")
    sleeper = "import sys, time; print('started', flush=True); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", main, "exec", *options, "hosts.yaml", "--", sys.executable, "-c",
                             sleeper, token], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def interrupt(proc: subprocess.Popen[str], started: list[str], before: Callable[[], None] = lambda: None) -> str:
    """Wait for each host's ``started``, run ``before``, send SIGINT; exec's stderr."""
    assert proc.stdout is not None
    assert sorted(proc.stdout.readline().strip() for _ in started) == started
    before()
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=60)[1]


@pytest.mark.parametrize("options", [(), ("--job-env",)])
def test_ctrl_c_ends_the_commands_on_local_hosts(tmp_path: Path, options: tuple[str, ...]) -> None:
    (tmp_path / "hosts.yaml").write_text("defaults: {transport: local}\nhosts: ['local-[1-2]']\n")
    token = f"exec-interrupted-{tmp_path.name}"
    commands: list[Path] = []

    def running() -> None:
        commands.extend(p for p in Path("/proc").glob("[0-9]*")
                        if token.encode() in _cmdline(p) and b"clusterrun.cli" not in _cmdline(p))
        assert len(commands) == 2  # the two commands

    try:
        with exec_interrupted(tmp_path, token, *options) as proc:
            err = interrupt(proc, ["local-1: started", "local-2: started"], running)
    finally:
        left = [p for p in commands if token.encode() in _cmdline(p)]
        for path in left:  # a failed test leaves nothing behind either
            os.kill(int(path.name), signal.SIGKILL)
    assert (proc.returncode, err) == (130, "clusterrun: interrupted\n")
    assert left == []


def _cmdline(path: Path) -> bytes:
    try:
        return (path / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.integration
def test_ctrl_c_over_ssh_returns_and_leaves_the_commands(sim_cluster: Callable[..., SimCluster],
                                                         tmp_path: Path) -> None:
    """Ctrl-C closes the connections and exits 130; a command without a terminal is not hung up by
    sshd, so it goes on (as with pdsh): docs/cli.md says so."""
    cluster = sim_cluster(2)
    (tmp_path / "hosts.yaml").write_text(f"ssh_config: {cluster.ssh_config}\nhosts: ['sim[1-2]']\n")
    token = f"exec-ssh-{tmp_path.name}"
    try:
        with exec_interrupted(tmp_path, token) as proc:
            err = interrupt(proc, ["sim1: started", "sim2: started"])
    finally:
        left = _kill_left(cluster, token)
    assert (proc.returncode, err) == (130, "clusterrun: interrupted\n")
    assert [len(pids) for pids in left] == [1, 1]


@pytest.mark.integration
def test_ctrl_c_over_ssh_ends_the_commands_run_with_the_job_env(sim_cluster: Callable[..., SimCluster],
                                                                tmp_path: Path) -> None:
    """With --job-env each host's agent runs the command: it sees its connection end and kills it."""
    cluster = sim_cluster(2)
    (tmp_path / "hosts.yaml").write_text(f"ssh_config: {cluster.ssh_config}\n"
                                         f"defaults: {{python: {sys.executable}}}\nhosts: ['sim[1-2]']\n")
    token = f"exec-ssh-env-{tmp_path.name}"
    try:
        with exec_interrupted(tmp_path, token, "--job-env") as proc:
            err = interrupt(proc, ["sim1: started", "sim2: started"])
        wait_for(lambda: not any(_running(cluster, token)), timeout=30, what="the commands to end")
    finally:
        _kill_left(cluster, token)
    assert (proc.returncode, err) == (130, "clusterrun: interrupted\n")


def _running(cluster: SimCluster, token: str) -> list[list[str]]:
    """Per host, the pids of the processes whose command line holds ``token``."""
    return [[line.split()[0] for line in host.run("ps", "-ewwo", "pid=,args=").stdout.splitlines() if token in line]
            for host in cluster.hosts]


def _kill_left(cluster: SimCluster, token: str) -> list[list[str]]:
    """``_running``, each killed: a test leaves nothing behind, failed or not."""
    left = _running(cluster, token)
    for host, pids in zip(cluster.hosts, left, strict=True):
        if pids:
            host.run("kill", "-KILL", *pids)
    return left
