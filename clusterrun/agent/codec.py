"""The agent's JSON (through json's C parts where checked) and its answers on stdout: a JSON line
each, and a log message's bytes raw after its line (``encode``)."""

from __future__ import annotations

import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _JSONContext:
    """What json's C scanner reads from a ``json.JSONDecoder`` (the defaults of ``json.loads``)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity


# _json's make_encoder and make_scanner are CPython internals: used only on the versions checked
# (tests/test_third_party.py fails on a newer Python until they are checked again). They stay with
# the bytecode cached: the json module (re, enum) still costs 6 of 20 ms per agent start (docs/benchmarks.md).
JSON_C_CHECKED = ((3, 8), (3, 13))


def _codec() -> tuple[Any, Any, Any]:
    """``dumps``, sorted-keys ``dumps`` and ``loads``, as ``json``'s (ASCII output, ``NaN`` allowed)."""
    try:
        if sys.implementation.name != "cpython" or not JSON_C_CHECKED[0] <= sys.version_info[:2] <= JSON_C_CHECKED[1]:
            raise ImportError("json's C parts not checked on this Python")
        import _json

        def encoder(sort_keys: bool) -> Any:
            encode = _json.make_encoder(None, _unserializable, _json.encode_basestring_ascii, None, ": ", ", ",
                                        sort_keys, False, True)
            return lambda obj: "".join(encode(obj, 0))

        scan = _json.make_scanner(_JSONContext)  # type: ignore[arg-type]  # reads only the attributes
        dumps, dumps_sorted = encoder(False), encoder(True)
        if dumps({"a": [1, 2.5, None, True, "\u00e9\n"]}) != '{"a": [1, 2.5, null, true, "\\u00e9\\n"]}':
            raise ImportError("json's C encoder works differently here")
    except (ImportError, AttributeError, TypeError):
        import json

        return json.dumps, lambda obj: json.dumps(obj, sort_keys=True), json.loads

    def loads(text: str | bytes) -> Any:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        start = len(text) - len(text.lstrip(" \t\n\r"))
        try:
            obj, end = scan(text, start)
        except StopIteration as exc:
            raise ValueError(f"not JSON (at character {exc.value})") from None
        if text[end:].strip(" \t\n\r"):
            raise ValueError(f"not JSON (extra data at character {end})")
        return obj

    return dumps, dumps_sorted, loads


def _unserializable(obj: object) -> None:
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


json_dumps, json_dumps_sorted, json_loads = _codec()


last_emit = [0.0]


def encode(obj: dict[str, Any]) -> bytes:
    """A message as the agent writes it: a JSON line; a ``data`` of bytes leaves the JSON and follows
    the line raw, its length as ``raw`` (``{"t": "log", ..., "raw": 6}\\nline\\n``): a log's bytes
    are neither encoded here nor decoded on the controller as JSON text (docs/benchmarks.md, "Logs"),
    and arrive as written."""
    data = obj.get("data")
    if isinstance(data, bytes):
        head = {key: value for key, value in obj.items() if key != "data"}
        head["raw"] = len(data)
        line: str = json_dumps(head)
        return line.encode() + b"\n" + data
    line = json_dumps(obj)
    return line.encode() + b"\n"


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(encode(obj))
    sys.stdout.buffer.flush()
    last_emit[0] = time.monotonic()
