"""The dispatch table of every operation, and the loop that answers requests on stdin."""

from __future__ import annotations

import os
import sys

from .codec import _emit, json_loads
from .doctorops import DOCTOR_OPS
from .follow import op_follow
from .gpus import op_gpus
from .network import op_route
from .probe import op_probe
from .records import AgentFailure
from .setup import op_setup
from .stackops import op_stack
from .start import op_start
from .status import op_jobs, op_remove, op_status
from .stop import op_stop
from .syncops import op_sync_hash, op_sync_put, op_sync_stat
from .wire import REQUESTS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


# Every operation: its request's ``op`` → the function that answers it. ``answer`` decodes the
# request line once into ``wire.REQUESTS[op]`` and hands the handler that object, never a dict
# (a new op: its Request type in wire.py, its handler here taking it; tests/test_wire.py checks
# both). ``follow`` streams its own answer and returns None; ``sync_put`` reads its files' bytes
# from stdin after the request.
OPS: dict[str, Callable[[Any], dict[str, Any] | None]] = {
    "probe": op_probe, "route": op_route, "setup": op_setup, "start": op_start, "follow": op_follow,
    "stop": op_stop, "status": op_status, "remove": op_remove, "jobs": op_jobs,
    "sync_stat": op_sync_stat, "sync_hash": op_sync_hash, "sync_put": op_sync_put, "gpus": op_gpus, "stack": op_stack,
    **DOCTOR_OPS,
}


def answer(line: bytes) -> dict[str, Any] | None:
    """The answer to one request line, or None for ``follow`` (which streams its own)."""
    try:
        req = json_loads(line)
        op = req.get("op") if isinstance(req, dict) else None
        if op not in OPS:
            return {"ok": False, "error": f"unknown op {op!r}"}
        # Decoded into its wire type: a missing or mistyped field is a bad request that names it,
        # and the operation reads the fields the type defines, its defaults filled in.
        return OPS[op](REQUESTS[op].from_json(req, f"{op} request"))
    except AgentFailure as exc:
        return {"ok": False, "error": str(exc)}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return {"ok": False, "error": f"bad request: {type(exc).__name__}: {exc}"}
    except BrokenPipeError:
        raise
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def serve(first: bytes = b"") -> int:
    """Answer the requests on stdin, one per line, until it ends (``first``: one read already)."""
    os.umask(0o077)
    stdin = sys.stdin.buffer
    try:
        while True:
            line, first = first or stdin.readline(), b""
            if not line:
                return 0
            if not line.strip():
                continue
            reply = answer(line)
            if reply is None:
                return 0  # a follow streamed to its end: the controller closes the channel
            _emit(reply)
    except BrokenPipeError:
        return 0


def main(folder: str, digest: str, run: str, installed: bool, first: bytes = b"") -> int:
    """The loader's entry point, running from the zip at ``run`` (version ``digest``, cached in
    ``folder``): compile a version on its first run here, prune old ones once a new one is in."""
    if installed:
        from .cache import prune

        prune(folder, digest)
    if not os.path.basename(run).startswith(f"agent-{digest}-"):  # the sources: compile them for the next run
        from .cache import compile_zip

        try:
            compile_zip(folder, digest, run)
        except (OSError, SyntaxError) as exc:
            sys.stderr.write(f"clusterrun: cannot compile the agent in {folder}: {exc}\n")
    return serve(first)
