"""The web server's guard on its own (an ASGI middleware, no server): token, cookie, origin, host; the cap on
live viewers; the command without its extra."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clusterrun.store.jobs import JobStore
from clusterrun.web.guard import COOKIE, Guard, host_name
from tests.conftest import ROOT

TOKEN = "t0ken-Abc_123"


def call(method: str = "GET", path: str = "/", query: str = "", app: Any = None,
         **headers: str) -> tuple[int, dict[str, str], bool]:
    """Run one request through the guard (in front of ``app``, which answers 200 unless given): its status,
    its headers, and whether the app behind it ran."""
    ran: list[bool] = []

    async def ok(scope: Any, receive: Any, send: Any) -> None:
        ran.append(True)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": path, "query_string": query.encode(),
             "headers": [(k.replace("_", "-").lower().encode(), v.encode())
                         for k, v in {"host": "127.0.0.1:8321", **headers}.items()]}
    asyncio.run((app or Guard(ok, TOKEN))(scope, receive, send))
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, bool(ran)


def test_without_the_token_or_its_cookie_every_request_is_401() -> None:
    for path in ("/", "/jobs/x", "/static/htmx.min.js", "/jobs/x/stream"):
        status, _, ran = call(path=path)
        assert (status, ran) == (401, False), path
    assert call(cookie=f"{COOKIE}=wrong")[0] == 401
    assert call(query="token=wrong")[0] == 401


def test_the_token_becomes_an_httponly_strict_cookie_and_leaves_the_address() -> None:
    status, headers, ran = call(path="/jobs/j1", query=f"node=1&token={TOKEN}")
    assert (status, ran) == (303, False)
    assert headers["location"] == "/jobs/j1?node=1"
    assert headers["set-cookie"] == f"{COOKIE}={TOKEN}; HttpOnly; SameSite=Strict; Path=/"
    # never a redirect to another site: "//host" would be one
    assert call(path="//evil.example/x", query=f"token={TOKEN}")[1]["location"] == "/evil.example/x"


def test_the_cookie_lets_a_request_through_with_the_pages_policy() -> None:
    status, headers, ran = call(cookie=f"other=1; {COOKIE}={TOKEN}")
    assert (status, ran) == (200, True)
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["referrer-policy"] == "no-referrer"


def test_another_origin_is_403_even_with_the_cookie_and_a_post_must_name_its_origin() -> None:
    cookie = f"{COOKIE}={TOKEN}"
    assert call(cookie=cookie, origin="http://127.0.0.1:9999")[:3:2] == (403, False)
    assert call(cookie=cookie, origin="http://evil.example")[0] == 403
    assert call(cookie=cookie, origin="null")[0] == 403
    assert call(cookie=cookie, origin="http://127.0.0.1:8321")[0] == 200
    assert call("POST", "/jobs/x/stop", cookie=cookie)[:3:2] == (403, False)
    assert call("POST", "/jobs/x/stop", cookie=cookie, origin="http://127.0.0.1:8321")[0] == 200
    # a no-cors GET of another site's page carries no Origin: the browser's Sec-Fetch-Site says it
    for site in ("same-site", "cross-site"):
        assert call(cookie=cookie, sec_fetch_site=site, sec_fetch_mode="no-cors")[:3:2] == (403, False)
        assert call(cookie=cookie, sec_fetch_site=site, sec_fetch_mode="navigate")[0] == 200  # a link followed
    assert call(cookie=cookie, sec_fetch_site="same-origin", sec_fetch_mode="cors")[0] == 200


def test_a_host_other_than_the_loopback_is_refused_as_a_dns_rebinding_page_would_send() -> None:
    cookie = f"{COOKIE}={TOKEN}"
    assert call(cookie=cookie, host="evil.example:8321", origin="http://evil.example:8321")[0] == 403
    for host in ("localhost:9000", "[::1]:8321", "127.0.0.1"):  # ssh -L may forward from another port
        assert call(cookie=cookie, host=host)[0] == 200, host
    assert host_name("[::1]:80") == "::1" and host_name("localhost:9000") == "localhost"


def test_web_without_the_extra_says_how_to_get_it() -> None:
    code = ("import sys; sys.modules['uvicorn'] = None; sys.argv[0] = 'clusterrun'\n"
            "from clusterrun.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", code, "web", "--port", "0"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "`clusterrun web` needs the web extra (uvicorn is missing)" in done.stderr
    assert "pip install 'clusterrun[web]'" in done.stderr


def test_a_live_stream_past_the_cap_of_viewers_is_503(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from clusterrun.web import app as web

    guarded = web.create_app(TOKEN, store=JobStore(tmp_path))
    monkeypatch.setattr(web, "MAX_VIEWERS", 0)
    assert call(path="/jobs/j1/stream", app=guarded, cookie=f"{COOKIE}={TOKEN}")[0] == 503
    monkeypatch.setattr(web, "MAX_VIEWERS", 1)  # under the cap: on to the job, which this store has not
    assert call(path="/jobs/j1/stream", app=guarded, cookie=f"{COOKIE}={TOKEN}")[0] == 404


@pytest.fixture
def quick_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The streams look at the store every 50 ms, not every second: a test of a change waits for the look after it."""
    from clusterrun.web import watch

    monkeypatch.setattr(watch, "EVERY", 0.05)


async def _events(app: Any, seen: str, then: Any, wanted: bytes, path: str = "/events") -> bytes:
    """A stream (the job list's ``/events?seen=...`` or a job's) until it has sent ``wanted``; ``then()`` once it
    started."""
    body = b""
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal body
        if message["type"] == "http.response.body":
            if not body:
                then()
            body += message.get("body", b"")
            if wanted in body:
                done.set()

    scope = {"type": "http", "method": "GET", "path": path, "query_string": f"seen={seen}".encode(),
             "headers": [(b"host", b"127.0.0.1:8321"), (b"cookie", f"{COOKIE}={TOKEN}".encode())]}
    await asyncio.wait_for(app(scope, receive, send), 30)
    return body


@pytest.mark.usefixtures("quick_looks")
def test_the_job_list_s_stream_says_what_changed_and_what_changed_before_it_started(tmp_path: Path) -> None:
    from clusterrun.web import app as web
    from clusterrun.web.watch import signature, version

    def new_job(name: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.json").write_text("{}")

    new_job("j-1")
    guarded = web.create_app(TOKEN, store=JobStore(tmp_path))
    # the page read the list before j-1 was made: its stream tells it at once
    assert b"event: changed\ndata: \n\n" in asyncio.run(_events(guarded, "before", lambda: None, b"event: changed"))
    # a page that read it after: nothing until the next change, which is named
    body = asyncio.run(_events(guarded, version(signature(JobStore(tmp_path))), lambda: new_job("j-2"), b"data: j-2\n"))
    assert body.count(b"event: changed") == 1, body


@pytest.mark.usefixtures("quick_looks")
def test_a_job_s_stream_says_at_once_what_changed_since_its_page_was_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page is read, then the job changes (a new attempt's node starts running), then the page's stream
    starts: the stream tells the page at once, as the page names the record it showed."""
    from clusterrun.core.events import NodeState
    from clusterrun.web import app as web
    from clusterrun.web import jobs
    from tests.test_joblist import make_record

    class NoLogs:  # the stream's log feed: no host to follow here
        def snapshot(self) -> tuple[dict[int, list[Any]], dict[int, Any]]:
            return {0: []}, {}

    class Feeds:
        def __init__(self, loop: Any) -> None: ...
        def join(self, *args: Any) -> NoLogs: return NoLogs()
        def leave(self, *args: Any) -> None: ...

    monkeypatch.setattr(web, "Feeds", Feeds)
    store = JobStore(tmp_path)
    record = make_record("train-20261129-010000-ab12", "running", None)
    record.nodes[0].state = NodeState.STARTING
    store.create(record)
    shown = jobs.marks_digest(record)  # what the page showed
    record.nodes[0].state = NodeState.RUNNING
    store._write(record)
    guarded = web.create_app(TOKEN, store=store)
    path = f"/jobs/{record.job_id}/stream"
    body = asyncio.run(_events(guarded, shown, lambda: None, b"event: changed", path=path))
    assert b"event: changed\ndata: record" in body, body
    # a page that showed the record as it is: nothing until the next change
    now = jobs.marks_digest(record)
    record.nodes[0].state = NodeState.SUCCEEDED
    body = asyncio.run(_events(guarded, now, lambda: store._write(record), b"event: changed", path=path))
    assert body.count(b"event: changed") == 1, body
