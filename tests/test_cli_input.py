"""What users type: durations on the command line (and in the hosts file), Ctrl-C at any moment, script names."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from clusterrun.cli import main
from clusterrun.core.durations import parse_duration, show_duration


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("1.5", 1.5), ("30s", 30), ("10m", 600), ("6h", 21600),
                                               ("2d", 172800), (" 10 M ", 600), (".5", 0.5), (7, 7.0)])
def test_durations_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "10x", "", "1e400", "m", True])
def test_bad_durations_are_refused(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)  # type: ignore[arg-type]
    assert not math.isnan(parse_duration("0"))


def test_minimum() -> None:
    with pytest.raises(ValueError, match="at least 1 s"):
        parse_duration("0.5", minimum=1)


def test_show() -> None:
    assert [show_duration(s) for s in (45, 600, 21600, 90)] == ["45 s", "10 min", "6 h", "90 s"]


@pytest.mark.parametrize("argv", [["up", "--grace", "nan", "h.yaml", "t.py"],
                                  ["up", "--grace", "inf", "h.yaml", "t.py"],
                                  ["up", "--unreachable-timeout", "nan", "h.yaml", "t.py"],
                                  ["wait", "--timeout", "inf", "job"], ["down", "--grace", "nan", "job"]])
def test_every_duration_option_refuses_nan_and_inf_as_usage(argv: list[str]) -> None:
    """Exit 2 before anything is looked at (today nan reached the stop as a 'bad request')."""
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and "Invalid value" in result.output and "Traceback" not in result.output


def test_ctrl_c_while_the_command_is_imported_exits_130_without_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import clusterrun.__main__ as entry
    import clusterrun.cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(clusterrun.cli, "main", interrupted)
    with pytest.raises(SystemExit) as caught:
        entry.run()
    assert caught.value.code == 130 and capsys.readouterr().err == "clusterrun: interrupted\n"


LOST_CTRL_C = """
import time, weakref
import clusterrun.__main__ as entry
import clusterrun.cli

def command():
    class Held:
        pass
    def callback(ref):  # where a Ctrl-C can land: importlib's module locks have such a callback
        raise KeyboardInterrupt
    held = Held()
    ref = weakref.ref(held, callback)
    del held  # the callback runs, from C: its exception is printed and dropped
    time.sleep(60)
    print("not interrupted")

clusterrun.cli.main = command
entry.program()
"""


def test_a_ctrl_c_dropped_inside_a_callback_is_raised_again() -> None:
    """A KeyboardInterrupt raised in a weakref's callback (Ctrl-C while `up` imports its modules)
    is lost to the program: it is raised again, and the command exits 130 with its one line."""
    proc = subprocess.run([sys.executable, "-c", LOST_CTRL_C], capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "clusterrun: interrupted\n")


def test_ctrl_c_in_the_first_moments_of_up_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any connection (reading the hosts file): click alone would print "Aborted!" and exit 1."""
    import clusterrun.cli.up as up

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(up, "hosts_for_up", interrupted)
    result = CliRunner().invoke(main, ["up", "--no-tui", "hosts.yaml", "train.py"])
    assert (result.exit_code, result.output) == (130, "clusterrun: interrupted\n")


def test_a_misspelt_script_is_refused_with_the_close_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts.yaml").write_text("hosts:\n  - host: a\n    transport: local\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["up", "--dry-run", "hosts.yaml", "trian.py"])
    assert result.exit_code == 2 and "hint: did you mean train.py?" in result.output


def test_a_missing_script_without_a_close_name_mentions_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hosts.yaml").write_text("hosts:\n  - host: a\n    transport: local\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["up", "--dry-run", "hosts.yaml", "model.py"])
    assert result.exit_code == 2 and "`sync: .`" in result.output


@pytest.mark.integration  # the doctor on local hosts imports torch on each: seconds
def test_doctor_checks_only_the_hosts_of_w_and_not_those_of_x(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("defaults:\n  transport: local\nhosts:\n  - host: a[1-3]\n")
    rows = {}
    for option in (["-w", "a[1,3]"], ["-x", "a2"]):
        result = CliRunner().invoke(main, ["doctor", *option, str(hosts)])
        rows[option[0]] = [line.split()[:2] for line in result.output.splitlines() if line.startswith("node")]
    assert rows == {"-w": [["node0", "a1"], ["node1", "a3"]], "-x": [["node0", "a1"], ["node1", "a3"]]}


def test_hosts_adopts_from_a_deepspeed_hostfile_as_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ps --hosts HOSTFILE` reads a DeepSpeed/MPI hostfile as `up` does (it was a YAML error)."""
    import clusterrun.life.discover

    asked = []
    monkeypatch.setattr(clusterrun.life.discover, "ask_hosts", lambda spec, ssh_config: asked.append(spec) or {})
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two workers\nworker-1 slots=4\nworker-2 slots=2\n")
    result = CliRunner().invoke(main, ["ps", "--hosts", str(hostfile)])
    assert result.exit_code == 0, result.output
    assert [(h.host, len(h.gpus or ())) for h in asked[0].hosts] == [("worker-1", 4), ("worker-2", 2)]


EDGES = {  # what up is given, what it says (exit 2): the option or file:line and what is allowed
    "max restarts over the file's cap": (["--max-restarts", "1001"], "",
                                         "Invalid value for '--max-restarts': 1001 is not in the range 0<=x<=1000"),
    "max restarts of 20 digits": (["--max-restarts", "99999999999999999999"], "",
                                  "'--max-restarts': 99999999999999999999 is not in the range 0<=x<=1000"),
    "an empty notify": (["--notify", ""], "", "clusterrun: error: --notify: must not be empty"),
    "a blank notify": (["--notify", "  "], "", "clusterrun: error: --notify: must not be empty"),
    "a restart window of 0": ([], "restart: {max: 1, window: 0}\n",
                              "hosts.yaml:4: restart.window: expected a duration above 0 (30m, 6h), got 0"),
    "a node set of a million hosts": ([], "", "hosts.yaml:3: hosts[0].host: 'h[1-999999]' is 999,999 hosts; a "
                                              "hosts file may have at most 10,000"),
}


@pytest.mark.parametrize("case", sorted(EDGES))
def test_input_edges_are_refused_and_nothing_starts(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     controller_state: Path) -> None:
    options, extra, said = EDGES[case]
    hosts = "h[1-999999]" if "node set" in case else "local-a"
    (tmp_path / "hosts.yaml").write_text(f"state_dir: {tmp_path / 'state'}\ndefaults: {{transport: local}}\n"
                                         f"hosts: ['{hosts}']\n{extra}")
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["up", "-d", *options, "hosts.yaml", "train.py"])
    assert result.exit_code == 2 and said in result.output, result.output
    assert not (tmp_path / "state").exists() and not (controller_state / "clusterrun" / "jobs").exists()
