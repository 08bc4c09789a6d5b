"""Who may use the server: the holder of its token, from its own origin, one of a bounded number at a time.

An ASGI middleware in front of every route (pages, assets, event streams, the stop):

- the URL printed at start carries a random token; a request that carries it (``?token=``) gets it
  back as an HttpOnly, SameSite=Strict cookie and is redirected to the same address without it (so
  the token leaves the address bar and the history); any other request without the cookie is 401;
- a request whose ``Origin`` is present and is not the page's own (``http://`` + its ``Host``) is 403,
  and so is a ``Host`` that is not the loopback or the address the server was bound to (a DNS
  rebinding page would name its own host there);
- so is a request a browser says another site's page made (``Sec-Fetch-Site``: a ``no-cors`` GET
  carries no ``Origin``), but for following a link (a top-level GET, which the cookie's
  ``SameSite=Strict`` already covers: such a page cannot read the answer);
- a ``POST`` must also say where it comes from (``Origin``, which browsers send with every POST);
- every answer forbids framing, sniffing, referrers and caching, and allows only the server's own
  scripts and styles (``Content-Security-Policy``).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "clusterrun_web"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                 b"connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


def new_token() -> str:
    return secrets.token_urlsafe(24)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def host_name(host: str) -> str:
    """``[::1]:8000`` → ``::1``; ``localhost:9000`` → ``localhost``."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """The middleware (see the module docstring); ``bound``: the address the server listens on."""

    def __init__(self, app: App, token: str, bound: str = "127.0.0.1") -> None:
        self.app = app
        self.token = token
        self.hosts = {*LOOPBACK, bound}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host", "")
        origin = headers.get("origin")
        if host_name(host) not in self.hosts:
            await _plain(send, 403, "this server answers only at its own address (the URL it printed)")
            return
        if origin is not None and origin != f"http://{host}":
            await _plain(send, 403, "refused: a request from another site")
            return
        fetched = headers.get("sec-fetch-site")  # a browser's word on who asks: no Origin on a no-cors GET
        if fetched in ("same-site", "cross-site") and not (
                headers.get("sec-fetch-mode") == "navigate" and scope.get("method") == "GET"):
            await _plain(send, 403, "refused: a request from another site")
            return
        if scope.get("method") == "POST" and origin is None:
            await _plain(send, 403, "refused: a POST must say where it comes from (Origin)")
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if secrets.compare_digest(query.get("token", ""), self.token) and scope.get("method") in ("GET", "HEAD"):
            rest = urlencode([(k, v) for k, v in query.items() if k != "token"])
            path = "/" + str(scope.get("path", "/")).lstrip("/")  # never "//host": that is another site
            await _redirect(send, path + (f"?{rest}" if rest else ""), self.token)
            return
        cookie = SimpleCookie(headers.get("cookie", ""))
        held = cookie[COOKIE].value if COOKIE in cookie else ""
        if not (secrets.compare_digest(held, self.token) or secrets.compare_digest(query.get("token", ""),
                                                                                      self.token)):
            await _plain(send, 401, "open the URL that `clusterrun web` printed (it carries the token)")
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        await self.app(scope, receive, secured)


async def _plain(send: Send, status: int, text: str) -> None:
    body = f"{status}: {text}\n".encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *HEADERS]})
    await send({"type": "http.response.body", "body": body})


async def _redirect(send: Send, location: str, token: str) -> None:
    cookie = f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode()),
                            (b"content-length", b"0"), *HEADERS]})
    await send({"type": "http.response.body", "body": b""})
