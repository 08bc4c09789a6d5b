"""`clusterrun web` in a real browser (Debian's chromium driven by Playwright) over a real job on local hosts:
the job list, a job's page live, search, the token, another site refused, the stop, a phone's width; the
loss chart, the list and a job's page following the jobs (a new job, a new state, a restart) without a reload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.conftest import ROOT, SUPPORT, marked, wait_for, write_hosts

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
DEADLINE = 60_000  # ms: what the page must show by then (a loaded CI machine starts torch slowly)
SHOTS = os.environ.get("CLUSTERRUN_WEB_SHOTS")  # a folder: the pages are saved there as PNG, to look at


def clusterrun(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's chromium (the test setup installs it when missing: `playwright install` downloads)."""
    subprocess.run(["sh", str(SUPPORT / "install_chromium.sh")], check=True, capture_output=True, timeout=900)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


class Server:
    """A `clusterrun web` (or any server that prints its URL) in a process of its own, ended by its pid."""

    def __init__(self, argv: list[str], pattern: str, cwd: Path = ROOT) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        assert self.proc.stdout is not None
        self.output: list[str] = []
        for line in self.proc.stdout:
            self.output.append(line)
            found = re.search(pattern, line)
            if found:
                self.found = found
                # the rest is read on, so that the server never waits on a full pipe (and kept for a failure)
                self.reader = threading.Thread(target=self.output.extend, args=(self.proc.stdout,), daemon=True)
                self.reader.start()
                return
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        raise AssertionError(f"{argv} ended without printing its address: {''.join(self.output)}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def web(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``web(control=False)``: a started `clusterrun web --port 0`, its URL with the token, and its base."""
    servers: list[Server] = []

    def start(control: bool = False) -> tuple[str, str, int]:
        server = Server([sys.executable, "-m", "clusterrun", "web", "--port", "0", *(["--control"] if control else [])],
                        r"(http://127\.0\.0\.1:\d+)/\?token=\S+")
        servers.append(server)
        return server.found.group(0), server.found.group(1), server.proc.pid

    yield start
    for server in servers:
        server.close()


def start_job(tmp_path: Path, state_dir: Path, name: str) -> str:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    proc = clusterrun("up", "-d", "--name", name, hosts, SUPPORT / "counter.py", "100000", "0.05")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def ps_json(job: str) -> dict[str, Any]:
    proc = clusterrun("ps", "--json", job)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["jobs"][0]  # type: ignore[no-any-return]


def last_line(page: Page, rank: int) -> int:
    """The highest `rank R line I` the page's log shows of rank R (-1: none yet)."""
    text = page.locator("#log").text_content() or ""
    numbers = [int(n) for n in re.findall(rf"rank {rank} line (\d+)", text)]
    return max(numbers, default=-1)


def agents(pid: int) -> list[int]:
    """The server's children that run the node agent (a local host's transport starts it as a child)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"-S" in argv and b"-c" in argv:
                found.append(int(child))
    return found


def no_sideways_scroll(page: Page) -> bool:
    return bool(page.evaluate("document.scrollingElement.scrollWidth <= window.innerWidth"))


def test_the_page_lists_a_running_job_shows_it_live_and_refuses_strangers(
        tmp_path: Path, state_dir: Path, browser: Browser, web: Any) -> None:
    job = start_job(tmp_path, state_dir, "webview")
    url, base, pid = web(control=True)  # the other site below tries a stop: only the guard may refuse it
    context = browser.new_context()
    page = context.new_page()
    page.goto(url)
    assert page.url == base + "/"  # the token became a cookie and left the address
    cookie = next(c for c in context.cookies() if c["name"] == "clusterrun_web")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    page.locator(f'a[href="/jobs/{job}"]').wait_for(timeout=DEADLINE)
    page.click(f'a[href="/jobs/{job}"]')
    page.wait_for_url(f"{base}/jobs/{job}")
    for node, host in ((0, "local-a"), (1, "local-b")):
        assert page.locator(f'tr[data-node="{node}"] .host').inner_text() == host
    # new lines arrive while the page is open, from both nodes
    # (polled from here: the page's policy forbids the string evaluation of Playwright's wait_for_function)
    wait_for(lambda: last_line(page, 0) >= 0, timeout=DEADLINE / 1000, what="a line of rank 0")
    seen = last_line(page, 0)
    wait_for(lambda: last_line(page, 0) > seen and last_line(page, 1) >= 0, timeout=DEADLINE / 1000,
             what=f"a line of rank 0 after line {seen}, and one of rank 1")
    if SHOTS:
        page.set_viewport_size({"width": 1280, "height": 900})
        page.screenshot(path=f"{SHOTS}/job-desktop.png", full_page=True)
    # search reads the whole log: a line of the start
    page.fill("#q", "rank 1 line 3")
    page.locator(".found .l", has_text="rank 1 line 3").first.wait_for(timeout=DEADLINE)
    assert "q=rank+1+line+3" in page.url  # the search is in the address: the link shows it again
    # a phone's width: no sideways scrolling, on the job's page and the list
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{base}/jobs/{job}")
    wait_for(lambda: last_line(page, 1) >= 0, timeout=DEADLINE / 1000, what="a line of rank 1")
    assert no_sideways_scroll(page)
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/job-phone.png", full_page=True)
    # a second viewer of the job: its logs are still read once, one reader (an agent's follow) per node
    second = context.new_page()
    second.goto(f"{base}/jobs/{job}?node=1")
    wait_for(lambda: last_line(second, 1) >= 0, timeout=DEADLINE / 1000, what="the second page's lines")
    assert "rank 0 line" not in (second.locator("#log").text_content() or "")  # node 1's alone
    wait_for(lambda: len(agents(pid)) == 2, timeout=60, what=f"one reader per node: {agents(pid)}")
    second.close()
    page.goto(base + "/")
    assert no_sideways_scroll(page)
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/jobs-phone.png", full_page=True)

    # without the token or its cookie: 401, for a page, an asset and the event stream
    stranger = browser.new_context().new_page()
    for path in ("/", f"/jobs/{job}", "/static/htmx.min.js", f"/jobs/{job}/stream", "/api/jobs", "/events",
                 f"/jobs/{job}/progress"):
        response = stranger.goto(base + path)
        assert response is not None and response.status == 401, path

    # another site (a server on another port: the same site to the cookie, another origin) that tries
    # to read the job, follow its stream and stop it, with the visitor's cookie: every request refused
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    (other_dir / "index.html").write_text(
        "<!doctype html><pre id=out></pre><script>\n"
        "const say = (what) => { document.getElementById('out').textContent += what + '\\n'; };\n"
        f"fetch('{base}/api/jobs', {{credentials: 'include'}}).then(r => say('read ' + r.status), "
        "() => say('read refused'));\n"
        f"fetch('{base}/api/jobs?opaque=1', {{mode: 'no-cors', credentials: 'include'}}).then(() => say('opaque'));\n"
        f"const stream = new EventSource('{base}/jobs/{job}/stream', {{withCredentials: true}});\n"
        "stream.onmessage = () => say('stream message');\n"
        "stream.onerror = () => { say('stream refused'); stream.close(); };\n"
        f"fetch('{base}/jobs/{job}/stop', {{method: 'POST', mode: 'no-cors', credentials: 'include'}})"
        ".then(() => say('stop sent'));\n"
        "</script>")
    other = Server([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "0"],
                   r"port (\d+)", cwd=other_dir)
    try:
        statuses: dict[str, int] = {}  # what the server answered to the requests a page may not read
        page.on("response", lambda r: statuses.__setitem__(r.url, r.status) if r.url.startswith(base) else None)
        page.goto(f"http://127.0.0.1:{other.found.group(1)}/index.html")
        said = page.locator("#out")
        for what in ("read refused", "opaque", "stream refused", "stop sent"):
            expect(said).to_contain_text(what, timeout=DEADLINE)
        assert "message" not in (said.text_content() or "")
        wait_for(lambda: len(statuses) == 2, timeout=30, what=f"the opaque requests' answers: {statuses}")
        assert statuses == {f"{base}/api/jobs?opaque=1": 403, f"{base}/jobs/{job}/stop": 403}
        # the requests the browser itself refused to show that page: the server refused them too
        for path in ("/api/jobs", f"/jobs/{job}/stream"):
            answer = page.request.get(base + path, headers={"Origin": f"http://127.0.0.1:{other.found.group(1)}"})
            assert answer.status == 403, path
    finally:
        other.close()
    assert ps_json(job)["state"] == "running" and len(marked(job)) >= 2
    context.close()


def test_stop_from_the_page_stops_the_job_verified_as_down_verifies(
        tmp_path: Path, state_dir: Path, browser: Browser, web: Any) -> None:
    job = start_job(tmp_path, state_dir, "webstop")
    wait_for(lambda: len(marked(job)) >= 2, timeout=90, what="the job's processes")
    read_only, _, _ = web()
    url, base, _ = web(control=True)
    context = browser.new_context()
    page = context.new_page()
    page.goto(read_only)
    page.goto(read_only.split("/?")[0] + f"/jobs/{job}")
    assert page.locator("button", has_text="Stop").count() == 0  # read-only: no stop offered ...
    # ... nor carried out, though same-origin and with the cookie
    refused = page.evaluate(f"fetch('/jobs/{job}/stop', {{method: 'POST'}}).then(r => r.status)")
    assert refused == 403 and marked(job)
    page.goto(url)
    page.goto(f"{base}/jobs/{job}")
    assert page.request.get(f"{base}/jobs/{job}/stop").status == 405  # no GET changes anything
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Stop')")
    report = page.locator("#stop-report")
    report.wait_for(timeout=DEADLINE * 2)
    assert report.get_attribute("data-verdict") == "stopped", report.inner_text()
    assert f"job {job} stopped; nothing of it is left on any host (verified by cgroup)" in report.inner_text()
    assert report.inner_text().count("nothing left (verified by cgroup)") == 2, report.inner_text()
    assert marked(job) == []
    assert ps_json(job)["state"] == "stopped"
    context.close()


def printed_losses(job: str) -> dict[int, float]:
    """The loss rank 0's tqdm bar printed at each step, from the job's log as `logs` reads it."""
    logs = clusterrun("logs", "--node", "0", job)  # rank 0 alone, as written
    assert logs.returncode == 0, logs.stderr
    return {int(n): float(loss) for n, loss in re.findall(r"(\d+)/40 \[[^\]]*loss=([\d.]+)\]", logs.stdout)}


def chart_points(page: Page) -> list[tuple[int, float]]:
    """The (step, loss) points of the page's loss chart, as its SVG carries them (not its pixels); both
    attributes read in one script, so that a live swap of the chart cannot come between them."""
    found = page.evaluate("""() => {
        const lines = document.querySelectorAll("#loss-chart polyline[data-attempt]");
        return lines.length === 1 ? [lines[0].getAttribute("data-steps") || "",
                                     lines[0].getAttribute("data-losses") || ""] : null;
    }""")
    if found is None:
        return []
    steps, losses = found
    return list(zip(map(int, steps.split()), map(float, losses.split()), strict=True))


def test_the_page_shows_the_training_s_progress_and_its_loss_chart_live(
        tmp_path: Path, state_dir: Path, browser: Browser, web: Any) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir, python=sys.executable)
    gate, later = tmp_path / "go", tmp_path / "later"  # every rank waits at step 20 and 30 of 40 for them
    started = clusterrun("up", "-d", "--name", "webprogress", hosts, SUPPORT / "progress_train.py", "--", "tqdm",
                         "40", gate, later)
    assert started.returncode == 0, started.stderr
    job = started.stdout.strip()
    try:
        wait_for(lambda: (ps_json(job)["progress"] or {}).get("step") == 20, timeout=180, what="step 20's reading")
        url, base, _ = web()
        page = browser.new_page(viewport={"width": 390, "height": 844})
        page.goto(url)
        page.goto(f"{base}/jobs/{job}")
        expect(page.locator("#progress")).to_contain_text("step 20/40 (50%)", timeout=DEADLINE)
        assert page.locator("#progress progress").get_attribute("value") == "20"
        # the chart a page opened now shows: every step's loss so far (the bar's line ends with the training)
        early = chart_points(page)
        assert [step for step, _ in early] == list(range(1, 21))
        assert no_sideways_scroll(page)
        if SHOTS:
            page.screenshot(path=f"{SHOTS}/chart-phone.png", full_page=True)
        page.evaluate("window.unreloaded = true")
        gate.touch()
        # the training goes on: the open page's chart follows it, without a reload (its nodes' states do not
        # change until the end: only the new readings the owner records bring the new points)
        wait_for(lambda: [step for step, _ in chart_points(page)][-1:] == [30], timeout=DEADLINE / 1000,
                 what="the chart's point at step 30")
        assert [step for step, _ in chart_points(page)] == list(range(1, 31)) and chart_points(page)[:20] == early
        later.touch()
        wait_for(lambda: [step for step, _ in chart_points(page)][-1:] == [40], timeout=DEADLINE / 1000,
                 what="the chart's point at step 40")
        wait_for(lambda: ps_json(job)["state"] == "succeeded", timeout=120, what="the training's end")
        printed = printed_losses(job)  # what rank 0's bar printed at each step, as `logs` reads it
        assert sorted(printed) == list(range(1, 41))
        assert chart_points(page) == sorted(printed.items()) and early == sorted(printed.items())[:20]
        expect(page.locator("#progress")).to_contain_text("step 40/40", timeout=DEADLINE)
        assert page.evaluate("window.unreloaded") is True and no_sideways_scroll(page)
        page.goto(base + "/")
        expect(page.locator(".training")).to_contain_text("step 40/40", timeout=DEADLINE)
        page.close()
    finally:
        gate.touch()
        later.touch()


def test_the_job_list_shows_a_new_job_and_its_new_state_without_a_reload(
        tmp_path: Path, state_dir: Path, browser: Browser, web: Any) -> None:
    url, base, _ = web()
    page = browser.new_page()
    page.goto(url)
    expect(page.locator("h1")).to_have_text("Jobs")
    page.evaluate("window.unreloaded = true")
    job = start_job(tmp_path, state_dir, "weblist")  # started after the page was loaded
    row = page.locator("li.job", has=page.locator(f'a[href="/jobs/{job}"]'))
    expect(row.locator(".state")).to_contain_text("running", timeout=DEADLINE)
    assert clusterrun("down", job).returncode == 0
    expect(row.locator(".state")).to_contain_text("stopped", timeout=DEADLINE)
    assert page.evaluate("window.unreloaded") is True  # the same page all along
    page.close()


def test_a_job_s_page_follows_a_restart_to_the_new_attempt_s_nodes_and_log(
        tmp_path: Path, state_dir: Path, browser: Browser, web: Any) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="restart: {backoff: 0s}\n")
    counter, gate = tmp_path / "runs", tmp_path / "fail"
    started = clusterrun("up", "-d", "--max-restarts", "1", "--name", "webrestart", hosts,
                         SUPPORT / "fail_once_gated.py", counter, gate)
    assert started.returncode == 0, started.stderr
    job = started.stdout.strip()
    try:
        url, base, _ = web()
        page = browser.new_page()
        page.goto(url)
        page.goto(f"{base}/jobs/{job}")
        log = page.locator("#log")
        for rank in (0, 1):
            expect(log).to_contain_text(f"run 1 rank {rank} line", timeout=DEADLINE)
        page.evaluate("window.unreloaded = true")
        gate.touch()  # rank 1 fails: the policy starts attempt 2
        for rank in (0, 1):  # the same page, now on attempt 2: its log, its nodes, its menu
            expect(log).to_contain_text(f"run 2 rank {rank} line", timeout=DEADLINE * 2)
        assert "run 1 " not in (log.text_content() or "")  # the new attempt's log alone
        expect(page.locator("#summary .state")).to_contain_text("attempt 2", timeout=DEADLINE)
        for node in (0, 1):
            expect(page.locator(f'tr[data-node="{node}"]')).to_contain_text("running", timeout=DEADLINE)
        expect(page.locator("#live h2").last).to_contain_text("attempt 2")
        assert page.evaluate("window.unreloaded") is True
        # the earlier attempt's log stays choosable
        page.select_option("#attempt", "1")
        expect(page.locator("#live h2").last).to_contain_text("attempt 1", timeout=DEADLINE)
        expect(log).to_contain_text("run 1 rank 1 fails", timeout=DEADLINE)
        assert "run 2 " not in (log.text_content() or "")
        assert "attempt=1" in page.url
        page.close()
    finally:
        clusterrun("down", job)
