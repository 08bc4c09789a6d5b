"""``clusterrun`` (the console script) and ``python -m clusterrun``: the command, with Ctrl-C at any
moment (also while its modules are imported) an exit 130 with one line, never a traceback; and at
once (``program``): the interpreter's own exit would wait for every thread, and one in a TCP
connect to a host that drops packets ends only at its ConnectTimeout."""

import os
import sys

INTERRUPTED = 130


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
