"""`ps` (default, -a, --state), `rm`/`prune`, and the JSON documents checked against docs/json.md.

Fast: the jobs are records made here; their hosts are local (the agent runs as a process, no
torchrun). A job that is "running" is owned by this test (it holds the job's owner lock), so that
no command reconciles it or starts a monitor for it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterrun.core.events import JobState, NodeState
from clusterrun.store.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord
from clusterrun.views.joblist import RECENT, header_text, job_state_text, shown, stop_guarantee
from tests import clirun
from tests.conftest import ROOT, write_hosts

DAY = 24 * 3600


def clusterrun(*args: str | os.PathLike[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return clirun.clusterrun(*args, cwd=cwd)


def make_record(job_id: str, state: str, ended_ago: float | None, hosts: Path | None = None,
                now: float | None = None) -> JobRecord:
    now = time.time() if now is None else now
    ended = None if ended_ago is None else now - ended_ago
    started = (ended or now) - 60
    text = hosts.read_text() if hosts is not None else "hosts:\n  - host: a\n"
    state_dir = re.search(r"state_dir: (.*)", text)
    node_state = {"running": NodeState.RUNNING, "succeeded": NodeState.SUCCEEDED}.get(state, NodeState(state))
    cause = "rank 1 on node 0: exit code 1" if state == "failed" else None
    return JobRecord(job_id=job_id, name=job_id.split("-")[0], created=started, hosts_file=str(hosts or "hosts.yaml"),
                     hosts_text=text, script="train.py", script_args=["--lr", "0.1"],
                     env_overrides={"API_TOKEN": "hunter2-secret"}, local_cwd=str(ROOT), grace=1.0, ssh_config=None,
                     plan={"state_dir": state_dir.group(1) if state_dir else None, "nodes": []},
                     state=JobState(state),
                     attempts=[AttemptRecord(1, started=started, master_port=29500, state=JobState(state), ended=ended,
                                             root_cause=cause)],
                     nodes=[NodeRecord(0, "local-a" if hosts else "a", node_state, pid=4321,
                                       exit_code=1 if state == "failed" else None)])


@pytest.fixture
def store(controller_state: Path) -> JobStore:
    return JobStore(controller_state / "clusterrun" / "jobs")


@pytest.fixture
def jobs(store: JobStore) -> Iterator[dict[str, str]]:
    """Four jobs: running (owned here), failed an hour ago, stopped two days ago, succeeded three days ago."""
    made = {"running": ("run-20261123-100000-aaaa", None), "failed": ("fail-20261123-090000-bbbb", 3600.0),
            "stopped": ("stop-20261121-090000-cccc", 2 * DAY), "succeeded": ("ok-20261120-090000-dddd", 3 * DAY)}
    for state, (job_id, ago) in made.items():
        store.create(make_record(job_id, state, ago))
    owner = store.try_own(made["running"][0])
    assert owner is not None
    yield {state: job_id for state, (job_id, _) in made.items()}
    store.release(owner)


def listed(stdout: str) -> set[str]:
    return {line.split()[0] for line in stdout.splitlines()[1:]}


def test_the_recent_window_is_pure() -> None:
    now = 1_000_000.0
    records = [make_record("a-1", "running", None, now=now), make_record("b-1", "failed", RECENT - 1, now=now),
               make_record("c-1", "failed", RECENT + 1, now=now)]
    assert [r.job_id for r in shown(records, now)[0]] == ["a-1", "b-1"] and shown(records, now)[1] == 1
    assert len(shown(records, now, show_all=True)[0]) == 3
    assert [r.job_id for r in shown(records, now, states=["failed"])[0]] == ["b-1", "c-1"]


def test_a_hosts_stop_guarantee_says_what_a_stop_will_rest_on() -> None:
    """The one wording of `up --dry-run`, `ps JOB` and the web page."""
    assert stop_guarantee([]) == ["a stop is verified by the attempt's cgroup"]
    lines = stop_guarantee(["no cgroup: cgroup2 is not mounted", "no pidfd: Python 3.8"])
    assert lines[0].startswith("a stop sweeps (no cgroup: ") and "verified" not in lines[0]
    assert lines[1:] == ["fallback: no cgroup: cgroup2 is not mounted", "fallback: no pidfd: Python 3.8"]


def test_a_running_attempt_with_a_failed_node_is_shown_failing_while_its_other_nodes_stop() -> None:
    now = time.time()
    record = make_record("run-20261123-100000-aaaa", "running", None, now=now)
    record.nodes = [NodeRecord(0, "a", NodeState.STOPPED), NodeRecord(1, "b", NodeState.FAILED, exit_code=1),
                    NodeRecord(2, "c", NodeState.RUNNING, unreachable_since=now - 30)]
    assert job_state_text(record, now).startswith("failing; node 2 unreachable since ")
    record.nodes[1].state = NodeState.LOST
    assert job_state_text(record, now).startswith("failing; ")
    record.nodes[1].state = NodeState.RUNNING  # only the host cannot be reached: nothing failed
    assert job_state_text(record, now).startswith("running; node 2 unreachable since ")


def test_ps_job_s_first_line_names_the_next_attempt_during_a_backoff_and_the_current_one_else() -> None:
    now = time.time()
    record = make_record("run-20261123-100000-aaaa", "running", None, now=now)
    assert header_text(record, now) == "job run-20261123-100000-aaaa (run): running, attempt 1, train.py --lr 0.1"
    record.state, record.restart_at = JobState.RESTARTING, now + 25
    assert header_text(record, now) == ("job run-20261123-100000-aaaa (run): restarting: attempt 2 starts in 25 s, "
                                        "train.py --lr 0.1")


def test_ps_shows_unfinished_and_recently_ended_jobs_by_default(jobs: dict[str, str]) -> None:
    default = clusterrun("ps")
    assert default.returncode == 0, default.stderr
    assert listed(default.stdout) == {jobs["running"], jobs["failed"]}, default.stdout
    assert "2 job(s) that ended more than a day ago not shown: `clusterrun ps -a`" in default.stderr

    everything = clusterrun("ps", "-a")
    assert listed(everything.stdout) == set(jobs.values()) and everything.stderr == ""
    assert listed(clusterrun("ps", "--all").stdout) == set(jobs.values())

    by_state = clusterrun("ps", "--state", "succeeded", "--state", "stopped")
    assert listed(by_state.stdout) == {jobs["succeeded"], jobs["stopped"]}, by_state.stdout
    assert listed(clusterrun("ps", "--state", "running").stdout) == {jobs["running"]}

    bad = clusterrun("ps", "--state", "done")
    assert bad.returncode == 2 and "'--state'" in bad.stderr and "done" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------ the documented schemas


def documented_schema(which: str) -> dict[str, Any]:
    """The JSON Schema under ``<!-- schema: which -->`` in docs/json.md."""
    text = (ROOT / "docs" / "json.md").read_text()
    found = re.search(rf"<!-- schema: {which} -->\n```json\n(.*?)\n```", text, re.S)
    assert found, f"no schema {which!r} in docs/json.md"
    return json.loads(found.group(1))  # type: ignore[no-any-return]


TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "null": type(None),
         "boolean": bool}
DATE_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)\Z")


def violations(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """What of ``value`` breaks ``schema`` (the part of JSON Schema that docs/json.md uses)."""
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(isinstance(value, TYPES[t]) and not (t == "integer" and isinstance(value, bool)) for t in types):
            return [f"{where}: {value!r} is not of type {types}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if schema.get("format") == "date-time" and isinstance(value, str) and not DATE_TIME.match(value):
        errors.append(f"{where}: {value!r} is not an ISO 8601 date-time")
    if "minimum" in schema and isinstance(value, int) and value < schema["minimum"]:
        errors.append(f"{where}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        errors += [f"{where}: {key!r} is missing" for key in schema.get("required", []) if key not in value]
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                errors += violations(item, properties[key], f"{where}.{key}")
            elif extra is False:
                errors.append(f"{where}: {key!r} is not in the documented schema")
            elif isinstance(extra, dict):
                errors += violations(item, extra, f"{where}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: {len(value)} items")
        for i, item in enumerate(value):
            errors += violations(item, schema.get("items", {}), f"{where}[{i}]")
    return errors


def test_the_validator_catches_what_the_schemas_rule_out() -> None:
    schema = documented_schema("ps")
    good = {"schema": 1, "jobs": []}
    assert violations(good, schema) == []
    assert violations({"schema": 2, "jobs": []}, schema)
    assert violations({"schema": 1, "jobs": [], "internal": 1}, schema)
    job = json.loads(clusterrun_json_of_one())
    assert violations(job, schema) == []
    job["jobs"][0]["created"] = 1700000000.0
    assert violations(job, schema) == ["$.jobs[0].created: 1700000000.0 is not of type ['string']"]


def clusterrun_json_of_one() -> str:
    from clusterrun.views.joblist import jobs_json

    return json.dumps(jobs_json([make_record("x-20261123-100000-eeee", "failed", 10.0)]))


def test_ps_json_matches_its_documented_schema_and_leaves_the_environment_out(jobs: dict[str, str],
                                                                              tmp_path: Path, store: JobStore) -> None:
    schema = documented_schema("ps")
    listing = clusterrun("ps", "-a", "--json")
    assert listing.returncode == 0, listing.stderr
    data = json.loads(listing.stdout)
    assert violations(data, schema) == []
    assert [j["id"] for j in data["jobs"]] == [jobs[s] for s in ("succeeded", "stopped", "failed", "running")]
    failed = data["jobs"][2]
    assert failed["state"] == "failed" and failed["ended"].endswith("Z") and failed["args"] == ["--lr", "0.1"]
    assert failed["attempts"][0]["root_cause"] == "rank 1 on node 0: exit code 1"
    assert "hunter2" not in listing.stdout and "API_TOKEN" not in listing.stdout
    default = json.loads(clusterrun("ps", "--json").stdout)
    assert {j["id"] for j in default["jobs"]} == {jobs["running"], jobs["failed"]}

    hosts = write_hosts(tmp_path, [1], tmp_path / "state")  # one job of a real (local) host: its answer too
    store.create(make_record("one-20261123-110000-ffff", "failed", 60.0, hosts=hosts))
    one = clusterrun("ps", "one", "--json")
    assert one.returncode == 0, one.stderr
    data = json.loads(one.stdout)
    assert violations(data, schema) == []
    assert [j["id"] for j in data["jobs"]] == ["one-20261123-110000-ffff"]
    assert set(data["jobs"][0]["nodes"][0]) >= {"containment", "fallbacks", "degraded"}


def test_dry_run_json_is_the_plan_in_its_documented_schema_and_starts_nothing(tmp_path: Path) -> None:
    hosts = write_hosts(tmp_path, [2, 1], tmp_path / "state")
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    proc = clusterrun("up", "--dry-run", "--json", "--env", "A=b c", hosts, "train.py", "--", "--steps", "3",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert violations(data, documented_schema("dry-run")) == []
    assert data["world_size"] == 3 and [n["ranks"] for n in data["nodes"]] == [[0, 1], [2, 2]]
    assert data["args"] == ["--steps", "3"] and data["nodes"][1]["env"]["A"] == "b c"
    assert "--node-rank=1" in data["nodes"][1]["argv"] and data["nodes"][1]["argv"][-2:] == ["--steps", "3"]
    assert not (tmp_path / "state" / "jobs").exists()
    alone = clusterrun("up", "--json", hosts, "train.py", cwd=tmp_path)
    assert alone.returncode == 2 and "--json goes with --dry-run" in alone.stderr, alone.stderr
    assert not (tmp_path / "state" / "jobs").exists()


# ------------------------------------------------------------------------------- rm and prune


def test_rm_removes_ended_jobs_and_refuses_a_running_one(jobs: dict[str, str], store: JobStore) -> None:
    running = clusterrun("rm", jobs["running"])
    assert running.returncode == 1, running.stderr
    assert f"job {jobs['running']} is running: not removed; stop it first (`clusterrun down" in running.stderr
    assert store.load(jobs["running"]).job_id == jobs["running"]

    both = clusterrun("rm", "fail", jobs["running"])  # a name, and the running job again
    assert both.returncode == 1 and both.stdout.split() == [jobs["failed"]], both.stderr
    assert {r.job_id for r in store.all()} == {jobs["running"], jobs["stopped"], jobs["succeeded"]}

    unknown = clusterrun("rm", "nothing-like-it", jobs["stopped"])
    assert unknown.returncode == 2 and "no job matches 'nothing-like-it'" in unknown.stderr
    assert len(store.all()) == 3  # nothing is removed when a job cannot be named

    pruned = clusterrun("prune")
    assert pruned.returncode == 0, pruned.stderr
    assert set(pruned.stdout.split()) == {jobs["stopped"], jobs["succeeded"]}
    assert "removed the records of 2 ended job(s); their logs stay on the hosts" in pruned.stderr
    assert [r.job_id for r in store.all()] == [jobs["running"]]


def host_state(state_dir: Path, job_id: str, state: dict[str, Any]) -> Path:
    attempt = state_dir / "jobs" / job_id / "node0" / "attempt1"
    attempt.mkdir(parents=True)
    (attempt / "output.log").write_text("step 1\n" * 100)
    (attempt / "state.json").write_text(json.dumps(state))
    return attempt


def test_rm_hosts_too_deletes_the_logs_on_the_hosts_only_when_confirmed(tmp_path: Path, store: JobStore) -> None:
    state_dir = tmp_path / "state"
    hosts = write_hosts(tmp_path, [1], state_dir)
    job = "gone-20261123-100000-abcd"
    store.create(make_record(job, "failed", 60.0, hosts=hosts))
    attempt = host_state(state_dir, job, {"state": "exited", "exit_code": 1})

    unconfirmed = clusterrun("rm", "--hosts-too", job)
    assert unconfirmed.returncode == 2, unconfirmed.stderr
    assert "no terminal to confirm on; nothing was removed" in unconfirmed.stderr and "-y/--yes" in unconfirmed.stderr
    assert attempt.is_dir() and store.load(job)

    confirmed = clusterrun("rm", "--hosts-too", "-y", job)
    assert confirmed.returncode == 0, confirmed.stderr
    assert f"node0 local-a: removed {state_dir / 'jobs' / job / 'node0'} (" in confirmed.stderr
    assert not (state_dir / "jobs" / job).exists() and store.all() == []


def test_rm_hosts_too_keeps_what_still_runs_on_a_host(tmp_path: Path, store: JobStore) -> None:
    """A record that says failed while a host still runs the job (its supervisor alive): the host
    refuses, nothing there is deleted and the record is kept."""
    state_dir = tmp_path / "state"
    hosts = write_hosts(tmp_path, [1], state_dir)
    job = "stale-20261123-100000-abcd"
    store.create(make_record(job, "failed", 60.0, hosts=hosts))
    me = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    attempt = host_state(state_dir, job, {"state": "running", "boot_id": boot,
                                          "supervisor": {"pid": os.getpid(), "start_time": int(me[19])}})
    proc = clusterrun("rm", "--hosts-too", "--yes", job)
    assert proc.returncode == 3, proc.stderr
    assert "still runs; stop the job first" in proc.stderr and "its record is kept" in proc.stderr
    assert (attempt / "output.log").is_file() and store.load(job).job_id == job


def test_down_of_a_finished_job_says_there_was_nothing_to_stop(tmp_path: Path, store: JobStore) -> None:
    hosts = write_hosts(tmp_path, [1], tmp_path / "state")
    store.create(make_record("done-20261123-100000-abcd", "failed", 60.0, hosts=hosts))
    proc = clusterrun("down", "done")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "clusterrun: job done-20261123-100000-abcd already finished (failed); nothing to stop\n"


def on_a_terminal(args: list[str], answer: str) -> tuple[int, str]:
    """Run clusterrun with a pseudo-terminal as stdin and stdout; type ``answer`` once it asks."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "clusterrun", *args], stdin=follower, stdout=follower,
                            stderr=follower, cwd=ROOT, close_fds=True)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 60
    try:
        while b"[y/N]" not in seen and time.monotonic() < deadline:
            if select.select([leader], [], [], 1)[0]:
                seen += os.read(leader, 4096)
        os.write(leader, answer.encode() + b"\n")
        code = proc.wait(timeout=60)
        while select.select([leader], [], [], 0.2)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other side has closed
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    return code, seen.decode(errors="replace")


def test_rm_hosts_too_asks_on_a_terminal_and_no_removes_nothing(tmp_path: Path, store: JobStore) -> None:
    state_dir = tmp_path / "state"
    hosts = write_hosts(tmp_path, [1], state_dir)
    job = "asked-20261123-100000-abcd"
    store.create(make_record(job, "succeeded", 60.0, hosts=hosts))
    attempt = host_state(state_dir, job, {"state": "exited", "exit_code": 0})
    code, shown_text = on_a_terminal(["rm", "--hosts-too", job], "n")
    assert code == 1 and "Delete the state and logs of 1 job(s) on local-a" in shown_text, shown_text
    assert "nothing was removed" in shown_text and attempt.is_dir() and store.load(job)
    code, shown_text = on_a_terminal(["rm", "--hosts-too", job], "y")
    assert code == 0, shown_text
    assert not attempt.exists() and store.all() == []


def test_a_damaged_record_is_listed_with_its_path_and_fix_and_rm_removes_it(jobs: dict[str, str],
                                                                            store: JobStore) -> None:
    """A truncated job.json: `ps` lists the job as damaged with the path and the fix, `ps --json`
    in `damaged`; every command naming it says the same and exits 1 (no traceback), its monitor
    exits with the message in its log; `rm` removes it; `prune` keeps it."""
    bad = "bad-20261123-100000-9999"
    store.create(make_record(bad, "running", None))
    path = store.dir(bad) / "job.json"
    at = path.read_bytes().index(b'"train.py"')
    path.write_bytes(path.read_bytes()[:at + 4])  # cut short in the middle of the script's name
    message = f"damaged record: {path} (not JSON at byte {at} of {at + 4}: Unterminated string"
    fix = f"remove it with `clusterrun rm {bad}`"

    listing = clusterrun("ps")
    assert listing.returncode == 0, listing.stderr
    assert re.search(rf"^{bad}\s+\?\s+\?\s+damaged", listing.stdout, re.M), listing.stdout
    assert jobs["running"] in listing.stdout and message in listing.stderr and fix in listing.stderr, listing.stderr
    data = json.loads(clusterrun("ps", "--json").stdout)
    assert violations(data, documented_schema("ps")) == []
    assert data["damaged"] == [{"id": bad, "path": str(path), "reason": f"not JSON at byte {at} of {at + 4}: "
                                "Unterminated string starting at", "fix": data["damaged"][0]["fix"]}]
    assert fix in data["damaged"][0]["fix"] and bad not in {j["id"] for j in data["jobs"]}

    for command in (["ps", bad], ["ps", "bad-2026"], ["logs", bad], ["attach", "--no-tui", bad], ["down", bad],
                    ["restart", bad], ["wait", bad]):
        named = clusterrun(*command)
        assert named.returncode == 1 and message in named.stderr and fix in named.stderr, (command, named.stderr)
        assert "Traceback" not in named.stderr, named.stderr
    monitor = clusterrun("_monitor", bad)  # its output is its log; the daemon's end closes the pipe
    assert message in monitor.stdout + monitor.stderr and "Traceback" not in monitor.stdout + monitor.stderr

    pruned = clusterrun("prune")
    assert pruned.returncode == 0 and f"kept the damaged record of job {bad}" in pruned.stderr and path.exists()
    removed = clusterrun("rm", bad)
    assert removed.returncode == 0 and removed.stdout == f"{bad}\n", removed.stderr
    assert not store.dir(bad).exists() and "damaged" not in clusterrun("ps").stdout


def test_dry_run_json_has_the_setup_network_and_sync_of_the_text_form(tmp_path: Path) -> None:
    """What `up --dry-run` prints as text is in its JSON too: each node's setup lines, its network
    interface and what a sync would copy."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("raise SystemExit('must not run')\n")
    workdir = tmp_path / "work"
    hosts = write_hosts(tmp_path, [1, 1], tmp_path / "state")
    hosts.write_text(hosts.read_text().replace("  transport: local\n", f"  transport: local\n  workdir: {workdir}\n"
                                               f"  sync: {project}\n  setup: export X=1\n"))
    proc = clusterrun("up", "--dry-run", "--json", hosts, "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert violations(data, documented_schema("dry-run")) == []
    for node in data["nodes"]:
        assert node["setup"] == ["export X=1"]
        assert node["setup_ran"] == {"ran": False, "python": None, "why_not": f"{workdir} does not exist yet"}
        assert node["sync"]["source"] == str(project) and node["sync"]["to"] == str(workdir)
        assert node["sync"]["files"] == 1 and node["sync"]["bytes"] == len("raise SystemExit('must not run')\n")
        assert node["network"] is not None and node["network"]["why"]
    assert not workdir.exists()  # a dry run copies nothing


def test_ps_of_a_64_node_job_shows_runs_of_nodes_alike_once_with_node_sets() -> None:
    from clusterrun.core.events import GpuReading, NodeGpus
    from clusterrun.views.joblist import node_rows

    record = make_record("big-1", "running", None)
    record.nodes = [NodeRecord(r, f"sim{r + 1:02d}", NodeState.FAILED if r >= 62 else NodeState.RUNNING,
                               pid=4000 + r, exit_code=1 if r >= 62 else None) for r in range(64)]
    gpus = {r: NodeGpus(r, host=f"sim{r + 1:02d}", gpus=(GpuReading(0, 50, 1024, 8192),)) for r in range(64)}
    gpus[10] = NodeGpus(10, host="sim11", problem="nvidia-smi exited with status 9")
    rows = node_rows(record, time.time(), {}, gpus)
    assert rows == [("NODE", "HOST", "STATE", "PID", "EXIT", "ERROR", "GPUS"),
                    ("0-9", "sim[01-10]", "running", "-", "-", "", "10× 50% 10/80G"),
                    ("10", "sim11", "running", "4010", "-", "", "⚠ nvidia-smi"),
                    ("11-61", "sim[12-62]", "running", "-", "-", "", "51× 50% 51/408G"),
                    ("62-63", "sim[63-64]", "failed", "-", "1", "", "2× 50% 2.0/16G")]
    small = make_record("small-1", "running", None)  # a row per node; no GPU column without nvidia-smi
    assert node_rows(small, time.time(), {0: "a: unreachable"}, {0: NodeGpus(0, host="a", missing=True)}) == [
        ("NODE", "HOST", "STATE", "PID", "EXIT", "ERROR"), ("0", "a", "running", "4321", "-", "a: unreachable")]


def test_ps_shows_the_signal_a_stopped_node_was_stopped_with_not_its_exit_code() -> None:
    """torchrun exits 1 after clusterrun's SIGTERM: that exit code was ours, so ``ps`` says how
    the node was stopped; a node that failed on its own keeps its exit code."""
    from clusterrun.views.joblist import node_rows

    record = make_record("stopped-1", "stopped", 10)
    record.nodes = [NodeRecord(0, "a", NodeState.STOPPED, pid=58, exit_code=1),
                    NodeRecord(1, "b", NodeState.STOPPED, pid=61, exit_code=None, signal=9),
                    NodeRecord(2, "c", NodeState.FAILED, pid=64, exit_code=1)]
    assert [row[2:5] for row in node_rows(record, time.time(), {})[1:]] == [
        ("stopped", "58", "SIGTERM"), ("stopped", "61", "SIGKILL"), ("failed", "64", "1")]
