"""What ``clusterrun doctor`` (and ``up``'s preflight) asks of a host beyond the probe:
``inspect``, ``listen``, ``unlisten`` and ``reach``; the controller's side is doctor.py."""

from __future__ import annotations

import os
import sys
import time

from .codec import json_loads
from .logind import logind_problem, user_scope
from .network import host_arg, sockets
from .probe import assigned, find_torch
from .records import AgentFailure, state_root
from .setup import PREPARED
from .system import collect, launch, which
from .wire import InspectRequest, ListenRequest, ReachRequest, UnlistenRequest

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


# What `clusterrun doctor` (and `up`'s preflight) asks of a host; controller side: doctor.py.
# torch's versions as the interpreter sees them when it imports torch (site on, as torchrun runs).
DEEP_TORCH = r"""
import json, sys
out = {}
try:
    import torch
    out["version"] = str(getattr(torch, "__version__", "unknown"))
    out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        out["nccl"] = None
    try:
        out["devices"] = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        out["devices"] = 0
except BaseException as exc:
    out = {"error": "%s: %s" % (type(exc).__name__, exc)}
sys.stdout.write(json.dumps(out))
"""


# The modules a script imports at its top level (not in a try or an if: those may be optional)
# that the interpreter cannot find, as it would run the script: its directory first on sys.path,
# then the job's PYTHONPATH. The script is parsed, never run.
FIND_IMPORTS = r"""
import ast, importlib.util, json, os, sys
script, path = sys.argv[1], sys.argv[2]
try:
    with open(script, "rb") as f:
        tree = ast.parse(f.read(), script)
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module.split(".")[0])
    sys.path[:0] = [os.path.dirname(os.path.abspath(script))] + [p for p in path.split(os.pathsep) if p]
    missing = []
    for name in dict.fromkeys(names):
        try:
            found = name in sys.builtin_module_names or importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    out = {"missing": missing}
except BaseException as exc:
    out = {"error": "%s: %s" % (type(exc).__name__, exc)}
sys.stdout.write(json.dumps(out))
"""


_LISTENERS: dict[int, Any] = {}  # port → (socket, lock released once closed) of a `listen`, until `unlisten`


def _path_kind(path: str) -> str:
    if os.path.isdir(path):
        return "dir"
    if os.path.isfile(path):
        return "file"
    return "missing" if not os.path.lexists(path) else "other"


def _disk(folder: str) -> dict[str, Any]:
    """Free space of the file system that holds ``folder`` (or would: its nearest existing parent)."""
    path = folder
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": path, "error": os.strerror(exc.errno or 0)}
    return {"path": path, "free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize,
            "writable": os.access(path, os.W_OK)}


def op_inspect(req: InspectRequest) -> dict[str, Any]:
    """``inspect``: what the doctor checks beyond the probe (see the module docstring)."""
    began = time.monotonic()
    cwd = os.path.expanduser(req.cwd or "~")
    answer: dict[str, Any] = {"ok": True, "time": time.time(), "cwd": cwd, "paths": {},
                              "disk": _disk(state_root(req.state_dir))}
    for path in req.paths or []:
        answer["paths"][path] = _path_kind(os.path.join(cwd, os.path.expanduser(path)))
    # the job's interpreter and environment where its setup ran in this agent, else this agent's own
    prepared = PREPARED.get((req.job, req.node, req.attempt)) if req.job is not None else None
    seen = prepared.python if prepared is not None and prepared.python else {}
    python, env = (seen["executable"], prepared.env) if prepared is not None and seen else (sys.executable, None)
    spec = find_torch() if env is None else None
    if env is not None:
        answer["torch_cuda"] = seen.get("torch_cuda")
    elif spec is not None and spec.origin:
        try:
            with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
                text = f.read()
            answer["torch_cuda"] = assigned(text, "cuda")
        except OSError:
            pass
    # The slow looks run side by side (on a GPU host, importing torch and each nvidia-smi can take
    # seconds: this is on every `up`'s path), each then read in turn.
    timeout = float(req.timeout or 120)
    deep = launch([python, "-c", DEEP_TORCH], timeout, env=env) if req.deep else None
    script = os.path.join(cwd, os.path.expanduser(req.imports)) if req.imports else None
    looks = script is not None and os.path.isfile(script)  # a missing one: its path says so
    imports = launch([python, "-c", FIND_IMPORTS, script or "", req.pythonpath or ""], timeout,
                     env=env) if looks else None
    if req.gpus:
        answer["nvidia_smi"] = which("nvidia-smi")
    gpu_list = gpu_apps = None
    if req.gpus and answer["nvidia_smi"]:
        gpu_list = launch(["nvidia-smi", "-L"], timeout=30)
        gpu_apps = launch(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name",
                           "--format=csv,noheader"], timeout=30)
    if req.deep:
        answer["deep"] = _json_of(collect(deep), f"{python} could not import torch")
    if looks:
        answer["imports"] = _json_of(collect(imports), f"{python} could not look")
    if req.gpus and answer["nvidia_smi"]:
        answer["gpu_list"], answer["gpu_apps"] = collect(gpu_list), collect(gpu_apps)
    problem = logind_problem()
    answer["logind"] = problem
    answer["logind_scope"] = bool(problem) and user_scope("probe", 0, 1) is not None
    answer["elapsed"] = time.monotonic() - began  # the controller's bracket of ``time`` ends this much earlier
    return answer


def _json_of(out: str | None, missing: str) -> dict[str, Any]:
    """A look's JSON answer, or ``{error}``: ``missing`` if it printed nothing (or failed)."""
    try:
        return json_loads(out) if out else {"error": missing}
    except ValueError:
        return {"error": f"unreadable output: {(out or '')[:200]!r}"}



def _listener_loop(sock: Any, port: int, token: bytes, done: Any) -> None:
    """Answer every connection with ``token``, then wait for the peer to close first (so that the
    TIME_WAIT is the peer's and the port is free for torchrun at once). Closes the listener and
    releases ``done`` once ``unlisten`` has taken it out of ``_LISTENERS``."""
    try:
        while any(entry[0] is sock for entry in _LISTENERS.values()):
            try:
                fd, _ = sock._accept()  # _socket's socket has no accept(): socket.py's own way, pinned by tests
            except OSError:  # a timeout (to see `unlisten`), or its shutdown
                continue
            conn = type(sock)(sock.family, sock.type, sock.proto, fileno=fd)
            try:
                conn.settimeout(5.0)
                conn.sendall(token + b"\n")
                while conn.recv(64):
                    pass
            except OSError:
                pass
            finally:
                conn.close()
    finally:
        sock.close()
        done.release()


def op_listen(req: ListenRequest) -> dict[str, Any]:
    """``listen``: open a TCP listener on ``port`` (all addresses; a free one if null) that answers
    ``token`` to whoever connects, until ``unlisten`` or the end of this agent."""
    import _thread

    socket = sockets()  # not the socket module: 4-5 ms of node 0's host CPU at every start (enum)
    token = req.token.encode()
    port = req.port
    for _ in range(1 if port else 200):
        candidate = int(port) if port else 20000 + int.from_bytes(os.urandom(2), "big") % 12001
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("", candidate))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            if port:
                return {"ok": True, "port": candidate, "listening": False, "error": os.strerror(exc.errno or 0)}
            continue
        sock.settimeout(0.2)
        done = _thread.allocate_lock()
        done.acquire()
        _LISTENERS[candidate] = (sock, done)
        _thread.start_new_thread(_listener_loop, (sock, candidate, token, done))
        return {"ok": True, "port": candidate, "listening": True}
    raise AgentFailure("no free TCP port found between 20000 and 32000")


def op_unlisten(req: UnlistenRequest) -> dict[str, Any]:
    """``unlisten``: close the listener; the port is free again when this answers."""
    socket = sockets()
    entry = _LISTENERS.pop(req.port, None)
    if entry is not None:
        sock, done = entry
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes its accept() at once (Linux)
        except OSError:
            pass
        done.acquire(timeout=10.0)
    return {"ok": True}


def _connect(socket: Any, addr: str, port: int, timeout: float) -> Any:
    """A TCP connection to ``addr:port``, trying each address it resolves to (as
    ``socket.create_connection``), each with ``timeout``."""
    error: OSError = OSError(f"cannot resolve {addr}")
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host_arg(addr), port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error


def op_reach(req: ReachRequest) -> dict[str, Any]:
    """``reach``: connect by TCP to ``addr:port`` and read the listener's ``token``; says whether
    it came back, else why not, and the local address the connection went out from."""
    socket = sockets()  # on every host at every preflight: not the socket module (network.sockets)

    addr, port, token = req.addr, req.port, req.token
    timeout = float(req.timeout or 5.0)  # each step: a dropped SYN must not hang the doctor
    answer: dict[str, Any] = {"ok": True, "reached": False, "error": None, "local": None}
    try:
        sock = _connect(socket, addr, port, timeout)
    except OSError as exc:
        answer["error"] = (f"timed out after {timeout:g} s: no answer at all (packets dropped on the way, "
                           "as a firewall's DROP does)") if isinstance(exc, socket.timeout) else (
            os.strerror(exc.errno) if exc.errno else str(exc))
        return answer
    try:
        answer["local"] = sock.getsockname()[0]
        got = b""
        while not got.endswith(b"\n") and len(got) < 256:
            chunk = sock.recv(256)
            if not chunk:
                break
            got += chunk
        if got.strip().decode("utf-8", "replace") == token:
            answer["reached"] = True
        else:
            answer["error"] = "something else answers there (not clusterrun's listener on node 0)"
    except OSError as exc:
        answer["error"] = (f"connected, but no answer within {timeout:g} s (not clusterrun's listener on node 0)"
                           if isinstance(exc, socket.timeout) else str(exc))
    finally:
        sock.close()
    return answer
