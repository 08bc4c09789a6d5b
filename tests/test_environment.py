"""A node's environment: forward_env, env_file, secret masking, precedence, setup (fast: no processes
but bash for the agent's setup).

The end-to-end canary (a secret reaching the script and nothing else, on local and simulated SSH
hosts) is in ``tests/test_env_canary.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clusterrun.agent.records import AgentFailure
from clusterrun.agent.wire import StartRequest
from clusterrun.config.environment import MASK, mask_env, parse_dotenv, redact, resolve, unmask
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import ConfigError, HostsUnavailable
from clusterrun.life.attempt import restart
from clusterrun.life.gate import plan_to_start
from clusterrun.life.recorder import new_record
from clusterrun.run import setups
from clusterrun.run.orchestrator import Job
from clusterrun.run.plan import HostFacts, build_plan, plan_to_json
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports.fake import FakeCluster

JOB = "train-20261123-120000-abcd"


def hosts_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def plan_of(spec, overrides=None):  # type: ignore[no-untyped-def]
    facts = [HostFacts(python="python3") for _ in spec.hosts]
    return build_plan(spec, "train.py", [], job_id=JOB, name="train", facts=facts, master_port=29500,
                      env_overrides=overrides or {})


# ------------------------------------------------------------------------------ env files


def test_dotenv_quotes_comments_and_export() -> None:
    text = textwrap.dedent("""\
        # a comment

        export A=1
        B = two words   # a comment after a space
        C='single $X "kept" \\n'
        D="double \\"q\\" \\\\ line\\nbreak"  # comment
        E=url#fragment
        F=
        G="  spaces kept  "
    """)
    assert parse_dotenv(text, ".env") == {
        "A": "1", "B": "two words", "C": 'single $X "kept" \\n', "D": 'double "q" \\ line\nbreak',
        "E": "url#fragment", "F": "", "G": "  spaces kept  ",
    }


@pytest.mark.parametrize(("text", "line", "message"), [
    ("A=1\nnot a variable\n", 2, ".env:2: expected NAME=VALUE"),
    ("A=1\n\n1BAD=x\n", 3, ".env:3: invalid environment variable name '1BAD'"),
    ('TOKEN="secret-value\n', 1, '.env:1: TOKEN: the value has no closing "'),
    ("TOKEN='secret-value' trailing\n", 1, "TOKEN: unexpected text after the closing '"),
])
def test_dotenv_errors_name_file_and_line_and_never_the_value(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_dotenv(text, ".env")
    assert info.value.line == line
    assert message in info.value.render()
    assert "secret-value" not in info.value.render()


def test_a_missing_env_file_is_reported_at_its_line_of_the_hosts_file(tmp_path: Path) -> None:
    path = hosts_file(tmp_path, """\
        hosts:
          - host: a
            env_file: missing.env
    """)
    spec = load_cluster_text(path.read_text(), str(path))
    with pytest.raises(ConfigError) as info:
        resolve(spec, {})
    assert info.value.render().startswith(f"{path}:3: hosts[0].env_file: cannot read {tmp_path}/missing.env: "
                                          "No such file or directory")


# --------------------------------------------------------------------- parsing and precedence


def test_precedence_forward_env_then_env_file_then_env_then_command_line(tmp_path: Path) -> None:
    (tmp_path / "top.env").write_text("FILE_ONLY=top\nBOTH=file\nLATER=top\nOMP_NUM_THREADS=8\n")
    (tmp_path / "host.env").write_text("LATER=host\n")
    path = hosts_file(tmp_path, """\
        forward_env: [NCCL_*, BOTH, FWD_ONLY, NOT_SET]
        env_file: top.env
        env: {BOTH: env}
        defaults:
          forward_env: WANDB_?
        hosts:
          - host: a
            env_file: [host.env]
            env: {CLI: host}
          - b
    """)
    spec, notes = resolve(load_cluster_text(path.read_text(), str(path)),
                          {"NCCL_DEBUG": "INFO", "BOTH": "fwd", "FWD_ONLY": "x", "WANDB_A": "w", "WANDB_AB": "no",
                           "nccl_lower": "no"})
    assert notes == ["forward_env: NOT_SET is not set in this environment; it is not passed on"]
    a, b = (n.env for n in plan_of(spec, {"CLI": "cli"}).nodes)
    assert a["NCCL_DEBUG"] == "INFO" and a["FWD_ONLY"] == "x" and a["WANDB_A"] == "w"
    assert "WANDB_AB" not in a and "nccl_lower" not in a  # globs match whole names, case matters
    assert a["BOTH"] == "env"  # env: wins over env_file, which wins over forward_env
    assert a["FILE_ONLY"] == "top" and a["LATER"] == "host" and b["LATER"] == "top"  # later files win
    assert a["CLI"] == "cli"  # --env wins over everything
    assert a["OMP_NUM_THREADS"] == "8"  # clusterrun's default of 1 is the weakest of all


def test_omp_num_threads_is_1_unless_env_sets_it() -> None:
    spec = load_cluster_text("hosts:\n  - a\n  - host: b\n    env: {OMP_NUM_THREADS: 4}\n")
    a, b = plan_of(spec).nodes
    assert a.env["OMP_NUM_THREADS"] == "1"
    assert b.env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize(("text", "report"), [
    ("hosts: [a]\nforward_env: [NCCL-*]\n",
     "<string>:2: forward_env[0]: expected a variable name or a glob pattern of one, got 'NCCL-*'"),
    ("hosts: [a]\nenv_file: 5\n", "<string>:2: env_file: expected a file name or a list of them, got 5"),
    ("hosts:\n  - host: a\n    setup: []\n", "<string>:3: hosts[0].setup: expected a shell command or a list of "
     "them, got an empty list"),
    ("hosts: [a]\nsetup: x\n", "<string>:2: setup: unknown key 'setup'"),
    ("hosts:\n  - host: a\n    setup: [echo a: b]\n", "<string>:3: hosts[0].setup[0]: expected a string, got a "
     "mapping\n  hint: put it in quotes: YAML reads 'word: text' as a mapping"),
    ("hosts: [a]\nenv: {HF_TOKEN: abc}\n", "<string>:2: env.HF_TOKEN: HF_TOKEN looks secret"),
    ("hosts: [a]\nsecret_env: [MY_CRED]\ndefaults:\n  env: {MY_CRED: abc}\n",
     "<string>:4: defaults.env.MY_CRED: MY_CRED looks secret"),
])
def test_bad_keys_are_reported_with_line_and_key(text: str, report: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster_text(text)
    assert info.value.render().startswith(report)


def test_setup_is_the_hosts_own_else_defaults() -> None:
    spec = load_cluster_text(textwrap.dedent("""\
        defaults:
          setup: module load cuda/12.4
        hosts:
          - a
          - host: b
            setup:
              - source /opt/conda/etc/profile.d/conda.sh && conda activate train
              - |
                if true; then
                  export X=1
                fi
    """))
    assert spec.hosts[0].setup == ("module load cuda/12.4",)
    assert spec.hosts[1].setup == ("source /opt/conda/etc/profile.d/conda.sh && conda activate train",
                                   "if true; then\n  export X=1\nfi\n")


# ------------------------------------------------------------------------------------ masking


def test_secret_looking_names_and_secret_env_are_masked() -> None:
    env = {"HF_TOKEN": "t0k3n", "WANDB_API_KEY": "k3y", "AWS_SECRET_ACCESS_KEY": "s", "DB_PASSWORD": "p",
           "my_secret_thing": "m", "MY_CRED": "c", "CRED_2": "c2", "NCCL_DEBUG": "INFO", "KEYBOARD": "us"}
    masked = mask_env(env, ["MY_CRED", "CRED_*"])
    assert {k for k, v in masked.items() if v == MASK} == set(env) - {"NCCL_DEBUG", "KEYBOARD"}
    assert masked["NCCL_DEBUG"] == "INFO"


def test_the_record_holds_secrets_masked_and_a_later_start_finds_them_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "s.env").write_text("FILE_TOKEN=from-the-file-canary\n")
    path = hosts_file(tmp_path, """\
        forward_env: [HF_TOKEN]
        env_file: s.env
        secret_env: [PLAIN_BUT_SECRET]
        hosts: [a, b]
    """)
    environ = {"HF_TOKEN": "forwarded-canary"}
    spec, _ = resolve(load_cluster_text(path.read_text(), str(path)), environ)
    overrides = {"CLI_KEY": "cli-canary", "PLAIN_BUT_SECRET": "listed-canary", "OTHER": "shown"}
    plan = plan_of(spec, overrides)
    assert plan.nodes[0].env["HF_TOKEN"] == "forwarded-canary"  # in memory, for the start request
    record = new_record(plan, hosts_file=str(path), hosts_text=path.read_text(), env_overrides=overrides,
                        local_cwd=str(tmp_path), ssh_config=None)
    store = JobStore(tmp_path / "jobs")
    store.create(record)
    on_disk = (tmp_path / "jobs" / JOB / "job.json").read_text()
    assert "canary" not in on_disk and "shown" in on_disk
    assert json.loads(on_disk)["env_overrides"]["CLI_KEY"] == MASK
    assert "canary" not in json.dumps(plan_to_json(plan))

    # A later start (the monitor finishing a start) reads them again from where they came from.
    monkeypatch.setattr("os.environ", {**environ, "CLI_KEY": "cli-again", "PLAIN_BUT_SECRET": "listed-again"})
    again = plan_to_start(store.load(JOB), recorded=Opened(store.load(JOB)).spec())
    assert again.nodes[1].env["HF_TOKEN"] == "forwarded-canary"
    assert again.nodes[1].env["FILE_TOKEN"] == "from-the-file-canary"
    assert again.nodes[1].env["CLI_KEY"] == "cli-again"
    monkeypatch.setattr("os.environ", {})
    with pytest.raises(ConfigError, match="CLI_KEY: its value is secret"):
        plan_to_start(store.load(JOB), recorded=Opened(store.load(JOB)).spec())


def test_unmask_and_redact() -> None:
    assert unmask({"A": "1", "B_TOKEN": MASK}, {"B_TOKEN": "v"}, "--env") == {"A": "1", "B_TOKEN": "v"}
    with pytest.raises(ConfigError) as info:
        unmask({"B_TOKEN": MASK}, {}, "--env")
    assert "hint: export B_TOKEN=... and run this again" in info.value.render()
    env = {"HF_TOKEN": "hf_abcdef", "SHORT_KEY": "ab", "PLAIN": "hf_abcdef2"}
    assert redact("bad token hf_abcdef, ab", env) == f"bad token {MASK}, ab"


# ------------------------------------------------------------------- setup and the agent


def test_a_failing_setup_on_one_host_starts_nothing_anywhere() -> None:
    fake = FakeCluster()
    spec = load_cluster_text("defaults:\n  setup: conda activate train\nhosts: [h0, h1]\n")
    spec, _ = resolve(spec, {})
    fake.host("h1").setup_error = "setup failed with status 1; its last lines:\n  | hf_canary_value not found"
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, env_overrides={"HF_TOKEN": "hf_canary_value"},
              transport_factory=fake.transport)
    try:
        with pytest.raises(HostsUnavailable) as info:
            job.prepare()
    finally:
        job.close()
    assert "h1: node 1: setup failed with status 1" in info.value.render()
    assert "hf_canary_value" not in info.value.render()  # an error message never shows a secret
    assert len(fake.ops("setup")) == 2 and fake.ops("start") == []
    assert fake.ops("setup")[0]["setup"] == ["conda activate train"]


def test_a_start_without_a_setup_request_carries_setup_and_names_its_secrets() -> None:
    fake = FakeCluster()
    spec = load_cluster_text("defaults:\n  setup: conda activate train\nhosts: [h0]\n")
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, env_overrides={"HF_TOKEN": "v", "A": "1"},
              transport_factory=fake.transport)
    try:
        job.prepare(run_setup=False)
        assert fake.ops("setup") == []
        job.start()
    finally:
        job.close()
    start = fake.ops("start")[0]
    assert start["secret_env"] == ["HF_TOKEN"] and start["setup"] == ["conda activate train"]
    assert start["env"]["HF_TOKEN"] == "v"  # the value travels on the agent's stdin, as data


VENV = {"executable": "/venv/bin/python3", "python": "3.11.7", "torch": "2.13.0", "torch_cuda": None,
        "torchrun_flags": ["--signals-to-handle"]}


def test_the_job_runs_the_interpreter_setup_leaves_and_is_checked_there(tmp_path: Path) -> None:
    """Issue 25: a host whose plain interpreter has no torch but whose setup activates one that has:
    the probe does not refuse, the preflight asks about the interpreter in setup's environment, and
    torchrun's argv takes the flags of that torch."""
    from clusterrun.life.gate import check_new

    fake = FakeCluster()
    spec = load_cluster_text("defaults:\n  setup: source /venv/bin/activate\nhosts: [h0]\n")
    fake.host("h0").torch = None
    fake.host("h0").after_setup = VENV
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport,
              local_cwd=str(tmp_path))
    try:
        plan, _, _ = check_new(job, spec, "train.py", str(tmp_path), full=True, dry_run=False)
    finally:
        job.close()
    assert fake.ops("setup")[0]["python"] == plan.nodes[0].argv[0]
    assert any(arg.startswith("--signals-to-handle=") for arg in plan.nodes[0].argv)
    assert job.set_up == {0: f"{plan.nodes[0].argv[0]} (/venv/bin/python3, after setup)"}
    inspect = fake.ops("inspect")[0]
    assert (inspect["job"], inspect["node"], inspect["attempt"]) == (JOB, 0, 1)


def test_setup_whose_interpreter_lacks_torch_is_refused_naming_the_host() -> None:
    fake = FakeCluster()
    spec = load_cluster_text("defaults:\n  setup: source /venv/bin/activate\nhosts: [h0, h1]\n")
    fake.host("h1").after_setup = {**VENV, "torch": None}
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    try:
        with pytest.raises(HostsUnavailable) as info:
            job.prepare()
    finally:
        job.close()
    text = info.value.render()
    assert "h1: node 1: torch is not installed for" in text and "(/venv/bin/python3, after setup)" in text
    assert "have setup: activate an environment that has it" in text and "h0:" not in text
    assert fake.ops("start") == []


def test_a_dry_run_runs_setup_but_not_before_its_sync_made_the_workdir() -> None:
    fake = FakeCluster()
    spec = load_cluster_text("defaults:\n  setup: source /venv/bin/activate\n  workdir: /w\nhosts: [h0, h1]\n")
    fake.host("h0").missing = {"."}
    fake.host("h1").missing = {"."}
    job = Job(spec, "train.py", job_id=JOB, name="train", emit=None, transport_factory=fake.transport)
    try:
        job.prepare(run_setup=False)
        setups.run(job, if_cwd={0})  # node 0's sync would make its workdir
    finally:
        job.close()
    assert sorted((op["node"], op["if_cwd"]) for op in fake.ops("setup")) == [(0, True), (1, False)]
    assert job.setup_skipped == {0: "/w does not exist yet"} and list(job.set_up) == [1]


def test_setup_exports_reach_the_environment_and_failures_say_why(tmp_path: Path) -> None:
    from clusterrun.agent import setup

    env, output = setup.run_setup(["export FROM_SETUP='a b'; unset DROPPED", "cd /; export WHERE=$OLDPWD",
                                   "if true; then\n  export MULTI=2\nfi\n", "echo said; echo err >&2"],
                                  {"DROPPED": "x", "GIVEN": "y"}, str(tmp_path))
    assert output == b"said\nerr\n"  # stdout and stderr, for the node's log
    assert env["FROM_SETUP"] == "a b" and env["GIVEN"] == "y" and env["MULTI"] == "2"
    assert env["WHERE"] == str(tmp_path)  # run in the node's working directory
    assert "DROPPED" not in env
    with pytest.raises(AgentFailure) as info:
        setup.run_setup(["true", "echo loading >&2; source /nonexistent/conda.sh && conda activate x", "true"],
                        {}, None)
    message = str(info.value)
    assert message.startswith("setup failed with status 1; nothing was started; its last lines:")
    assert "/nonexistent/conda.sh: No such file or directory" in message
    assert "clusterrun: setup[1] exited with status 1" in message
    with pytest.raises(AgentFailure, match="does one call `exit`"):
        setup.run_setup(["exit 0"], {}, None)


def test_the_agent_writes_secret_values_masked_in_spec_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clusterrun.agent import records, start

    handed: dict[str, object] = {}

    def spawn(folder: str, scope: object = None, env: dict[str, str] | None = None) -> tuple[int, int]:
        handed.update(env or {})
        raise OSError(28, "No space left on device")  # stop here: the spec is written, nothing runs

    monkeypatch.setattr(start, "spawn_supervisor", spawn)
    monkeypatch.setattr(start, "logind_problem", lambda: "")
    monkeypatch.setattr(start, "make_cgroup", lambda *a: (None, "test"))
    written: dict[str, bytes] = {}
    real_write = records.write_atomic
    monkeypatch.setattr(records, "write_atomic", lambda path, data: (written.__setitem__(path, data),
                                                                      real_write(path, data)))
    req = StartRequest(job=JOB, node=0, attempt=1, state_dir=str(tmp_path), argv=["true"],
                       env={"HF_TOKEN": "canary-start", "A": "1"}, secret_env=["HF_TOKEN"])
    with pytest.raises(AgentFailure):
        start.op_start(req)
    spec_json = next(data for path, data in written.items() if path.endswith("spec.json"))
    assert json.loads(spec_json)["env"] == {"HF_TOKEN": MASK, "A": "1"}
    assert handed["HF_TOKEN"] == "canary-start"  # the supervisor gets it in memory


def test_supervise_imports_the_agent_from_where_it_runs_and_reads_the_environment_from_stdin(
        tmp_path: Path) -> None:
    """The supervisor started by systemd-run (``SUPERVISE``) imports the package from the path the
    agent runs from (on a host, its cached zip), never from source sent again, and gets the
    environment through the pipe: secrets never reach the disk or a command line."""
    import zipfile

    from clusterrun.agent.supervisor import SUPERVISE

    zipped = tmp_path / "agent.zip"
    with zipfile.ZipFile(zipped, "w") as archive:  # a stand-in package: prints what it was given
        archive.writestr("pkg/__init__.py", "")
        archive.writestr("pkg/supervisor.py", "import sys\ndef supervise_in_scope(folder, env):\n"
                                              "    sys.stdout.write(__file__ + ' ' + folder + ' ' + env.decode())\n")
    proc = subprocess.run([sys.executable, "-S", "-c", SUPERVISE, "folder", str(zipped), "pkg"],
                          input=b'{"A_TOKEN": "v"}', capture_output=True, timeout=30, check=True)
    assert proc.stdout == f'{zipped}/pkg/supervisor.py folder {{"A_TOKEN": "v"}}'.encode()


def test_a_restart_without_a_secret_the_last_attempt_had_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = hosts_file(tmp_path, "forward_env: [HF_TOKEN]\nhosts: [a]\n")
    spec, _ = resolve(load_cluster_text(path.read_text(), str(path)), {"HF_TOKEN": "v"})
    record = new_record(plan_of(spec), hosts_file=str(path), hosts_text=path.read_text(), env_overrides={},
                        local_cwd=str(tmp_path), ssh_config=None)
    store = JobStore(tmp_path / "jobs")
    store.create(record)
    monkeypatch.setattr("os.environ", {})
    with pytest.raises(ConfigError, match="HF_TOKEN: its value is secret"):
        restart(store, store.load(JOB), lambda event: None, recorded=Opened(store.load(JOB)).spec())
    assert store.load(JOB).attempt == 1  # nothing new was started or recorded
