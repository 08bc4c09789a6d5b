"""Third-party and CPython internals that clusterrun relies on, pinned to the versions checked.

Each test fails on an upgrade past those versions: check the internals named in the test again,
then raise the bound. (DataTable's caches: tests/test_tui_snapshots.py.)"""

from __future__ import annotations

import json
import sys

from clusterrun.agent import codec


def test_the_agent_uses_json_s_c_parts_only_on_the_pythons_checked() -> None:
    """make_encoder's nine arguments and the attributes make_scanner reads (codec._JSONContext)."""
    assert sys.version_info[:2] <= codec.JSON_C_CHECKED[1], f"Python {sys.version_info[:2]} is newer than checked"
    assert codec.json_loads is not json.loads  # the C parts, on this Python
    text = '{"a": [1, 2.5, null, true, "\\u00e9\\n", -Infinity], "b": {"c": -1e+300}}'
    assert codec.json_loads(text) == json.loads(text)
    obj = {"z": [1, 2.5, None, True, "é\n\udcff"], "a": {"c": float("inf")}}
    assert codec.json_dumps(obj) == json.dumps(obj)
    assert codec.json_dumps_sorted(obj) == json.dumps(obj, sort_keys=True)
