"""``clusterrun`` (the console script) and ``python -m clusterrun``: the command, with Ctrl-C at any
moment (also while its modules are imported) an exit 130 with one line, never a traceback; and at
once (``program``): the interpreter's own exit would wait for every thread, and one in a TCP
connect to a host that drops packets ends only at its ConnectTimeout."""

import os
import sys
import threading

INTERRUPTED = 130
AGAIN_AFTER = 0.05  # s: far longer than the rest of a callback and of the hook, too short to feel
_UNRAISABLE = sys.unraisablehook


def _interrupt_again(unraisable: "sys.UnraisableHookArgs") -> None:
    """A Ctrl-C whose KeyboardInterrupt was raised inside a callback that Python runs from C (a
    weakref's, a ``__del__``; importlib's module locks have one) is printed and dropped there: the
    main thread is sent SIGINT again, from a thread, after that callback and this hook have returned
    (a signal handled inside either would be dropped the same way)."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        again = threading.Timer(AGAIN_AFTER, _sigint_main)
        again.daemon = True
        again.start()
        return
    _UNRAISABLE(unraisable)


def _sigint_main() -> None:
    import signal  # a real signal: it also ends a wait the main thread is blocked in

    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def run() -> None:
    try:
        from clusterrun.cli import main

        main()
    except KeyboardInterrupt:
        sys.stderr.write("clusterrun: interrupted\n")
        sys.exit(INTERRUPTED)


def program() -> None:
    """``run()`` as the program: after Ctrl-C (the command's finally blocks have run), it leaves
    without waiting for the threads still talking to hosts."""
    sys.unraisablehook = _interrupt_again
    try:
        run()
    except SystemExit as exc:
        if exc.code != INTERRUPTED:
            raise
    else:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(INTERRUPTED)


if __name__ == "__main__":
    program()
