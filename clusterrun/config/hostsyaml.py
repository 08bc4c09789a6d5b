"""The hosts file's YAML, node by node: composed with each value's line, checked everywhere, plain values read.

``compose`` turns the text into PyYAML's node tree (a syntax error is a ``ConfigError`` at its
line). ``NodeReader`` holds what ``config._Parser`` builds on: pass 1, ``check_tree`` (tags, key
shapes, duplicate keys and secrets on every node), and the readers of plain values (``fields``,
``string``, ``integer``, ``strings``), each raising ``ConfigError(message, path=, line=, key=,
hint=)`` at the node's line; ``config`` adds the schema, ``watchconfig`` reads its keys with them.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import NoReturn

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from clusterrun.core.errors import ConfigError

_TAG = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
TIMESTAMP, _MERGE = _TAG + "timestamp", _TAG + "merge"
_ALLOWED_TAGS = {STR, INT, FLOAT, BOOL, NULL, TIMESTAMP, _MERGE, _TAG + "seq", _TAG + "map"}

_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)\Z")
_BAD_CHARS = re.compile(r"[\s\x00-\x1f\x7f]")
_MAX_DIGITS = 20  # a longer number is not a count or a port (and int() refuses > 4,300 digits)


def compose(text: str, path: str) -> Node | None:
    """The node tree of hosts-file ``text`` (None for an empty document); ``path`` is only used in error messages."""
    hint = "check the indentation (spaces, not tabs) and the quoting around this line"
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = (exc.problem or "syntax error").removeprefix("but ")
        if exc.context:
            problem += f" ({exc.context})"
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(f"invalid YAML: {problem}", path=path, line=line, hint=hint) from exc
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        char = f" #x{exc.character:04x}" if isinstance(exc.character, int) else ""
        raise ConfigError(f"invalid YAML: unacceptable character{char}", path=path, line=line) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", path=path, hint=hint) from exc
    except RecursionError as exc:
        raise ConfigError("invalid YAML: nested too deeply", path=path) from exc
    return root


def line_of(node: Node) -> int:
    return int(node.start_mark.line) + 1


def describe(node: Node) -> str:
    """What the user wrote, for ``got ...`` in messages."""
    if isinstance(node, SequenceNode):
        return "an empty list" if not node.value else "a list"
    if isinstance(node, MappingNode):
        return "a mapping"
    text = str(node.value)
    if node.tag == STR:
        return repr(text if len(text) <= 60 else text[:57] + "...")
    if node.tag == BOOL:
        return f"{text} (YAML reads it as a boolean)"
    if node.tag == NULL:
        return "an empty value" if text in ("", "~", "null", "Null", "NULL") else text
    if node.tag == TIMESTAMP:
        return f"{text} (YAML reads it as a date)"
    return text


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_secret(name: str) -> bool:
    lowered = name.lower()
    return lowered in ("password", "passphrase") or lowered.endswith(("_password", "_passphrase"))


class NodeReader:
    """One file's nodes read with their lines: create → check_tree(root) → fields, string, integer, strings."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, message: str, node: Node | None, key: str | None, hint: str | None = None) -> ConfigError:
        line = line_of(node) if node is not None else None
        return ConfigError(message, path=self.path, line=line, key=key or None, hint=hint)

    def expected(self, what: str, node: Node, key: str, hint: str | None = None) -> ConfigError:
        if hint is None and isinstance(node, ScalarNode) and node.tag != STR and what.startswith("a string"):
            quoted = f'put the value in quotes: "{node.value}"'
            hint = "give a value, or remove the key" if node.tag == NULL else quoted
        return self.error(f"expected {what}, got {describe(node)}", node, key, hint)

    # -- pass 1: every node, whatever its place in the schema ---------------------------------

    def check_tree(self, root: Node) -> None:
        """Refuse unsafe tags, odd keys, duplicate keys and secrets anywhere in the document."""
        stack: list[tuple[Node, str]] = [(root, "")]
        seen: set[int] = set()  # aliases share nodes, and may even form cycles
        while stack:
            node, path = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.tag not in _ALLOWED_TAGS:
                raise self.error(f"YAML tag '{node.tag.replace(_TAG, '!!')}' is not allowed", node, path,
                                 "hosts files are plain (safe) YAML: strings, numbers, booleans, lists, mappings")
            children: list[tuple[Node, str]] = []
            if isinstance(node, ScalarNode):
                self._check_text(node, path)
            elif isinstance(node, SequenceNode):
                children = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
            elif isinstance(node, MappingNode):
                children = self._check_mapping(node, path)
            stack.extend(reversed(children))

    def _check_text(self, node: ScalarNode, path: str) -> None:
        # Neither can reach a command line or an environment: fail here rather than at launch.
        if "\x00" in node.value:
            raise self.error("must not contain NUL characters", node, path)
        try:
            node.value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise self.error("is not valid text (it holds a lone surrogate)", node, path) from exc

    def _check_mapping(self, node: MappingNode, path: str) -> list[tuple[Node, str]]:
        children: list[tuple[Node, str]] = []
        names: dict[str, Node] = {}
        for knode, vnode in node.value:
            if not isinstance(knode, ScalarNode):
                raise self.error(f"a key must be a plain name, got {describe(knode)}", knode, path)
            name = str(knode.value)
            key = join_key(path, name)
            if knode.tag == _MERGE:
                raise self.error("YAML merge keys ('<<') are not supported", knode, path,
                                 "put settings shared by all hosts under 'defaults:'")
            if _is_secret(name):
                in_env = path == "env" or path.endswith(".env")
                hint = ("keep secrets out of the hosts file; set them on the host instead" if in_env
                        else "use an SSH key (identity_file) or ssh-agent")
                raise self.error("passwords are not accepted in hosts files", knode, key, hint)
            if name in names:
                raise self.error(f"duplicate key '{name}' (also at line {line_of(names[name])})", knode, key,
                                 "YAML would silently keep only the last one; remove one of them")
            names[name] = knode
            children.append((vnode, key))
        return children

    # -- plain values, for pass 2 ------------------------------------------------------------

    def fields(self, node: Node, key: str, allowed: Iterable[str], what: str) -> dict[str, Node]:
        """The mapping's entries by name; unknown names are refused with a suggestion."""
        if not isinstance(node, MappingNode):
            raise self.expected(what, node, key)
        allowed = tuple(allowed)
        result: dict[str, Node] = {}
        for knode, vnode in node.value:
            name = str(knode.value)
            if name not in allowed:
                if key == "defaults" and name in ("host", "address"):
                    raise self.error(f"'{name}' cannot be set in defaults", knode, join_key(key, name),
                                     "each host entry names its own host and address")
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(allowed)
                raise self.error(f"unknown key '{name}'", knode, join_key(key, name), hint)
            result[name] = vnode
        return result

    def string(self, node: Node, key: str, *, name_like: bool = False) -> str:
        if not (isinstance(node, ScalarNode) and node.tag == STR):
            raise self.expected("a string", node, key)
        value = str(node.value)
        if not value.strip():
            raise self.error("must not be empty", node, key)
        if "\n" in value or "\r" in value:
            raise self.error("must be a single line of text", node, key)
        if name_like:
            if _BAD_CHARS.search(value):
                raise self.error(f"must not contain spaces or control characters, got {value!r}", node, key)
            if value.startswith("-"):
                raise self.error(f"must not start with '-', got {value!r}", node, key,
                                 "ssh would read it as an option")
            if "@" in value:
                raise self.error(f"must not contain '@', got {value!r}", node, key, "put the user name in 'user:'")
        return value

    def integer(self, node: Node, key: str, what: str, low: int, high: int | None = None,
                hint: str | None = None) -> int:
        if not (isinstance(node, ScalarNode) and node.tag == INT):
            raise self.expected(what, node, key)
        text = str(node.value)
        if not _DECIMAL.match(text):
            raise self.expected(what, node, key, "write it as a plain decimal number")
        if len(text.lstrip("+-")) > _MAX_DIGITS:
            return self._too_large(what, text, node, key, hint)
        value = int(text)
        if value < low or (high is not None and value > high):
            raise self.expected(what, node, key, hint)
        return value

    def _too_large(self, what: str, text: str, node: Node, key: str, hint: str | None) -> NoReturn:
        raise self.error(f"expected {what}, got a number of {len(text.lstrip('+-')):,} digits", node, key, hint)

    def strings(self, node: Node, key: str, what: str) -> list[tuple[str, Node]]:
        """A string or a non-empty list of strings, each with its node."""
        if isinstance(node, ScalarNode) and node.tag == STR:
            return [(self.string_or_lines(node, key), node)]
        if not isinstance(node, SequenceNode) or not node.value:
            raise self.expected(what, node, key)
        return [(self.string_or_lines(item, f"{key}[{i}]"), item) for i, item in enumerate(node.value)]

    def string_or_lines(self, node: Node, key: str) -> str:
        if isinstance(node, MappingNode):
            raise self.expected("a string", node, key, "put it in quotes: YAML reads 'word: text' as a mapping")
        if not (isinstance(node, ScalarNode) and node.tag == STR):
            raise self.expected("a string", node, key)
        if not str(node.value).strip():
            raise self.error("must not be empty", node, key)
        return str(node.value)
