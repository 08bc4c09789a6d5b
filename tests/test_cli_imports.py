"""What the commands import: ``main`` loads a command's module only when that command runs, and
``up``, ``ps``, ``logs`` and ``down`` load none of Slurm's, the dashboard's, ``stack``'s or the web page's modules
(their start-up is the controller's CPU at N=1, see docs/benchmarks.md)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import click
import pytest

from clusterrun.cli import COMMANDS, main
from tests.conftest import ROOT

COMMAND_MODULES = sorted({f"clusterrun.cli.{module}" for module, _ in COMMANDS.values()})
# Loaded only by what runs under Slurm, opens the dashboard or takes stacks.
NOT_FOR_UP_PS_LOGS_DOWN = ("textual", "rich", "clusterrun.tui", "clusterrun.life.session", "clusterrun.slurm.step",
                           "clusterrun.slurm.run", "clusterrun.store.slurmlogs", "clusterrun.slurm.view",
                           "clusterrun.diagnose.stacks", "clusterrun.agent.follow", "clusterrun.agent.monitor",
                           "clusterrun.web", "starlette", "uvicorn", "jinja2", "anyio")  # web: an optional extra
# ... and `ps`'s listing and JSON, which a job's start and stop need not.
NOT_FOR_UP_DOWN = ("clusterrun.views.joblist",)
# ... and a job's owner, start, stop and follower, which `logs` of an ended job need not (its start-up is
# most of what it takes beside `ssh HOST cat`: docs/benchmarks.md, "Logs"); `logs -f` loads them to follow.
NOT_FOR_LOGS = ("clusterrun.life.lifecycle", "clusterrun.life.recorder", "clusterrun.life.attempt",
                "clusterrun.life.gate", "clusterrun.life.notify", "clusterrun.run.orchestrator",
                "clusterrun.run.follower", "clusterrun.run.stops", "clusterrun.slurm", "clusterrun.sync",
                "clusterrun.checks", "paramiko")
REPORT = ("import atexit, os, sys\n"
          "report = lambda: print('MODULES', *sorted(sys.modules), file=sys.stderr, flush=True)\n"
          "atexit.register(report)\n"
          "leave = os._exit\n"  # click 8.0's completion ends by os._exit, past atexit
          "os._exit = lambda code: (report(), leave(code))\n")


def _modules(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[set[str], str]:
    """The modules a fresh interpreter had loaded when ``code`` (run with ``args``) ended, and its stdout."""
    done = subprocess.run([sys.executable, "-c", REPORT + code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={**os.environ, **(env or {})})
    line = next(line for line in done.stderr.splitlines() if line.startswith("MODULES "))
    return set(line.split()[1:]), done.stdout


def _loaded(modules: set[str], names: tuple[str, ...] | list[str]) -> list[str]:
    return sorted(m for m in modules for name in names if m == name or m.startswith(name + "."))


def test_every_command_is_in_the_table_with_its_module_and_its_own_short_help() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    ctx = click.Context(main)
    assert set(main.commands) == set(COMMANDS)
    for name, (module, short) in COMMANDS.items():
        command = main.get_command(ctx, name)
        assert command is not None and command.callback is not None, name
        assert command.callback.__module__ == f"clusterrun.cli.{module}", name
        assert command.get_short_help_str(limit=10**6) == short, f"COMMANDS[{name!r}] differs from its docstring"
        assert command.hidden == name.startswith("_"), name


def test_help_and_completion_list_every_command_without_importing_one() -> None:
    shown = [name for name in COMMANDS if not name.startswith("_")]
    code = "from clusterrun.cli import main\nsys.argv[0] = 'clusterrun'\nmain()\n"
    modules, out = _modules(code, "--help")
    assert not _loaded(modules, [*COMMAND_MODULES, "clusterrun.life.attempt", "clusterrun.life.recorder"]), out
    listed = out.split("Commands:")[1].split()
    assert all(name in listed for name in shown) and "_monitor" not in listed, out
    # each row as click would cut the command's own short help
    assert "stop        Stop JOB on every host (idempotent)." in out
    modules, out = _modules(code, env={"_CLUSTERRUN_COMPLETE": "zsh_complete", "COMP_WORDS": "clusterrun ",
                                       "COMP_CWORD": "1"})
    assert not _loaded(modules, COMMAND_MODULES), out
    assert out.splitlines()[1::3] == sorted(shown), out  # zsh: type, value, help per item
    assert "Stop JOB on every host (idempotent)." in out


@pytest.mark.parametrize("command", ["up", "ps", "logs", "down"])
def test_up_ps_logs_and_down_load_no_slurm_dashboard_or_stack_module(command: str) -> None:
    """Their modules, as `main` loads them to run the command (what runs later is in the integration
    test `test_timings.py::test_the_commands_that_print_import_no_textual`)."""
    module = COMMANDS[command][0]
    modules, _ = _modules(f"from clusterrun.cli import main, {module}\n")
    assert not _loaded(modules, NOT_FOR_UP_PS_LOGS_DOWN)
    assert command in ("ps", "logs") or not _loaded(modules, NOT_FOR_UP_DOWN)
    assert command != "logs" or not _loaded(modules, NOT_FOR_LOGS)
