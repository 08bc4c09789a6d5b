"""The clusterrun node agent: a stdlib-only package, run on every host (local or over SSH).

How it is run
-------------
This package is stdlib only and written in parts (``codec``, ``records``, ``procs``, ``cgroup``,
``survivor``, ``monitor`` (with ``hangwatch``), ``supervisor`` (starts the survivor), ``stop``, ``orphans``,
``follow``, ``stackops``, ... and ``serve``, the dispatch table; ``wire`` types every request, shared with the
controller). The controller
ships it to a host as one zip, named by its sha256 (``clusterrun/transports/bundle.py``: fixed
timestamps, sorted entries, the package as ``clusterrun_agent``). It never builds a shell
command from job data: it runs the constant command ``PYTHON -S -c BOOTSTRAP`` and writes to
its stdin::

    <length of the loader in bytes, decimal>\n
    <the loader: loader.py's source>
    <sha256 of the zip, hex> <its length in bytes>[ push][ ahead]\n

``BOOTSTRAP`` runs the loader, which looks for the zip in the user's cache (``$XDG_CACHE_HOME``
or ``~/.cache``, then ``clusterrun/``; ``$TMPDIR/clusterrun-<uid>`` where that cannot be made: a
directory 0700 that must belong to the user and be writable by no one else, or the loader
refuses to run with the path and the fix) and answers
``{"agent": "have"}`` or ``{"agent": "need"}``; only after ``need`` does the controller send
the zip's bytes, which the loader verifies (sha256), writes to a temporary name and renames into
place (never replaced in place). With ``push`` the zip follows at once, whatever the cache
holds, and nothing is answered (a one-shot pipe, as in tests). With ``ahead`` the first request
line follows the preamble at once, before any zip (the loader reads it first and answers it after
``have``/``need``): a connection's first answer comes one round trip sooner. A cached zip is verified at every
use: a damaged one is replaced. The first run of a version compiles it, once per interpreter:
``agent-<sha256>-<cache tag>-<its CRC-32>.zip`` holds the bytecode (and the sources, for
tracebacks), and later runs import from that (``zipimport``, first on ``sys.path``). Versions
not used for ``cache.PRUNE_AFTER`` are removed when a new one is installed. Then come the
requests::

    <a JSON request>\n
    <the next JSON request, once the previous one is answered>\n ...

The agent answers them, one per line, until stdin ends or a ``follow`` has streamed to its end:
the controller probes, starts and follows a node with one agent process (one SSH channel, one
interpreter start). Argv and environment therefore travel as data: a fish or tcsh login shell,
quoting or ``AcceptEnv`` cannot change them, and no secret appears on a command line. The agent
answers with JSON lines on stdout; a line with ``raw: N`` is followed by N bytes that are not JSON
(a log's, as written: ``codec.encode``). ``-S`` skips ``site``: the agent needs only the standard
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
           the job at logout). With ``route_to`` (as for ``route``), also ``network``; with
           ``inspect`` or ``listen`` (those requests, as objects), their answers under those keys,
           as if asked alone (a failure is that key's ``{ok: false, error}``): ``up``'s preflight
           in the probe's exchange.
``route``  ``{route_to: {addr, port, peers, always_peers}}`` → ``{ok, network: {netns, master,
           peer, preset}}``: how this host reaches the master ``addr``. ``master`` and ``peer`` are
           ``{target, resolved, source, interface, loopback, error, hosts_line}`` (the kernel's route lookup
           through a connected UDP socket, which sends nothing; ``interface`` holds ``source``;
           ``hosts_line`` the /etc/hosts line that maps a name to a loopback ``resolved``);
           ``peer`` is the first of ``peers`` reached through another interface than loopback,
           looked for when the master is reached through loopback or not at all (or always, with
           ``always_peers``); ``netns`` identifies this network namespace (boot id and inode);
           ``preset`` the ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` set in this environment.
``setup``  ``{job, node, attempt, setup, env, cwd, python, if_cwd}`` → ``{ok, python, skipped}``: runs
           the ``setup`` commands (a list of shell commands) in bash in ``cwd`` with ``env`` on
           top of the agent's environment, each of which must succeed, and keeps the environment
           they leave and their output, in memory, for this agent's ``start`` (and ``inspect``)
           of the same attempt (``{ok: false, error}`` with their last lines of output
           otherwise). With ``python`` (the job's interpreter), ``python`` is how it runs there
           (found on the PATH setup leaves, ``site`` on): ``{executable, python, torch,
           torch_cuda, torchrun_flags}`` or ``{error}``. With ``if_cwd``, nothing runs while
           ``cwd`` is missing (``skipped`` says so). The controller asks every host before it starts any.
``start``  ``{job, node, attempt, state_dir, argv, env, cwd, first_rank, secret_env, setup}`` →
           ``{ok, dir, state, setup_log}``: torchrun's environment is what ``setup`` left (run now if
           this agent has not run it; its output opens ``output.log``, and comes back as
           ``setup_log`` up to 1 MiB: the controller shows it before the start), else the agent's with ``env``
           on top; the values of the names in ``secret_env`` reach the supervisor in memory
           only and ``spec.json`` holds ``****``.
           creates the attempt directory and the attempt's cgroup, starts the detached supervisor
           and returns once it has started torchrun (or failed to: ``{ok: false, error}``; a state
           dir that cannot be written, or a logind that would kill the job at logout, starts
           nothing). The supervisor tells it how the start went through a pipe, not the disk.
           With ``unlisten`` (a port), this agent's ``listen``er there is closed first (node 0's
           preflight listener on the master port, which torchrun binds).
``follow`` ``{job, node, attempt, state_dir, offset | tail, logs, once, interval, asks}`` → a stream of lines:
           ``{t: "log", offset, next, times, raw}`` and ``raw`` bytes of the log after its newline,
           as written (complete lines only; ``next`` is the byte offset to resume from; ``times``: the entries of
           ``output.times`` that cover them, ``[[offset, ns], ...]``), ``{t: "state", state}``
           whenever the state file changes (``stop_requested: true`` once a stop's ``stop`` file is
           there: the ranks it kills did not fail), ``{t: "beat"}`` after ``HEARTBEAT`` seconds without
           anything else, and finally ``{t: "end", state}`` after a last read that includes a
           partial last line. Resuming from ``next`` loses and repeats nothing. ``tail: N`` starts
           at the last N complete lines instead of ``offset``; ``before: N`` with ``offset`` starts
           at the last N complete lines before ``offset`` (a viewer's scrollback: the ``offset``
           of the first ``log`` message is then before the one asked for); ``interval``: the least
           time in seconds between two reads of the log, so between two ``log`` messages (the
           controller's share of its message budget; the first lines after a pause go at once);
           ``logs: false`` sends no log data
           (states only); ``once: true`` ends with ``{t: "eof", next, state}`` at the end of what
           is written so far if the job still runs. ``asks: true`` (the job owner's follower): a
           ``stop`` request may come on stdin while it streams; it is answered in the stream as
           ``{t: "answer", answer}``, before the state it leads to; after its ``end`` the agent
           answers further requests on stdin as any agent does (the owner's next attempt probes
           and starts the node on it), until stdin ends. ``state.state`` is ``lost`` when neither the
           survivor, the monitor nor torchrun runs any more (host rebooted, processes killed, pid
           reused; ``rebooted: true`` when the host's boot id changed). ``follow``, ``status`` and
           ``stop`` start a monitor for an unfinished attempt that has none (``ensure_monitor``):
           it copies the lines left and writes the final state.
``stop``   ``{job, node, attempt, state_dir, grace, by, failing, failed}`` → ``{ok, killed: [...], left: [...], state,
           containment, verified, detail, fallbacks, degraded, notes, grace, at_once}``: the stop described below,
           of that attempt only; idempotent. An attempt not ended yet first gets a line in its
           ``output.log``, ``---- stopped by <by> at 11:37:58Z ----`` (``by`` null: ``clusterrun``),
           before torchrun is signalled: its shutdown output, which reads like a crash, follows it.
           ``killed`` entries are ``{pid, name, state, signal}``
           (the last signal sent: torchrun's is ``SIGKILL`` when it outlived the ``grace``, in seconds,
           that the answer repeats). ``containment`` is ``cgroup`` (``verified``: the
           attempt's cgroup was empty, then removed), ``sweep`` (``verified`` false: ``left: []``
           means only that no process the sweep can see is left) or ``reboot``; ``notes`` say what
           could not be recorded on disk. Without the attempt's directory (never started, or
           deleted) the stop looks all the same (``orphans``): ``records_gone: true``, ``looked``
           (where, in words) and ``found_by`` (the cgroups named after the attempt, the marker
           scan); what they found is stopped, torchrun first, and verified by the cgroup if any.
``status`` ``{job, node, attempt, state_dir}`` → ``{ok, state, alive, log_size, containment,
           fallbacks, degraded}`` (``lost`` as for ``follow``; ``alive``: ``survivor``, ``supervisor``
           (the monitor), ``torchrun``). For ``status`` and ``stop``, a node never started (no
           attempt directory, and nothing of it found) is ``{state: {state: "absent"}}``, not an
           error; without its directory while its processes run, ``status`` says ``lost`` with
           ``records_gone``, ``found_by`` and an ``error`` naming the fix.
``stack``  ``{job, node, attempt, state_dir, ranks, native, timeout, looks, apart}`` → ``{ok, state, tool,
           error, fix, ranks: [{rank, local_rank, pid, threads: [{name, active, frames: [{name, file, line,
           lib}]}], error, fix, moved, cpu, runnable, state}]}`` (``stackops``): ``py-spy dump --json``
           (``--native`` with ``native``) of each live worker of the attempt (``ranks``: only these
           global ranks), all at once, each within ``timeout`` seconds; frames innermost first
           (``lib``: the file is the standard library's or an installed package's). A worker is
           looked at only while it carries the attempt's marker. ``state`` is the node's (no ranks
           unless ``starting`` or ``running``); ``error``/``fix`` without ranks: py-spy is not on
           this host (looked for beside the job's interpreter, on a rank's PATH, the agent's,
           ``~/.local/bin``) and the command that installs it; a rank's ``error``/``fix``: why it
           could not be looked at (a ptrace the kernel refused: the process's owner,
           ``kernel.yama.ptrace_scope``, no ``CAP_SYS_PTRACE``; py-spy's timeout; the process
           gone). ``looks`` 2 (the job's owner, when the job hangs): every worker twice, ``apart``
           seconds apart, and the last look with ``moved`` (its main thread's stack differs between the looks),
           ``cpu`` (the share of one core it used between them), ``runnable`` (the share of that
           time its main thread ran or waited for a core: ``/proc/PID/schedstat``) and ``state``
           (its process's: ``R``, ``S``, ``D``); the ranks are then there without py-spy too,
           with their CPU, beside the answer's ``error``.
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
``sync_put`` ``{root, root_mode, entries: [{path, kind, mode, size, mtime_ns, data, target}]}``
           followed on stdin by the bytes of every entry with ``data`` (``size`` each, in order)
           → ``{ok, written}``: directories, symlinks and files (written to a temporary name, then
           renamed; mode and mtime set). The data is read to its end even after a failure, whose
           answer names the path (``cannot write PATH: No space left on device``).
           ``clusterrun/sync/copy.py`` is the controller's side.

``inspect`` ``{cwd, paths, state_dir, deep, gpus, imports, pythonpath, job, node, attempt}`` →
           ``{ok, cwd, paths, disk, torch_cuda, deep, imports, nvidia_smi, gpu_list, gpu_apps,
           logind, logind_scope, time, elapsed}`` (for
           ``clusterrun doctor``): with ``imports`` (a script there), ``imports`` is ``{missing: [modules]}``
           or ``{error}``: its top-level imports the interpreter cannot find (``FIND_IMPORTS``, never run);
           ``paths`` maps each path (relative to ``cwd``, default the home directory) to ``file``,
           ``dir``, ``missing`` or ``other``; ``disk`` the free space of the state dir's file system;
           ``torch_cuda`` the CUDA version torch was built for (its version.py, no import); with
           ``deep``, ``deep`` is what the interpreter says after importing torch (``version``,
           ``cuda``, ``nccl``, ``devices``, or ``error``); with ``gpus``, ``nvidia-smi -L`` and
           its compute apps (null where it is missing); ``logind`` is ``logind_problem()``;
           ``time`` the host's clock when the request came, ``elapsed`` the seconds it took.
           "The interpreter" is the agent's own, or, with ``job`` (a ``setup`` of that job, node
           and attempt ran in this agent), the job's in the environment that setup made.
``listen`` ``{port | null, token}`` → ``{ok, port, listening, error}``: a TCP listener on every
           address that answers ``token`` to each connection, until ``unlisten {port}`` or the
           agent's end (``listening`` false and the reason when the port is taken).
``reach``  ``{addr, port, token, timeout}`` → ``{ok, reached, error, local}``: a TCP connection
           to a ``listen``er (on node 0); ``reached`` only if the token came back. ``timeout``
           bounds the connection and each read: packets dropped on the way time out, never hang.
``gpus``   ``{timeout}`` → ``{ok, found, gpus: [{index, util, mem_used, mem_total}], problem}``:
           ``nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total`` (percent,
           MiB; null for ``[N/A]``), killed after ``timeout`` s. ``found`` false: no nvidia-smi on
           PATH; ``problem``: why there are no readings though it is there (its status, or what it
           printed instead): an answer, not an error. Polled by the dashboard, asked by ``ps JOB``.

``run``    ``{argv, env, cwd, setup, setup_timeout}`` → a stream of ``{t: "out", data}`` (stdout and
           stderr as they come, decoded as UTF-8 with surrogateescape), ``{t: "beat"}`` after
           ``HEARTBEAT`` seconds of silence and ``{t: "end", status}`` (``runops``; ``clusterrun
           exec --job-env``): ``argv`` run as ``start`` would run torchrun, in ``cwd`` with ``env``
           after ``setup`` (its output not sent), stdin at its end; not found on that PATH, it is
           ``NAME: command not found`` with status 127. Its process group is killed when stdin ends.

Errors are ``{ok: false, error: "..."}``; the exit code is 0 whenever an answer was written. A
request whose field is missing or of the wrong type (``wire``) is ``bad request: ...`` naming it.

State on the host
-----------------
``<state_dir>/jobs/<job>/node<node>/attempt<attempt>/`` (directories 0700, files 0600, created
under umask 077 so they are never readable by others, not even briefly):

``spec.json``       the request: argv, env (secret values as ``****``), cwd, setup, first_rank, about,
                    hang_after, progress
                    (written once, before the supervisor starts)
``output.log``      the output of the node's ``setup`` first, each line tagged ``[setup]:``; then
                    torchrun's stdout and stderr, appended (O_APPEND) and never truncated, and
                    every worker's lines, whole and tagged ``[rankN]:`` (see ``RankLogs``); a
                    stop's mark line (``---- stopped by ... ----``), appended by ``stop``
``torchrun/``       torchrun's own ``--log-dir`` (per-rank files it truncates; read by ``RankLogs``)
``state.json``      written by the survivor until the monitor starts, then by the monitor only,
                    atomically (temp file, fsync, rename), and by a stop that outlived them:
                    ``state`` (starting → running → exited), ``survivor`` ``{pid, start_time,
                    sid}``, ``exit_status`` (``unknown``: torchrun ended after its survivor,
                    which alone could reap it; ``exit_code`` is then null and ``error`` says so,
                    unless its ranks' ends tell it: ``exit_learned`` then says how, see
                    ``monitor.learned_exit``; or a ``failed`` stop cut torchrun's teardown short
                    after a rank of it had failed: ``monitor.failed_first``; ``failed_rank`` then
                    names the rank that failed first, its exit code possibly unread),
                    ``cgroup`` (the attempt's cgroup once the supervisor is in it, else null),
                    ``fallbacks`` (what the host lacked, in words), ``degraded`` (why the
                    supervisor could not write something), ``supervisor`` (the monitor) and ``torchrun``
                    ``{pid, start_time}`` (start time in clock ticks since boot), ``boot_id``,
                    ``exit_code`` / ``signal`` of torchrun, ``error`` (could not start),
                    ``stop_requested`` and ``stopped_by`` (who, in words: ``down``, ``fail-fast
                    after node 1 failed``), ``stop_at`` (the ``stop`` file's time),
                    ``workers`` ``[{rank, local_rank, pid, died, exit_code}]``
                    (``died``: wall-clock time the worker process ended, to find the first failure;
                    ``exit_code``: as read while it was a zombie, before torchrun reaped it),
                    ``sessions`` (session ids seen among the job's processes),
                    ``session_leaders`` (sid → start time of its leader when first seen),
                    ``quiet_since`` (wall-clock time since which the node's ranks wrote nothing,
                    once that lasted ``hang_after``; null again when one writes or none is alive;
                    see ``QuietWatch``: whether the job hangs is its owner's decision),
                    ``progress`` (on the node of rank 0: the training's progress read from rank 0's
                    output, ``{step, total, per_second, eta_seconds, metrics, updated}``; see
                    ``progress.Tracker``; saved at most every ``PROGRESS_EVERY`` seconds),
                    ``rdzv_joined`` (until there are workers: whether torchrun holds a connection
                    to the master port, i.e. joined the rendezvous) and,
                    when torchrun exited non-zero, ``oom``: what the kernel said of OOM kills
                    during the attempt (see ``KernelLog``): ``kills`` ``[{pid, comm, line, summary,
                    constraint, oom_memcg, task_memcg}]`` from /dev/kmsg (PIDs of any process:
                    the controller matches them to the job's), ``kmsg_error`` (why it could not be
                    read), ``overwritten``, ``pid_namespace`` (the job's PIDs are not the
                    kernel's), ``cgroup_oom_kills`` (``oom_kill`` of the attempt's cgroup's
                    ``memory.events``), ``cgroup_events`` and ``cgroup_error``
``spec.json`` also holds ``cgroup`` (made for the attempt), ``user_scope`` and ``fallbacks``
``stop``            written by the first stop request, kept by later ones: a line with ``failed`` for a
                    ``failed`` stop (else empty), then who stopped it (the request's ``by``); its
                    mtime is ``stop_at`` in the state: when a stop first reached the node
                    (``monitor.read_stop``)
``exit``            written by the survivor once it reaped torchrun, atomically (temp + rename),
                    before anything else: ``{exit_code, signal, pid}`` (see ``read_exit``)
``ranklogs.json``   the monitor's journal of ``RankLogs``: each per-rank file's offset passed
                    on, the last batch's ranges and the log's size before it (see
                    ``resume_offsets``), rewritten in place before each batch (JSON, padded
                    with spaces over a longer record before it; no fsync)
``output.times``    when output.log's bytes were written: a line ``<offset> <ns>`` (wall clock) per
                    batch of lines, the bytes from ``offset`` to the next line's (``RankLogs.note_time``)
``monitor.lock``    flock'ed by the one monitor at work; another waits on it, then takes over
``degraded``        present once the supervisor could not write its state or log (a full or
                    read-only disk, a quota): the reason, if even that could be written. The
                    supervisor goes on supervising with its state in memory and writes it again
                    when it can; ``status``, ``follow`` and ``stop`` report ``degraded``.
``supervisor.log``  the survivor's and the monitors' own diagnostics

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
a new interpreter that imports this package from its cached zip and reads the job's environment
from stdin) when their user manager runs and lingers, and makes the attempt's cgroup in that
scope; otherwise the start is refused.

The survivor and the monitor
----------------------------
Podman's conmon is the model: the part that must outlive everything is small and only waits.
The **survivor** (``survivor.Survivor``) is forked by ``start`` from the agent (twice, so that
it is nobody's child but init's or a subreaper's; no second interpreter start), in its own
session with stdin from /dev/null, stdout and stderr to ``supervisor.log``, every other
descriptor closed (the SSH channel included), no terminal and SIGHUP ignored, so it survives the
controller and the SSH connection. It makes itself a child subreaper (orphaned descendants are
re-parented to it, not to init), sets ``CLUSTERRUN_JOB=<job>.<node>.<attempt>`` in the job's
environment, runs torchrun with its output appended to ``output.log`` and forks the monitor;
then it only waits (SIGCHLD and SIGTERM through a wake-up pipe) and reaps: torchrun's status
goes to the ``exit`` file at once; a monitor that died is forked again (``RESPAWNS`` at most);
once torchrun has exited and a monitor has finished, it leaves and removes the attempt's cgroup.

The **monitor** (``monitor.Monitor``; state.json's ``supervisor``) does the rest, in the
survivor's session: it merges the rank logs (``RankLogs``, resuming from its journal), records
the worker processes and when each one ended, and the sessions; once torchrun has ended (its
pidfd) it reads the exit file (waiting while the survivor lives), kills what is left of the job
(its ``job`` cgroup, then the sweep below), copies the last lines and writes the final state.
It may be SIGKILLed at any moment: the survivor, or the next agent's ``status``, ``follow`` or
``stop``, starts another, which takes the lock and resumes: no line lost, none written twice,
and the final state is torchrun's real exit. If the survivor is killed, the monitor goes on;
torchrun's status is then unknown (``exit_status``), which the controller reports as such.
Both sleep until something happens (inotify on torchrun's per-rank files, pidfds of the workers
and torchrun; see ``Waker``), as ``follow`` does (inotify on the attempt directory, pidfds of
the survivor, the monitor and torchrun): a quiet job costs no CPU on the host. Where inotify is
missing they poll. From just before torchrun starts the survivor holds the kernel's log open
(/dev/kmsg from its end; the monitor reads it at each scan: ``KernelLog``; a monitor started by
an agent opens it anew) for OOM kills; when torchrun exits non-zero, those and the attempt's
cgroup's ``memory.events`` become the state's ``oom`` (the controller matches them to the root
cause's PID).

The verified stop
-----------------
A stop names one attempt and touches nothing of another. SIGTERM to torchrun first (it stops its
workers; killing workers first makes it restart them), up to ``grace`` seconds for it to exit
(``failing``, an attempt that fails anyway, with a cgroup: SIGKILL to torchrun at once, no grace,
and its end waited for with its workers', after the cgroup's kill; ``at_once`` in the answer;
``failed`` too, the node whose rank failed first: its ``stop`` file says ``failed`` and its final
state is that failure, exit code 1 as torchrun's, not stopped);
then, with a cgroup, ``cgroup.kill`` of its ``job`` cgroup (Linux >= 5.14; else freeze it and
SIGKILL every process in ``cgroup.procs``), the monitor's and the survivor's exit (it removes the cgroup), and
the same for the whole attempt cgroup if it is still there; verified: ``cgroup.events`` says
``populated 0``, or the cgroup is gone (a cgroup can only be removed once empty). With or
without a cgroup, a sweep of everything left of this attempt: the survivor's descendants ∪
processes carrying the attempt's marker ∪ processes in the attempt's recorded sessions. Every
process is identified again *after* a pidfd was opened for it and is signalled through that
pidfd, so a reused pid is never signalled. SIGTERM, a short wait, SIGKILL, re-scan until nothing
is left. The sweep cannot see a process that left the job's tree (no subreaper, or the
survivor was killed), its sessions and its environment (``setsid`` + ``env -i``): only the
cgroup verifies. The answer lists what was killed and what could not be (e.g. a process in
uninterruptible sleep). Nothing is ever matched by command line.
"""

PROTOCOL = 2  # protocol.PROTOCOL on the controller: bump both for any change the other side would misread

# Constant: no job data in it; no single quotes, backslashes, "!" or "$", so that once quoted for
# the remote shell (sh, bash, zsh, fish or tcsh) it reaches Python unchanged. It runs the loader,
# with the current directory (the user's home, where sshd starts it) out of sys.path: a zlib.py or
# select.py of the user's there would be imported in place of the standard library's.
BOOTSTRAP = (
    "import sys;sys.path=[p for p in sys.path if p];b=sys.stdin.buffer;n=int(b.readline());s=b.read(n);"
    'exec(compile(s,"clusterrun-loader","exec"),{"__name__":"__clusterrun_loader__"})'
)
