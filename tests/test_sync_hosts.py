"""The sync end to end: `up` copies the project to simulated hosts (real sshd) and to a local
host's workdir, incrementally, and a full or read-only workdir stops everything before the start."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.sync.carriers import DELTA_MIN
from tests.conftest import ROOT, run_up
from tests.simhosts import SimCluster, namespace_problem, unavailable
from tests.test_sync import make_tree

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]

TRAIN = "import os\nprint('synced', os.getcwd(), open('pkg/data.txt').read().strip())\n"


def project(root: Path) -> Path:
    make_tree(root)
    (root / "train.py").write_text(TRAIN)
    (root / "pkg" / "data.txt").write_text("v1\n")
    return root


def sim_hosts_file(folder: Path, cluster: SimCluster, workdirs: list[Path], extra: str = "") -> Path:
    lines = [f"state_dir: {folder / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
             f"  python: {sys.executable}", "  sync: proj", "  sync_exclude: ['*.ckpt']", "hosts:"]
    for host, workdir in zip(cluster.hosts, workdirs, strict=True):
        lines += [f"  - host: {host.name}", "    nproc: 1", f"    workdir: {workdir}"]
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def tree(root: Path) -> dict[str, tuple[str, int, int, int, bytes | str]]:
    """Every path below ``root``: kind, mode, inode, mtime and content (or link target)."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = ("l", 0, st.st_ino, 0, os.readlink(path))
        elif path.is_dir():
            found[rel] = ("d", st.st_mode & 0o7777, st.st_ino, 0, b"")
        else:
            found[rel] = ("f", st.st_mode & 0o7777, st.st_ino, st.st_mtime_ns, path.read_bytes())
    return found


def same_content(source: Path, copy: Path, left_out: str = r"\.ckpt$") -> None:
    """``copy`` holds what the sync should have copied of ``source``: content, modes, mtimes, links
    (``left_out``: what sync_exclude leaves out besides the project's .gitignore files)."""
    excluded = r"(^|/)(\.git|build)(/|$)|\.log$|^pkg/secret\.txt$"
    want = {p: (k, m, t, c) for p, (k, m, _, t, c) in tree(source).items()
            if not re.search(excluded, p) and not (left_out and re.search(left_out, p))}
    have = {p: (k, m, t, c) for p, (k, m, _, t, c) in tree(copy).items()}
    assert have == want


# What carries the data where a host holds another version of a big file (sync.carrier), and the
# simulated hosts that make it so: rsync where the hosts have it, else the agent (which carries
# files new to a host, or a little changed, always).
CARRIERS = ("rsync", "agent")
BIG = "pkg/model.bin"  # a file of DELTA_MIN bytes that the hosts hold in another version (``stale``)


def stale(source: Path, workdirs: list[Path]) -> None:
    """A big file in ``source`` and another version of it in each workdir: rsync's delta may spare
    sending it, so the sync's carrier is the host's (``carrier``)."""
    (source / BIG).write_bytes(os.urandom(DELTA_MIN))
    for workdir in workdirs:
        (workdir / BIG).parent.mkdir(parents=True, exist_ok=True)
        (workdir / BIG).write_bytes(b"an older version")


@pytest.fixture(params=CARRIERS)
def carrier(request: pytest.FixtureRequest) -> str:
    if shutil.which("rsync") is None:  # the integration tests' setup installs it
        unavailable("rsync is not installed here (tests/_support/install_sshd.sh rsync)")
    if request.param == "agent" and (reason := namespace_problem()) is not None:
        unavailable(f"hiding rsync needs the hosts' own mount namespaces: {reason}")
    return str(request.param)


def hosts_for(carrier: str) -> dict[str, object]:
    """SimCluster.start's options for simulated hosts whose sync goes by ``carrier``."""
    rsync = shutil.which("rsync")
    return {"rsync": {}, "agent": {"hide": [rsync]}}[carrier]


def copied(node: int, host: str, files: int, via: str, size: str = r"[^);]*") -> str:
    return rf"sync node{node} {host}: {files} file\(s\) copied \({size} by {via}\)"


def test_up_syncs_the_project_to_every_host_then_only_what_changed(sim_cluster: MakeCluster, tmp_path: Path,
                                                                   carrier: str) -> None:
    cluster = sim_cluster(2, **hosts_for(carrier))
    source = project(tmp_path / "proj")
    workdirs = [tmp_path / "w1", tmp_path / "w2"]
    stale(source, workdirs)
    hosts = sim_hosts_file(tmp_path, cluster, workdirs)
    first = run_up(hosts, "train.py")
    assert first.returncode == 0, first.stderr
    # over the connection `up` opened anyway: one login per host (the sync opens none of its own)
    assert [host.log.read_text().count("Accepted publickey") for host in cluster.hosts] == [1, 1]
    for node, (host, workdir) in enumerate(zip(cluster.hosts, workdirs, strict=True)):
        synced = rf"^node{node} {host.name} +rank{node} +\| synced {workdir} v1$"
        assert re.search(synced, first.stdout, re.M), first.stdout
        same_content(source, workdir)
        assert re.search(copied(node, host.name, 7, carrier), first.stderr), first.stderr
    assert (workdirs[0] / "pkg" / "tool.sh").stat().st_mode & 0o777 == 0o750
    assert not (workdirs[0] / ".git").exists() and not (workdirs[0] / "pkg" / "data" / "big.ckpt").exists()
    assert (workdirs[0] / "secret.txt").exists() and not (workdirs[0] / "pkg" / "secret.txt").exists()

    before = tree(workdirs[0])
    (source / "pkg" / "data.txt").write_text("v2, longer\n")  # changed: copied again
    os.utime(source / "pkg" / "tool.sh", ns=(10**18, 10**18))  # only its mtime changed: not copied
    second = run_up(hosts, "train.py")
    assert second.returncode == 0, second.stderr
    for node, (host, workdir) in enumerate(zip(cluster.hosts, workdirs, strict=True)):  # a small change: the agent
        assert re.search(copied(node, host.name, 1, "agent", "11 B") + ", 1 with only mode/mtime set, 8 unchanged",
                         second.stderr), second.stderr
        assert re.search(rf"^node{node} {host.name} +rank{node} +\| synced {workdir} v2, longer$", second.stdout, re.M)
        same_content(source, workdir)
    after = tree(workdirs[0])
    replaced = sorted(p for p in before if before[p][2] != after[p][2])
    assert replaced == ["pkg/data.txt"]  # every other file is the one written the first time
    assert after["pkg/tool.sh"][3] == 10**18 and before["pkg/tool.sh"][3] != 10**18


def test_a_login_shell_that_prints_text_makes_rsync_give_way_to_the_agent(sim_cluster: MakeCluster,
                                                                          tmp_path: Path) -> None:
    """rsync cannot pass a shell's greeting (its protocol breaks); the agent skips it: the sync
    still copies everything, and says why."""
    if shutil.which("rsync") is None:
        unavailable("rsync is needed (tests/_support/install_sshd.sh rsync)")
    noisy = tmp_path / "noisy-sh"
    noisy.write_text('#!/bin/sh\necho "Welcome to the cluster!"\nexec /bin/sh "$@"\n')
    noisy.chmod(0o755)
    cluster = sim_cluster(1, login_shell=str(noisy))
    source = project(tmp_path / "proj")
    stale(source, [tmp_path / "w1"])
    hosts = sim_hosts_file(tmp_path, cluster, [tmp_path / "w1"])
    proc = run_up(hosts, "train.py")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"sync node0 sim1: 7 file\(s\) copied \([^)]* by agent; rsync could not start \(exit 2: "
                     r"protocol version mismatch -- is your shell clean\?\)\)", proc.stderr), proc.stderr
    same_content(source, tmp_path / "w1")


FULL = {  # how each carrier says that sim2's disk is full
    "rsync": r'by rsync \(exit 11\): rsync: \[receiver\] write failed on "{w}/\S+": No space left on device \(28\)$',
    "agent": r"cannot write {w}/\S+: No space left on device$",
}


def test_a_full_or_read_only_workdir_fails_the_host_before_anything_starts(sim_cluster: MakeCluster,
                                                                           tmp_path: Path, carrier: str) -> None:
    if (reason := namespace_problem()) is not None:
        unavailable(f"the workdirs are mounted inside the simulated hosts: {reason}")
    cluster = sim_cluster(3, **hosts_for(carrier))
    assert cluster.isolated
    source = project(tmp_path / "proj")
    workdirs = [tmp_path / "w1", tmp_path / "full", tmp_path / "ro"]
    for workdir in workdirs:
        workdir.mkdir()
    stale(source, [workdirs[0], workdirs[2]])  # more than the 1 MB disk holds
    for host, argv in ((cluster.hosts[1], ["mount", "-t", "tmpfs", "-o", "size=1m", "crtest-full", str(workdirs[1])]),
                       (cluster.hosts[2], ["mount", "--bind", "-o", "ro", str(workdirs[2]), str(workdirs[2])])):
        done = host.run(*argv)  # in the host's own mount namespace: gone with the host
        assert done.returncode == 0, done.stderr
    done = cluster.hosts[1].run("sh", "-c", f"mkdir {workdirs[1]}/pkg && echo old > {workdirs[1]}/{BIG}")
    assert done.returncode == 0, done.stderr  # on its small disk, the older version of the big file
    hosts = sim_hosts_file(tmp_path, cluster, workdirs)
    proc = run_up(hosts, "train.py")
    assert proc.returncode == 3, proc.stderr
    assert "2 host(s) cannot run the job; nothing was started" in proc.stderr, proc.stderr
    assert re.search(rf"^sim2: sync to {workdirs[1]} failed: " + FULL[carrier].format(w=workdirs[1]), proc.stderr,
                     re.M), proc.stderr
    assert re.search(rf"^sim3: sync to {workdirs[2]} failed: cannot write {workdirs[2]}\S*: Read-only file "
                     "system$", proc.stderr, re.M), proc.stderr
    assert "Traceback" not in proc.stderr and not re.search("^sim1:", proc.stderr, re.M)  # sim1 was fine
    assert not (tmp_path / "state" / "jobs").exists()  # no node of the job was started, on any host
    listed = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "-a", "--json"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert json.loads(listed.stdout)["jobs"] == []
    for workdir in workdirs:  # no half-written file left behind (rsync's and ours have temporary names)
        assert {str(p.relative_to(workdir)) for p in workdir.rglob("*")} <= {
            str(p.relative_to(source)) for p in source.rglob("*")}


def test_a_local_host_syncs_to_its_own_workdir_and_dry_run_copies_nothing(tmp_path: Path) -> None:
    source = project(tmp_path / "proj")
    workdir = tmp_path / "elsewhere"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"state_dir: {tmp_path / 'state'}\ndefaults:\n  transport: local\n  python: {sys.executable}\n"
                     f"hosts:\n  - host: here\n    workdir: {workdir}\n  - host: same\n    workdir: {source}\n")
    dry = run_up("--dry-run", "--sync", source, hosts, "train.py")
    assert dry.returncode == 0, dry.stderr
    assert "sync node0 here: would copy 7 file(s)" in dry.stderr
    assert f"sync node1 same: {source} is the synced directory itself: nothing to copy" in dry.stderr
    assert not workdir.exists()
    proc = run_up("--sync", source, hosts, "train.py")
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"^node0 here +rank0 +\| synced {workdir} v1$", proc.stdout, re.M), proc.stdout
    assert re.search(rf"^node1 same +rank1 +\| synced {source} v1$", proc.stdout, re.M), proc.stdout
    same_content(source, workdir, left_out="")


def test_restart_syncs_the_project_again_before_the_new_attempt(tmp_path: Path) -> None:
    source = project(tmp_path / "proj")
    workdir = tmp_path / "w"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"state_dir: {tmp_path / 'state'}\ndefaults:\n  transport: local\n  python: {sys.executable}\n"
                     f"  sync: proj\nhosts:\n  - host: here\n    workdir: {workdir}\n")
    first = run_up(hosts, "train.py")
    assert first.returncode == 0, first.stderr
    job = re.search(r"clusterrun: job (\S+): \d+ nodes", first.stderr)
    assert job is not None
    (source / "pkg" / "data.txt").write_text("v2\n")

    def clusterrun(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)

    restarted = clusterrun("restart", job.group(1))
    assert restarted.returncode == 0, restarted.stderr
    assert "sync node0 here: 1 file(s) copied (3 B by agent)" in restarted.stderr  # a small change: no delta to gain
    assert clusterrun("wait", job.group(1)).returncode == 0
    logs = clusterrun("logs", job.group(1), "--node", "0")
    assert f"synced {workdir} v2" in logs.stdout, logs.stdout + logs.stderr
