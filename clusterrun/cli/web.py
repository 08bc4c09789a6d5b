"""``web``: serve every job of this controller as a web page (the optional ``web`` extra)."""

from __future__ import annotations

from types import FrameType

import click

from clusterrun.cli import EXIT_USAGE, _fail, main
from clusterrun.core.errors import ConfigError


@main.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8321, show_default=True, metavar="N",
              help="The port to listen on (0: any free one; the URL printed says which).")
@click.option("--bind", default="127.0.0.1", show_default=True, metavar="ADDRESS",
              help="The address to listen on. Keep the loopback and reach it with `ssh -L` (docs/web.md).")
@click.option("--control", is_flag=True, help="Allow the page to stop and restart jobs (default: read-only).")
def web(port: int, bind: str, control: bool) -> None:
    """Serve every job of this controller as a web page: nodes, attempts, root cause and each node's log, live.

    Prints a URL with a random token: the first visit turns it into a cookie, and every request
    without one is refused, as is a request from another site. Read-only unless --control (stop
    and restart, as `clusterrun down` and `restart` do them). Needs `pip install 'clusterrun[web]'`;
    see docs/web.md (`ssh -L` from a laptop)."""
    try:
        import uvicorn

        from clusterrun.web.app import create_app
        from clusterrun.web.guard import new_token
    except ImportError as exc:  # the extra is not installed: say how to get it
        _fail(ConfigError(f"`clusterrun web` needs the web extra ({exc.name} is missing)",
                          hint="pip install 'clusterrun[web]'"), EXIT_USAGE)
    import socket

    token = new_token()
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind, port))
    except OSError as exc:
        _fail(ConfigError(f"cannot listen on {bind}:{port}: {exc.strerror}", key="--port",
                          hint="choose another port with --port N (0: any free one)"), EXIT_USAGE)
    sock.listen(128)  # connections wait from now on: the URL printed below is good at once
    shown = f"[{bind}]" if ":" in bind else bind
    click.echo(f"clusterrun web: http://{shown}:{sock.getsockname()[1]}/?token={token}"
               + ("  (control: stop and restart allowed)" if control else "  (read-only)"), err=True)
    app = create_app(token, control=control, bound=bind)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            app.end_streams()  # the open event streams end now: uvicorn waits for every connection to close
            super().handle_exit(sig, frame)

    Server(config).run(sockets=[sock])
