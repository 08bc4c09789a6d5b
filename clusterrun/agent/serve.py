"""The dispatch table of every operation, and the loop that answers requests on stdin."""

from __future__ import annotations

import os
import sys

from .codec import emit, json_loads
from .records import AgentFailure
from .wire import REQUESTS, Request

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


# Every operation: its request's ``op`` -> the module of this package and the function there that
# answers it, imported at its first request (a probe imports what a probe needs, not the start's,
# the follow's or the sync's parts: half the agent's import time). ``answer`` decodes the request
# line once into ``wire.REQUESTS[op]`` and hands the handler that object, never a dict (a new op:
# its Request type in wire.py, its handler here taking it; tests/test_wire.py checks both).
# ``follow`` and ``run`` stream their own answers and return None; ``sync_put`` reads its files' bytes from
# stdin after the request.
OPS: dict[str, tuple[str, str]] = {
    "probe": ("probe", "op_probe"), "route": ("network", "op_route"), "setup": ("setup", "op_setup"),
    "start": ("start", "op_start"), "follow": ("follow", "op_follow"), "stop": ("stop", "op_stop"),
    "status": ("status", "op_status"), "remove": ("status", "op_remove"), "jobs": ("status", "op_jobs"),
    "sync_stat": ("syncops", "op_sync_stat"), "sync_hash": ("syncops", "op_sync_hash"),
    "sync_put": ("syncops", "op_sync_put"), "gpus": ("gpus", "op_gpus"), "stack": ("stackops", "op_stack"),
    "inspect": ("doctorops", "op_inspect"), "listen": ("doctorops", "op_listen"),
    "unlisten": ("doctorops", "op_unlisten"), "reach": ("doctorops", "op_reach"), "run": ("runops", "op_run"),
}


def handler(op: str) -> Callable[[Any], dict[str, Any] | None]:
    """The function that answers ``op`` (one of ``OPS``), its module imported now if not yet."""
    module, name = OPS[op]
    handle: Callable[[Any], dict[str, Any] | None] = getattr(
        __import__(f"{__package__}.{module}", fromlist=[name]), name)
    return handle


def answer(line: bytes) -> dict[str, Any] | None:
    """The answer to one request line, or None for ``follow`` and ``run`` (which stream their own)."""
    try:
        req = json_loads(line)
        op = req.get("op") if isinstance(req, dict) else None
        if op not in OPS:
            return {"ok": False, "error": f"unknown op {op!r}"}
        # Decoded into its wire type: a missing or mistyped field is a bad request that names it,
        # and the operation reads the fields the type defines, its defaults filled in.
        return handler(op)(REQUESTS[op].from_json(req, f"{op} request"))
    except (AgentFailure, ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        return failure(exc)


def answer_to(request: Request) -> dict[str, Any] | None:
    """The answer to a request that came inside another one (the probe's ``inspect``, ``listen``):
    as if it had come alone, a failure its own ``{ok: false, error}``."""
    try:
        return handler(request.op)(request)
    except (AgentFailure, ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        return failure(exc)


# What may come on the stdin of a ``follow`` (its ``asks``): the owner's stop of the node, sent down the
# channel its follower holds instead of to a new agent (a channel and an interpreter's start).
ASIDE_OPS = ("stop",)
# Whether stdin is still read once the streaming request ends: a ``follow`` with ``asks`` leaves
# its agent to the owner's next requests (its next attempt's probe and start), until stdin ends;
# whether a failing attempt's stop came aside (``failing``: a restart may follow).
_after = {"carry_on": False, "failing": False}
# What a restart asks of the agent that followed the failed attempt: imported once the follow ends
# after a failing stop, while the other nodes still stop, not when the next attempt waits for it.
NEXT_OPS = ("probe", "inspect", "listen", "reach", "start")


def aside_ready() -> None:
    """Import what answers ``ASIDE_OPS`` now (the stop: 10-45 ms of imports on a loaded host), not
    while a failing attempt waits for its stop; the agent answers requests after the follow's end."""
    _after["carry_on"] = True
    for op in ASIDE_OPS:
        handler(op)


def answer_aside() -> bool:
    """Answer one request that came on stdin while a ``follow`` streams, as ``{"t": "answer",
    "answer": ...}`` among its messages; False once stdin has ended (nothing more will come)."""
    line = sys.stdin.buffer.readline()
    if not line:
        _after["carry_on"] = False
        return False
    if line.strip():
        try:
            req = json_loads(line)
            op = req.get("op")
        except (ValueError, AttributeError):
            req, op = {}, None
        reply = answer(line) if op in ASIDE_OPS else {"ok": False, "error": f"{op!r} cannot come aside a follow"}
        _after["failing"] = _after["failing"] or bool(req.get("failing"))
        emit({"t": "answer", "answer": reply})
    return True


def failure(exc: Exception) -> dict[str, Any]:
    """A failed operation's answer, in words."""
    if isinstance(exc, BrokenPipeError):
        raise exc
    if isinstance(exc, AgentFailure):
        return {"ok": False, "error": str(exc)}
    if isinstance(exc, OSError):
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": False, "error": f"bad request: {type(exc).__name__}: {exc}"}


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
            if reply is None and not _after["carry_on"]:
                return 0  # a follow or a run streamed to its end: the controller closes the channel
            if reply is not None:
                emit(reply)
            elif _after["failing"]:
                _after["failing"] = False
                for op in NEXT_OPS:
                    handler(op)
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
