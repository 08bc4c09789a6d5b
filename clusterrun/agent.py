"""The clusterrun node agent: one stdlib-only file, run on every host (local or over SSH).

How it is run
-------------
The controller never builds a shell command from job data. It runs the constant command
``PYTHON -S -c BOOTSTRAP`` (see ``BOOTSTRAP``) and writes to its stdin::

    <length of LOADER in bytes, decimal>\\n
    <LOADER>
    <sha256 of the agent source, hex> <its length in bytes>\\n
    <the agent source>
    <a JSON request>\\n
    <the next JSON request, once the previous one is answered>\\n ...

``BOOTSTRAP`` reads and runs ``LOADER``, which reads the agent's source and executes it with
``__name__ == "__clusterrun_agent__"`` (its compiled code cached under ``~/.cache/clusterrun``,
0600 in 0700, by sha256 and interpreter version: compiling it costs more than a probe). The
agent then answers requests, one per line, until stdin ends or a ``follow`` has streamed to its
end: the controller probes, starts and follows a node with one agent process (one SSH channel,
one interpreter start). Argv and environment therefore travel as data: a fish or tcsh login
shell, quoting or ``AcceptEnv`` cannot change them, and no secret appears on a command line. The
agent answers with JSON lines on stdout. ``-S`` skips ``site``: the agent needs only the standard
library, and the ``.pth`` files of a big environment can cost more than the agent's own work
(the probe looks for torch with ``site``'s paths all the same).

Requests (``op``) and answers
-----------------------------
``probe``  ``{free_port: bool, state_dir}`` → ``{ok, protocol, hostname, python, torch,
           torchrun_flags, boot_id, port, state_dir, containment, fallbacks}`` (``protocol``:
           ``PROTOCOL``); ``torch`` is the installed version or null (found without importing
           torch); ``port`` a TCP port that was free on this host, when asked; ``containment``
           ``cgroup`` or ``sweep`` (what a stop here would rely on) and ``fallbacks`` what this
           host lacks, in words (no cgroup and why, no pidfd, no ctypes, a logind that would kill
           the job at logout). With ``route_to`` (as for ``route``), also ``network``.
``route``  ``{route_to: {addr, port, peers, always_peers}}`` → ``{ok, network: {netns, master,
           peer, preset}}``: how this host reaches the master ``addr``. ``master`` and ``peer`` are
           ``{target, resolved, source, interface, loopback, error, hosts_line}`` (the kernel's route lookup
           through a connected UDP socket, which sends nothing; ``interface`` holds ``source``;
           ``hosts_line`` the /etc/hosts line that maps a name to a loopback ``resolved``);
           ``peer`` is the first of ``peers`` reached through another interface than loopback,
           looked for when the master is reached through loopback or not at all (or always, with
           ``always_peers``); ``netns`` identifies this network namespace (boot id and inode);
           ``preset`` the ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` set in this environment.
``setup``  ``{job, node, attempt, setup, env, cwd}`` → ``{ok}``: runs the ``setup`` commands (a list of
           shell commands) in bash in ``cwd`` with ``env`` on top of the agent's environment, each
           of which must succeed, and keeps the environment they leave, in memory, for this
           agent's ``start`` of the same attempt (``{ok: false, error}`` with their last lines of
           output otherwise). The controller asks every host before it starts any.
``start``  ``{job, node, attempt, state_dir, argv, env, cwd, first_rank, secret_env, setup}`` →
           ``{ok, dir, state}``: torchrun's environment is what ``setup`` left (run now if this
           agent has not run it), else the agent's with ``env`` on top; the values of the names
           in ``secret_env`` reach the supervisor in memory only and ``spec.json`` holds ``****``.
           creates the attempt directory and the attempt's cgroup, starts the detached supervisor
           and returns once it has started torchrun (or failed to: ``{ok: false, error}``; a state
           dir that cannot be written, or a logind that would kill the job at logout, starts
           nothing). The supervisor tells it how the start went through a pipe, not the disk.
``follow`` ``{job, node, attempt, state_dir, offset | tail, logs, once}`` → a stream of lines:
           ``{t: "log", offset, next, data}`` (complete lines only, bytes decoded as UTF-8 with
           surrogateescape; ``next`` is the byte offset to resume from), ``{t: "state", state}``
           whenever the state file changes, ``{t: "beat"}`` after ``HEARTBEAT`` seconds without
           anything else, and finally ``{t: "end", state}`` after a last read that includes a
           partial last line. Resuming from ``next`` loses and repeats nothing. ``tail: N`` starts
           at the last N complete lines instead of ``offset``; ``before: N`` with ``offset`` starts
           at the last N complete lines before ``offset`` (a viewer's scrollback: the ``offset``
           of the first ``log`` message is then before the one asked for); ``logs: false`` sends no log data
           (states only); ``once: true`` ends with ``{t: "eof", next, state}`` at the end of what
           is written so far if the job still runs. ``state.state`` is ``lost`` when neither the
           supervisor nor torchrun runs any more (host rebooted, processes killed, pid reused).
``stop``   ``{job, node, attempt, state_dir, grace}`` → ``{ok, killed: [...], left: [...], state,
           containment, verified, detail, fallbacks, degraded, notes, grace}``: the stop described below,
           of that attempt only; idempotent. ``killed`` entries are ``{pid, name, state, signal}``
           (the last signal sent: torchrun's is ``SIGKILL`` when it outlived the ``grace``, in seconds,
           that the answer repeats). ``containment`` is ``cgroup`` (``verified``: the
           attempt's cgroup was empty, then removed), ``sweep`` (``verified`` false: ``left: []``
           means only that no process the sweep can see is left) or ``reboot``; ``notes`` say what
           could not be recorded on disk.
``status`` ``{job, node, attempt, state_dir}`` → ``{ok, state, alive, log_size, containment,
           fallbacks, degraded}`` (``lost`` as for ``follow``). For ``status`` and ``stop``, a node
           never started (no attempt directory) is ``{state: {state: "absent"}}``, not an error.
``remove`` ``{job, node, state_dir}`` → ``{ok, removed, bytes}``: deletes the node's directory
           (every attempt: state and logs; ``removed`` its path, null if there was none, ``bytes``
           the size of its files) and the job's directory once empty; refused while a supervisor
           or torchrun of any attempt runs.
``jobs``   ``{state_dir}`` → ``{ok, root, jobs: [{job, node, attempt, state, started, argv, env,
           cwd, first_rank, about}]}``: every node attempt under the state dir, its ``state`` as
           ``status`` gives it, when it was started (epoch seconds) and what ``start`` was given
           (``about``: the job's name, script, arguments and master, for a controller without
           the job's record to adopt it).

``sync_stat`` ``{root, paths}`` → ``{ok, root, exists, dev, ino, boot_id, rsync, entries: {path:
           [kind, size, mtime_ns, mode, link target]}}`` of the paths below ``root`` (the workdir, ``~``
           expanded) that exist; kind ``f``, ``d``, ``l`` or ``o``; ``rsync``: its path on PATH.
``sync_hash`` ``{root, paths}`` → ``{ok, hashes: {path: sha256 hex}}``.
``sync_put`` ``{root, root_mode, entries: [{path, kind, mode, size, mtime_ns, data, target, from}]}``
           followed on stdin by the bytes of every entry with ``data`` (``size`` each, in order)
           → ``{ok, written}``: directories, symlinks and files (written to a temporary name, then
           renamed; mode and mtime set); a file with ``from`` is that temporary file below
           ``root`` (``*.clusterrun-tmp``, written over SFTP), renamed into place. The data is
           read to its end even after a failure, whose answer names the path (``cannot write
           PATH: No space left on device``).
           ``clusterrun/sync.py`` is the controller's side.

``inspect`` ``{cwd, paths, state_dir, deep, gpus}`` → ``{ok, cwd, paths, disk, torch_cuda, deep,
           nvidia_smi, gpu_list, gpu_apps, logind, logind_scope, time, elapsed}`` (for ``clusterrun doctor``):
           ``paths`` maps each path (relative to ``cwd``, default the home directory) to ``file``,
           ``dir``, ``missing`` or ``other``; ``disk`` the free space of the state dir's file system;
           ``torch_cuda`` the CUDA version torch was built for (its version.py, no import); with
           ``deep``, ``deep`` is what the interpreter says after importing torch (``version``,
           ``cuda``, ``nccl``, ``devices``, or ``error``); with ``gpus``, ``nvidia-smi -L`` and
           its compute apps (null where it is missing); ``logind`` is ``logind_problem()``;
           ``time`` the host's clock when the request came, ``elapsed`` the seconds it took.
``listen`` ``{port | null, token}`` → ``{ok, port, listening, error}``: a TCP listener on every
           address that answers ``token`` to each connection, until ``unlisten {port}`` or the
           agent's end (``listening`` false and the reason when the port is taken).
``reach``  ``{addr, port, token, timeout}`` → ``{ok, reached, error, local}``: a TCP connection
           to a ``listen``er (on node 0); ``reached`` only if the token came back. ``timeout``
           bounds the connection and each read: packets dropped on the way time out, never hang.

Errors are ``{ok: false, error: "..."}``; the exit code is 0 whenever an answer was written.

State on the host
-----------------
``<state_dir>/jobs/<job>/node<node>/attempt<attempt>/`` (directories 0700, files 0600, created
under umask 077 so they are never readable by others, not even briefly):

``spec.json``       the request: argv, env (secret values as ``****``), cwd, setup, first_rank, about
                    (written once, before the supervisor starts)
``output.log``      torchrun's stdout and stderr, appended (O_APPEND) and never truncated, and
                    every worker's lines, whole and tagged ``[rankN]:`` (see ``RankLogs``)
``torchrun/``       torchrun's own ``--log-dir`` (per-rank files it truncates; read by ``RankLogs``)
``state.json``      written by the supervisor, atomically (temp file, fsync, rename), and by a
                    stop that outlived it: ``state`` (starting → running → exited),
                    ``cgroup`` (the attempt's cgroup once the supervisor is in it, else null),
                    ``fallbacks`` (what the host lacked, in words), ``degraded`` (why the
                    supervisor could not write something), ``supervisor`` and ``torchrun``
                    ``{pid, start_time}`` (start time in clock ticks since boot), ``boot_id``,
                    ``exit_code`` / ``signal`` of torchrun, ``error`` (could not start),
                    ``stop_requested``, ``workers`` ``[{rank, local_rank, pid, died}]`` (``died``:
                    wall-clock time the worker process ended, to find the first failure),
                    ``sessions`` (session ids seen among the job's processes),
                    ``session_leaders`` (sid → start time of its leader when first seen) and,
                    when torchrun exited non-zero, ``oom``: what the kernel said of OOM kills
                    during the attempt (see ``KernelLog``): ``kills`` ``[{pid, comm, line, summary,
                    constraint, oom_memcg, task_memcg}]`` from /dev/kmsg (PIDs of any process:
                    the controller matches them to the job's), ``kmsg_error`` (why it could not be
                    read), ``overwritten``, ``pid_namespace`` (the job's PIDs are not the
                    kernel's), ``cgroup_oom_kills`` (``oom_kill`` of the attempt's cgroup's
                    ``memory.events``), ``cgroup_events`` and ``cgroup_error``
``spec.json`` also holds ``cgroup`` (made for the attempt), ``user_scope`` and ``fallbacks``
``stop``            present once a stop was requested
``degraded``        present once the supervisor could not write its state or log (a full or
                    read-only disk, a quota): the reason, if even that could be written. The
                    supervisor goes on supervising with its state in memory and writes it again
                    when it can; ``status``, ``follow`` and ``stop`` report ``degraded``.
``supervisor.log``  the supervisor's own diagnostics

The cgroup
----------
Where the host allows it, every attempt of every node runs in a cgroup v2 of its own,
``clusterrun-<job>-n<node>-a<attempt>`` (a random suffix if a stale one has the name): the
supervisor in it, torchrun and everything it starts in its child ``job``. As root it is made at
the top of the cgroup2 mount (found in /proc/self/mountinfo: ``/sys/fs/cgroup`` on most
distributions), outside any login session; as a user inside the user's own cgroup if that was
delegated (writable), but never inside a systemd user manager without linger, which stops at the
last logout (containment never costs detachment). Otherwise (no cgroup2, not delegated, or
``CLUSTERRUN_NO_CGROUP`` set on the host) there is no cgroup and the stop is a sweep only; the
reason is among the ``fallbacks``. A process cannot leave its cgroup without write access to a
cgroup above it, so what the job forks, daemonizes, ``setsid``'s, ``unshare``'s or runs under
``env -i`` stays in; what is started through a running daemon (``systemd-run``, ``docker run``,
``tmux new -d`` with a server already running) never was in it. A supervisor SIGKILLed cannot
remove its cgroup: ``status`` and ``stop`` remove it once it is empty.

logind: inside a login session whose processes logind kills at logout (``KillUserProcesses=yes``
for this user), a start as root with a cgroup goes ahead (the cgroup is outside the session); a
user's supervisor is started through ``systemd-run --user --scope -p Delegate=yes`` (``SUPERVISE``:
a new interpreter reading the agent's source from stdin) when their user manager runs and
lingers, and makes the attempt's cgroup in that scope; otherwise the start is refused.

The supervisor
--------------
Forked by ``start`` from the agent (twice, so that it is nobody's child but init's or a
subreaper's; no second interpreter start), in its own session with stdin from /dev/null, stdout
and stderr to ``supervisor.log``, every other descriptor closed (the SSH channel included), no
terminal and SIGHUP ignored, so it survives the controller and the SSH connection.
It makes itself a child subreaper (orphaned descendants are re-parented to it, not to init),
sets ``CLUSTERRUN_JOB=<job>.<node>.<attempt>`` in the job's environment and runs torchrun with
its output appended to ``output.log``. It records the worker processes and when each one ended,
reaps everything, and when torchrun has exited kills what is left of the job (its ``job``
cgroup, then the sweep below) before leaving and removing the attempt's cgroup and writing the
final state. It sleeps until something happens (inotify on torchrun's per-rank files, pidfds of
the workers, SIGCHLD and SIGTERM through a wake-up pipe; see ``Waker``), as ``follow`` does
(inotify on the attempt directory, pidfds of the supervisor and torchrun): a quiet job costs
no CPU on the host. Where inotify is missing they poll. From just before torchrun starts it
reads the kernel's log (/dev/kmsg from its end, at each scan: ``KernelLog``) for OOM kills; when
torchrun exits non-zero, those and the attempt's cgroup's ``memory.events`` become the state's
``oom`` (the controller matches them to the root cause's PID).

The verified stop
-----------------
A stop names one attempt and touches nothing of another. SIGTERM to torchrun first (it stops its
workers; killing workers first makes it restart them), up to ``grace`` seconds for it to exit;
then, with a cgroup, ``cgroup.kill`` of its ``job`` cgroup (Linux >= 5.14; else freeze it and
SIGKILL every process in ``cgroup.procs``), the supervisor's exit (it removes the cgroup), and
the same for the whole attempt cgroup if it is still there; verified: ``cgroup.events`` says
``populated 0``, or the cgroup is gone (a cgroup can only be removed once empty). With or
without a cgroup, a sweep of everything left of this attempt: the supervisor's descendants ∪
processes carrying the attempt's marker ∪ processes in the attempt's recorded sessions. Every
process is identified again *after* a pidfd was opened for it and is signalled through that
pidfd, so a reused pid is never signalled. SIGTERM, a short wait, SIGKILL, re-scan until nothing
is left. The sweep cannot see a process that left the job's tree (no subreaper, or the
supervisor was killed), its sessions and its environment (``setsid`` + ``env -i``): only the
cgroup verifies. The answer lists what was killed and what could not be (e.g. a process in
uninterruptible sleep). Nothing is ever matched by command line.
"""

from __future__ import annotations

import os
import select
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations are never evaluated, and typing costs every start (docs/benchmarks.md)
    from collections.abc import Callable
    from typing import Any, NoReturn

# The agent starts once per node and command, so what it imports is paid on every host every
# time. The modules json and signal import re and enum (docs/benchmarks.md): the agent uses their
# C parts, which json and signal themselves are built on (the fallbacks keep it working without).
if TYPE_CHECKING:
    import signal
else:
    try:
        import _signal as signal
    except ImportError:  # not CPython
        import signal

PROTOCOL = 1  # protocol.PROTOCOL on the controller: bump both for any change the other side would misread

SIGNAL_NAMES: dict[int, str] = {signal.SIGTERM: "SIGTERM", signal.SIGKILL: "SIGKILL"}


class _JSONContext:
    """What json's C scanner reads from a ``json.JSONDecoder`` (the defaults of ``json.loads``)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity


# _json's make_encoder and make_scanner are CPython internals: used only on the versions checked
# (tests/test_third_party.py fails on a newer Python until they are checked again).
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

# Constant: no job data in it; no single quotes, backslashes, "!" or "$", so that once quoted for
# the remote shell (sh, bash, zsh, fish or tcsh) it reaches Python unchanged.
BOOTSTRAP = (
    "import sys;b=sys.stdin.buffer;n=int(b.readline());s=b.read(n);"
    'exec(compile(s,"clusterrun-agent","exec"),{"__name__":"__clusterrun_agent__"})'
)

# What BOOTSTRAP runs first: it reads ``<sha256 of the agent> <length>`` and the agent's source,
# and runs the code compiled from it, cached per interpreter version in the user's cache dir
# (compiling the agent costs more than everything else it does to answer a probe).
LOADER = r"""
import os, sys, marshal
b = sys.stdin.buffer
digest, size = b.readline().split()
source = b.read(int(size))
code = path = None
try:
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "clusterrun")
    suffix = "-%s-%x.bin" % (sys.implementation.cache_tag, sys.hexversion)
    path = os.path.join(folder, "agent-" + digest.decode("ascii") + suffix)
    with open(path, "rb") as f:
        code = marshal.loads(f.read())
except Exception:
    pass  # not cached yet (or unreadable): compile
if code is None:
    code = compile(source, "clusterrun-agent", "exec")
    if path:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            tmp = "%s.%s.tmp" % (path, os.urandom(6).hex())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(marshal.dumps(code))
            os.rename(tmp, path)
            for name in os.listdir(folder):  # other versions of the agent, for this interpreter
                if name.startswith("agent-") and name.endswith(suffix) and os.path.join(folder, name) != path:
                    os.unlink(os.path.join(folder, name))
        except OSError:
            pass
exec(code, {"__name__": "__clusterrun_agent__", "__clusterrun_source__": source})
"""

MARKER_VAR = "CLUSTERRUN_JOB"
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_ID_CHARS = _ALNUM | frozenset("._-")
PR_SET_CHILD_SUBREAPER = 36
# How often at most ``follow`` reads new bytes of the node's log, and the supervisor new bytes of
# torchrun's per-rank files (to merge them into that log): under a steady flow a line's latency
# from the worker to the controller is about the sum of the two, plus the network
# (docs/benchmarks.md). Without inotify they are also the polling intervals.
POLL_INTERVAL = 0.05
MERGE_INTERVAL = 0.02
# Both wait for inotify to say that something changed instead of waking up at those intervals (a
# quiet job then costs no CPU), so the first line after a quiet spell goes at once. They look
# anyway after IDLE_CHECK seconds without any event. The supervisor looks for new worker
# processes every SCAN_INTERVAL seconds for BUSY seconds after torchrun started or made new
# per-rank files (it is starting workers), else every IDLE_SCAN_INTERVAL seconds.
IDLE_CHECK = 1.0
SCAN_INTERVAL = 0.25
IDLE_SCAN_INTERVAL = 2.0
BUSY = 10.0
# ``follow`` says something at least this often, so a reader can tell a dead connection from a
# quiet job: no message for a few heartbeats means the link is gone.
HEARTBEAT = 5.0
# torchrun options newer than the oldest torch we support; the probe says which a host has.
OPTIONAL_TORCHRUN_FLAGS = ("--signals-to-handle", "--shutdown-timeout")


class AgentFailure(Exception):
    """A request that cannot be carried out; reported as ``{ok: false, error}``."""


# --------------------------------------------------------------------------------- small helpers


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _unlink_quietly(path: str) -> None:
    """Remove a temporary file a failed write leaves (gone already is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_atomic(path: str, data: bytes) -> None:
    """Write a temporary file (0600, a random name: hosts sharing a filesystem have the same pids), fsync, rename."""
    tmp = f"{path}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _write_json_atomic(path: str, obj: object) -> None:
    _write_atomic(path, json_dumps_sorted(obj).encode())


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            value = json_loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _state_root(state_dir: str | None) -> str:
    if state_dir:
        return os.path.abspath(os.path.expanduser(state_dir))
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "clusterrun")


def _attempt_dir(req: dict[str, Any]) -> str:
    job, node, attempt = req.get("job"), req.get("node"), req.get("attempt")
    if not isinstance(job, str) or not (0 < len(job) <= 128 and job[0] in _ALNUM and _ID_CHARS.issuperset(job)):
        raise AgentFailure(f"invalid job id {job!r}")
    if not isinstance(node, int) or not isinstance(attempt, int) or node < 0 or attempt < 1:
        raise AgentFailure(f"invalid node {node!r} or attempt {attempt!r}")
    root = _state_root(req.get("state_dir"))
    return os.path.join(root, "jobs", job, f"node{node}", f"attempt{attempt}")


def _marker(job: str, node: int, attempt: int) -> str:
    """The variable every process of one attempt of one node carries: never another attempt's."""
    return f"{MARKER_VAR}={job}.{node}.{attempt}"


def _fs_problem(exc: OSError) -> str:
    """A short reason for a failed write to the state dir (a full or read-only disk, a quota)."""
    return f"{os.strerror(exc.errno) if exc.errno else exc}" + (f": {exc.filename}" if exc.filename else "")


# ------------------------------------------------------------------------------------ cgroups v2


CGROUP_OFF_VAR = "CLUSTERRUN_NO_CGROUP"  # set (non-empty) on a host: no cgroup, the sweep only


def _cgroup2_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (its root visible), from /proc/self/mountinfo."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split(" ", 1)[0] == "cgroup2" and len(fields) >= 5 and fields[3] == "/":
            return fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
    return None


def _own_cgroup(pid: int | str = "self") -> str | None:
    """The cgroup v2 path of a process (``/user.slice/...``), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _lingers() -> bool:
    """Whether systemd keeps this user's manager after their last logout (``loginctl enable-linger``):
    asked of logind, else its linger file."""
    name = _user_name()
    out = _capture(["loginctl", "show-user", name, "-p", "Linger"])
    if out and "Linger=" in out:
        return "Linger=yes" in out
    return os.path.exists(f"/var/lib/systemd/linger/{name}")


def _which(name: str) -> str | None:
    for folder in (os.environ.get("PATH") or "/usr/bin:/bin").split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def user_scope(job: str, node: int, attempt: int) -> list[str] | None:
    """The systemd-run argv that starts a command in a scope of the user's systemd manager, out of
    the login session (Delegate=yes: the supervisor makes its cgroup there), or None when no
    manager runs, it does not linger (it would stop at the last logout, the job with it) or
    systemd-run is missing."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    if not os.path.exists(os.path.join(runtime, "systemd", "private")) or not _which("systemd-run"):
        return None
    if not _lingers():
        return None
    return ["systemd-run", "--user", "--scope", "--quiet", "--collect", "-p", "Delegate=yes",
            f"--unit=clusterrun-{job}-n{node}-a{attempt}-{os.urandom(3).hex()}", "--"]


def cgroup_parent() -> tuple[str | None, str]:
    """The cgroup under which this agent may make one per attempt, or None and why not.

    As root: the top of the cgroup2 mount (outside any login session, so logind's
    KillUserProcesses does not reach it). As a user: the agent's own cgroup if it was delegated
    (writable), except inside a systemd user manager that stops at the last logout (no linger):
    containment must never cost detachment."""
    if os.environ.get(CGROUP_OFF_VAR):
        return None, f"cgroups turned off on this host ({CGROUP_OFF_VAR} is set)"
    mount = _cgroup2_mount()
    if mount is None:
        return None, "no cgroup2 file system is mounted"
    if os.geteuid() == 0:
        if os.access(os.path.join(mount, "cgroup.procs"), os.W_OK) and os.access(mount, os.W_OK):
            return mount, ""
        return None, f"{mount} is not writable (read-only mount?)"
    own = _own_cgroup()
    if own is None:
        return None, "this process is in no cgroup v2"
    path = mount + own.rstrip("/") if own != "/" else mount
    if not (os.access(path, os.W_OK) and os.access(os.path.join(path, "cgroup.procs"), os.W_OK)):
        return None, (f"cgroup {path} is not delegated to uid {os.getuid()} (not writable); run as root or "
                      "in a delegated cgroup (systemd: Delegate=yes) for a stop verified by cgroup")
    if f"/user@{os.getuid()}.service" in own and not _lingers():
        return None, (f"cgroup {path} belongs to the systemd user manager, which stops at your last logout: "
                      "`loginctl enable-linger` lets it (and a cgroup per job) outlive the session")
    return path, ""


def cg_write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def cg_pids(cgroup: str) -> list[int]:
    """Every process in ``cgroup`` and the cgroups below it (as this pid namespace sees them)."""
    pids: list[int] = []
    for folder, _dirs, _files in os.walk(cgroup):
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids += [int(p) for p in f.read().split() if p != "0"]
        except (OSError, ValueError):
            pass
    return sorted(set(pids))


def cg_populated(cgroup: str) -> bool:
    """True while a process lives in ``cgroup`` or below (``cgroup.events``: ``populated 1``)."""
    try:
        with open(os.path.join(cgroup, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return bool(cg_pids(cgroup))


def cg_kill(cgroup: str, killed: dict[int, dict[str, Any]]) -> str:
    """Kill everything in ``cgroup`` and below at once (``cgroup.kill``, Linux >= 5.14), else
    freeze it and SIGKILL each process (by pidfd, once it is seen in the cgroup again, so that a
    reused pid is never signalled); returns the method used."""
    for pid in cg_pids(cgroup):
        info = proc_info(pid)
        if info is not None and info.state != "Z":
            killed.setdefault(pid, info.as_dict())["signal"] = "SIGKILL"
    if not os.path.isdir(cgroup):
        return "gone"
    try:
        cg_write(os.path.join(cgroup, "cgroup.kill"), b"1")
        return "cgroup.kill"
    except OSError:
        pass
    frozen = False
    try:
        cg_write(os.path.join(cgroup, "cgroup.freeze"), b"1")  # nothing forks between listing and killing
        frozen = True
    except OSError:
        pass
    where = _cgroup_path(cgroup)
    try:
        for _ in range(500):
            pids = cg_pids(cgroup)
            if not pids:
                break
            for pid in pids:
                try:
                    handle = PidHandle(pid)
                except ProcessLookupError:
                    continue
                own = _own_cgroup(pid) or ""
                if own == where or own.startswith(where + "/"):
                    handle.signal(signal.SIGKILL)
                handle.close()
            time.sleep(0.01)
    finally:
        if frozen:
            try:
                cg_write(os.path.join(cgroup, "cgroup.freeze"), b"0")  # SIGKILL ends frozen tasks all the same
            except OSError:
                pass
    return "freeze + SIGKILL"


def _cgroup_path(folder: str) -> str:
    """The cgroup path (``/clusterrun-...``) of a cgroup directory, as /proc/PID/cgroup names it."""
    mount = _cgroup2_mount() or ""
    return (folder[len(mount):] or "/") if folder.startswith(mount) else folder


def cg_wait_empty(cgroup: str, deadline: float) -> bool:
    """Wait until no process is left in ``cgroup`` or below; True if none is."""
    while cg_populated(cgroup):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def cg_remove(cgroup: str) -> bool:
    """Remove an empty cgroup and its (empty) children; True if it is gone."""
    for folder, _dirs, _files in sorted(os.walk(cgroup), key=lambda entry: -len(entry[0])):
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return not os.path.isdir(cgroup)


# ------------------------------------------------------------------------------ process inspection


class ProcInfo:
    """What /proc/<pid>/stat says of one process."""

    __slots__ = ("pid", "comm", "state", "ppid", "sid", "start_time")

    def __init__(self, pid: int, comm: str, state: str, ppid: int, sid: int, start_time: int) -> None:
        self.pid, self.comm, self.state = pid, comm, state
        self.ppid, self.sid, self.start_time = ppid, sid, start_time

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.comm, "state": self.state}


def proc_info(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    lpar, rpar = data.find(b"("), data.rfind(b")")
    rest = data[rpar + 2 :].split()
    try:
        return ProcInfo(pid, data[lpar + 1 : rpar].decode(errors="replace"), rest[0].decode(),
                        int(rest[1]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def all_procs() -> dict[int, ProcInfo]:
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = proc_info(int(name))
            if info is not None:
                procs[info.pid] = info
    return procs


def has_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return (b"\0" + marker.encode() + b"\0") in (b"\0" + env + b"\0")


def proc_env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return {}
    env = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def descendants(root: int, procs: dict[int, ProcInfo]) -> set[int]:
    children: dict[int, list[int]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class PidHandle:
    """A process pinned by a pidfd (where the kernel and Python have them), so that a signal
    can never reach another process that later got the same pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        if hasattr(os, "pidfd_open"):
            try:
                self.fd = os.pidfd_open(pid)
            except ProcessLookupError:
                raise
            except OSError:
                self.fd = -1

    def signal(self, sig: int) -> bool:
        try:
            if self.fd >= 0:
                signal.pidfd_send_signal(self.fd, sig)
            else:
                os.kill(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def alive(self) -> bool:
        info = proc_info(self.pid)
        if self.fd >= 0:
            return bool(select.select([self.fd], [], [], 0)[0] == []) and (info is None or info.state != "Z")
        return info is not None and info.state != "Z"

    def wait(self, timeout: float) -> bool:
        """Wait until the process has ended (or is a zombie); True if it did."""
        deadline = time.monotonic() + timeout
        while self.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.fd >= 0:
                select.select([self.fd], [], [], min(left, 0.2))
            else:
                time.sleep(min(left, 0.05))
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pin(pid: int, start_time: int | None) -> PidHandle | None:
    """A handle on ``pid`` if it still is the process that started at ``start_time``."""
    try:
        handle = PidHandle(pid)
    except ProcessLookupError:
        return None
    info = proc_info(pid)
    if info is None or (start_time is not None and info.start_time != start_time) or not handle.alive():
        handle.close()
        return None
    return handle


# ------------------------------------------------------------------------------------- the sweep


class JobScope:
    """Which processes belong to one node's job: the supervisor's tree ∪ marker ∪ sessions."""

    def __init__(self, state: dict[str, Any], exclude: set[int]) -> None:
        sup = state.get("supervisor") or {}
        self.sup_pid = sup.get("pid")
        self.sup_start = sup.get("start_time")
        self.marker = _marker(state["job"], state["node"], state["attempt"])
        self.sessions = set(state.get("sessions") or [])
        # When each session was first seen: the start time of its leader (None: already gone).
        self.leaders = {int(sid): start for sid, start in (state.get("session_leaders") or {}).items()}
        tr = state.get("torchrun") or {}
        if tr.get("pid"):
            self.sessions.add(tr["pid"])  # torchrun leads its own session
            self.leaders[tr["pid"]] = tr.get("start_time")
        self.min_start = self.sup_start or 0
        self.exclude = set(exclude)
        if self.sup_pid:
            self.exclude.add(self.sup_pid)

    def _supervisor_alive(self, procs: dict[int, ProcInfo]) -> bool:
        info = procs.get(self.sup_pid) if self.sup_pid else None
        return info is not None and info.start_time == self.sup_start

    def _in_session(self, info: ProcInfo, procs: dict[int, ProcInfo]) -> bool:
        """In one of the job's sessions, and that session is still the one recorded.

        Linux does not hand out a pid while it names a live session, so a session whose leader is
        gone is still ours; a living leader must be the process recorded (else the pid was reused
        by a process that then started a session of its own)."""
        if info.sid not in self.sessions or info.start_time < self.min_start:
            return False
        leader = procs[info.sid] if info.sid in procs else proc_info(info.sid)
        if leader is None:
            return True
        recorded = self.leaders.get(info.sid)
        return recorded is not None and leader.start_time == recorded

    def members(self, procs: dict[int, ProcInfo]) -> set[int]:
        tree = descendants(self.sup_pid, procs) if self.sup_pid and self._supervisor_alive(procs) else set()
        found = set()
        for pid, info in procs.items():
            if pid in self.exclude or info.state == "Z":
                continue
            if pid in tree or self._in_session(info, procs) or has_marker(pid, self.marker):
                found.add(pid)
        return found

    def belongs(self, pid: int) -> bool:
        """Check one process again (after it was pinned): is it still part of the job?"""
        info = proc_info(pid)
        if info is None or info.state == "Z":
            return False
        if self._in_session(info, {}):
            return True
        if has_marker(pid, self.marker):
            return True
        seen = set()
        while info is not None and info.ppid > 1 and info.pid not in seen:
            seen.add(info.pid)
            if info.ppid == self.sup_pid:
                sup = proc_info(self.sup_pid)
                return sup is not None and sup.start_time == self.sup_start
            info = proc_info(info.ppid)
        return False

    def signal_all(self, sig: int, killed: dict[int, dict[str, Any]]) -> int:
        """Send ``sig`` to every live member; returns how many were signalled."""
        count = 0
        for pid in sorted(self.members(all_procs())):
            try:
                handle = PidHandle(pid)
            except ProcessLookupError:
                continue
            try:
                if not self.belongs(pid) or not handle.alive():
                    continue
                info = proc_info(pid)
                if handle.signal(sig):
                    count += 1
                    entry = killed.setdefault(pid, info.as_dict() if info else {"pid": pid})
                    entry["signal"] = SIGNAL_NAMES.get(sig, str(sig))
            finally:
                handle.close()
        return count

    def sweep(self, term_wait: float, deadline: float, killed: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """SIGTERM what is left, wait up to ``term_wait``, then SIGKILL and re-scan until nothing
        is left or ``deadline`` (monotonic) passes. Returns the processes still there."""
        if self.signal_all(signal.SIGTERM, killed):
            end = min(deadline, time.monotonic() + term_wait)
            while time.monotonic() < end and self.members(all_procs()):
                time.sleep(0.05)
        while True:
            procs = all_procs()
            left = self.members(procs)
            if not left:
                return []
            if time.monotonic() >= deadline:
                return [procs[p].as_dict() for p in sorted(left) if p in procs]
            self.signal_all(signal.SIGKILL, killed)
            time.sleep(0.05)


# -------------------------------------------------------------------------------------- requests


def _find_torch() -> Any:
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


def op_probe(req: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "ok": True,
        "protocol": PROTOCOL,
        "hostname": os.uname().nodename,  # what socket.gethostname() returns
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "boot_id": _boot_id(),
        "torch": None,
        "torchrun_flags": [],
        "state_dir": _state_root(req.get("state_dir")),
        "port": None,
    }
    spec = _find_torch()
    if spec is not None and spec.origin:
        torch_dir = os.path.dirname(spec.origin)
        try:
            with open(os.path.join(torch_dir, "version.py")) as f:
                answer["torch"] = _version_of(f.read())
            with open(os.path.join(torch_dir, "distributed", "run.py")) as f:
                run_py = f.read()
            answer["torchrun_flags"] = [flag for flag in OPTIONAL_TORCHRUN_FLAGS if flag in run_py]
        except OSError:
            answer["torch"] = answer["torch"] or "unknown"
    if req.get("free_port"):
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
    if req.get("route_to"):
        answer["network"] = network_route(req["route_to"])
    return answer


def _version_of(version_py: str) -> str:
    """The ``__version__ = '...'`` of a module's source (torch/version.py), or ``unknown``."""
    for line in version_py.splitlines():
        name, equals, value = line.partition("=")
        value = value.strip()
        if equals and name.split(":")[0].strip() == "__version__" and value[:1] in ("'", '"'):
            end = value.find(value[0], 1)
            return value[1:end] if end > 1 else "unknown"
    return "unknown"


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


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SIOCGIFADDR = 0x8915


def op_route(req: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "network": network_route(req.get("route_to") or {})}


def network_route(target: dict[str, Any]) -> dict[str, Any]:
    """How this host reaches the master ``target["addr"]`` (see ``route``): the kernel's route
    lookup, the interface of the source address it picks, this network namespace's identity, and
    the interface variables already set in this environment. When the master is reached through
    loopback (or not at all), the first of ``peers`` reached otherwise says which interface the
    other nodes can reach this host by."""
    addr, port = str(target.get("addr") or ""), int(target.get("port") or 9)
    master = _route(addr, port)
    peer = None
    if master["loopback"] or master["error"] or target.get("always_peers"):
        for other in target.get("peers") or []:
            found = _route(str(other), port)
            if not found["error"] and not found["loopback"]:
                peer = found
                break
    try:
        st = os.stat("/proc/self/ns/net")
        netns = f"{_boot_id()}:{st.st_dev}:{st.st_ino}"
    except OSError:
        netns = f"{_boot_id()}:{os.uname().nodename}"
    return {"netns": netns, "master": master, "peer": peer,
            "preset": {name: os.environ[name] for name in IFNAME_VARS if os.environ.get(name)}}


def _route(addr: str, port: int) -> dict[str, Any]:
    """The address ``addr`` resolves to here, the local address the kernel would send to it from
    (a connected UDP socket sends nothing) and that address's interface; or why there is none."""
    import socket

    found: dict[str, Any] = {"target": addr, "resolved": None, "source": None, "interface": None,
                             "loopback": False, "error": None}
    try:
        infos = socket.getaddrinfo(addr, port, 0, socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        found["error"] = f"cannot resolve {addr}: {getattr(exc, 'strerror', None) or exc}"
        return found
    for family, kind, proto, _, sockaddr in infos:
        resolved = str(sockaddr[0])
        s = socket.socket(family, kind, proto)
        try:
            s.connect(sockaddr)
            source = str(s.getsockname()[0])
        except OSError as exc:
            found["error"] = found["error"] or f"no route to {addr} ({resolved}): {exc.strerror or exc}"
            continue
        finally:
            s.close()
        found.update(resolved=resolved, source=source, interface=_interface_of(source), error=None,
                     loopback=_is_loopback(resolved) or _is_loopback(source))
        break
    if found["loopback"] and found["resolved"] != addr:
        found["hosts_line"] = _hosts_line(addr, found["resolved"])
    return found


def _hosts_line(name: str, address: str) -> str | None:
    """``/etc/hosts:3: 127.0.1.1 gpu-a`` if that file maps ``name`` to ``address``."""
    try:
        with open("/etc/hosts", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                fields = line.split("#", 1)[0].split()
                if fields[:1] == [address] and name.lower() in (n.lower() for n in fields[1:]):
                    return "/etc/hosts:{}: {}".format(number, " ".join(fields))
    except OSError:
        pass
    return None


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127.")


def _interface_of(address: str) -> str | None:
    """The interface that holds ``address``: an ioctl per interface (IPv4) or /proc/net/if_inet6,
    else ``ip -o addr`` (secondary IPv4 addresses)."""
    import socket

    address = address.split("%")[0]
    try:
        if ":" in address:
            wanted = socket.inet_pton(socket.AF_INET6, address).hex()
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and fields[0] == wanted:
                        return fields[5]
        else:
            import fcntl

            packed = socket.inet_aton(address)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for _, name in socket.if_nameindex():
                    try:
                        ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR, name.encode()[:15].ljust(40, b"\0"))
                    except OSError:
                        continue  # no IPv4 address
                    if ifreq[20:24] == packed:
                        return name
    except (OSError, ValueError):
        pass
    for line in (_capture(["ip", "-o", "addr", "show"]) or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None


# What systemd-run runs in the user's scope: the agent's source arrives on stdin, as for BOOTSTRAP.
# After the source, a NUL and the job's environment as JSON (it holds secrets: never on disk).
SUPERVISE = (
    'import os,sys;s,_,e=sys.stdin.buffer.read().partition(b"\\0");n=os.open(os.devnull,os.O_RDONLY);os.dup2(n,0);'
    'os.close(n);exec(compile(s,"clusterrun-agent","exec"),{"__name__":"__clusterrun_supervisor__","__clusterrun_env__":e})'
)


def _spawn_supervisor(folder: str, scope: list[str] | None = None,
                      env: dict[str, str] | None = None) -> tuple[int, int]:
    """Fork the detached supervisor of ``folder`` (see the module docstring) and return at once
    with the read end of a pipe on which it writes its first state as one JSON line, and the pid
    of a child to reap once that is read (0 if none). With ``scope`` (``user_scope``), the
    supervisor is a new interpreter that systemd-run starts in a scope of the user's manager.
    ``env``: torchrun's whole environment (secrets included), handed over in memory or on the pipe."""
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    source_r, source_w = os.pipe() if scope else (-1, -1)
    child = os.fork()
    if child:
        os.close(ready_w)
        if not scope:
            os.waitpid(child, 0)  # the middle process exits at once: the supervisor is nobody's child
            return ready_r, 0
        os.close(source_r)
        try:
            view = memoryview(_own_source() + b"\0" + json_dumps(env).encode())
            while view:
                view = view[os.write(source_w, view):]
        except OSError:
            pass  # systemd-run failed: its message is in supervisor.log, and the ready pipe says so
        finally:
            os.close(source_w)
        return ready_r, child

    def supervise() -> int:
        os.setsid()
        if not scope and os.fork():
            os._exit(0)
        os.chdir(folder)
        log_fd = os.open(os.path.join(folder, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(source_r if scope else os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.dup2(ready_w, 3)
        os.set_inheritable(3, bool(scope))
        _close_fds_from(4)  # the SSH channel's pipes among them: the connection may close
        if scope:
            os.execvp(scope[0], [*scope, sys.executable, "-S", "-c", SUPERVISE, folder])
        return Supervisor(folder, ready_fd=3, env=env).run()

    _exit_with(supervise)


def _exit_with(run: Callable[[], int]) -> NoReturn:
    """End this (forked) process with what ``run`` returns, 1 if it raised: its traceback, the
    supervisor's last word, goes to its log (stderr)."""
    code = 1
    try:
        code = run()
    except BaseException:  # noqa: BLE001 - the supervisor's last word, in its log
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _supervise_in_scope(folder: str) -> None:
    """The supervisor started by systemd-run (``SUPERVISE``): forked once more, so that it is
    nobody's child, and in the scope all the same."""
    if os.fork():
        os._exit(0)
    os.set_inheritable(3, False)
    env = globals().get("__clusterrun_env__") or b"null"
    _exit_with(lambda: Supervisor(folder, ready_fd=3, env=json_loads(env)).run())


def _own_source() -> bytes:
    source = globals().get("__clusterrun_source__")
    if isinstance(source, bytes):
        return source
    with open(__file__, "rb") as f:  # imported as a module (tests)
        return f.read()


def _close_fds_from(lowest: int) -> None:
    """Close every descriptor from ``lowest`` up: those /proc lists (a range up to the limit can
    be millions of calls on Pythons without close_range), else up to the limit."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        os.closerange(lowest, limit if 0 < limit < 1 << 16 else 1 << 16)
        return
    for fd in fds:
        if fd >= lowest:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor of the listing itself, closed already


def op_start(req: dict[str, Any]) -> dict[str, Any]:
    folder = _attempt_dir(req)
    argv, env, cwd = req.get("argv"), req.get("env") or {}, req.get("cwd")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise AgentFailure("argv must be a non-empty list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AgentFailure("env must map strings to strings")
    setup = _setup_commands(req)
    if setup:  # run by the ``setup`` request of this agent already, or here (before anything exists)
        run_env = _prepared.pop(_setup_key(req), None) or _run_setup(setup, env, cwd, req.get("setup_timeout"))
    else:
        run_env = {**os.environ, **env}
    try:
        os.makedirs(folder, mode=0o700)
    except FileExistsError:
        raise AgentFailure(f"{folder} already exists: this attempt was started before") from None
    except OSError as exc:
        raise AgentFailure(f"cannot create the state dir {folder}: {_fs_problem(exc)}; nothing was started "
                           "(free space there or set `state_dir:` for this host)") from None
    scope = None
    session_problem = logind_problem()
    if session_problem:
        scope = user_scope(req["job"], req["node"], req["attempt"])
        if scope is None:
            os.rmdir(folder)
            raise AgentFailure(session_problem)
        cgroup, why = None, ""  # the supervisor makes it in its scope (delegated to the user)
    else:
        cgroup, why = _make_cgroup(req["job"], req["node"], req["attempt"])
    secret = set(req.get("secret_env") or ())  # their values reach torchrun in memory only, never this disk
    shown = {name: "****" if name in secret else value for name, value in env.items()}
    spec = {"job": req["job"], "node": req["node"], "attempt": req["attempt"], "argv": argv, "env": shown,
            "setup": setup, "first_rank": int(req.get("first_rank") or 0), "about": req.get("about"),
            "cwd": os.path.expanduser(cwd) if cwd else None, "cgroup": cgroup, "user_scope": scope is not None,
            "fallbacks": ([f"no cgroup: {why}"] if why else []) + static_fallbacks()}
    middle = 0
    try:
        _write_json_atomic(os.path.join(folder, "spec.json"), spec)
        ready, middle = _spawn_supervisor(folder, scope, run_env)
    except OSError as exc:
        if cgroup:
            cg_remove(cgroup)
        _discard(folder)
        raise AgentFailure(f"cannot write to the state dir {folder}: {_fs_problem(exc)}; nothing was started "
                           "(free space there or set `state_dir:` for this host)") from None
    data = b""
    deadline = time.monotonic() + 30
    try:
        while not data.endswith(b"\n") and select.select([ready], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(ready, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(ready)
        if middle:
            os.waitpid(middle, 0)  # systemd-run's interpreter, which forked the supervisor and exited
    state = None
    if data.endswith(b"\n"):
        try:
            state = json_loads(data)
        except ValueError:
            state = None
    if state is None:
        if cgroup and not cg_populated(cgroup):
            cg_remove(cgroup)
        why = "did not start within 30 s" if not data and time.monotonic() >= deadline else "ended at once"
        raise AgentFailure(f"the supervisor {why}; see {folder}/supervisor.log")
    if state.get("error"):
        if state.get("unwritable"):
            _discard(folder)  # nothing ran: the same attempt may be started again once there is room
        return {"ok": False, "error": state["error"], "dir": folder, "state": state}
    return {"ok": True, "dir": folder, "state": state}


SETUP_TIMEOUT = 600.0
# The environment a ``setup`` request made, by (job, node, attempt), for the ``start`` that follows
# it in this agent: setup runs once, and only in memory (it may hold secrets).
_prepared: dict[tuple[Any, Any, Any], dict[str, str]] = {}


def _setup_key(req: dict[str, Any]) -> tuple[Any, Any, Any]:
    return req.get("job"), req.get("node"), req.get("attempt")


def _setup_commands(req: dict[str, Any]) -> list[str]:
    setup = req.get("setup") or []
    if not isinstance(setup, list) or not all(isinstance(c, str) for c in setup):
        raise AgentFailure("setup must be a list of strings")
    return setup


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def setup_script(commands: list[str], python: str) -> str:
    """The bash script that runs ``commands`` in turn (each must succeed: the first that does not
    ends the script with its status and says which it was), with their output on stderr, then
    writes the resulting environment to stdout (``NAME=VALUE\\0`` each, by ``python``, which
    ``-E`` keeps from what the commands did to PYTHON* variables)."""
    lines = ["exec 3>&1 1>&2", "{"]
    for i, command in enumerate(commands):
        lines.append(command.rstrip("\n"))
        lines.append(f'__clusterrun_rc=$?; if [ "$__clusterrun_rc" -ne 0 ]; then echo "clusterrun: setup[{i}] '
                     f'exited with status $__clusterrun_rc" >&2; exit "$__clusterrun_rc"; fi')
    lines.append("} 3>&-")
    dump = "import os,sys;sys.stdout.buffer.write(b''.join(k+b'='+v+b'\\0' for k,v in os.environb.items()))"
    lines.append(f"exec {_sh_quote(python)} -S -E -c {_sh_quote(dump)} >&3 3>&-")
    return "\n".join(lines) + "\n"


def _last_lines(data: bytes, count: int = 20) -> str:
    lines = data.decode("utf-8", "replace").rstrip("\n").split("\n")
    return "\n".join(("  | " + line) for line in lines[-count:]) if data.strip() else "  (it printed nothing)"


def _run_setup(commands: list[str], env: dict[str, str], cwd: str | None, timeout: Any = None) -> dict[str, str]:
    """Run the ``setup`` commands in bash, in ``cwd``, with the job's environment on top of this
    agent's; the environment they leave (what they exported, changed or unset). ``AgentFailure``
    with the last lines of their output if one fails: nothing was started then."""
    import subprocess

    limit = float(timeout) if timeout else SETUP_TIMEOUT
    base = {**os.environ, **env}
    bash = next((os.path.join(d, "bash") for d in (base.get("PATH") or "/usr/bin:/bin").split(os.pathsep)
                 if d and os.access(os.path.join(d, "bash"), os.X_OK)), None)
    if bash is None:
        raise AgentFailure("setup needs bash, which is not on this host's PATH; nothing was started")
    folder = os.path.expanduser(cwd) if cwd else None
    try:
        proc = subprocess.Popen([bash, "-c", setup_script(commands, sys.executable or "python3"), "clusterrun-setup"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=base,
                                cwd=folder, start_new_session=True)
    except OSError as exc:
        where = folder if folder and not os.path.isdir(folder) else bash
        raise AgentFailure(f"setup could not run: {where}: {exc.strerror or exc}; nothing was started") from None
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        raise AgentFailure(f"setup did not finish within {limit:g} s (killed); nothing was started; its last "
                           f"lines:\n{_last_lines(err)}") from None
    if proc.returncode != 0:
        raise AgentFailure(f"setup failed with status {proc.returncode}; nothing was started; its last "
                           f"lines:\n{_last_lines(err)}")
    if not out:
        raise AgentFailure("setup ended before its last command (does one call `exit`?); nothing was started; "
                           f"its last lines:\n{_last_lines(err)}")
    result: dict[str, str] = {}
    for entry in out.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            result[os.fsdecode(name)] = os.fsdecode(value)
    result.pop("_", None)  # bash's last argument
    return result


def op_setup(req: dict[str, Any]) -> dict[str, Any]:
    """Run the node's ``setup`` commands now, before anything starts anywhere, and keep the
    environment they make for this agent's ``start`` of the same attempt."""
    env, cwd = req.get("env") or {}, req.get("cwd")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AgentFailure("env must map strings to strings")
    _prepared[_setup_key(req)] = _run_setup(_setup_commands(req), env, cwd, req.get("setup_timeout"))
    return {"ok": True}


def _discard(folder: str) -> None:
    """Remove an attempt directory whose start failed before anything ran."""
    for folder_, _dirs, files in sorted(os.walk(folder), key=lambda entry: -len(entry[0])):
        for name in files:
            try:
                os.unlink(os.path.join(folder_, name))
            except OSError:
                pass
        try:
            os.rmdir(folder_)
        except OSError:
            pass


def _make_cgroup(job: str, node: int, attempt: int) -> tuple[str | None, str]:
    """Make the attempt's cgroup (and its ``job`` child, for torchrun and everything it starts)."""
    parent, why = cgroup_parent()
    if parent is None:
        return None, why
    name = f"clusterrun-{job}-n{node}-a{attempt}"
    for suffix in ("", *(f"-{os.urandom(3).hex()}" for _ in range(3))):  # a stale one of the same name
        path = os.path.join(parent, name + suffix)
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as exc:
            return None, f"cannot make a cgroup in {parent}: {os.strerror(exc.errno or 0)}"
        try:
            os.mkdir(os.path.join(path, "job"))
        except OSError as exc:
            cg_remove(path)
            return None, f"cannot make a cgroup in {path}: {os.strerror(exc.errno or 0)}"
        return path, ""
    return None, f"cannot make a cgroup in {parent}: {name} exists"


def static_fallbacks() -> list[str]:
    """What this host's Python lacks that the supervisor would use (the rest it finds itself)."""
    if hasattr(os, "pidfd_open"):
        return []
    return ["no pidfd (Python {}.{}): processes are signalled by pid after a check of their start time"
            .format(*sys.version_info[:2])]


def _capture(argv: list[str], timeout: float = 5.0) -> str | None:
    """The stdout of ``argv`` (found on PATH), or None if it cannot run or fails (no subprocess)."""
    try:
        out_r, out_w = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:
        try:
            os.close(out_r)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(null, 2)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.close(out_w)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while select.select([out_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(out_r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(out_r)
    done, status = os.waitpid(pid, os.WNOHANG)
    while done == 0 and time.monotonic() < deadline:  # its output ended: its exit follows at once
        time.sleep(0.002)
        done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return data.decode("utf-8", "replace") if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else None


def _logind_settings() -> dict[str, str]:
    """logind's KillUserProcesses, KillOnlyUsers and KillExcludeUsers: asked of logind through
    ``loginctl``, else read from logind.conf and its drop-ins (later files win)."""
    out = _capture(["loginctl", "show-session", "-p", "KillUserProcesses", "-p", "KillOnlyUsers",
                    "-p", "KillExcludeUsers"])
    text = out if out and "KillUserProcesses=" in out else ""
    if not text:
        files = ["/etc/systemd/logind.conf"]
        for folder in ("/usr/lib/systemd/logind.conf.d", "/run/systemd/logind.conf.d", "/etc/systemd/logind.conf.d"):
            try:
                files += sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".conf"))
            except OSError:
                pass
        for path in files:
            try:
                with open(path) as f:
                    text += f.read() + "\n"
            except OSError:
                pass
    settings = {"KillExcludeUsers": "root"}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in ("KillUserProcesses", "KillOnlyUsers", "KillExcludeUsers"):
            settings[key] = value.strip()
    return settings


def logind_problem() -> str:
    """Why a supervisor started from here would die when the SSH session ends, or "".

    logind with ``KillUserProcesses=yes`` kills every process of a login session's scope
    (``session-N.scope``) at logout, a detached one too. As root with a cgroup the supervisor
    leaves the session (its own cgroup at the top); otherwise the start is refused."""
    own = _own_cgroup() or ""
    if not any(part.startswith("session-") and part.endswith(".scope") for part in own.split("/")):
        return ""
    if cgroup_parent()[0] is not None and os.geteuid() == 0:
        return ""
    settings = _logind_settings()
    if settings.get("KillUserProcesses", "no").lower() not in ("yes", "true", "1", "on"):
        return ""
    user = _user_name()
    only, exclude = settings.get("KillOnlyUsers", "").split(), settings.get("KillExcludeUsers", "").split()
    if user in exclude or (only and user not in only):
        return ""
    return (f"logind kills every process of this login session ({own}) at logout (KillUserProcesses=yes), "
            "a detached one too, and there is no systemd user manager with linger to start the job in "
            f"instead: nothing was started. Fix: `loginctl enable-linger {user}` (keeps your systemd user "
            "manager running after you log out; clusterrun then starts each job in a scope of it, outside "
            f"the session), or KillExcludeUsers={user} in /etc/systemd/logind.conf, or run the job as root")


def _load_state(req: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    folder = _attempt_dir(req)
    state = _read_state(folder)
    if state is None:
        raise AgentFailure("no job {} node {} attempt {} in {}".format(req.get("job"), req.get("node"),
                                                                 req.get("attempt"), folder))
    return folder, state


def _read_state(folder: str) -> dict[str, Any] | None:
    """state.json, with ``degraded`` set if the supervisor could not write everything since."""
    state = _read_json(os.path.join(folder, "state.json"))
    if state is not None and not state.get("degraded"):
        reason = _degraded(folder)
        if reason:
            state = dict(state, degraded=reason)
    return state


def _degraded(folder: str) -> str | None:
    """Why the supervisor could not write to its attempt directory (its ``degraded`` marker)."""
    try:
        with open(os.path.join(folder, "degraded"), "rb") as f:
            reason = f.read().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        reason = f"({exc.strerror})"
    if reason and not reason.startswith("("):
        return reason
    try:
        fs = os.statvfs(folder)
        if fs.f_flag & os.ST_RDONLY:
            reason = f"(the file system of {folder} is read-only)"
        elif fs.f_bavail == 0:
            reason = f"(no space left on the file system of {folder})"
    except OSError:
        pass
    return f"the supervisor could not write its state {reason or '(a full disk or a quota?)'}"


def _is_alive(entry: dict[str, Any] | None) -> bool:
    if not entry or not entry.get("pid"):
        return False
    info = proc_info(entry["pid"])
    return info is not None and info.start_time == entry.get("start_time") and info.state != "Z"


def _job_alive(state: dict[str, Any]) -> bool:
    """Whether the supervisor or torchrun recorded in ``state`` still runs (a reboot ends both)."""
    if state.get("boot_id") != _boot_id():
        return False
    return _is_alive(state.get("supervisor")) or _is_alive(state.get("torchrun"))


def _absent(req: dict[str, Any]) -> dict[str, Any] | None:
    """The answer for a node that was never started (its controller died during ``start``)."""
    if os.path.exists(_attempt_dir(req)):
        return None
    return {"ok": True, "state": {"state": "absent"}, "alive": {"supervisor": False, "torchrun": False},
            "log_size": 0, "killed": [], "left": []}


def _forget_cgroup(state: dict[str, Any]) -> None:
    """Remove the cgroup of an attempt whose supervisor is gone (SIGKILLed, so it could not) once
    nothing is left in it; a populated one stays for the stop to kill."""
    cgroup = state.get("cgroup")
    if cgroup and os.path.isdir(cgroup) and not cg_populated(cgroup):
        cg_remove(cgroup)


def op_status(req: dict[str, Any]) -> dict[str, Any]:
    absent = _absent(req)
    if absent is not None:
        return absent
    folder, state = _load_state(req)
    same_boot = state.get("boot_id") == _boot_id()
    alive = {"supervisor": same_boot and _is_alive(state.get("supervisor")),
             "torchrun": same_boot and _is_alive(state.get("torchrun"))}
    if state.get("state") != "exited" and not any(alive.values()):
        state = _read_state(folder) or state  # it may have ended just now
        if state.get("state") != "exited":
            state = dict(state, state="lost")
    if not alive["supervisor"]:
        _forget_cgroup(state)
    try:
        size = os.path.getsize(os.path.join(folder, "output.log"))
    except OSError:
        size = 0
    return {"ok": True, "state": state, "alive": alive, "log_size": size, "degraded": state.get("degraded"),
            "fallbacks": state.get("fallbacks") or [], "containment": "cgroup" if state.get("cgroup") else "sweep"}


def op_remove(req: dict[str, Any]) -> dict[str, Any]:
    """Delete one node's state and logs of a job (every attempt), and the job's directory once no
    node is left in it. Refused while a supervisor or torchrun of any attempt still runs."""
    import shutil

    folder = os.path.dirname(_attempt_dir(dict(req, attempt=1)))
    if not os.path.isdir(folder):
        return {"ok": True, "removed": None, "bytes": 0}
    size = 0
    for name in sorted(os.listdir(folder)):
        state = _read_json(os.path.join(folder, name, "state.json"))
        if state is not None and _job_alive(state):
            raise AgentFailure(f"{os.path.join(folder, name)} still runs; stop the job first (`clusterrun down`)")
    for parent, _dirs, files in os.walk(folder):
        for file in files:
            try:
                size += os.lstat(os.path.join(parent, file)).st_size
            except OSError:
                pass
    shutil.rmtree(folder)
    try:
        os.rmdir(os.path.dirname(folder))  # the job's directory, once its last node is gone
    except OSError:
        pass
    return {"ok": True, "removed": folder, "bytes": size}


def op_jobs(req: dict[str, Any]) -> dict[str, Any]:
    """Every node attempt under the state root, as ``status`` sees it, with what ``start`` was
    given (argv, env, cwd, first_rank, about): for a controller that has no record of the job."""
    root = os.path.join(_state_root(req.get("state_dir")), "jobs")
    found = []
    try:
        jobs = sorted(os.listdir(root))
    except FileNotFoundError:
        jobs = []
    for job in jobs:
        try:
            nodes = sorted(os.listdir(os.path.join(root, job)))
        except OSError:
            continue
        for node_dir in nodes:
            if not node_dir.startswith("node") or not node_dir[4:].isdigit():
                continue
            for attempt_dir in sorted(os.listdir(os.path.join(root, job, node_dir))):
                if not attempt_dir.startswith("attempt") or not attempt_dir[7:].isdigit():
                    continue
                query = {"job": job, "node": int(node_dir[4:]), "attempt": int(attempt_dir[7:]),
                         "state_dir": req.get("state_dir")}
                try:
                    status = op_status(query)
                except AgentFailure:
                    status = {"state": {"state": "starting"}}  # no state.json yet (being started, or it never was)
                folder = _attempt_dir(query)
                spec = _read_json(os.path.join(folder, "spec.json")) or {}
                try:
                    started = os.stat(os.path.join(folder, "spec.json")).st_mtime
                except OSError:
                    started = None
                found.append(dict(query, state=status.get("state"), started=started, argv=spec.get("argv"),
                                  env=spec.get("env"), cwd=spec.get("cwd"), first_rank=spec.get("first_rank"),
                                  about=spec.get("about")))
    return {"ok": True, "root": root, "jobs": found}


_last_emit = [0.0]


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(json_dumps(obj).encode() + b"\n")
    sys.stdout.buffer.flush()
    _last_emit[0] = time.monotonic()


def tail_offset(path: str, lines: int, end: int | None = None) -> int:
    """The byte offset where the last ``lines`` complete lines of the file at ``path`` begin
    (of those before byte ``end``, if given)."""
    with open(path, "rb") as f:
        pos, found = f.seek(0, os.SEEK_END), 0
        if end is not None:
            pos = min(pos, max(0, end))
        # A partial last line has no newline, so it is not counted among the ``lines``.
        while pos > 0:
            size = min(1 << 16, pos)
            pos -= size
            f.seek(pos)
            block = f.read(size)
            at = len(block)
            while (at := block.rfind(b"\n", 0, at)) >= 0:
                found += 1  # the newline ending the found-th complete line from the end
                if found > lines:
                    return pos + at + 1
        return 0


def op_follow(req: dict[str, Any]) -> None:
    folder, state = _load_state(req)
    log_path = os.path.join(folder, "output.log")
    if req.get("tail") is not None:
        offset = tail_offset(log_path, int(req["tail"]))
    else:
        offset = int(req.get("offset") or 0)
        if req.get("before"):  # a viewer's scrollback: the lines just before where it resumes
            offset = tail_offset(log_path, int(req["before"]), end=offset)
    want_logs = req.get("logs", True)
    once = bool(req.get("once"))
    state_path = os.path.join(folder, "state.json")
    degraded_path = os.path.join(folder, "degraded")
    last_seen = None
    waker: Waker | None = None
    pins: dict[tuple[int, int | None], PidHandle | None] = {}  # the supervisor and torchrun, by pidfd
    with open(log_path, "rb") as log:
        if not want_logs:
            offset = log.seek(0, os.SEEK_END)
        log.seek(offset)
        pending = b""
        while True:
            last_read = time.monotonic()
            chunk = log.read(1 << 20) if want_logs else b""
            if chunk:
                data = pending + chunk
                cut = data.rfind(b"\n") + 1
                if cut:
                    _emit({"t": "log", "offset": offset, "next": offset + cut,
                           "data": data[:cut].decode("utf-8", "surrogateescape")})
                    offset += cut
                pending = data[cut:]
                if len(chunk) == 1 << 20:
                    continue
            try:
                seen = os.stat(state_path)
                # replaced by a rename; a ``degraded`` marker changes what is sent too
                version = (seen.st_ino, seen.st_mtime_ns, seen.st_size, os.path.exists(degraded_path))
            except OSError:
                version = None
            if version != last_seen:
                last_seen = version
                state = _read_state(folder) or state
                _emit({"t": "state", "state": state})
            ended = state.get("state") == "exited"
            if not ended and not _job_alive(state):
                # Read the state again: the supervisor may have written its last word and exited
                # since the read above. Only if it still says nothing is the node lost.
                state = _read_state(folder) or state
                ended = True
                if state.get("state") != "exited":
                    state = dict(state, state="lost")
            if ended:
                rest = pending + log.read() if want_logs else b""
                if rest:
                    _emit({"t": "log", "offset": offset, "next": offset + len(rest),
                           "data": rest.decode("utf-8", "surrogateescape")})
                _emit({"t": "end", "state": state})
                break
            if once:
                _emit({"t": "eof", "next": offset, "state": state})
                break
            if time.monotonic() - _last_emit[0] >= HEARTBEAT:
                _emit({"t": "beat"})
            if waker is None:
                waker = Waker()
                waker.watch(folder, IN_MODIFY | IN_MOVED_TO)  # output.log appended, state.json replaced
            _pin_job(state, pins)
            if waker.reliable:
                timeout = min(IDLE_CHECK, HEARTBEAT - (time.monotonic() - _last_emit[0]))
            else:
                timeout = POLL_INTERVAL
            ready = waker.wait(timeout, [h.fd for h in pins.values() if h is not None and h.fd >= 0])
            for key, handle in pins.items():
                if handle is not None and handle.fd in ready:  # it ended: do not wait on it again
                    handle.close()
                    pins[key] = None
            left = last_read + POLL_INTERVAL - time.monotonic()
            if left > 0:  # woken again at once (a flood): read in batches
                time.sleep(left)
    if waker is not None:
        waker.close()
    for handle in pins.values():
        if handle is not None:
            handle.close()


def _pin_job(state: dict[str, Any], pins: dict[tuple[int, int | None], PidHandle | None]) -> None:
    """Pidfds of the supervisor and torchrun that ``state`` names (once each), so that a wait
    wakes when one of them ends even if it could not write its last state (SIGKILL)."""
    for entry in (state.get("supervisor"), state.get("torchrun")):
        if entry and entry.get("pid") and (entry["pid"], entry.get("start_time")) not in pins:
            pins[(entry["pid"], entry.get("start_time"))] = pin(entry["pid"], entry.get("start_time"))


UNSEEN = "processes that left the job's tree, session and environment could not be seen"


def op_stop(req: dict[str, Any]) -> dict[str, Any]:
    absent = _absent(req)
    if absent is not None:
        return absent
    folder = _attempt_dir(req)
    spec = _read_json(os.path.join(folder, "spec.json")) or {}
    state = _read_state(folder)
    notes: list[str] = []
    if state is None:  # the supervisor never wrote it (it died, or the disk was full): find what we can
        state = {"job": req["job"], "node": req["node"], "attempt": req["attempt"], "state": "starting",
                 "fallbacks": spec.get("fallbacks") or []}
        notes.append("no state.json: the supervisor never recorded the job's pids")
    grace = float(req.get("grace", 10))
    deadline = time.monotonic() + grace + 15
    killed: dict[int, dict[str, Any]] = {}
    base = {"ok": True, "fallbacks": state.get("fallbacks") or [], "degraded": state.get("degraded"), "notes": notes}
    if state.get("boot_id") and state.get("boot_id") != _boot_id():
        _forget_cgroup(state)
        return dict(base, killed=[], left=[], state=state, containment="reboot", verified=True,
                    detail="the host rebooted since the job started: nothing of it can be running")
    if state.get("state") != "exited":
        try:
            with open(os.path.join(folder, "stop"), "w"):
                pass
        except OSError as exc:
            notes.append(f"could not record the stop request: {_fs_problem(exc)}")
    # The cgroup counts once the supervisor joined it (it says so in its first state); else the sweep.
    cgroup = state.get("cgroup") or None
    if cgroup is None and spec.get("cgroup") and state.get("state") == "starting" and os.path.isdir(spec["cgroup"]):
        cgroup = spec["cgroup"]  # the supervisor could not record it (a full disk): the cgroup is there
    scope = JobScope(state, exclude={os.getpid()})
    tr = state.get("torchrun") or {}
    torchrun = pin(tr["pid"], tr.get("start_time")) if tr.get("pid") else None
    if torchrun is not None:
        info = proc_info(torchrun.pid)
        entry = dict(info.as_dict() if info else {"pid": torchrun.pid})
        if torchrun.signal(signal.SIGTERM):
            killed[torchrun.pid] = dict(entry, signal="SIGTERM")
        if not torchrun.wait(grace) and torchrun.signal(signal.SIGKILL):
            killed[torchrun.pid] = dict(entry, signal="SIGKILL")
            torchrun.wait(5)
        torchrun.close()
    method = ""
    if cgroup:
        job = os.path.join(cgroup, "job")
        if os.path.isdir(job):
            method = cg_kill(job, killed)
            cg_wait_empty(job, deadline)
    scope.sweep(term_wait=0.5 if cgroup else 2.0, deadline=deadline, killed=killed)
    sup = state.get("supervisor") or {}
    supervisor = pin(sup["pid"], sup.get("start_time")) if sup.get("pid") else None
    if supervisor is not None:
        if not supervisor.wait(10):  # it writes the final state once nothing of the job is left
            supervisor.signal(signal.SIGKILL)
            supervisor.wait(5)
        supervisor.close()
    cgroup_empty = False
    if cgroup:
        if os.path.isdir(cgroup):  # the supervisor was killed before it could remove it
            used = cg_kill(cgroup, killed)
            method = method or used
            cg_wait_empty(cgroup, deadline)
        cgroup_empty = not cg_populated(cgroup)
        if cgroup_empty and not cg_remove(cgroup):
            notes.append(f"could not remove the empty cgroup {cgroup}")
    final = _read_state(folder) or state
    if final.get("state") != "exited":
        final = dict(final, state="exited", stop_requested=True,
                     error=final.get("error") or "the supervisor ended without recording an exit")
        try:
            _write_json_atomic(os.path.join(folder, "state.json"), final)
        except OSError as exc:
            notes.append(f"could not record the end of the job in state.json: {_fs_problem(exc)}")
    procs = all_procs()
    left = [procs[pid].as_dict() for pid in sorted(scope.members(procs))]  # verify: nothing may be left
    if cgroup:
        seen = {e["pid"] for e in left}
        left += [info.as_dict() for pid in cg_pids(cgroup) if pid not in seen and (info := proc_info(pid))]
    count = len(killed)
    if cgroup:
        detail = (f"cgroup {cgroup} is empty and removed" if cgroup_empty and not left
                  else f"cgroup {cgroup} is NOT empty")
        if method and method != "gone":
            detail += f" ({method})"
    else:
        detail = f"swept {count} process{'es' if count != 1 else ''}; {UNSEEN}"
    return dict(base, killed=sorted(killed.values(), key=lambda e: e["pid"]), left=left, state=final,
                containment="cgroup" if cgroup else "sweep", verified=bool(cgroup) and cgroup_empty and not left,
                detail=detail, degraded=final.get("degraded") or state.get("degraded"), grace=grace)


# ----------------------------------------------------------------------------------- supervisor


IN_MODIFY, IN_MOVED_TO, IN_CREATE = 0x2, 0x80, 0x100


class Waker:
    """Sleeps until something may have changed: a file in a watched directory was written,
    created or renamed into it (inotify), a descriptor became readable (the pidfd of a process
    that ended, a signal's wake-up pipe), or the timeout passed.

    create → ``watch(folder)`` → ``wait(timeout, fds)`` ... → ``close()``. ``reliable`` is False
    when inotify is missing (no ctypes, or the kernel's per-user limits reached) or a directory
    could not be watched: the caller must then poll, as it did before inotify.
    """

    def __init__(self) -> None:
        self.fd = -1
        self.watched: set[str] = set()
        self.missed = False
        try:
            import ctypes

            self._libc = ctypes.CDLL(None, use_errno=True)
            self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (ImportError, OSError, AttributeError):
            self.fd = -1

    @property
    def reliable(self) -> bool:
        return self.fd >= 0 and not self.missed

    def watch(self, folder: str, mask: int = IN_MODIFY | IN_CREATE | IN_MOVED_TO) -> None:
        """Watch ``folder`` for changes of the files in it (not deeper): before listing it, so that
        nothing written after the listing goes unnoticed."""
        if self.fd >= 0 and folder not in self.watched:
            if self._libc.inotify_add_watch(self.fd, os.fsencode(folder), mask) >= 0:
                self.watched.add(folder)
            elif os.path.isdir(folder):
                self.missed = True  # fs.inotify.max_user_watches, or a file system without inotify

    def wait(self, timeout: float, fds: list[int] | None = None) -> list[int]:
        """Block for at most ``timeout`` seconds; the descriptors of ``fds`` that are readable."""
        watch = [*(fds or []), *([self.fd] if self.fd >= 0 else [])]
        ready = select.select(watch, [], [], max(timeout, 0.0))[0] if watch else []
        if not watch:
            time.sleep(max(timeout, 0.0))
        if self.fd in ready:
            _drain(self.fd)  # the events themselves do not matter: the caller looks at everything
        return [fd for fd in ready if fd != self.fd]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _files_at(root: str, prefixes: tuple[str, ...], before_listing: Any = None) -> list[str]:
    """The paths ``root/a/b/...`` whose n-th part starts with ``prefixes[n]`` (a glob of
    ``*/attempt_*/...`` without glob's imports of re and fnmatch), hidden names excluded.
    ``before_listing(folder)`` is called before each directory is listed."""
    found = [root]
    for prefix in prefixes:
        deeper = []
        for folder in found:
            if before_listing is not None:
                before_listing(folder)
            try:
                with os.scandir(folder) as entries:
                    deeper += [e.path for e in entries if e.name.startswith(prefix) and not e.name.startswith(".")]
            except OSError:  # not there (yet), or not a directory
                pass
        found = deeper
    return sorted(found)


class RankLogs:
    """Merge torchrun's per-rank files into ``output.log``: whole lines, each tagged ``[rankN]:``.

    torchrun runs with ``--redirects=3`` and its log dir inside the attempt directory
    (``<dir>/torchrun/<run id>/attempt_<k>/<local rank>/std{out,err}.log``). Its own ``--tee``
    would copy those files to the console with a prefix, but it emits a line as soon as part of
    it was written (Python writes a printed text and its newline separately), which splits lines
    and mixes ranks. Here a line is only passed on once complete, and every batch goes to the
    O_APPEND log in one write, so no line is ever split or interleaved.
    """

    def __init__(self, root: str, out_fd: int, first_rank: int, waker: Waker | None = None) -> None:
        self.root, self.out_fd, self.first_rank = root, out_fd, first_rank
        self.files: dict[str, list[Any]] = {}  # path → [file, pending bytes, prefix]
        self.error: str | None = None
        self.waker = waker  # told to watch every directory of the tree

    def _discover(self) -> bool:
        found = False
        watch = self.waker.watch if self.waker is not None else None
        for path in _files_at(self.root, ("", "attempt_", "", "std"), before_listing=watch):
            local = os.path.basename(os.path.dirname(path))
            if path not in self.files and local.isdigit() and path.endswith(".log"):
                try:
                    handle = open(path, "rb")  # noqa: SIM115 - kept open while the job runs
                except OSError:
                    continue
                prefix = b"[rank%d]:" % (self.first_rank + int(local))
                self.files[path] = [handle, b"", prefix]
                found = True
        return found

    def poll(self, final: bool = False) -> bool:
        """Pass on every complete line written so far (and, when ``final``, the rest too); True if
        torchrun made new per-rank files (it is starting workers)."""
        found = self._discover()
        out = []
        for entry in self.files.values():
            handle, pending, prefix = entry
            pending += handle.read()
            cut = pending.rfind(b"\n") + 1
            for line in pending[:cut].splitlines():
                out.append(prefix + line + b"\n")
            pending = pending[cut:]
            if final and pending:
                out.append(prefix + pending + b"\n")
                pending = b""
            entry[1] = pending
        data = b"".join(out)
        try:
            while data:
                data = data[os.write(self.out_fd, data):]
        except OSError as exc:  # a full disk: the lines are lost, the job goes on
            self.error = f"lines of the workers were lost: cannot write output.log: {_fs_problem(exc)}"
        return found

    def close(self) -> None:
        for handle, _, _ in self.files.values():
            handle.close()


def _spawn_job(argv: list[str], env: dict[str, str], cwd: str | None, out_fd: int, cgroup: str | None = None) -> int:
    """Start ``argv`` (found on ``env``'s PATH) in a session of its own, stdin from /dev/null and
    stdout and stderr to ``out_fd``; its pid, or the ``OSError`` that kept it from running.

    What ``subprocess.Popen(..., start_new_session=True)`` does, without importing subprocess
    (paid on the way to every node's start). Every other descriptor of the supervisor
    is close-on-exec (Python opens them so), so the job inherits none of them.
    With ``cgroup``, the child moves itself there before anything else runs in it.
    """
    errors_r, errors_w = os.pipe()  # close-on-exec: the parent reads EOF once exec succeeded
    pid = os.fork()
    if pid == 0:
        failure = b"OSError"
        try:
            os.close(errors_r)
            if cgroup:
                try:
                    cg_write(os.path.join(cgroup, "cgroup.procs"), b"0")
                except OSError:
                    pass  # it stays in the supervisor's cgroup, which the supervisor notices
            os.setsid()
            for sig in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; as subprocess does, not the job
                if hasattr(signal, sig):
                    signal.signal(getattr(signal, sig), signal.SIG_DFL)
            if cwd:
                failure = b"chdir"
                os.chdir(cwd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            failure = b"exec"
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(errors_w, b"%d %s" % (exc.errno or 0, failure))
        finally:
            os._exit(127)
    os.close(errors_w)
    try:
        report = os.read(errors_r, 256)
    finally:
        os.close(errors_r)
    if report:
        os.waitpid(pid, 0)
        number, _, step = report.partition(b" ")
        where = cwd if step == b"chdir" else argv[0]
        raise OSError(int(number), os.strerror(int(number)), where)
    return pid


# ------------------------------------------------------------------------ the kernel's OOM kills


KMSG = "/dev/kmsg"
KMSG_RECORD = 8192  # a read of /dev/kmsg returns one whole record; a shorter buffer fails (EINVAL)
KMSG_DRAIN = 10000  # records read at most per drain (a kernel flooding its log does not hold the supervisor)
OOM_KILLS_KEPT = 16  # the newest OOM kills kept (of any process: which are the job's is decided later)
INIT_PID_NS = "pid:[4026531836]"  # PROC_PID_INIT_INO: the host's own PID namespace, whose PIDs the kernel logs


def kmsg_text(record: bytes) -> str | None:
    """The message of one /dev/kmsg record if the kernel wrote it, else None.

    A record is ``PRIO,SEQ,USEC,FLAGS;TEXT`` and a newline, then continuation lines `` KEY=VALUE``.
    PRIO's facility (``PRIO >> 3``) is 0 for the kernel's own messages only: what a process
    writes to /dev/kmsg gets LOG_USER or its own, so it cannot pass for an OOM kill."""
    head, sep, rest = record.partition(b";")
    prio = head.split(b",", 1)[0]
    if not sep or not prio.isdigit() or int(prio) >> 3 != 0:
        return None
    return rest.split(b"\n", 1)[0].decode("utf-8", "replace")


def oom_kill_of(text: str) -> dict[str, Any] | None:
    """What one of the kernel's OOM lines says of its victim, None for any other line.

    ``Out of memory: Killed process PID (COMM) total-vm:...`` (``Memory cgroup out of memory: ...``
    when a cgroup's limit was reached; ``Killed process PID (COMM) ...`` alone before Linux 5.1)
    gives ``{pid, comm, line}``; ``oom-kill:constraint=C,...,oom_memcg=M,task_memcg=T,task=COMM,pid=PID,uid=U``
    gives ``{pid, comm, summary, constraint, oom_memcg, task_memcg}`` (``summary``: the line)."""
    if text.startswith("oom-kill:"):
        body = text[len("oom-kill:"):]
        pid_at = body.rfind(",pid=")
        task_at = body.rfind("task=", 0, pid_at)
        pid = body[pid_at + 5:].split(",", 1)[0]
        if pid_at < 0 or task_at < 0 or not pid.isdigit():
            return None
        found: dict[str, Any] = {"pid": int(pid), "comm": body[task_at + 5:pid_at], "summary": text}
        for item in body[:task_at].split(","):
            key, _, value = item.partition("=")
            if key in ("constraint", "oom_memcg", "task_memcg"):
                found[key] = value
        return found
    at = text.find("Killed process ")
    if at < 0 or (at > 0 and not (text[:at].endswith(": ") and "out of memory" in text[:at].lower())):
        return None
    pid, _, after = text[at + len("Killed process "):].partition(" ")
    if not pid.isdigit():
        return None
    end = after.find(") total-vm:")
    end = end if end >= 0 else after.rfind(")")
    return {"pid": int(pid), "comm": after[1:end] if after.startswith("(") and end > 0 else "", "line": text}


def kmsg_problem(path: str, exc: OSError) -> str:
    """Why the kernel's log cannot be read, in words, with what reading it needs."""
    why = f"{path}: {os.strerror(exc.errno or 0)}"
    if exc.errno in (1, 13):  # EPERM, EACCES
        try:
            with open("/proc/sys/kernel/dmesg_restrict", "rb") as f:
                restrict = f.read().decode().strip()
        except OSError:
            restrict = "?"
        why += f" (kernel.dmesg_restrict = {restrict}: reading it needs root or CAP_SYSLOG)"
    return why


def cgroup_oom_kills(cgroup: str) -> tuple[int | None, str | None]:
    """``oom_kill`` of the cgroup's ``memory.events`` (how many processes in it or below any OOM
    killer killed), or None and why it cannot be read (the memory controller not enabled there)."""
    path = os.path.join(cgroup, "memory.events")
    try:
        with open(path, "rb") as f:
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None, (f"{path} does not exist: the memory controller is not enabled for that cgroup (it is not "
                      "in cgroup.subtree_control above it, or is bound to a cgroup v1 hierarchy)")
    except OSError as exc:
        return None, f"{path}: {os.strerror(exc.errno or 0)}"
    for line in data.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value), None
    return None, f"{path} has no oom_kill line"


class KernelLog:
    """The kernel's OOM kills from the moment it was opened on: create → drain() ... → report() → close().

    Reads /dev/kmsg without blocking, from its end when opened (``SEEK_END``): each read returns
    one record, EAGAIN when none is left, EPIPE when records were overwritten in the kernel's
    ring buffer before they were read (the next read goes on with the oldest left). Reading needs
    root or CAP_SYSLOG where ``kernel.dmesg_restrict`` is 1: ``error`` then says so."""

    def __init__(self, path: str = KMSG) -> None:
        self.path, self.fd = path, -1
        self.error: str | None = None
        self.overwritten = False
        self.kills: dict[int, dict[str, Any]] = {}  # pid → what the kernel's lines said of it, oldest first
        self.keep: set[int] = set()  # the job's PIDs known so far: their kills are the last to be dropped
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError as exc:
            self.error = kmsg_problem(path, exc)
            self.close()

    def drain(self) -> None:
        """Read every record written since the last drain."""
        for _ in range(KMSG_DRAIN):
            if self.fd < 0:
                return
            try:
                record = os.read(self.fd, KMSG_RECORD)
            except BlockingIOError:
                return
            except BrokenPipeError:
                self.overwritten = True
                continue
            except OSError as exc:
                self.error = kmsg_problem(self.path, exc)
                self.close()
                return
            if not record:
                return
            self.feed(record)

    def feed(self, record: bytes) -> None:
        text = kmsg_text(record)
        found = oom_kill_of(text) if text is not None else None
        if found is None:
            return
        entry = self.kills.pop(found["pid"], {})  # both lines of one kill make one entry, the newest
        entry.update(found)
        self.kills[found["pid"]] = entry
        while len(self.kills) > OOM_KILLS_KEPT:
            others = [pid for pid in self.kills if pid not in self.keep]
            del self.kills[others[0] if others else next(iter(self.kills))]

    def report(self, cgroup: str | None) -> dict[str, Any]:
        """``state.json``'s ``oom``: the OOM kills since it was opened and the cgroup's count."""
        self.drain()
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = INIT_PID_NS
        kills, cgroup_error = (cgroup_oom_kills(cgroup) if cgroup else
                               (None, "no cgroup of its own for this attempt"))
        return {"kmsg": self.path, "kmsg_error": self.error, "overwritten": self.overwritten,
                "kills": list(self.kills.values()), "pid_namespace": pid_ns != INIT_PID_NS,
                "cgroup_events": os.path.join(cgroup, "memory.events") if cgroup else None,
                "cgroup_oom_kills": kills, "cgroup_error": cgroup_error}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Supervisor:
    """Runs one node's torchrun: create → run() → (torchrun exits) → sweep → final state."""

    def __init__(self, folder: str, ready_fd: int = -1, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.env = env  # torchrun's environment (spec.json holds it with secret values masked)
        spec = _read_json(os.path.join(folder, "spec.json"))
        if spec is None:
            raise SystemExit(f"clusterrun supervisor: no spec.json in {folder}")
        self.spec = spec
        self.ready_fd = ready_fd
        self.cgroup: str | None = spec.get("cgroup")
        self.job_cgroup: str | None = os.path.join(self.cgroup, "job") if self.cgroup else None
        me = proc_info(os.getpid())
        self.state = {
            "state": "starting", "job": spec["job"], "node": spec["node"], "attempt": spec["attempt"],
            "boot_id": _boot_id(), "supervisor": {"pid": os.getpid(), "start_time": me.start_time if me else None},
            "torchrun": None, "exit_code": None, "signal": None, "error": None, "stop_requested": False,
            "workers": [], "sessions": [], "started_at": time.time(), "ended_at": None,
            "cgroup": None, "fallbacks": list(spec.get("fallbacks") or []), "degraded": None,
        }
        self.term_requested = False
        self.workers: dict[int, PidHandle] = {}

    def save(self) -> bool:
        """Write the state; on a full or read-only disk keep it in memory and go on supervising
        (stopping needs no disk), and leave a ``degraded`` marker for the agent where one fits."""
        try:
            _write_json_atomic(os.path.join(self.folder, "state.json"), self.state)
            return True
        except OSError as exc:
            self._degrade(f"cannot write state.json: {_fs_problem(exc)}")
            return False

    def _degrade(self, reason: str) -> None:
        if self.state.get("degraded"):
            return
        self.state["degraded"] = reason
        try:
            print(f"clusterrun supervisor: degraded: {reason}", flush=True)
        except OSError:
            pass  # supervisor.log is on the same disk
        try:  # an empty file needs an inode, not a block: it often fits where the state did not
            fd = os.open(os.path.join(self.folder, "degraded"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, reason.encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    def _ready(self) -> None:
        """Tell the agent that started us how the start went (once), whether or not it is on disk."""
        if self.ready_fd >= 0:
            try:
                os.write(self.ready_fd, json_dumps(self.state).encode() + b"\n")
            except OSError:
                pass  # the agent is gone: the state file says it
            os.close(self.ready_fd)
            self.ready_fd = -1

    def _on_term(self, signum: int, frame: object) -> None:
        self.term_requested = True

    def _join_cgroup(self) -> None:
        if self.spec.get("user_scope"):  # started by systemd-run in a scope delegated to the user
            self.cgroup, why = _make_cgroup(self.spec["job"], self.spec["node"], self.spec["attempt"])
            self.job_cgroup = os.path.join(self.cgroup, "job") if self.cgroup else None
            if why:
                self.state["fallbacks"].append(f"no cgroup: {why}")
        if not self.cgroup:
            return
        try:
            cg_write(os.path.join(self.cgroup, "cgroup.procs"), str(os.getpid()).encode())
        except OSError as exc:
            self.state["fallbacks"].append(f"no cgroup: cannot join {self.cgroup}: {os.strerror(exc.errno or 0)}")
            cg_remove(self.cgroup)
            self.cgroup = self.job_cgroup = None
        self.state["cgroup"] = self.cgroup

    def _leave_cgroup(self) -> None:
        """Once nothing of the job is left: move out of the attempt's cgroup and remove it."""
        if not self.cgroup:
            return
        try:
            cg_write(os.path.join(os.path.dirname(self.cgroup), "cgroup.procs"), str(os.getpid()).encode())
        except OSError:
            return  # the stop removes it once the supervisor has exited
        self.state["cgroup_removed"] = cg_remove(self.cgroup)

    def run(self) -> int:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        self._join_cgroup()
        if not _set_subreaper():
            self.state["fallbacks"].append("no subreaper (prctl through ctypes failed): orphans of the job go to "
                                           "init and are found by marker and session only")
        env = dict(self.env) if self.env is not None else {**os.environ, **self.spec["env"]}
        key, _, value = _marker(self.spec["job"], self.spec["node"], self.spec["attempt"]).partition("=")
        env[key] = value
        # torchrun's --log-dir, inside this attempt's private directory (never the log we keep)
        env["PET_LOG_DIR"] = os.path.join(self.folder, "torchrun")
        # Woken by a child's end and by SIGTERM: their handlers write to this pipe (a handler for
        # SIGCHLD, not SIG_IGN, which would reap torchrun before its status is read).
        self.wakeup, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, _ignore)
        self.waker = Waker()
        if self.waker.fd < 0:
            self.state["fallbacks"].append("no inotify: the supervisor polls (20 times a second)")
        try:
            log_fd = os.open(os.path.join(self.folder, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.makedirs(env["PET_LOG_DIR"], mode=0o700, exist_ok=True)  # torchrun accepts it existing
            _write_json_atomic(os.path.join(self.folder, "state.json"), self.state)  # nothing runs yet
        except OSError as exc:
            self.state.update(state="exited", ended_at=time.time(), unwritable=True,
                              error=f"cannot write to the state dir {self.folder}: {_fs_problem(exc)}; nothing was "
                                    "started (free space there or set `state_dir:` for this host)")
            self._leave_cgroup()
            self._ready()
            return 1
        self.rank_logs = RankLogs(env["PET_LOG_DIR"], log_fd, int(self.spec.get("first_rank") or 0), self.waker)
        self.kernel = KernelLog()  # from here on: an OOM kill of the job is among what it reads
        try:
            pid = _spawn_job(self.spec["argv"], env, self.spec.get("cwd") or None, log_fd, self.job_cgroup)
        except OSError as exc:
            self.kernel.close()
            os.close(log_fd)
            self.state.update(state="exited", error="could not start {}: {}".format(self.spec["argv"][0], exc),
                              ended_at=time.time())
            self._leave_cgroup()
            self.save()
            self._ready()
            return 1
        info = proc_info(pid)
        torchrun = PidHandle(pid)
        if self.job_cgroup and _own_cgroup(pid) != _cgroup_path(self.job_cgroup):
            self.state["fallbacks"].append(f"torchrun is not in {self.job_cgroup}: a stop kills the attempt's "
                                           "whole cgroup instead")
            self.job_cgroup = None
        self.state.update(state="running", torchrun={"pid": pid, "start_time": info.start_time if info else None})
        self.state["sessions"] = [pid]
        self.save()
        self._ready()
        status = self._watch(torchrun)
        torchrun.close()
        if os.WIFSIGNALED(status):
            self.state["signal"] = os.WTERMSIG(status)
            self.state["exit_code"] = -os.WTERMSIG(status)
        else:
            self.state["exit_code"] = os.WEXITSTATUS(status)
        self.state["stop_requested"] = self.term_requested or os.path.exists(os.path.join(self.folder, "stop"))
        self.save()
        if self.job_cgroup:  # what torchrun left behind, all of it, at once
            cg_kill(self.job_cgroup, {})
            cg_wait_empty(self.job_cgroup, time.monotonic() + 10)
        scope = JobScope(self.state, exclude={os.getpid()})
        scope.sweep(term_wait=2.0, deadline=time.monotonic() + 20, killed={})
        self._reap_all(timeout=10)
        self.rank_logs.poll(final=True)  # nothing of the job is left to write: the rest, partial lines too
        self.rank_logs.close()
        if self.rank_logs.error:
            self._degrade(self.rank_logs.error)
        os.close(log_fd)
        if self.state["exit_code"] != 0:  # a rank or torchrun may have been OOM-killed: what the kernel said
            self.state["oom"] = self.kernel.report(self.cgroup)
        self.kernel.close()
        self._leave_cgroup()
        self.state.update(state="exited", ended_at=time.time())
        self.save()
        return 0

    def _watch(self, torchrun: PidHandle) -> int:
        """Reap children until torchrun exits; meanwhile merge the rank logs and record workers
        and sessions. Sleeps until something happens (see ``Waker``): a rank file written or
        created, a worker's pidfd, a child's end or SIGTERM (through the signal wake-up pipe)."""
        waker = self.waker
        last_scan = last_merge = 0.0
        busy_until = time.monotonic() + BUSY  # torchrun is about to start its workers
        forwarded = unsaved = False
        while True:
            now = time.monotonic()
            polling = not waker.reliable or any(h.fd < 0 for h in self.workers.values())
            scan_every = SCAN_INTERVAL if polling or now < busy_until else IDLE_SCAN_INTERVAL
            timeout = MERGE_INTERVAL if polling else min(last_scan + scan_every - now, IDLE_CHECK)
            ready = waker.wait(timeout, [h.fd for h in self.workers.values() if h.fd >= 0] + [self.wakeup])
            if self.wakeup in ready:
                _drain(self.wakeup)
            changed = False
            for pid, handle in list(self.workers.items()):
                if handle.fd in ready or (handle.fd < 0 and not handle.alive()):
                    for w in self.state["workers"]:
                        if w["pid"] == pid and w["died"] is None:
                            w["died"] = time.time()
                            changed = True
                    handle.close()
                    del self.workers[pid]
            status = None
            while True:
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == torchrun.pid:
                    status = st
            if self.term_requested and not forwarded:
                forwarded = True
                torchrun.signal(signal.SIGTERM)
            now = time.monotonic()
            if status is None and now - last_scan >= scan_every:
                last_scan = now
                changed |= self._scan(torchrun.pid)
                self.kernel.keep = {torchrun.pid, *(w["pid"] for w in self.state["workers"])}
                self.kernel.drain()  # often enough that the kernel's ring buffer does not overwrite a kill
            if status is None and last_merge + MERGE_INTERVAL > now:  # woken again at once (a flood): batches
                time.sleep(last_merge + MERGE_INTERVAL - now)
            last_merge = time.monotonic()
            if self.rank_logs.poll():
                busy_until = last_merge + BUSY
            if self.rank_logs.error:
                self._degrade(self.rank_logs.error)
            if changed or (unsaved and now - last_scan < 0.1):  # after a failed write: at each scan
                unsaved = not self.save()
            if status is not None:
                for w in self.state["workers"]:
                    if w["died"] is None:
                        w["died"] = time.time()
                return status

    def _scan(self, torchrun_pid: int) -> bool:
        procs = all_procs()
        changed = False
        known = {w["pid"] for w in self.state["workers"]}
        for pid, info in procs.items():
            if info.ppid == torchrun_pid and pid not in known and info.state != "Z":
                env = proc_env(pid)
                if "RANK" not in env:
                    continue
                try:
                    handle = PidHandle(pid)
                except ProcessLookupError:
                    continue
                self.workers[pid] = handle
                self.state["workers"].append({"pid": pid, "rank": int(env.get("RANK", -1)),
                                              "local_rank": int(env.get("LOCAL_RANK", -1)), "died": None})
                changed = True
        sessions = set(self.state["sessions"])
        leaders = self.state.setdefault("session_leaders", {})
        for pid in descendants(os.getpid(), procs):
            sid = procs[pid].sid
            if sid not in sessions:
                sessions.add(sid)
                leader = procs.get(sid)
                leaders[str(sid)] = leader.start_time if leader is not None else None
        if sessions != set(self.state["sessions"]):
            self.state["sessions"] = sorted(sessions)
            changed = True
        return changed

    def _reap_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.05)


def _ignore(signum: int, frame: object) -> None:
    """A signal handler that does nothing: the signal only wakes the wait (``set_wakeup_fd``)."""


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; False where that failed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (ImportError, OSError, AttributeError):  # ImportError: a Python built without ctypes
        return False  # the marker and the recorded sessions still find the job's processes


# ------------------------------------------------------------------------------------------ sync


SYNC_CHUNK = 1 << 20


def _sync_root(req: dict[str, Any]) -> str:
    root = req.get("root")
    if not isinstance(root, str) or not root:
        raise AgentFailure(f"invalid sync root {root!r}")
    return os.path.abspath(os.path.expanduser(root))


def _sync_path(root: str, rel: object) -> str:
    """``root/rel`` for a relative path that stays below ``root`` (never ``..`` or absolute)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\x00" in rel:
        raise AgentFailure(f"invalid sync path {rel!r}")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise AgentFailure(f"invalid sync path {rel!r}")
    return os.path.join(root, *parts)


def _sync_error(exc: OSError, path: str) -> AgentFailure:
    return AgentFailure(f"cannot write {path}: {os.strerror(exc.errno) if exc.errno else exc}")


def op_sync_stat(req: dict[str, Any]) -> dict[str, Any]:
    """What is at each of ``paths`` below ``root``: ``[kind, size, mtime_ns, mode, link target]``
    (kind ``f`` file, ``d`` directory, ``l`` symlink, ``o`` anything else); missing paths are left out."""
    root = _sync_root(req)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return {"ok": True, "root": root, "exists": False, "entries": {}, "rsync": _which("rsync")}
    import stat as _stat  # already loaded by os

    if not _stat.S_ISDIR(st.st_mode):
        raise AgentFailure(f"{root} (workdir) is not a directory")
    entries: dict[str, list[Any]] = {}
    for rel in req.get("paths") or ():
        path = _sync_path(root, rel)
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        mode = info.st_mode
        kind = ("f" if _stat.S_ISREG(mode) else "d" if _stat.S_ISDIR(mode)
                else "l" if _stat.S_ISLNK(mode) else "o")
        entries[rel] = [kind, info.st_size, info.st_mtime_ns, _stat.S_IMODE(mode),
                        os.readlink(path) if kind == "l" else None]
    return {"ok": True, "root": root, "exists": True, "dev": st.st_dev, "ino": st.st_ino,
            "boot_id": _boot_id(), "rsync": _which("rsync"), "entries": entries}


def op_sync_hash(req: dict[str, Any]) -> dict[str, Any]:
    """The sha256 of each regular file of ``paths`` below ``root`` (missing ones left out)."""
    import hashlib

    root = _sync_root(req)
    hashes: dict[str, str] = {}
    for rel in req.get("paths") or ():
        digest = hashlib.sha256()
        try:
            with open(_sync_path(root, rel), "rb") as f:
                block = f.read(SYNC_CHUNK)
                while block:
                    digest.update(block)
                    block = f.read(SYNC_CHUNK)
        except OSError:
            continue
        hashes[rel] = digest.hexdigest()
    return {"ok": True, "hashes": hashes}


def op_sync_put(req: dict[str, Any]) -> dict[str, Any]:
    """Write ``entries`` below ``root``; the contents of the files with ``data`` follow the request
    line on stdin, in order, ``size`` bytes each. Each file goes to a temporary name beside its
    target, then is renamed over it (a reader never sees half a file), with ``mode`` and
    ``mtime_ns`` set; ``d`` makes a directory, ``l`` a symlink, and an entry without ``data`` only
    sets mode and mtime. The data is always read to its end, so that the next request is read
    from the right place, also after a failure (then the first one is the answer)."""
    stdin = sys.stdin.buffer
    entries = req.get("entries") or []
    pending = sum(int(e.get("size") or 0) for e in entries if e.get("kind") == "f" and e.get("data"))
    failure: AgentFailure | None = None
    written = 0
    try:
        root = _sync_root(req)
        try:
            if not os.path.isdir(root):  # a workdir made here gets the source's mode; one that exists keeps its own
                os.makedirs(root)
                if isinstance(req.get("root_mode"), int):
                    os.chmod(root, req["root_mode"])
        except OSError as exc:
            raise _sync_error(exc, root) from None
        for entry in entries:
            path = _sync_path(root, entry.get("path"))
            kind, size, mode = entry.get("kind"), int(entry.get("size") or 0), int(entry.get("mode") or 0o644)
            data = bool(entry.get("data"))
            if failure is not None:  # skip the rest, reading what belongs to it
                if kind == "f" and data:
                    _sync_skip(stdin, size)
                    pending -= size
                continue
            try:
                if kind == "d":
                    _sync_dir(path, mode)
                elif kind == "l":
                    _sync_link(path, str(entry.get("target")))
                elif kind == "f" and data:
                    pending -= size
                    _sync_file(stdin, path, size, mode, int(entry.get("mtime_ns") or 0))
                    written += 1
                elif kind == "f" and entry.get("from"):
                    _sync_install(_sync_path(root, entry.get("from")), path, mode, int(entry.get("mtime_ns") or 0),
                                  size, str(entry.get("sha256") or ""))
                    written += 1
                elif kind == "f":
                    os.chmod(path, mode)
                    os.utime(path, ns=(int(entry["mtime_ns"]), int(entry["mtime_ns"])))
                else:
                    raise AgentFailure(f"invalid sync entry kind {kind!r}")
            except _SyncShort as exc:
                raise AgentFailure(str(exc)) from None
            except OSError as exc:
                named = exc.filename if isinstance(exc.filename, str) else ""  # a symlink's is its target
                inside = named.startswith(root + os.sep) and not named.endswith(".clusterrun-tmp")
                failure = _sync_error(exc, named if inside else path)
            except AgentFailure as exc:
                failure = exc
    finally:
        if pending > 0:
            _sync_skip(stdin, pending)
    if failure is not None:
        raise failure
    return {"ok": True, "written": written}


class _SyncShort(Exception):
    """stdin ended inside a file's data."""


def _sync_skip(stdin: Any, size: int) -> None:
    while size > 0:
        block = stdin.read(min(size, SYNC_CHUNK))
        if not block:
            return
        size -= len(block)


def _sync_dir(path: str, mode: int) -> None:
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, mode)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkdir(path)
    os.chmod(path, mode)  # the agent's umask is 077


def _sync_link(path: str, target: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        raise AgentFailure(f"cannot write {path}: a directory is in the way of a symlink; remove it on the host")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.urandom(6).hex()}.clusterrun-tmp"
    os.symlink(target, tmp)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _sync_install(tmp: str, path: str, mode: int, mtime_ns: int, size: int, sha256: str) -> None:
    """Rename the temporary file ``tmp`` (written over SFTP) to ``path``, with its mode and mtime,
    once its size and sha256 are the source's: paramiko's pipelined SFTP writes can fail unseen."""
    import hashlib

    if not tmp.endswith(".clusterrun-tmp"):
        raise AgentFailure(f"invalid sync temporary file {tmp!r}")
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            raise AgentFailure(f"cannot write {path}: a directory is in the way of a file; remove it on the host")
        digest = hashlib.sha256()
        got = 0
        with open(tmp, "rb") as f:
            while block := f.read(SYNC_CHUNK):
                digest.update(block)
                got += len(block)
        if got != size or digest.hexdigest() != sha256:
            lost = f"only {got} of {size} bytes arrived" if got < size else "its content arrived damaged"
            raise AgentFailure(f"cannot write {path}: {lost} over SFTP (is the disk full, or a quota reached?)")
        os.chmod(tmp, mode)
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.rename(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _sync_file(stdin: Any, path: str, size: int, mode: int, mtime_ns: int) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        _sync_skip(stdin, size)
        raise AgentFailure(f"cannot write {path}: a directory is in the way of a file; remove it on the host")
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.urandom(6).hex()}.clusterrun-tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        _sync_skip(stdin, size)
        raise
    left = size
    try:
        try:
            while left > 0:
                block = stdin.read(min(left, SYNC_CHUNK))
                if not block:
                    raise _SyncShort(f"the data of {path} ended after {size - left} of {size} bytes")
                left -= len(block)
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.rename(tmp, path)
    except BaseException:
        _sync_skip(stdin, left)
        _unlink_quietly(tmp)
        raise

# ---------------------------------------------------------------------------------- doctor

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


def op_inspect(req: dict[str, Any]) -> dict[str, Any]:
    """``inspect``: what the doctor checks beyond the probe (see the module docstring)."""
    began = time.monotonic()
    cwd = os.path.expanduser(req["cwd"]) if req.get("cwd") else os.path.expanduser("~")
    answer: dict[str, Any] = {"ok": True, "time": time.time(), "cwd": cwd, "paths": {},
                              "disk": _disk(_state_root(req.get("state_dir")))}
    for path in req.get("paths") or []:
        answer["paths"][path] = _path_kind(os.path.join(cwd, os.path.expanduser(path)))
    spec = _find_torch()
    if spec is not None and spec.origin:
        try:
            with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
                text = f.read()
            answer["torch_cuda"] = _assigned(text, "cuda")
        except OSError:
            pass
    if req.get("deep"):
        out = _capture([sys.executable, "-c", DEEP_TORCH], timeout=float(req.get("timeout") or 120))
        try:
            answer["deep"] = json_loads(out) if out else {"error": f"{sys.executable} could not import torch"}
        except ValueError:
            answer["deep"] = {"error": f"unreadable output: {(out or '')[:200]!r}"}
    if req.get("gpus"):
        answer["nvidia_smi"] = _which("nvidia-smi")
        if answer["nvidia_smi"]:
            answer["gpu_list"] = _capture(["nvidia-smi", "-L"], timeout=30)
            answer["gpu_apps"] = _capture(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name",
                                           "--format=csv,noheader"], timeout=30)
    problem = logind_problem()
    answer["logind"] = problem
    answer["logind_scope"] = bool(problem) and user_scope("probe", 0, 1) is not None
    answer["elapsed"] = time.monotonic() - began  # the controller's bracket of ``time`` ends this much earlier
    return answer


def _assigned(source: str, name: str) -> str | None:
    """The string assigned to ``name`` in a module's source (``cuda: Optional[str] = '12.4'``), or None."""
    for line in source.splitlines():
        key, equals, value = line.partition("=")
        value = value.strip()
        if equals and key.split(":")[0].strip() == name and value[:1] in ("'", '"'):
            end = value.find(value[0], 1)
            return value[1:end] if end > 1 else None
    return None


def _listener_loop(sock: Any, port: int, token: bytes, done: Any) -> None:
    """Answer every connection with ``token``, then wait for the peer to close first (so that the
    TIME_WAIT is the peer's and the port is free for torchrun at once). Closes the listener and
    releases ``done`` once ``unlisten`` has taken it out of ``_LISTENERS``."""
    try:
        while any(entry[0] is sock for entry in _LISTENERS.values()):
            try:
                conn, _ = sock.accept()
            except OSError:  # a timeout (to see `unlisten`), or its shutdown
                continue
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


def op_listen(req: dict[str, Any]) -> dict[str, Any]:
    """``listen``: open a TCP listener on ``port`` (all addresses; a free one if null) that answers
    ``token`` to whoever connects, until ``unlisten`` or the end of this agent."""
    import _thread
    import socket

    token = str(req.get("token") or "").encode()
    port = req.get("port")
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


def op_unlisten(req: dict[str, Any]) -> dict[str, Any]:
    """``unlisten``: close the listener; the port is free again when this answers."""
    import socket

    entry = _LISTENERS.pop(int(req.get("port") or 0), None)
    if entry is not None:
        sock, done = entry
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes its accept() at once (Linux)
        except OSError:
            pass
        done.acquire(timeout=10.0)
    return {"ok": True}


def op_reach(req: dict[str, Any]) -> dict[str, Any]:
    """``reach``: connect by TCP to ``addr:port`` and read the listener's ``token``; says whether
    it came back, else why not, and the local address the connection went out from."""
    import socket

    addr, port, token = str(req["addr"]), int(req["port"]), str(req.get("token") or "")
    timeout = float(req.get("timeout") or 5.0)  # each step: a dropped SYN must not hang the doctor
    answer: dict[str, Any] = {"ok": True, "reached": False, "error": None, "local": None}
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
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


DOCTOR_OPS = {"inspect": op_inspect, "listen": op_listen, "unlisten": op_unlisten, "reach": op_reach}


# ------------------------------------------------------------------------------------ entry points


def answer(line: bytes) -> dict[str, Any] | None:
    """The answer to one request line, or None for ``follow`` (which streams its own)."""
    try:
        req = json_loads(line)
        op = req.get("op")
        if op == "probe":
            return op_probe(req)
        if op == "start":
            return op_start(req)
        if op == "setup":
            return op_setup(req)
        if op == "follow":
            op_follow(req)
            return None
        if op == "stop":
            return op_stop(req)
        if op == "status":
            return op_status(req)
        if op == "remove":
            return op_remove(req)
        if op == "jobs":
            return op_jobs(req)
        if op in ("sync_stat", "sync_hash", "sync_put"):
            return {"sync_stat": op_sync_stat, "sync_hash": op_sync_hash, "sync_put": op_sync_put}[op](req)
        if op == "route":
            return op_route(req)
        if op in DOCTOR_OPS:
            return DOCTOR_OPS[op](req)
        return {"ok": False, "error": f"unknown op {op!r}"}
    except AgentFailure as exc:
        return {"ok": False, "error": str(exc)}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return {"ok": False, "error": f"bad request: {type(exc).__name__}: {exc}"}
    except BrokenPipeError:
        raise
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def serve() -> int:
    """Answer the requests on stdin, one per line, until it ends (the ``BOOTSTRAP`` path)."""
    os.umask(0o077)
    stdin = sys.stdin.buffer
    try:
        while True:
            line = stdin.readline()
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


if __name__ == "__clusterrun_agent__":
    sys.exit(serve())
elif __name__ == "__clusterrun_supervisor__":
    _supervise_in_scope(sys.argv[1])
