"""``clusterrun`` (the console script) and ``python -m clusterrun``: the command, with Ctrl-C at any
moment (also while its modules are imported) an exit 130 with one line, never a traceback."""

import sys


def run() -> None:
    try:
        from clusterrun.cli import main

        main()
    except KeyboardInterrupt:
        sys.stderr.write("clusterrun: interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    run()
