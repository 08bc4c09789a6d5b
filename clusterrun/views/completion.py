"""Shell completion for bash, zsh and fish, with click's own machinery (``clusterrun completion SHELL``).

click's scripts call ``clusterrun`` back with ``_CLUSTERRUN_COMPLETE=<shell>_complete`` set; the
commands and options complete from the click definitions, ``HOSTS.yaml`` from the file system,
and a JOB from this controller's job store (``complete_jobs``): ids, and names (given by ``--name`` or
taken from the script), each with the job it means. A store that cannot be read completes nothing, never a traceback.
"""

from __future__ import annotations

import click
from click.shell_completion import CompletionItem, get_completion_class

from clusterrun.core.errors import ClusterrunError
from clusterrun.store.jobs import JobStore, by_name

__all__ = ["SHELLS", "complete_jobs", "script"]

SHELLS = ("bash", "zsh", "fish")
PROG = "clusterrun"
COMPLETE_VAR = "_CLUSTERRUN_COMPLETE"


def complete_jobs(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The job ids and names that start with ``incomplete``, newest first, each with its state."""
    try:
        records = JobStore().all()
    except (ClusterrunError, OSError):
        return []
    states = {r.job_id: r.state for r in records}
    named: set[str] = set()
    items: list[CompletionItem] = []
    for record in reversed(records):
        if record.job_id.startswith(incomplete):
            items.append(CompletionItem(record.job_id, help=f"{record.state} {record.name}"))
        # a name once, with the job it means (JobStore.find: the one not ended, else the newest)
        if record.name.startswith(incomplete) and record.name not in named and record.name != record.job_id:
            named.add(record.name)
            job = by_name(record.name, [r for r in records if r.name == record.name]).job_id
            items.append(CompletionItem(record.name, help=f"{states[job]} {job}"))
    return items


# click 8.4.0 and 8.4.1 write a fish script that fish cannot parse (pallets/click#3502, fixed in 8.4.2)
BROKEN_FISH = ("8.4.0", "8.4.1")


def script(command: click.Command, shell: str) -> str:
    """The completion script for ``shell``, to ``source`` (bash, zsh) or put in fish's completions."""
    from importlib import metadata  # importlib.metadata imports email: only for this script

    if shell == "fish" and (version := metadata.version("click")) in BROKEN_FISH:
        raise click.ClickException(f"click {version} writes a broken fish completion (pallets/click#3502); "
                                   "install another: pip install 'click!=8.4.0,!=8.4.1'")
    cls = get_completion_class(shell)
    if cls is None:
        raise click.BadParameter(f"no completion for {shell!r}; one of {', '.join(SHELLS)}")
    return cls(command, {}, PROG, COMPLETE_VAR).source()
