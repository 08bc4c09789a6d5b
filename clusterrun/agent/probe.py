"""``probe``: the interpreter, torch (found without importing it), a free port, containment."""

from __future__ import annotations

import os
import sys

from . import PROTOCOL
from .cgroup import cgroup_parent
from .logind import logind_problem, user_scope
from .network import network_route
from .records import AgentFailure, boot_id, state_root
from .system import static_fallbacks
from .wire import ProbeRequest

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


# torchrun options newer than the oldest torch we support; the probe says which a host has.
OPTIONAL_TORCHRUN_FLAGS = ("--signals-to-handle", "--shutdown-timeout")


def find_torch() -> Any:
    """torch's module spec for this interpreter, without importing torch. The agent runs without
    ``site`` (``-S``), so ``sys.prefix`` is the base interpreter's even in a virtual environment:
    look in the site directories ``site`` would add (the environment's own, as its ``pyvenv.cfg``
    says), and run ``site`` only if torch is not there (a ``.pth`` file may know more; it may also
    import anything, such as an editable install's finder)."""
    import importlib.machinery
    import site

    paths, system_site = list(sys.path), True
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for cfg in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg")):
        try:
            with open(cfg, encoding="utf-8") as f:
                values = [v for k, _, v in (line.partition("=") for line in f)
                          if k.strip().lower() == "include-system-site-packages"]
        except OSError:
            continue
        system_site = not values or values[-1].strip().lower() == "true"  # site's default: true
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        paths += [os.path.join(os.path.dirname(exe_dir), lib, version, "site-packages")
                  for lib in dict.fromkeys((getattr(sys, "platlibdir", "lib"), "lib"))]
        break
    if system_site:
        try:
            paths += [*site.getsitepackages([sys.base_prefix]), site.getusersitepackages()]
        except AttributeError:  # an old virtualenv's own site module
            pass
    try:
        spec = importlib.machinery.PathFinder.find_spec("torch", paths)
        if spec is None and sys.flags.no_site:
            import importlib.util

            site.main()
            spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    return spec


def op_probe(req: ProbeRequest) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "ok": True,
        "protocol": PROTOCOL,
        "hostname": os.uname().nodename,  # what socket.gethostname() returns
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "boot_id": boot_id(),
        "torch": None,
        "torchrun_flags": [],
        "state_dir": state_root(req.state_dir),
        "port": None,
    }
    spec = find_torch()
    if spec is not None and spec.origin:
        torch_dir = os.path.dirname(spec.origin)
        try:
            with open(os.path.join(torch_dir, "version.py")) as f:
                answer["torch"] = version_of(f.read())
            with open(os.path.join(torch_dir, "distributed", "run.py")) as f:
                run_py = f.read()
            answer["torchrun_flags"] = [flag for flag in OPTIONAL_TORCHRUN_FLAGS if flag in run_py]
        except OSError:
            answer["torch"] = answer["torch"] or "unknown"
    if req.free_port:
        answer["port"] = _free_port()
    parent, why = cgroup_parent()
    answer["containment"] = "cgroup" if parent else "sweep"
    answer["fallbacks"] = ([f"no cgroup: {why}"] if why else []) + static_fallbacks()
    try:
        import _ctypes  # noqa: F401 - the supervisor's subreaper and inotify go through ctypes
    except ImportError:
        answer["fallbacks"] += ["no subreaper (Python without ctypes)", "no inotify (Python without ctypes)"]
    problem = logind_problem()
    if problem and user_scope("probe", 0, 1) is not None:
        problem = ("logind kills this login session's processes at logout (KillUserProcesses=yes): jobs start "
                   "in a scope of your systemd user manager instead (it lingers)")
    if problem:
        answer["fallbacks"].append(problem)
    if req.route_to is not None:
        answer["network"] = network_route(req.route_to)
    if req.inspect is not None or req.listen is not None:  # the preflight's, answered as if asked alone
        from .serve import answer_to

        for key, also in (("inspect", req.inspect), ("listen", req.listen)):
            if also is not None:
                answer[key] = answer_to(also)
    return answer


def version_of(version_py: str) -> str:
    """The ``__version__ = '...'`` of a module's source (torch/version.py), or ``unknown``."""
    for line in version_py.splitlines():
        name, equals, value = line.partition("=")
        value = value.strip()
        if equals and name.split(":")[0].strip() == "__version__" and value[:1] in ("'", '"'):
            end = value.find(value[0], 1)
            return value[1:end] if end > 1 else "unknown"
    return "unknown"


def assigned(source: str, name: str) -> str | None:
    """The string assigned to ``name`` in a module's source (``cuda: Optional[str] = '12.4'``), or None."""
    for line in source.splitlines():
        key, equals, value = line.partition("=")
        value = value.strip()
        if equals and key.split(":")[0].strip() == name and value[:1] in ("'", '"'):
            end = value.find(value[0], 1)
            return value[1:end] if end > 1 else None
    return None


def _free_port() -> int:
    # Below Linux's ephemeral range (32768+), so an outgoing connection will not take it later.
    # _socket, not socket: the socket module imports enum and selectors.
    try:
        import _socket as socket
    except ImportError:  # not CPython
        import socket  # type: ignore[no-redef]

    for _ in range(200):
        port = 20000 + int.from_bytes(os.urandom(2), "big") % 12001
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("", port))
        except OSError:
            continue
        finally:
            s.close()
        return port
    raise AgentFailure("no free TCP port found between 20000 and 32000")
