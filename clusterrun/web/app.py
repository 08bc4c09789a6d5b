"""The web server's routes: the job list, a job's page, its live log stream, and (``--control``) stop and restart.

Pages are Jinja templates made live with htmx (vendored in ``static/``: no asset from another
site); a job's page holds one server-sent event stream (``/jobs/ID/stream``) that carries its new
log lines, ``changed`` when a node's or the job's state changes (the page fetches the summary
again), ``progress`` when the training's progress does (the progress fragment alone), and
``attempt`` when a new attempt starts (a page that follows the latest attempt fetches its log
part again). The job list holds one stream (``/events``) whose ``changed`` makes it fetch the list
again. Anything that blocks (the hosts, the job store) runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from markupsafe import escape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from clusterrun.core.errors import ClusterrunError, JobNotFound
from clusterrun.core.ranges import parse_ranges
from clusterrun.diagnose.rootcause import split_rank
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.web import jobs
from clusterrun.web.chart import loss_chart
from clusterrun.web.feeds import RING, Changed, Feeds, Lines, State, Viewer
from clusterrun.web.guard import Guard
from clusterrun.web.watch import StoreWatch, signature, version

HERE = Path(__file__).parent
MAX_VIEWERS = 32  # live streams at once; one more is refused (503)
TAIL = 200  # lines of each node a page shows first


class Options:
    """A page's log choices, from its query: node, ranks, attempt, search, the last N lines."""

    def __init__(self, request: Request, record: JobRecord) -> None:
        q = request.query_params
        nodes = range(len(record.nodes))
        node = q.get("node", "")
        self.node = int(node) if node.isdigit() and int(node) in nodes else None
        self.nodes = [self.node] if self.node is not None else list(nodes)
        self.rank_text = q.get("rank", "").strip()
        try:
            self.ranks: frozenset[int] | None = frozenset(parse_ranges(self.rank_text)) if self.rank_text else None
        except ValueError:
            self.ranks, self.rank_text = None, ""
        attempt = q.get("attempt", "")
        self.follows = not (attempt.isdigit() and 1 <= int(attempt) <= record.attempt)  # the latest, as it changes
        self.attempt = record.attempt if self.follows else int(attempt)
        self.query = q.get("q", "")[:200]
        tail = q.get("tail", "")
        self.tail = min(int(tail), RING) if tail.isdigit() else TAIL

    def keeps(self, node: int, line: str) -> bool:
        if node not in self.nodes or (self.query and self.query.lower() not in line.lower()):
            return False
        return self.ranks is None or split_rank(line)[0] in self.ranks

    def query_string(self) -> str:
        from urllib.parse import urlencode

        pairs = {"node": "" if self.node is None else str(self.node), "rank": self.rank_text,
                 "attempt": "" if self.follows else str(self.attempt), "q": self.query, "tail": str(self.tail)}
        return urlencode({k: v for k, v in pairs.items() if v})


def _lines_html(node: int, lines: Sequence[str], prefix: bool) -> str:
    tag = f'<span class="n">node{node}</span> ' if prefix else ""
    return "".join(f'<div class="l">{tag}{escape(line)}</div>' for line in lines)


def _first_lines(rings: dict[int, list[tuple[int, str]]], options: Options, prefix: bool) -> str:
    """The last lines of each node a page starts with, the nodes' lines in the order they arrived."""
    kept = sorted((number, node, line) for node in options.nodes
                  for number, line in _last([(n, x) for n, x in rings[node] if options.keeps(node, x)], options.tail))
    return "".join(_lines_html(node, [line], prefix) for _, node, line in kept)


def _last(lines: list[Any], count: int) -> list[Any]:
    return lines[len(lines) - count:] if count < len(lines) else lines


def _sse(event: str, data: str) -> bytes:
    return (f"event: {event}\n" + "".join(f"data: {part}\n" for part in data.split("\n")) + "\n").encode()


class Web(Guard):
    """The application behind its guard, with what a stopping server calls."""

    def __init__(self, app: Starlette, token: str, bound: str, state: dict[str, Any]) -> None:
        super().__init__(app, token, bound)
        self.state = state

    def end_streams(self) -> None:
        """End the live streams now: a stopping server waits for every open connection."""
        if "feeds" in self.state:
            self.state["feeds"].end_streams()
        self.state["watch"].end()


def create_app(token: str, *, control: bool = False, store: JobStore | None = None,
               bound: str = "127.0.0.1") -> Web:
    """The ASGI application, behind its guard (``guard.Guard``)."""
    store = store or JobStore()
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["loss_chart"] = loss_chart
    watch = StoreWatch(store)
    opener = jobs.Opener(store)  # each job's hosts file parsed once for the server's life
    state: dict[str, Any] = {"viewers": 0, "watch": watch}

    def feeds(request: Request) -> Feeds:
        if "feeds" not in state:
            state["feeds"] = Feeds(asyncio.get_running_loop())
        return state["feeds"]  # type: ignore[no-any-return]

    async def record_of(job_id: str) -> JobRecord:
        return await run_in_threadpool(jobs.load, store, job_id)

    async def index(request: Request) -> Response:
        show_all = request.query_params.get("all") == "1"
        seen = version(await run_in_threadpool(signature, store))  # before the records are read: what changes shows
        document = await run_in_threadpool(jobs.job_list, opener, show_all)
        page = "joblist.html" if request.headers.get("hx-request") and request.query_params.get("part") else "jobs.html"
        return templates.TemplateResponse(request, page, {"doc": document, "show_all": show_all, "seen": seen})

    async def list_events(request: Request) -> Response:
        """The job list's stream: ``changed`` (with the jobs' ids) when a record changed, nothing else."""
        if state["viewers"] >= MAX_VIEWERS:
            return PlainTextResponse(f"more than {MAX_VIEWERS} live viewers; close a page and reload",
                                     status_code=503)

        async def events() -> AsyncIterator[bytes]:
            changes = watch.subscribe()
            state["viewers"] += 1
            try:
                behind = version(await watch.baseline()) != request.query_params.get("seen")
                yield b"retry: 3000\n\n"
                if behind:  # a job changed since the page read the list (any later change is a look's)
                    yield _sse("changed", "")
                while ids := await changes.get():  # empty: the server ends
                    yield _sse("changed", " ".join(sorted(ids)))
            finally:
                state["viewers"] -= 1
                watch.unsubscribe(changes)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-accel-buffering": "no"})

    async def job_page(request: Request) -> Response:
        job_id = request.path_params["job"]
        record = await record_of(job_id)  # before the view is read: what changes after it, the stream tells
        view = await run_in_threadpool(jobs.job_view, opener, job_id)
        options = Options(request, record)
        found = None
        if options.query:
            found = await run_in_threadpool(jobs.log_search, opener.keep(record), options.attempt, options.nodes,
                                            options.query, options.ranks)
        context = {"job": view, "o": options, "control": control, "found": found, "nnodes": len(record.nodes),
                   "seen": jobs.marks_digest(record)}
        if not (request.headers.get("hx-request") and request.query_params.get("part")):
            return templates.TemplateResponse(request, "job.html", context)
        # the choices go into the address (without the fragment's marker): a link or a reload shows this view
        address = f"/jobs/{job_id}" + (f"?{options.query_string()}" if options.query_string() else "")
        return templates.TemplateResponse(request, "live.html", dict(context, oob=True),  # and the attempts' menu
                                          headers={"HX-Push-Url": address})

    async def summary(request: Request) -> Response:
        view = await run_in_threadpool(jobs.job_view, opener, request.path_params["job"])
        return templates.TemplateResponse(request, "summary.html", {"job": view, "control": control})

    async def progress(request: Request) -> Response:
        view = await run_in_threadpool(jobs.progress_view, store, request.path_params["job"])
        return templates.TemplateResponse(request, "progress.html", {"job": view})

    async def stream(request: Request) -> Response:
        if state["viewers"] >= MAX_VIEWERS:
            return PlainTextResponse(f"more than {MAX_VIEWERS} live viewers; close a page and reload",
                                     status_code=503)
        record = await record_of(request.path_params["job"])
        options = Options(request, record)
        prefix = len(options.nodes) > 1

        async def events() -> AsyncIterator[bytes]:
            viewer = Viewer()  # joined here, where the finally below is sure to leave
            feed = feeds(request).join(opener.keep(record), options.attempt, viewer)
            changes = watch.subscribe()
            forward = asyncio.get_running_loop().create_task(_forward(changes, record.job_id, viewer))
            state["viewers"] += 1
            try:
                await watch.baseline()  # subscribed: a change from here on reaches this stream
                now = record
                with contextlib.suppress(ClusterrunError):  # removed meanwhile: the next look tells
                    now = await record_of(record.job_id)
                seen = jobs.marks(now)
                rings, states = feed.snapshot()
                first = _first_lines(rings, options, prefix)
                yield b"retry: 3000\n" + _sse("lines", first or "")
                if options.follows and now.attempt > options.attempt:
                    yield _sse("attempt", str(now.attempt))
                elif jobs.marks_digest(now) != request.query_params.get("seen"):  # changed since the page read it
                    yield _sse("changed", "record") + _sse("progress", "")
                while True:
                    message = await viewer.queue.get()
                    if message is None:  # fell behind: the browser reconnects and starts again
                        return
                    if isinstance(message, Lines):
                        kept = [x for x in message.lines if options.keeps(message.node, x)]
                        if message.backlog:
                            kept = _last(kept, options.tail)
                        if kept:
                            yield _sse("lines", _lines_html(message.node, kept, prefix))
                    elif isinstance(message, State):
                        yield _sse("changed", message.state)
                    elif isinstance(message, Changed):
                        try:
                            now = await record_of(record.job_id)
                        except ClusterrunError:  # removed (or being rewritten): the summary says which
                            yield _sse("changed", "record")
                            continue
                        marks = jobs.marks(now)
                        if options.follows and now.attempt > options.attempt:
                            yield _sse("attempt", str(now.attempt))
                        if marks[0] != seen[0]:
                            yield _sse("changed", "record")
                        if marks[1] != seen[1]:
                            yield _sse("progress", "")
                        seen = marks
            finally:
                state["viewers"] -= 1
                forward.cancel()
                watch.unsubscribe(changes)
                feeds(request).leave(feed, viewer)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"x-accel-buffering": "no"})

    async def api_jobs(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(jobs.job_list, opener, request.query_params.get("all") == "1"))

    async def api_job(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(jobs.job_view, opener, request.path_params["job"]))

    async def stop(request: Request) -> Response:
        if not control:
            return PlainTextResponse("read-only: start `clusterrun web --control` to stop jobs", status_code=403)
        downed, lines = await run_in_threadpool(jobs.stop, opener, request.path_params["job"])
        return templates.TemplateResponse(request, "stopped.html", {"downed": downed, "lines": lines,
                                                                    "summary": downed.summary()})

    async def restart(request: Request) -> Response:
        if not control:
            return PlainTextResponse("read-only: start `clusterrun web --control` to restart jobs", status_code=403)
        record = await record_of(request.path_params["job"])
        text = await run_in_threadpool(_restart, record)
        return HTMLResponse(f'<pre class="report">{escape(text)}</pre>')

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204)

    routes = [
        Route("/", index),
        Route("/favicon.ico", no_icon),
        Route("/jobs/{job}", job_page),
        Route("/jobs/{job}/summary", summary),
        Route("/jobs/{job}/progress", progress),
        Route("/events", list_events),
        Route("/jobs/{job}/stream", stream),
        Route("/jobs/{job}/stop", stop, methods=["POST"]),
        Route("/jobs/{job}/restart", restart, methods=["POST"]),
        Route("/api/jobs", api_jobs),
        Route("/api/jobs/{job}", api_job),
        Mount("/static", StaticFiles(directory=str(HERE / "static"))),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await watch.close()
        if "feeds" in state:
            state["feeds"].close()

    return Web(Starlette(routes=routes, lifespan=lifespan, exception_handlers={ClusterrunError: _failed}), token, bound,
               state)


async def _forward(changes: asyncio.Queue[frozenset[str]], job_id: str, viewer: Viewer) -> None:
    """The store's changes of ``job_id`` to a job page's stream (an empty set, the server's end, ends it)."""
    while ids := await changes.get():
        if job_id in ids:
            viewer.put(Changed())
    viewer.queue.put_nowait(None)


async def _failed(request: Request, exc: Exception) -> Response:
    """What a page or stream says when the job cannot be read: its error with the hint, 404 for an unknown job."""
    text = exc.render() if isinstance(exc, ClusterrunError) else str(exc)
    return PlainTextResponse(text, status_code=404 if isinstance(exc, JobNotFound) else 500)


def _restart(record: JobRecord) -> str:
    """``clusterrun restart JOB``, run as that command (its checks, verified stop and start), and what it said."""
    import os
    import subprocess
    import sys

    cwd = record.local_cwd if record.local_cwd and os.path.isdir(record.local_cwd) else None
    done = subprocess.run([sys.executable, "-m", "clusterrun", "restart", record.job_id], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=900, cwd=cwd)
    return (done.stdout + done.stderr).strip() or f"exit {done.returncode}"
