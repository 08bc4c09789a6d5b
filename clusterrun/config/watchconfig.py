"""The hosts file's long-run keys (``restart``; the watch's ``setup_timeout``, ``startup_timeout``, ``hang_after``,
``on_hang``, ``notify``, ``progress``), validated with the file's line and a hint like every other key
(``config._Parser`` calls this)."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from clusterrun.config.restarts import MAX_RESTARTS, RestartPolicy, parse_backoff
from clusterrun.config.watch import EVENTS, ON_HANG, Notify, Watch, parse_duration

if TYPE_CHECKING:
    from clusterrun.config.hostsyaml import NodeReader

WATCH_KEYS = ("setup_timeout", "startup_timeout", "hang_after", "on_hang", "notify", "progress")
_NOTIFY_KEYS = ("command", "on")
RESTART_KEYS = ("max", "backoff", "on_exit_codes", "window")
SCALAR_TAGS = tuple("tag:yaml.org,2002:" + t for t in ("str", "int", "float"))


def duration(parser: NodeReader, node: Node, key: str, *, off: bool = False) -> float | None:
    """``90``, ``45s``, ``10m``, ``2h`` (and ``off`` where allowed) in seconds; None for ``off``."""
    text = str(node.value).strip() if isinstance(node, ScalarNode) else ""
    if off and text.lower() in ("off", "false", "never"):
        return None
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise parser.expected("a duration above 0 (90, 45s, 10m, 2h)" + (" or off" if off else ""), node, key)
    return seconds


def watch_settings(parser: NodeReader, top: dict[str, Node]) -> tuple[Watch, Notify | None]:
    """The ``Watch`` and ``Notify`` of the file's top level (defaults for keys it does not set)."""
    watch = Watch()
    if "setup_timeout" in top:
        watch = dataclasses.replace(watch, setup_timeout=duration(parser, top["setup_timeout"], "setup_timeout") or 0.0)
    if "startup_timeout" in top:
        watch = dataclasses.replace(watch, startup_timeout=duration(parser, top["startup_timeout"],
                                                                    "startup_timeout") or 0.0)
    if "hang_after" in top:
        watch = dataclasses.replace(watch, hang_after=duration(parser, top["hang_after"], "hang_after", off=True))
    if "on_hang" in top:
        value = parser.string(top["on_hang"], "on_hang")
        if value not in ON_HANG:
            raise parser.error(f"must be one of {', '.join(ON_HANG)}, got {value!r}", top["on_hang"], "on_hang",
                               "stack saves the ranks' stacks beside the logs; restart restarts the job")
        watch = dataclasses.replace(watch, on_hang=value)
    if "progress" in top:
        watch = dataclasses.replace(watch, progress=progress_pattern(parser, top["progress"]))
    return watch, notify(parser, top["notify"]) if "notify" in top else None


def progress_pattern(parser: NodeReader, node: Node) -> str:
    """``progress:``, a regular expression whose named groups (``step``, ``total``, ``loss``, any metric) read
    a progress line of rank 0's output (``agent/progress.py``)."""
    value = parser.string(node, "progress")
    hint = r"e.g. progress: 'it=(?P<step>\d+)/(?P<total>\d+) nll=(?P<nll>[\d.]+)'"
    try:
        groups = re.compile(value).groupindex
    except re.error as exc:
        raise parser.error(f"not a regular expression: {exc}", node, "progress", hint) from None
    if not groups:
        raise parser.error("names no group: name the step, total and metrics, as (?P<step>\\d+)", node, "progress",
                           hint)
    return value


def notify(parser: NodeReader, node: Node) -> Notify:
    """``notify: {command: "...", on: [failed, succeeded, hung, restarted]}`` (or just the command)."""
    if isinstance(node, ScalarNode):
        return Notify(parser.string(node, "notify"))
    if not isinstance(node, MappingNode):
        raise parser.expected("a command, or a mapping with 'command' and 'on'", node, "notify")
    entries = parser.fields(node, "notify", _NOTIFY_KEYS, "a mapping with 'command' and 'on'")
    if "command" not in entries:
        raise parser.error("missing required key 'command'", node, "notify",
                           "e.g. notify: {command: \"notify-send clusterrun $CLUSTERRUN_EVENT\"}")
    on: tuple[str, ...] = EVENTS
    if "on" in entries:
        on = tuple(value for value, _ in parser.strings(entries["on"], "notify.on", "a list of events"))
        for value, item in parser.strings(entries["on"], "notify.on", "a list of events"):
            if value not in EVENTS:
                raise parser.error(f"unknown event {value!r}", item, "notify.on", "events: " + ", ".join(EVENTS))
    return Notify(parser.string(entries["command"], "notify.command"), on)


def restart_policy(parser: NodeReader, node: Node) -> RestartPolicy:
    """``restart: {max: 3, backoff: 30s..10m, on_exit_codes: [1], window: 6h}`` (see clusterrun.config.restarts)."""
    entries = parser.fields(node, "restart", RESTART_KEYS, "a mapping such as {max: 3, backoff: 30s..10m}")
    most = (parser.integer(entries["max"], "restart.max", f"a count from 0 to {MAX_RESTARTS}", 0, MAX_RESTARTS)
            if "max" in entries else 0)
    timing: dict[str, Any] = {}
    for key, parse in (("backoff", parse_backoff), ("window", parse_duration)):
        if key in entries:
            vnode = entries[key]
            if not (isinstance(vnode, ScalarNode) and vnode.tag in SCALAR_TAGS):
                raise parser.expected("a duration such as 30s, 10m or 6h", vnode, f"restart.{key}")
            try:
                timing[key] = parse(str(vnode.value))
            except ValueError as exc:
                raise parser.error(str(exc), vnode, f"restart.{key}", "e.g. backoff: 30s..10m, window: 6h") from None
            if key == "window" and timing[key] <= 0:  # no restart would count: the budget would never run out
                raise parser.expected("a duration above 0 (30m, 6h)", vnode, "restart.window",
                                      "leave window out to count every restart of the job")
    codes, items = None, entries.get("on_exit_codes")
    if items is not None:
        if not (isinstance(items, SequenceNode) and items.value):
            raise parser.expected("a non-empty list of exit codes", items, "restart.on_exit_codes")
        codes = tuple(parser.integer(item, f"restart.on_exit_codes[{i}]", "an exit code from 0 to 255", 0, 255)
                      for i, item in enumerate(items.value))
    first, longest = timing.get("backoff", (30.0, 600.0))
    return RestartPolicy(most, first, longest, codes, timing.get("window"))
