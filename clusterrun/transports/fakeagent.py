"""What the fake hosts' agents answer: every request of the agent's protocol, answered as
``clusterrun.agent`` answers it, from the fake hosts' state (``fakehosts``).

``FakeAgent`` holds the state the answers read and change beside the hosts (the nodes started,
every request received, the listeners open, a clock); ``fake.FakeCluster`` is one, with the hosts
by name and what a test asks of them, and ``fake.FakeTransport`` hands its sessions' requests to
``_answers``.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from clusterrun.agent.gpus import parse_gpus
from clusterrun.agent.monitor import first_failure, rank_end
from clusterrun.agent.wire import REQUESTS
from clusterrun.core.errors import ConnectError
from clusterrun.transports.fakehosts import FakeHost, FakeNode, Key, pids


class FakeAgent:
    """The agents of a fake cluster's hosts: create → ``_answers(host, request, epoch)`` per request."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.nodes: dict[Key, FakeNode] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (host, request), every one received
        self._ticks = itertools.count(1)
        self.listeners: dict[int, tuple[FakeHost, str]] = {}  # port → the host listening and its token

    def now(self) -> float:
        """A fake wall clock that only moves forward, one tick per event (orders failures)."""
        return float(next(self._ticks))

    def _answers(self, host: FakeHost, request: dict[str, Any], epoch: int) -> Iterator[dict[str, Any]]:
        with self.changed:
            self.requests.append((host.name, request))
            self.changed.notify_all()
        op = request.get("op")
        kind = REQUESTS.get(str(op))
        if kind is not None:
            try:  # held to the real agent: a request it would refuse as malformed is refused here too
                kind.from_json(request, f"{op} request")
            except ValueError as exc:
                yield {"ok": False, "error": f"bad request: ValueError: {exc}"}
                return
        if op == "follow":
            yield from self._follow(host, request, epoch)
            return
        handler = {"probe": self._probe, "start": self._start, "stop": self._stop, "status": self._status,
                   "setup": self._setup, "route": self._route, "inspect": self._inspect, "listen": self._listen,
                   "unlisten": self._unlisten, "reach": self._reach, "remove": self._remove,
                   "jobs": self._jobs, "gpus": self._gpus, "stack": self._stack}.get(str(op))
        if handler is None:
            yield {"ok": False, "error": f"unknown op {op!r}"}
            return
        with self.changed:
            answer = handler(host, request)
            self.changed.notify_all()
        yield answer

    def _probe(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        answer = {"ok": True, "protocol": host.protocol, "hostname": host.name, "python": host.python,
                  "torch": host.torch,
                  "torchrun_flags": ["--node-rank", "--master-addr", "--master-port", "--nproc-per-node"],
                  "boot_id": host.boot_id, "port": 29500 if request.get("free_port") else None,
                  "state_dir": request.get("state_dir") or "~/.local/state/clusterrun"}
        if request.get("route_to") is not None:  # as the agent: the route's answer in the probe's
            answer["network"] = self._route(host, request)["network"]
        if request.get("inspect") is not None:  # and the preflight's, answered as if asked alone
            answer["inspect"] = self._inspect(host, request["inspect"])
        if request.get("listen") is not None:
            answer["listen"] = self._listen(host, request["listen"])
        return answer

    def _setup(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        if host.setup_error is not None:
            return {"ok": False, "error": host.setup_error}
        if request.get("if_cwd") and "." in host.missing:
            return {"ok": True, "skipped": f"{request.get('cwd')} does not exist yet"}
        limit = float(request.get("setup_timeout") or 600)
        if not self.changed.wait_for(lambda: not host.setup_blocks, timeout=limit):  # releases the lock meanwhile
            return {"ok": False, "error": f"setup did not finish within {limit:g} s (killed); nothing was started; "
                                          "its last lines:\n  | waiting for the data set"}
        if not request.get("python"):
            return {"ok": True}
        return {"ok": True, "python": host.after_setup or {
            "executable": request["python"], "python": host.python, "torch": host.torch,
            "torch_cuda": host.torch_cuda, "torchrun_flags": []}}

    @staticmethod
    def _route(host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        target = str((request.get("route_to") or {}).get("addr"))
        if callable(host.network):
            return {"ok": True, "network": host.network(target)}
        return {"ok": True, "network": host.network or {
            "netns": f"fake:{host.name}", "peer": None, "preset": {},
            "master": {"target": target, "resolved": target, "source": "192.0.2.1",
                       "interface": "eth0", "loopback": False, "error": None}}}

    def _inspect(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        cwd = request.get("cwd") or f"/home/{host.name}"
        paths = {p: "missing" if p in host.missing else "dir" if p == "." else "file"
                 for p in request.get("paths") or []}
        answer: dict[str, Any] = {
            "ok": True, "time": time.time() + host.clock_offset, "elapsed": 0.0, "cwd": cwd, "paths": paths,
            "disk": {"path": request.get("state_dir") or "~/.local/state/clusterrun", "free": host.disk_free},
            "torch_cuda": host.torch_cuda, "logind": host.logind, "logind_scope": False}
        if request.get("deep"):
            answer["deep"] = ({"error": host.torch_error} if host.torch_error else
                              {"version": host.torch, "cuda": host.torch_cuda, "nccl": host.nccl,
                               "devices": host.torch_devices})
        if request.get("imports") and request["imports"] not in host.missing:
            answer["imports"] = {"missing": sorted(host.modules_missing)}
        if request.get("gpus"):
            answer["nvidia_smi"] = "/usr/bin/nvidia-smi" if host.gpu_list is not None else None
            answer["gpu_list"], answer["gpu_apps"] = host.gpu_list, host.gpu_apps
        return answer

    @staticmethod
    def _gpus(host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        if host.gpu_query is None:
            return {"ok": True, "found": False, "gpus": [], "problem": ""}
        try:  # read as the agent reads it
            gpus = [] if host.gpu_problem else parse_gpus(host.gpu_query)
        except ValueError as exc:
            return {"ok": True, "found": True, "gpus": [], "problem": str(exc)}
        return {"ok": True, "found": True, "gpus": gpus, "problem": host.gpu_problem}

    def _listen(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        port = int(request.get("port") or 29500)
        if port in host.ports_taken or port in self.listeners:
            return {"ok": True, "port": port, "listening": False, "error": "Address already in use"}
        self.listeners[port] = (host, str(request.get("token")))
        return {"ok": True, "port": port, "listening": True}

    def _unlisten(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        self.listeners.pop(int(request.get("port") or 0), None)
        return {"ok": True}

    def _reach(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        listener = self.listeners.get(int(request["port"]))
        if listener is None:
            return {"ok": True, "reached": False, "error": "Connection refused", "local": None}
        if listener[0].firewalled and listener[0] is not host:
            return {"ok": True, "reached": False, "local": None,  # the agent's words for a dropped SYN
                    "error": f"timed out after {float(request.get('timeout') or 5.0):g} s: no answer at all (packets "
                             "dropped on the way, as a firewall's DROP does)"}
        if listener[1] != request.get("token"):
            return {"ok": True, "reached": False, "local": host.name,
                    "error": "something else answers there (not clusterrun's listener on node 0)"}
        return {"ok": True, "reached": True, "error": None, "local": host.name}

    @staticmethod
    def _key(request: dict[str, Any]) -> Key:
        return str(request["job"]), int(request["node"]), int(request["attempt"])

    def _start(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("unlisten") is not None:  # the preflight's listener, closed before torchrun binds
            self._unlisten(host, {"port": request["unlisten"]})
        if host.start_error is not None:
            error, host.start_error = host.start_error, None
            return {"ok": False, "error": error}
        key = self._key(request)
        if key in self.nodes:
            return {"ok": False, "error": f"node {key[1]} attempt {key[2]} of job {key[0]} exists already"}
        state = {"state": "running", "boot_id": host.boot_id, "supervisor": {"pid": next(pids), "start_time": 1},
                 "torchrun": {"pid": next(pids), "start_time": 1}}
        node = self.nodes[key] = FakeNode(key, host, list(request.get("argv") or ()), dict(request.get("env") or {}),
                                          state=state, spec=_spec(host, request))
        answer = {"ok": True, "dir": f"fake:{key}", "state": dict(node.state)}
        if request.get("setup") and host.setup_output is not None:  # as the agent: the log's head, and in the answer
            node.log += b"".join(b"[setup]: " + line.encode() + b"\n" for line in host.setup_output.splitlines())
            answer["setup_log"] = node.log.decode()
        return answer

    def _view(self, host: FakeHost, node: FakeNode) -> dict[str, Any]:
        """The node's state as the agent reports it: ``lost`` when its host restarted; when its
        processes vanished on the same boot, ended with an unknown exit status (as the monitor the
        real agent starts then writes it)."""
        state = node.state
        if state.get("state") != "exited" and not node.running:
            if state.get("boot_id") != host.boot_id:
                return dict(state, state="lost", rebooted=True, error="the host restarted since the job started "
                            "(its boot id changed): the job's processes ended with it")
            return dict(state, state="exited", exit_code=None, signal=None, exit_status="unknown",
                        error="torchrun's exit status is unknown: the survivor that waited for it ended first "
                              "(killed?)")
        return dict(state)

    def _absent(self, request: dict[str, Any]) -> dict[str, Any] | None:
        if self._key(request) in self.nodes:
            return None
        return {"ok": True, "state": {"state": "absent"}, "alive": {"supervisor": False, "torchrun": False},
                "log_size": 0, "killed": [], "left": []}

    def _stop(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        absent = self._absent(request)
        if absent is not None:
            return absent
        node = self.nodes[self._key(request)]
        node.stops += 1
        if request.get("failed") and not node.contained:  # as the agent: torchrun ends on its own
            return {"ok": True, "killed": [], "left": [], "state": self._view(host, node), "containment": "sweep",
                    "verified": False, "grace": float(request.get("grace", 10))}
        killed = []
        if node.running:
            stop_at = self.now()  # as the agent's ``stop`` file: before the end it brings
            when = time.strftime("%H:%M:%SZ", time.gmtime(time.time()))
            node.log += f"---- stopped by {request.get('by') or 'clusterrun'} at {when} ----\n".encode()  # as the agent
            how = "SIGKILL" if node.outlives_grace else "SIGTERM"
            killed = [{"pid": node.state["torchrun"]["pid"], "name": "torchrun", "signal": how}]
            code = None if node.outlives_grace else node.stop_exit_code
            node.state = dict(node.state, state="exited", exit_code=code, signal=9 if node.outlives_grace else
                              None if code is not None else 15, stop_requested=True, ended_at=self.now(),
                              stopped_by=request.get("by") or "clusterrun", stop_at=stop_at)
            first = first_failure(node.state.get("workers") or [])
            if request.get("failed") and first:  # as the monitor's ``failed_first``: the rank's failure, not a stop
                node.state.update(exit_code=1, signal=None, stop_requested=False, stopped_by=None,
                                  failed_rank=first.get("rank"),
                                  exit_learned=f"{rank_end(first)}; torchrun was stopped at once after it")
        cgroup = {"containment": "cgroup", "verified": not node.leave_on_stop,
                  "at_once": bool(request.get("failing")) and bool(killed)} if node.contained else {}
        return {"ok": True, "killed": killed, "left": list(node.leave_on_stop), "state": self._view(host, node),
                "grace": float(request.get("grace", 10)), **cgroup}

    def _status(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        absent = self._absent(request)
        if absent is not None:
            return absent
        node = self.nodes[self._key(request)]
        alive = node.running
        return {"ok": True, "state": self._view(host, node), "alive": {"supervisor": alive, "torchrun": alive},
                "log_size": len(node.log)}

    def _stack(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        """As the agent's ``stack``: the ranks' stacks a test gave the node (``FakeNode.stacks``)."""
        if self._key(request) not in self.nodes:
            return {"ok": True, "state": "absent", "ranks": []}
        node = self.nodes[self._key(request)]
        state = str(self._view(host, node).get("state"))
        return {"ok": True, "state": state, "ranks": list(node.stacks) if state in ("starting", "running") else []}

    def _on(self, host: FakeHost, request: dict[str, Any]) -> list[FakeNode]:
        """The node attempts under this host's state dir of the request, in the agent's order
        (its directories' names sorted: ``node10`` before ``node2``)."""
        root = _state_root(request.get("state_dir"))
        mine = [n for n in self.nodes.values() if n.host is host and n.spec.get("root") == root]
        return sorted(mine, key=lambda n: (n.key[0], f"node{n.key[1]}", f"attempt{n.key[2]}"))

    def _remove(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        """As the agent's ``remove``: every attempt of one node, refused while one of them runs."""
        job, node = request.get("job"), request.get("node")
        if not isinstance(job, str) or not (0 < len(job) <= 128 and job[0].isascii() and job[0].isalnum()
                                            and all(c.isascii() and (c.isalnum() or c in "._-") for c in job)):
            return {"ok": False, "error": f"invalid job id {job!r}"}
        if not isinstance(node, int) or node < 0:
            return {"ok": False, "error": f"invalid node {node!r} or attempt 1"}
        folder = f"{_state_root(request.get('state_dir'))}/jobs/{job}/node{node}"
        attempts = [n for n in self._on(host, request) if n.key[:2] == (job, node)]
        if not attempts:
            return {"ok": True, "removed": None, "bytes": 0}
        for attempt in attempts:
            if attempt.running:
                return {"ok": False, "error": f"{folder}/attempt{attempt.key[2]} still runs; stop the job first "
                                              "(`clusterrun down`)"}
        size = 0
        for attempt in attempts:  # what the agent counts: the log, spec.json and state.json
            size += len(attempt.log) + len(json.dumps(attempt.spec)) + len(json.dumps(attempt.state))
            del self.nodes[attempt.key]
        return {"ok": True, "removed": folder, "bytes": size}

    def _jobs(self, host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
        """As the agent's ``jobs``: every node attempt under the state dir, with what ``start`` was given."""
        found = []
        for node in self._on(host, request):
            job, rank, attempt = node.key
            spec = node.spec
            found.append({"job": job, "node": rank, "attempt": attempt, "state_dir": request.get("state_dir"),
                          "state": self._view(host, node), "started": spec.get("started"), "argv": list(node.argv),
                          "env": dict(spec.get("env") or {}), "cwd": spec.get("cwd"),
                          "first_rank": spec.get("first_rank"), "about": spec.get("about")})
        return {"ok": True, "root": f"{_state_root(request.get('state_dir'))}/jobs", "jobs": found}

    def _follow(self, host: FakeHost, request: dict[str, Any], epoch: int) -> Iterator[dict[str, Any]]:
        key = self._key(request)
        with self.changed:
            node = self.nodes.get(key)
            if node is None:
                yield {"ok": False, "error": f"no job {key[0]} node {key[1]} attempt {key[2]}"}
                return
            if request.get("tail") is not None:
                offset = _tail_offset(bytes(node.log), int(request["tail"]))
            else:
                offset = int(request.get("offset") or 0)
                if request.get("before"):
                    offset = _tail_offset(bytes(node.log[:offset]), int(request["before"]))
            if not request.get("logs", True):
                offset = len(node.log)
        last_state: dict[str, Any] | None = None
        while True:
            with self.changed:
                if host._epoch != epoch:
                    raise ConnectError(host.name, "the connection was lost (fake)")
                data = bytes(node.log[offset:]) if request.get("logs", True) else b""
                state = self._view(host, node)
            cut = data.rfind(b"\n") + 1
            if cut:
                yield {"t": "log", "offset": offset, "next": offset + cut,
                       "data": data[:cut]}
                offset += cut
                with self.changed:
                    node.sent_to = offset
                    self.changed.notify_all()
            if state != last_state:
                last_state = state
                yield {"t": "state", "state": state}
            if state.get("state") in ("exited", "lost"):
                rest = data[cut:]
                if rest:
                    yield {"t": "log", "offset": offset, "next": offset + len(rest),
                           "data": rest}
                yield {"t": "end", "state": state}
                return
            if request.get("once"):
                yield {"t": "eof", "next": offset, "state": state}
                return
            seen_to, seen_state = offset + len(data) - cut, last_state

            def moved_on(seen_to: int = seen_to, seen_state: dict[str, Any] | None = seen_state) -> bool:
                return host._epoch != epoch or len(node.log) > seen_to or self._view(host, node) != seen_state

            with self.changed:
                moved = self.changed.wait_for(moved_on, timeout=0.5)
            if not moved:
                yield {"t": "beat"}


def _state_root(state_dir: str | None) -> str:
    """The state dir as the agent names it (its default left unexpanded: a fake host has no home)."""
    return (state_dir or "~/.local/state/clusterrun").rstrip("/")


def _spec(host: FakeHost, request: dict[str, Any]) -> dict[str, Any]:
    """What the agent's ``start`` writes to ``spec.json`` (secret values as ``****``), when, and where."""
    secret = set(request.get("secret_env") or ())
    cwd = request.get("cwd")
    if isinstance(cwd, str) and (cwd == "~" or cwd.startswith("~/")):
        cwd = f"/home/{host.name}{cwd[1:]}"
    return {"root": _state_root(request.get("state_dir")), "started": time.time(),
            "env": {k: "****" if k in secret else v for k, v in (request.get("env") or {}).items()},
            "cwd": cwd or None, "first_rank": int(request.get("first_rank") or 0), "about": request.get("about")}


def _tail_offset(data: bytes, lines: int) -> int:
    """Where the last ``lines`` complete lines of ``data`` begin (as the agent's ``tail_offset``)."""
    end = data.rfind(b"\n") + 1
    at = end
    for _ in range(lines):
        found = data.rfind(b"\n", 0, at - 1) if at > 0 else -1
        if found < 0:
            return 0
        at = found + 1
    return at
