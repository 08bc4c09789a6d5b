"""What ``up``'s options change of the hosts file: the hosts file read, ``-w``/``-x`` applied, the
watch, notify and sync options laid over it and every host's environment resolved, in one call
(``hosts_for_up``), so that the command hands on a finished ``ClusterSpec``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from clusterrun.config.environment import resolve
from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.config.selection import load_hosts
from clusterrun.config.watch import EVENTS, Notify, parse_duration
from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen


@frozen
class UpOptions:
    """``up``'s options over the hosts file, as typed (durations as text, checked by ``apply``)."""

    nodes: str | None = None
    exclude: str | None = None
    startup_timeout: str | None = None
    setup_timeout: str | None = None
    hang_after: str | None = None
    on_hang: str | None = None
    notify_command: str | None = None
    no_sync: bool = False

    def apply(self, spec: ClusterSpec) -> ClusterSpec:
        """The hosts file's watch, notify and sync with these options laid over them (``ConfigError``
        for a bad duration or an empty ``--notify``)."""
        watch = spec.watch
        if self.startup_timeout is not None:
            watch = dataclasses.replace(watch, startup_timeout=_seconds(self.startup_timeout, "--startup-timeout"))
        if self.setup_timeout is not None:
            watch = dataclasses.replace(watch, setup_timeout=_seconds(self.setup_timeout, "--setup-timeout"))
        if self.hang_after is not None:
            watch = dataclasses.replace(watch, hang_after=None if self.hang_after.lower() in ("off", "never")
                                        else _seconds(self.hang_after, "--hang-after"))
        if self.on_hang is not None:
            watch = dataclasses.replace(watch, on_hang=self.on_hang)
        notify = spec.notify
        if self.notify_command is not None and not self.notify_command.strip():
            raise ConfigError("must not be empty", key="--notify",
                              hint="e.g. --notify 'notify-send clusterrun $CLUSTERRUN_EVENT'; nothing was started")
        if self.notify_command is not None:
            notify = Notify(self.notify_command, notify.on if notify is not None else EVENTS)
        hosts = tuple(dataclasses.replace(h, sync=None) for h in spec.hosts) if self.no_sync else spec.hosts
        return dataclasses.replace(spec, watch=watch, notify=notify, hosts=hosts)


@frozen
class UpHosts:
    """The hosts file as ``up`` uses it: the finished spec, the YAML text its record keeps (the
    chosen part only, under ``-w``/``-x``) and notes on forwarded variables that are not set."""

    spec: ClusterSpec
    text: str
    notes: tuple[str, ...]


def hosts_for_up(path: str, options: UpOptions, environ: Mapping[str, str]) -> UpHosts:
    """The hosts file (or hostfile) at ``path`` read once and finished for ``up``; ``ConfigError``
    names the file, line and key of what is wrong."""
    spec, text = load_hosts(path, options.nodes, options.exclude)
    spec, notes = resolve(options.apply(spec), environ)
    return UpHosts(spec, text, tuple(notes))


def _seconds(text: str, key: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise ConfigError(str(exc), key=key) from None
    if value <= 0:
        raise ConfigError(f"{text!r}: must be above 0", key=key)
    return value


__all__ = ["UpHosts", "UpOptions", "hosts_for_up"]
