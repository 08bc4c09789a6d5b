"""Simulated machines for integration tests: each "host" runs a real OpenSSH sshd in its own namespaces.

Lifecycle: ``SimCluster.start(n)`` → ``ssh -F cluster.ssh_config sim1 …`` (``host.run`` looks inside a host,
``host.kill`` crashes it, ``host.block_tcp`` firewalls a port) → ``close()``; the ``sim_cluster`` fixture
factory closes what it made, failed or not.
Each host has its own network, PID, mount and UTS namespaces: a veth on a bridge ``10.77.<k>.0/24`` (``.1`` is the
root namespace, hosts ``.11``…; no default route, no NAT), a private ``/run``, a shared ``/etc/hosts`` naming every
host (or one per host: ``etc_hosts``), optionally an ``eth1`` on a second bridge (``second_network``), and sshd
as its PID namespace's first process, so killing that process kills all the host runs. Where namespaces are refused,
one sshd per loopback address ``127.0.0.(10+i)`` on its own port stands in (``isolated=False``, ``fallback_reason``
says why), except under ``CI=true``, where that is an error. All that is made is named after the creating process
(netns ``crsim-<pid>-…``, links with alias ``crsim-<pid>``, temp dirs ``crsim-<pid>-…``): ``sweep_stale`` finds it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import fnmatch
import functools
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from tests.simnet import (
    IP,
    PREFIX,
    SSHD,
    SimHostError,
    _comm,
    _free_port,
    _free_subnet,
    _ip_batch,
    _ip_json,
    _keygen,
    _listening,
    _netns_names,
    _passwd,
    _sshd_version,
    children,
)

TIMEOUT = 10.0
NFT = shutil.which("nft") or "/usr/sbin/nft"  # nftables, for SimHost.block_tcp (package nftables)
FIREWALL = "crsim-firewall"  # the nftables table block_tcp adds in a host's own network namespace
USER, USER_ID = "crtest", 64123  # the simulated hosts' unprivileged user (SimCluster.start(user=True))
SECOND_NET = "10.76"  # below the first network's 10.77: of two gloo peers, the higher address connects to the lower
ATTEMPT_CGROUPS = "clusterrun-*-n*-a*"  # the agent's cgroup of an attempt, at the top of the hierarchy
# What paramiko negotiates with this OpenSSH (its first choice, mlkem768x25519, is newer than 9.2)
# and the cipher clusterrun asks for first: the benchmarks' OpenSSH baselines on paramiko's terms.
PARAMIKO_TERMS = ("-o", "KexAlgorithms=curve25519-sha256", "-o", "Ciphers=aes128-gcm@openssh.com")
WIPED_LOGS = ("/var/log/wtmp", "/var/log/lastlog", "/var/log/btmp")

# First process of a new PID namespace, inside the host's network namespace; ends by exec'ing sshd.
BOOTSTRAP = """\
set -eu
name=$1 cidr=$2 hosts=$3 config=$4 passwd=$5 sshd=$6 cgroup=$7 login=$8 cidr2=$9 boot_id=${10}
shift 10
mount --make-rprivate /
ip link set lo up
ip addr replace "$cidr" dev eth0  # a rebooted host finds its address kept
ip link set eth0 up
if [ -n "$cidr2" ]; then ip addr replace "$cidr2" dev eth1 && ip link set eth1 up; fi
hostname "$name"
mount -t tmpfs -o mode=0755,size=8m crsim-run /run
# `ip netns exec` remounted /sys without cgroups: the host's cgroup2 where most distributions have it
if [ "$cgroup" = yes ]; then mount -t cgroup2 crsim-cgroup2 /sys/fs/cgroup; fi
# every login starts in this cgroup, as pam_systemd puts it in a session's (or a delegated) scope
if [ -n "$login" ]; then echo $$ > "/sys/fs/cgroup/$login/cgroup.procs"; fi
mkdir -m 0755 /run/sshd
mount --bind "$hosts" /etc/hosts
for log in "$@"; do mount --bind /dev/null "$log"; done
if [ -n "$passwd" ]; then mount --bind "$passwd" /etc/passwd; fi
# a rebooted host has a boot id of its own, as a real one has after a restart (the kernel's is shared)
if [ -n "$boot_id" ]; then mount --bind "$boot_id" /proc/sys/kernel/random/boot_id; fi
exec "$sshd" -D -e -f "$config"
"""


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block ends, then raise the first one that came: their exception
    raised inside ``Popen``, after the fork, would leave the child running where no ``close`` can find it."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread runs handlers
        yield
        return
    came: list[int] = []
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    held = {signum: handler for signum, handler in before.items() if handler is not None}  # None: set in C
    for signum in held:
        signal.signal(signum, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        if came:
            signal.raise_signal(came[0])


@dataclass
class SimHost:
    """One simulated machine: started by ``SimCluster.start`` → ``run`` / ``kill`` → removed by its cluster."""

    name: str
    address: str
    port: int
    isolated: bool
    log: Path
    pid: int = 0
    address2: str | None = None  # its address on the second network (eth1), if it has one
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host's namespaces (directly in the loopback fallback), output captured."""
        enter = ["nsenter", f"--target={self.pid}", "--net", "--pid", "--mount", "--uts"] if self.isolated else []
        return subprocess.run([*enter, *argv], capture_output=True, text=True, timeout=timeout, check=False)

    def block_tcp(self, port: int, verdict: str = "drop") -> None:
        """Firewall TCP ``port`` of this host against the other machines: an nftables rule in the host's
        own network namespace (never this machine's ruleset) applies ``verdict`` to incoming TCP to
        ``port`` on every interface but loopback. ``drop``: connections time out; ``reject``: refused
        (ICMP port unreachable); ``reject with icmpx type admin-prohibited``: firewalld's "No route to
        host". The host itself still reaches the port; ``unblock_tcp`` (or the cluster's ``close``) lifts it."""
        if not self.isolated:
            raise SimHostError("a firewall rule needs a network namespace per host, which the fallback has not")
        if not os.path.exists(NFT):
            raise SimHostError(f"{NFT} not found: install nftables (tests/_support/install_sshd.sh nftables:nft)")
        rules = (f"add table inet {FIREWALL}; "
                 f"add chain inet {FIREWALL} input {{ type filter hook input priority 0; policy accept; }}; "
                 f'add rule inet {FIREWALL} input iifname != "lo" tcp dport {int(port)} {verdict}')
        done = self.run(NFT, rules)
        if done.returncode != 0:
            raise SimHostError(f"{self.name}: nft refused {rules!r}: {done.stderr.strip()}")

    def unblock_tcp(self) -> None:
        """Remove every rule ``block_tcp`` added on this host."""
        done = self.run(NFT, f"delete table inet {FIREWALL}")
        if done.returncode != 0:
            raise SimHostError(f"{self.name}: nft could not delete table {FIREWALL}: {done.stderr.strip()}")

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def served(self) -> list[int]:
        """The sshd processes serving connections to this host now (children of the listener)."""
        return [pid for pid in children().get(self.pid, []) if _comm(pid) == "sshd"]

    def drop_connections(self) -> int:
        """Cut every SSH connection to this host, as a network failure would, but leave sshd listening:
        SIGKILL the sshd processes serving the connections: the listener's children named sshd (orphans of the
        host, such as detached job supervisors, are its children too, as they would be init's). Returns how many."""
        served = self.served()
        for pid in served:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(served)

    def kill(self) -> None:
        """Simulate the machine dying: SIGKILL its first process, and with it its whole PID namespace.
        The attempts' cgroups its processes were in (on this machine's hierarchy, which the host
        mounts) are removed once empty: a dead host's supervisors cannot, and nothing else would."""
        if self._proc is None:
            return
        held: set[str] = set()
        # While the launcher (unshare, or sshd itself in the fallback) lives, self.pid cannot have been reused.
        if self._proc.poll() is None:
            held = _attempt_cgroups_of(self) if self.isolated else set()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid or self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=TIMEOUT)
        for cgroup in held:
            _remove_empty_cgroup(cgroup)


@dataclass
class SimCluster:
    """Simulated machines on one bridge: ``start`` → ``hosts``, ``ssh_config``, ``known_hosts`` → ``close``."""

    dir: Path
    isolated: bool
    fallback_reason: str | None = None
    hosts: list[SimHost] = field(default_factory=list)
    subnet: int = 0
    ssh_config: Path = field(init=False)
    known_hosts: Path = field(init=False)
    client_key: Path = field(init=False)
    _bridge: str | None = None
    _bridge2: str | None = None
    subnet2: int = 0
    etc_hosts: Callable[[SimHost, Sequence[SimHost]], str] | None = None
    second_network: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()
    _links: list[str] = field(default_factory=list)
    _netns: list[str] = field(default_factory=list)
    _closed: bool = False
    cgroup: bool = True
    user: bool = False
    login_cgroup: str = ""
    connect_timeout: int = 10
    _cgroups_before: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ssh_config, self.known_hosts = self.dir / "ssh_config", self.dir / "known_hosts"
        self.client_key = self.dir / "client" / "id_ed25519"

    def ssh_argv(self, host: str, *command: str, terms: Sequence[str] = ()) -> list[str]:
        """The OpenSSH client argv that runs ``command`` on ``host`` with this cluster's config
        (``terms``: options to add, e.g. ``PARAMIKO_TERMS``)."""
        return ["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", *terms, host, *command]

    @classmethod
    def start(cls, n: int, *, login_shell: str | Mapping[str, str] | None = None,
              sshd_options: Mapping[str, str] | None = None, isolated: bool | None = None,
              cgroup: bool = True, user: bool = False, login_cgroup: str = "",
              etc_hosts: Callable[[SimHost, Sequence[SimHost]], str] | None = None,
              second_network: Sequence[str] = (), hide: Sequence[str] = (), connect_timeout: int = 10) -> SimCluster:
        """Start hosts ``sim1``…``simN``; return once every sshd accepts connections.

        ``login_shell`` replaces root's shell on every host (a str) or on the named hosts (a mapping), through a
        copy of /etc/passwd bind-mounted in the host. ``sshd_options`` override or add sshd_config keywords.
        ``isolated=None`` uses namespaces where permitted; False forces the loopback fallback; True refuses it.
        ``cgroup`` mounts cgroup2 at ``/sys/fs/cgroup`` in every host (the one hierarchy of this kernel, as a
        real host has it); False leaves the hosts without cgroups (the loopback fallback always sees this one's).
        ``user`` adds the unprivileged user ``USER`` (uid ``USER_ID``, /bin/sh, a home of their own on each host)
        who logs in with the cluster's client key. ``login_cgroup`` (a path below the cgroup2 root, which the
        caller makes and removes) is where every login starts, as pam_systemd puts it in a session scope.
        ``etc_hosts(host, hosts)`` gives each host an /etc/hosts of its own (default: one naming every host).
        ``second_network`` names hosts that also get an ``eth1`` on a second bridge ``10.76.<subnet2>.0/24``
        (``host.address2``): a network that the hosts not named cannot reach. ``hide`` lists files (programs)
        that the hosts do not have: /dev/null is mounted over each, in the hosts' mount namespaces. All these
        need namespaces. ``connect_timeout`` is the ssh_config's ``ConnectTimeout`` (seconds; clusterrun's
        too): what a connection attempt to an unreachable host costs.
        """
        if not 1 <= n <= 200:
            raise ValueError(f"n must be between 1 and 200, not {n}")
        _sweep_once()
        reason = namespace_problem() if isolated is not False else "loopback fallback requested by the caller"
        if reason and isolated:
            raise SimHostError(f"namespaces are not available: {reason}")
        if reason and isolated is None and in_ci():
            raise SimHostError(f"CI=true: the simulated hosts must have namespaces here, and cannot: {reason}")
        if reason:
            print(f"simhosts: not isolated, one sshd per loopback address instead: {reason}", file=sys.stderr)
            if login_shell or user or login_cgroup or etc_hosts or second_network or hide:
                raise SimHostError("login_shell, user, login_cgroup, etc_hosts, second_network and hide need "
                                   "namespaces per host, which the fallback has not")
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-"))
        cluster = cls(dir=folder, isolated=not reason, fallback_reason=reason, cgroup=cgroup, user=user,
                      login_cgroup=login_cgroup.strip("/"), etc_hosts=etc_hosts, second_network=tuple(second_network),
                      hide=tuple(hide), connect_timeout=connect_timeout)
        cluster._cgroups_before = _attempt_cgroups()
        _OPEN.append(cluster)
        try:
            cluster._start(n, login_shell, dict(sshd_options or {}))
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _start(self, n: int, login_shell: str | Mapping[str, str] | None, options: dict[str, str]) -> None:
        for folder in [self.client_key.parent, *(self.dir / f"sim{i}" for i in range(1, n + 1))]:
            folder.mkdir(mode=0o700)
        _keygen([self.client_key, *(self.dir / f"sim{i}" / "ssh_host_ed25519_key" for i in range(1, n + 1))])
        if self.isolated:
            self._make_network(n)
            addresses = [(f"10.77.{self.subnet}.{10 + i}", 22) for i in range(1, n + 1)]
        else:
            addresses = [(f"127.0.0.{10 + i}", _free_port(f"127.0.0.{10 + i}")) for i in range(1, n + 1)]
            with contextlib.suppress(OSError):  # sshd's privilege-separation dir, normally made by its init script
                Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for i, (address, port) in enumerate(addresses, 1):
            self.hosts.append(SimHost(f"sim{i}", address, port, self.isolated, self.dir / f"sim{i}" / "sshd.log",
                                      address2=(f"{SECOND_NET}.{self.subnet2}.{10 + i}"
                                                if f"sim{i}" in self.second_network else None)))
        self._write_files(login_shell, options)
        for i, host in enumerate(self.hosts):
            self._launch(host, self._netns[i] if self.isolated else None)
        self._wait_ready()

    def _make_network(self, n: int) -> None:
        pid = os.getpid()
        # Choosing a free /24 and taking it is atomic among concurrent test processes; locking the temp dir
        # itself leaves no lock file behind.
        lock = os.open(tempfile.gettempdir(), os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _free_subnet()
            self._bridge = bridge = f"cr{pid:x}b{self.subnet:x}"
            lines = [f"link add {bridge} type bridge", f"link set {bridge} alias {PREFIX}-{pid}",
                     f"addr add 10.77.{self.subnet}.1/24 dev {bridge}", f"link set {bridge} up"]
            for i in range(1, n + 1):
                netns, veth = f"{PREFIX}-{pid}-{self.subnet}-sim{i}", f"cr{pid:x}v{self.subnet:x}h{i:x}"
                self._netns.append(netns)
                self._links.append(veth)
                lines += [f"netns add {netns}", f"link add {veth} type veth peer name eth0 netns {netns}",
                          f"link set {veth} alias {PREFIX}-{pid}", f"link set {veth} master {bridge}",
                          f"link set {veth} up"]
            _ip_batch(lines)
            if self.second_network:
                self.subnet2 = _free_subnet(SECOND_NET)
                self._bridge2 = bridge = f"cr{pid:x}c{self.subnet2:x}"
                lines = [f"link add {bridge} type bridge", f"link set {bridge} alias {PREFIX}-{pid}",
                         f"addr add {SECOND_NET}.{self.subnet2}.1/24 dev {bridge}", f"link set {bridge} up"]
                for i in range(1, n + 1):
                    if f"sim{i}" not in self.second_network:
                        continue
                    veth = f"cr{pid:x}w{self.subnet2:x}h{i:x}"
                    self._links.append(veth)
                    lines += [f"link add {veth} type veth peer name eth1 netns {self._netns[i - 1]}",
                              f"link set {veth} alias {PREFIX}-{pid}", f"link set {veth} master {bridge}",
                              f"link set {veth} up"]
                _ip_batch(lines)
        finally:
            os.close(lock)

    def _write_files(self, login_shell: str | Mapping[str, str] | None, options: dict[str, str]) -> None:
        (self.dir / "authorized_keys").write_text(self.client_key.with_suffix(".pub").read_text())
        (self.dir / "hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
                                        + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        (self.dir / "bootstrap.sh").write_text(BOOTSTRAP)
        known, config = [], []
        for host in self.hosts:
            key = " ".join((self.dir / host.name / "ssh_host_ed25519_key.pub").read_text().split()[:2])
            names = [host.address, host.name]
            if host.port != 22:
                names = [f"[{name}]:{host.port}" for name in names]
            known.append(f"{','.join(names)} {key}\n")
            config.append(f"Host {host.name}\n    HostName {host.address}\n    Port {host.port}\n"
                          f"    User {pwd.getpwuid(os.getuid()).pw_name}\n    IdentityFile {self.client_key}\n"
                          f"    IdentitiesOnly yes\n    UserKnownHostsFile {self.known_hosts}\n"
                          "    StrictHostKeyChecking yes\n    BatchMode yes\n"
                          f"    ConnectTimeout {self.connect_timeout}\n\n")
            (self.dir / host.name / "sshd_config").write_text(self._sshd_config(host, options))
            if self.etc_hosts is not None:
                (self.dir / host.name / "hosts").write_text(self.etc_hosts(host, self.hosts))
            shell = login_shell if isinstance(login_shell, str) else (login_shell or {}).get(host.name)
            if self.isolated:
                # Each machine has its own home: the user's shell start-up files (here ~/.bashrc runs
                # `pyenv init`, whose rehash lock a killed host would leave behind) stay out of the test.
                home = self.dir / host.name / "home"
                home.mkdir(mode=0o700)
                passwd = _passwd(home, shell)
                if self.user:
                    passwd += f"{USER}:x:{USER_ID}:{USER_ID}::{self._user_home(host)}:/bin/sh\n"
                (self.dir / host.name / "passwd").write_text(passwd)
        self.known_hosts.write_text("".join(known))
        self.ssh_config.write_text("".join(config))

    def _user_home(self, host: SimHost) -> Path:
        """``USER``'s home on ``host``, with the client key authorized (the folders above it are 0711)."""
        home = self.dir / host.name / USER
        if not home.exists():
            for folder in (self.dir, self.dir / host.name):
                folder.chmod(0o711)
            (home / ".ssh").mkdir(parents=True)
            (home / ".ssh" / "authorized_keys").write_text(self.client_key.with_suffix(".pub").read_text())
            for path in (home, home / ".ssh", home / ".ssh" / "authorized_keys"):
                os.chown(path, USER_ID, USER_ID)
            home.chmod(0o700)
        return home

    def _sshd_config(self, host: SimHost, options: dict[str, str]) -> str:
        settings = {
            "ListenAddress": host.address, "Port": str(host.port),
            "HostKey": str(self.dir / host.name / "ssh_host_ed25519_key"),
            "AuthorizedKeysFile": f"{self.dir / 'authorized_keys'} .ssh/authorized_keys",
            "PubkeyAuthentication": "yes", "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
            "PermitRootLogin": "prohibit-password", "StrictModes": "no", "UsePAM": "no", "PidFile": "none",
            "PrintMotd": "no", "PrintLastLog": "no", "Subsystem": "sftp internal-sftp",
        }
        if _sshd_version() >= (9, 8):
            # Every client connects from the bridge's one address: penalising it would refuse later tests.
            settings["PerSourcePenalties"] = "no"
        # sshd keeps the first value it reads for a keyword, so the caller's options go first.
        overridden = {key.lower() for key in options}
        kept = {key: value for key, value in settings.items() if key.lower() not in overridden}
        return "".join(f"{key} {value}\n" for key, value in {**options, **kept}.items())

    def _launch(self, host: SimHost, netns: str | None, boot_id: Path | None = None) -> None:
        folder = self.dir / host.name
        if netns:
            passwd = folder / "passwd"
            argv = [IP, "netns", "exec", netns, "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--mount",
                    "--propagation", "private", "--kill-child", "sh", str(self.dir / "bootstrap.sh"), host.name,
                    f"{host.address}/24", str(folder / "hosts" if self.etc_hosts else self.dir / "hosts"),
                    str(folder / "sshd_config"), str(passwd) if passwd.exists() else "", SSHD,
                    "yes" if self.cgroup else "no", self.login_cgroup, f"{host.address2}/24" if host.address2 else "",
                    str(boot_id or ""), *filter(os.path.isfile, WIPED_LOGS), *self.hide]
        else:
            argv = [SSHD, "-D", "-e", "-f", str(folder / "sshd_config")]
        with open(host.log, "wb") as log, _signals_held():
            host._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          start_new_session=True)
        host.pid = 0 if netns else host._proc.pid

    def set_link(self, host: SimHost, up: bool) -> None:
        """Plug ``host``'s network cable in or out (its veth on the bridge): packets to and from it
        vanish, as on a real network failure; nothing on the host notices."""
        if not self.isolated:
            raise SimHostError("a host's link can only be cut where hosts have network namespaces")
        _ip_batch([f"link set {self._links[self.hosts.index(host)]} {'up' if up else 'down'}"])

    def reboot(self, host: SimHost, new_boot_id: bool = True) -> None:
        """Simulate a reboot: the host dies with everything on it, then comes back with a fresh PID namespace
        and a new boot id (/proc/sys/kernel/random/boot_id; same name, address and host key; files on disk are
        kept, as on a real machine). ``new_boot_id=False``: the kernel's boot id, as if every process of the
        host had been killed at once (the OOM killer, a container restarted)."""
        if not self.isolated:
            raise SimHostError("reboot needs a PID namespace per host, which the fallback has not")
        host.kill()
        boot_id = self.dir / host.name / "boot_id" if new_boot_id else None
        if boot_id is not None:
            boot_id.write_text(f"{uuid.uuid4()}\n")
        self._launch(host, self._netns[self.hosts.index(host)], boot_id)
        self._wait_ready([host])

    def _wait_ready(self, hosts: Sequence[SimHost] | None = None) -> None:
        deadline = time.monotonic() + TIMEOUT
        pending = {host.name: host for host in (self.hosts if hosts is None else hosts)}
        while pending:
            for host in list(pending.values()):
                if host._proc is None or host._proc.poll() is not None:
                    raise SimHostError(f"{host.name} exited during start-up:\n{host.log.read_text()}")
                # Connecting before the host has its address would cost an ARP retry (1 s): first look for
                # sshd's listening socket in the host's network namespace, which sends no packet.
                if self.isolated and not _listening(host._proc.pid, host.port):
                    continue
                with contextlib.suppress(OSError), socket.create_connection((host.address, host.port), 1):
                    del pending[host.name]
            if pending and time.monotonic() > deadline:
                raise SimHostError(f"sshd not ready after {TIMEOUT} s on {sorted(pending)}")
            time.sleep(0.01 if pending else 0)
        if self.isolated:
            parents = children()
            for host in self.hosts if hosts is None else hosts:
                found = parents.get(host._proc.pid if host._proc else 0, [])
                if len(found) != 1:
                    raise SimHostError(f"{host.name}: expected one first process, found {found}")
                host.pid = found[0]

    def close(self) -> None:
        """Kill every host, delete the namespaces, links and bridge made for them, wait until gone, remove files."""
        if self._closed:
            return
        self._closed = True
        # A host killed with its jobs cannot remove their attempts' cgroups: each host's kill removes those
        # its processes held. Never another test's (running, or just made and still empty: parallel workers);
        # but in the loopback fallback any process may be the hosts': every attempt cgroup made meanwhile.
        left = [] if self.isolated else sorted(_attempt_cgroups() - self._cgroups_before)
        for host in self.hosts:
            host.kill()
        for cgroup in left:
            _remove_empty_cgroup(cgroup)
        links = [*self._links, *(bridge for bridge in (self._bridge, self._bridge2) if bridge)]
        if links or self._netns:
            _ip_batch([*(f"link del {x}" for x in links), *(f"netns del {x}" for x in self._netns)], force=True)
            deadline = time.monotonic() + TIMEOUT
            while left := ({x["ifname"] for x in _ip_json("link")} & set(links)) | (_netns_names() & set(self._netns)):
                if time.monotonic() > deadline:
                    raise SimHostError(f"still present after close: {sorted(left)}")
                time.sleep(0.02)
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(ValueError):
            _OPEN.remove(self)


_OPEN: list[SimCluster] = []


@atexit.register
def _close_open_clusters() -> None:
    for cluster in list(_OPEN):
        with contextlib.suppress(Exception):
            cluster.close()


def close_on_signals() -> None:
    """End this process on SIGTERM and SIGHUP as on Ctrl-C, through its ``finally`` blocks and atexit, so that
    the clusters it started are closed (the default action ends it at once and leaves them behind); a second
    signal during that cleanup is ignored. For programs that are not pytest: the benchmarks."""

    def leave(signum: int, frame: object) -> None:
        for other in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(other, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, leave)


@pytest.fixture
def sim_cluster() -> Iterator[Callable[..., SimCluster]]:
    """A factory ``make(n, login_shell=None, **kwargs) -> SimCluster``; every cluster it made is closed at teardown."""
    with contextlib.ExitStack() as closing:

        def make(n: int, login_shell: str | Mapping[str, str] | None = None, **kwargs: object) -> SimCluster:
            cluster = SimCluster.start(n, login_shell=login_shell, **kwargs)  # type: ignore[arg-type]
            closing.callback(cluster.close)
            return cluster

        yield make


def in_ci() -> bool:
    """True under CI (``CI=true``), which must test what it claims: no loopback fallback, no skips."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip a test this machine cannot run (saying why); under CI, fail it instead."""
    if in_ci():
        pytest.fail(f"CI=true, but this machine cannot run the test: {reason}")
    pytest.skip(reason)


@functools.cache
def namespace_problem() -> str | None:
    """Why namespaces cannot be used here, or None when they can (probed once per process)."""
    for tool in (SSHD, IP, "unshare", "nsenter", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed (run tests/_support/install_sshd.sh)"
    probe = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "--uts", "--mount", "true"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"unshare refused: {probe.stderr.strip()}"
    netns, bridge = f"{PREFIX}-{os.getpid()}-probe", f"cr{os.getpid():x}p"
    try:
        _ip_batch([f"netns add {netns}", f"link add {bridge} type bridge"])
    except SimHostError as exc:
        return str(exc)
    finally:
        _ip_batch([f"link del {bridge}", f"netns del {netns}"], force=True)
    return None


def _attempt_cgroups() -> set[str]:
    """The attempts' cgroups at the top of this machine's cgroup2 hierarchy, which the simulated
    hosts mount as their own (as root, the agent makes them there)."""
    from clusterrun.agent.cgroup import cgroup2_mount

    mount = cgroup2_mount()
    return set() if mount is None else {str(p) for p in Path(mount).glob(ATTEMPT_CGROUPS) if p.is_dir()}


def _attempt_cgroups_of(host: SimHost) -> set[str]:
    """The attempts' cgroups (this machine's paths, as ``_attempt_cgroups`` lists them) that hold a
    process of ``host``'s PID namespace."""
    from clusterrun.agent.cgroup import cgroup2_mount

    mount, held = cgroup2_mount(), set()
    with contextlib.suppress(OSError):
        namespace = os.readlink(f"/proc/{host.pid}/ns/pid")
        for entry in filter(str.isdigit, os.listdir("/proc")) if mount else ():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    for line in Path(f"/proc/{entry}/cgroup").read_text().splitlines():
                        top = line[4:].split("/", 1)[0] if line.startswith("0::/") else ""
                        if fnmatch.fnmatchcase(top, ATTEMPT_CGROUPS):
                            held.add(os.path.join(mount or "", top))
    return held


def _remove_empty_cgroup(cgroup: str) -> None:
    """Remove ``cgroup`` and its ``job`` child once the processes killed in them are gone; a cgroup
    that stays populated (another test's job) is left alone."""
    from clusterrun.agent import cgroup as cg

    for path in (os.path.join(cgroup, "job"), cgroup):
        if os.path.isdir(path) and cg.cg_wait_empty(path, time.monotonic() + 5):
            with contextlib.suppress(OSError):
                os.rmdir(path)


@functools.cache
def _sweep_once() -> None:
    sweep_stale()


def sweep_stale() -> None:
    """Remove the namespaces (and their processes), links and temp dirs of test processes that are gone."""

    def dead(name: str) -> bool:
        found = re.match(rf"{PREFIX}-(\d+)(?:-|$)", name)
        return found is not None and not os.path.exists(f"/proc/{found[1]}")

    if not shutil.which(IP):
        return
    stale = [netns for netns in _netns_names() if dead(netns)]
    for netns in stale:
        pids = subprocess.run([IP, "netns", "pids", netns], capture_output=True, text=True, check=False).stdout
        for pid in pids.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    links = [link["ifname"] for link in _ip_json("link") if dead(link.get("ifalias", ""))]
    _ip_batch([*(f"link del {x}" for x in links), *(f"netns del {x}" for x in stale)], force=True)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*"):
        if folder.is_dir() and dead(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
