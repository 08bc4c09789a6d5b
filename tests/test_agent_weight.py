"""What the agent's requests of a start cost a host: the preflight's requests (probe, route,
listen, reach, unlisten) import none of the stdlib modules that cost milliseconds at every start
(``socket`` imports ``enum`` and ``selectors``; ``enum`` ``functools`` and ``collections``; see
docs/benchmarks.md). A top-level ``import socket`` in one of them makes this fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("socket", "selectors", "enum", "re", "functools", "collections", "typing", "json", "subprocess")

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from clusterrun.agent import serve
from clusterrun.agent.codec import json_dumps, json_loads

def ask(request):
    answer = serve.answer(json_dumps(request).encode())
    assert answer.get("ok") is not False, answer
    return answer

ask({"op": "probe", "state_dir": sys.argv[2], "free_port": True})
ask({"op": "route", "route_to": {"addr": "127.0.0.1"}})
port = ask({"op": "listen", "port": None, "token": "t"})["port"]
assert ask({"op": "reach", "addr": "127.0.0.1", "port": port, "token": "t"})["reached"]
ask({"op": "unlisten", "port": port})
print(json_dumps(sorted(name for name in sys.argv[3].split(",") if name in sys.modules)))
"""


def test_preflight_requests_import_no_heavy_module(tmp_path: Path) -> None:
    # -S as the agent runs (no site, so nothing imported before the agent's own code)
    out = subprocess.run([sys.executable, "-S", "-c", SCRIPT, str(ROOT), str(tmp_path / "state"), ",".join(HEAVY)],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
