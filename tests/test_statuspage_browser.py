"""The status page in a real browser: Debian's Chromium driven by Playwright, against the
proxy as a subprocess and a slow origin, while a reader with a read plan runs.

The figures the page shows (its ``data-*`` values: exact numbers behind the rounded
text) are compared with ``/-/stats``, ``/-/downloads``, ``/-/plans`` and ``/-/entries``:
bracketed by the JSON read before and after while everything moves, equal once the
reader and the downloads are held still by the origin, and equal again at rest. The page
must make no request beyond loopback, log no console error, run no text from the JSON as
markup (an entry URL and a plan name carry ``<script>`` and ``onerror``), and offer
purging only once the admin token is typed in.

Chromium comes from Debian (``apt-get install chromium``; .ci/run installs it) and is
launched by path: Playwright's own browser download is not used. Without it the test
skips, unless ``SHARDCACHE_REQUIRE_BROWSER=1`` (set by .ci/run once Chromium is
installed) makes a missing browser a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from opshelpers import ProxyProcess
from proxy_helpers import Fault, Origin, raw_request

pytestmark = pytest.mark.timeout(180)

CHROMIUM = os.environ.get("SHARDCACHE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "page-token"
KB = 1024
MOVING = 4  # shards 0..3 come slowly from the origin
HELD = 4  # shards 4..7 are held by the origin (headers sent, body not) until released
SHARD = 256 * KB
EVIL_PLAN = "job<script>window.__pwned=1</script><img src=x onerror=window.__pwned=2>"
EVIL_QUERY = "?v=<script>window.__pwned=3</script><img/src=x/onerror=window.__pwned=4>"


def _browser():
    if os.environ.get("SHARDCACHE_REQUIRE_BROWSER") == "1":
        from playwright.sync_api import sync_playwright

        assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM}: no Chromium, yet one is required"
        return sync_playwright
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install 'shardcache[test]')")
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    return sync_playwright


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def snapshot(base: str) -> dict:
    """What the proxy says now, in the page's terms."""
    s = get_json(f"{base}/-/stats")
    downloads = get_json(f"{base}/-/downloads")["downloads"]
    plans = get_json(f"{base}/-/plans")["plans"]
    return {
        "version": s["version"],
        "hits": s["hits"],
        "misses": s["misses"],
        "served": s["served_bytes"],
        "fetched": s["upstream_bytes"],
        "entries": s["entries"],
        "bytes": s["bytes"],
        "limit": s["limit"],
        "in_flight": s["in_flight"],
        "downloads": sorted((d["url"], d["written"]) for d in downloads),
        "plans": [
            (page_name(p["name"], p["id"]), p["position"], p["ready_ahead_shards"]) for p in plans
        ],
    }


# One atomic read of everything the page shows (the page's script runs between calls,
# never during one).
READ_PAGE = """() => {
  const v = (id) => document.getElementById(id).dataset.value;
  const rows = (id) => [...document.querySelectorAll('#' + id + ' tbody tr')]
      .filter((tr) => !tr.querySelector('td.empty'));
  return {
    refreshes: Number(document.body.dataset.refreshes),
    version: document.getElementById('version').textContent,
    hits: Number(v('hits')), misses: Number(v('misses')),
    served: Number(v('served-bytes')), fetched: Number(v('upstream-bytes')),
    entries: Number(v('entries')), bytes: Number(v('bytes')), limit: Number(v('limit')),
    in_flight: Number(v('in-flight')),
    downloads: rows('downloads').map((tr) => [tr.cells[0].textContent,
                                             Number(tr.cells[3].dataset.written)]),
    plans: rows('plans').map((tr) => [tr.cells[0].textContent,
                                     Number(tr.cells[1].dataset.position),
                                     Number(tr.cells[2].dataset.readyAhead)]),
    largest: rows('largest').map((tr) => [tr.cells[0].textContent,
                                         Number(tr.cells[1].dataset.value)]),
    hottest: rows('hottest').map((tr) => [tr.cells[0].textContent,
                                         Number(tr.cells[2].dataset.value)]),
    purge_buttons: document.querySelectorAll('#largest button, #hottest button').length,
    scripts: document.scripts.length,
    images: document.images.length,
    pwned: window.__pwned === undefined ? null : window.__pwned,
    samples: Number(document.getElementById('chart').dataset.samples || 0),
    lines: document.querySelectorAll('#chart polyline').length,
    error: document.getElementById('error').hidden ? '' :
           document.getElementById('error').textContent,
  };
}"""


def page_after_refresh(page, base: str) -> tuple[dict, dict, dict]:
    """(the JSON before, what the page shows from a refresh begun after it, the JSON
    after): the page read between them."""
    before = snapshot(base)
    count = page.evaluate("() => Number(document.body.dataset.refreshes)")
    # refresh count+1 may have begun before `before`; count+2 begins after it ended
    page.wait_for_function(
        f"() => Number(document.body.dataset.refreshes) >= {count + 2}", timeout=20_000
    )
    shown = page.evaluate(READ_PAGE)
    after = snapshot(base)
    return before, shown, after


def page_name(plan_name: str, plan_id: str) -> str:
    return f"{plan_name} ({plan_id})"


class Reader(threading.Thread):
    """A training job's reader: registers its shard order as a read plan, then reads
    the shards one by one with a pause between them, and the first two again."""

    def __init__(self, base: str, paths: list[str]) -> None:
        super().__init__(daemon=True, name="reader")
        self.base = base
        self.paths = paths
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.read: list[str] = []
        self.plan_id = ""

    def run(self) -> None:
        try:
            req = urllib.request.Request(
                f"{self.base}/-/plans",
                data=json.dumps({"urls": self.paths, "name": EVIL_PLAN, "lookahead": 2}).encode(),
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                self.plan_id = json.load(r)["id"]
            for path in self.paths + self.paths[:2]:
                with urllib.request.urlopen(self.base + path, timeout=120) as r:
                    while r.read(16 * KB):
                        time.sleep(0.002)  # a reader slower than the cache
                self.read.append(path)
                time.sleep(0.3)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()


def wait_still(base: str, origin: Origin, held: list[str], timeout: float = 60.0) -> dict:
    """Wait until the reader and every download wait on the origin's held shards and
    nothing moves: two equal snapshots a second apart."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = snapshot(base)
        if now == last and now["in_flight"] > 0 and origin.gets[held[0]] >= 1:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"the proxy never held still: {last}")


def test_status_page_shows_what_the_json_routes_say(tmp_path: Path) -> None:
    sync_playwright = _browser()
    gate = threading.Event()
    origin = Origin().start()
    paths = []
    for i in range(MOVING + HELD):
        name = f"shard-{i:02d}.tar"
        origin.files[name] = bytes([i]) * (SHARD + i * KB)  # sizes differ: a clear ranking
        if i < MOVING:
            origin.faults[name] = Fault(chunk=32 * KB, delay=0.05)
        else:
            origin.faults[name] = Fault(gate=gate)
        paths.append(f"/{name}")
    origin.files["q.tar"] = b"q" * 3000
    proxy = ProxyProcess(origin.url, tmp_path / "cache", ["--admin-token", TOKEN]).start()
    requests_seen: list[str] = []
    outside: list[str] = []
    problems: list[str] = []
    try:
        proxy.wait_healthy()
        base = proxy.url
        # an entry whose URL carries markup (the query keeps < and > as sent)
        assert raw_request(proxy.port, "/q.tar" + EVIL_QUERY)[0] == 200
        reader = Reader(base, paths)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context()

            def route(r) -> None:
                url = r.request.url
                requests_seen.append(url)
                host = urllib.parse.urlsplit(url).hostname
                if host in ("127.0.0.1", "localhost", "::1"):
                    r.continue_()
                else:
                    outside.append(url)
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on(
                "console",
                lambda m: (
                    problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning")
                    else None
                ),
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))

            # / leads to the page, which refreshes itself every 2 s by default
            page.goto(base + "/")
            assert page.url == base + "/-/"
            page.wait_for_function("() => Number(document.body.dataset.refreshes) >= 1")
            assert page.text_content("#interval") == "2"
            page.goto(base + "/-/?interval=0.5")
            page.wait_for_function("() => Number(document.body.dataset.refreshes) >= 1")

            # -- while the reader reads: every figure between the JSON before and after
            reader.start()
            for _ in range(3):
                before, shown, after = page_after_refresh(page, base)
                for key in ("hits", "misses", "served", "fetched", "entries", "bytes"):
                    assert before[key] <= shown[key] <= after[key], (key, before, shown, after)
                assert (
                    shown["version"] == "v" + after["version"] and shown["limit"] == after["limit"]
                )
                if shown["plans"]:  # registered: its position only moves forward
                    name, pos, _ = shown["plans"][0]
                    assert name == after["plans"][0][0]
                    pos0 = before["plans"][0][1] if before["plans"] else 0
                    assert pos0 <= pos <= after["plans"][0][1], (before, shown, after)

            # -- held still by the origin: the page shows exactly what the JSON says
            still = wait_still(base, origin, [p.lstrip("/") for p in paths[MOVING:]])
            before, shown, after = page_after_refresh(page, base)
            assert before == after == still, "the proxy moved while it should hold still"
            for key in ("hits", "misses", "served", "fetched", "entries", "bytes", "in_flight"):
                assert shown[key] == still[key], (key, shown[key], still[key])
            assert sorted(map(tuple, shown["downloads"])) == still["downloads"]
            assert shown["in_flight"] == len(shown["downloads"]) >= 1
            assert [tuple(p) for p in shown["plans"]] == still["plans"]
            assert still["plans"][0][0] == page_name(EVIL_PLAN, reader.plan_id)
            # the request for the first held shard, waiting, is the last one counted
            assert still["plans"][0][1] == MOVING + 1

            # -- at rest: the same, and the entries' rankings too
            gate.set()
            assert reader.done.wait(90), "the reader did not finish"
            assert reader.error is None, reader.error
            deadline = time.monotonic() + 30
            while get_json(f"{base}/-/stats")["in_flight"] and time.monotonic() < deadline:
                time.sleep(0.2)
            before, shown, after = page_after_refresh(page, base)
            assert before == after
            for key in ("hits", "misses", "served", "fetched", "entries", "bytes", "in_flight"):
                assert shown[key] == after[key], (key, shown[key], after[key])
            assert after["hits"] >= 2 and after["entries"] == MOVING + HELD + 1
            assert shown["downloads"] == [] and shown["in_flight"] == 0
            entries = get_json(f"{base}/-/entries")
            assert [tuple(e) for e in shown["largest"]] == [
                (e["url"], e["size"]) for e in entries["largest"]
            ]
            assert [u for u, _ in shown["hottest"]] == [e["url"] for e in entries["hottest"]]
            assert shown["samples"] >= 3 and shown["lines"] >= 2, "the chart was not drawn"

            # -- text from the JSON stays text
            evil_url = f"{origin.url}/q.tar{EVIL_QUERY}"
            assert evil_url in [u for u, _ in shown["largest"]]
            assert shown["pwned"] is None and shown["scripts"] == 1 and shown["images"] == 0

            # -- purging: offered only with a token, and the proxy checks it
            assert shown["purge_buttons"] == 0
            page.fill("#token", "wrong")
            page.click("#token-form button[type=submit]")
            page.wait_for_selector("#largest button")
            row = page.locator("#largest tbody tr", has_text="q.tar")
            row.locator("button").click()
            page.wait_for_function(
                "() => document.getElementById('admin-result').textContent.includes('403')"
            )
            page.fill("#token", TOKEN)
            page.click("#token-form button[type=submit]")
            page.locator("#largest tbody tr", has_text="q.tar").locator("button").click()
            page.wait_for_function(
                "() => document.getElementById('admin-result').textContent.startsWith('purged')"
            )
            assert get_json(f"{base}/-/stats")["entries"] == MOVING + HELD
            page.click("#token-clear")
            page.wait_for_function(
                "() => document.querySelectorAll('#largest button').length === 0"
            )
            browser.close()
    finally:
        gate.set()
        rc = proxy.stop()
        origin.stop()
    # the purge refused with the wrong token is the one failed request the page made
    problems = [p for p in problems if "403" not in p]
    assert not problems, problems
    assert not outside, f"requests beyond loopback: {outside}"
    assert rc == 0
    # only the page, its files and the JSON routes: no /favicon.ico, which would be a
    # shard request to the upstream
    paths = {urllib.parse.urlsplit(u).path for u in requests_seen}
    page_paths = {"/", "/-/", "/-/stats", "/-/plans", "/-/downloads", "/-/entries", "/-/cache"}
    assert paths == page_paths | {"/-/static/status.css", "/-/static/status.js"}, paths


def test_status_page_shows_upstream_errors(tmp_path: Path) -> None:
    """An upstream that refuses connections shows on the page as ``/-/stats``
    (``upstream_health``) has it: down, the reason and message, the failures by reason;
    a message is shown as text, never as markup."""
    sync_playwright = _browser()
    origin = Origin().start()
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    down = f"down=http://127.0.0.1:{dead}/data"  # a named upstream, labelled NAME=URL
    proxy = ProxyProcess([origin.url, down], tmp_path / "cache", ["--retries", "0"])
    proxy.start()
    problems: list[str] = []
    try:
        proxy.wait_healthy()
        base = proxy.url
        with urllib.request.urlopen(base + "/-/stats", timeout=10) as r:
            assert json.loads(r.read())["upstreams"]
        try:
            urllib.request.urlopen(base + "/down/x.tar", timeout=30)
        except urllib.error.HTTPError as exc:
            assert exc.code == 502
        with urllib.request.urlopen(base + "/-/stats", timeout=10) as r:
            health = {h["upstream"]: h for h in json.loads(r.read())["upstream_health"]}
        refused = health[down]["failures"].get("refused", 0)  # the startup probe's and ours
        assert health[down]["state"] == "down" and refused >= 1, health
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(base + "/-/?interval=0.5")
            page.wait_for_function("() => Number(document.body.dataset.refreshes) >= 1")
            rows = page.eval_on_selector_all(
                "#upstreams tbody tr",
                "(trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent))",
            )
            shown = {r[0]: r for r in rows}
            assert shown[origin.url][1:] == ["none", "none"], rows
            row = shown[down + " (down)"]
            assert row[1].startswith("refused ") and health[down]["last_error"]["at"] in row[1]
            assert row[2] == f"refused: {refused}"

            def hostile(route) -> None:  # an upstream's message is text, never markup
                resp = route.fetch()
                body = resp.json()
                for h in body["upstream_health"]:
                    if h["last_error"]:
                        h["last_error"]["message"] = "<img src=x onerror=window.__pwned=1>"
                route.fulfill(response=resp, json=body)

            page.route("**/-/stats", hostile)
            count = page.evaluate("() => Number(document.body.dataset.refreshes)")
            page.wait_for_function(f"() => Number(document.body.dataset.refreshes) >= {count + 2}")
            assert page.evaluate(
                "() => [window.__pwned === undefined, document.images.length]"
            ) == [
                True,
                0,
            ]
            browser.close()
    finally:
        assert proxy.stop() == 0
        origin.stop()
    assert not problems, problems
