"""The status page's server side, in-process against a real origin: ``/`` redirecting to
``/-/``, the page's files from package data with their security headers, and the
read-only routes it reads (``/-/downloads``, ``/-/entries``). The page itself runs in a
real browser in tests/test_statuspage_browser.py."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
from proxy_helpers import Fault, Origin
from support.data import blob
from support.proxy import committed
from support.wait import until

from proxy import statuspage
from proxy.app import STORE, make_app
from proxy.config import Settings
from proxy.policy import Upstream

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
KB = 1024


@pytest.fixture
def origin():
    o = Origin().start()
    yield o
    o.stop()


@pytest.fixture
def proxy(aiohttp_client, tmp_path, origin):
    async def make(**overrides):
        base = Settings(
            cache_dir=tmp_path / "cache",
            upstreams=(Upstream(None, origin.url),),
            cache_size=100 << 20,
            read_timeout=5.0,
            retries=2,
            retry_backoff=0.01,
            chunk_size=16 << 10,
        )
        return await aiohttp_client(make_app(dataclasses.replace(base, **overrides)))

    return make


async def fetch(client, path: str) -> bytes:
    async with client.get(path) as r:
        assert r.status == 200, (path, r.status, await r.text())
        return await r.read()


async def downloads(client) -> list[dict]:
    """The rows of ``/-/downloads``: the downloads running now."""
    async with client.get("/-/downloads") as r:
        return (await r.json())["downloads"]


# --- the page and its files -------------------------------------------------------------


async def test_root_redirects_to_the_page_and_the_page_is_served_with_its_headers(proxy):
    c = await proxy()
    async with c.get("/", allow_redirects=False) as r:
        assert r.status == 302 and r.headers["Location"] == "/-/"
    async with c.head("/", allow_redirects=False) as r:
        assert r.status == 302 and r.headers["Location"] == "/-/"
    async with c.get("/") as r:  # followed: the page
        assert r.status == 200 and r.url.path == "/-/"
        html = await r.text()
        csp = r.headers["Content-Security-Policy"]
        assert r.headers["Content-Type"].startswith("text/html")
        assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert html.encode() == statuspage.static_file("index.html")
    # no inline script or style, nothing from elsewhere: every reference is to this proxy
    for m in re.finditer(r"<script\b([^>]*)>(.*?)</script>", html, re.S):
        assert 'src="/-/static/' in m.group(1) and not m.group(2).strip(), m.group(0)
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", html, re.I)
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    # an icon of its own: a browser's /favicon.ico would be a shard request to the upstream
    assert '<link rel="icon" href="data:,">' in html
    assert all(ref.startswith("/-/static/") for ref in refs if ref != "data:,"), refs
    for name, ctype in statuspage.STATIC_FILES.items():
        if name == "index.html":
            continue
        async with c.get(f"/-/static/{name}") as r:
            assert r.status == 200 and r.headers["Content-Type"] == ctype
            assert r.headers["Content-Security-Policy"] == csp
            assert await r.read() == statuspage.static_file(name)
        async with c.head(f"/-/static/{name}") as r:
            assert r.status == 200
            assert int(r.headers["Content-Length"]) == len(statuspage.static_file(name))
    async with c.get("/-/static/../app.py") as r:
        assert r.status == 404
    async with c.get("/-/static/index.html") as r:
        assert r.status == 404  # the page is at /-/ only
    async with c.post("/-/") as r:
        assert r.status == 405 and r.headers["Allow"] == "GET, HEAD"
    # the script writes text, never markup
    script = statuspage.static_file("status.js").decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


async def test_page_requests_are_counted_with_the_proxys_own_routes(proxy, origin):
    origin.files["a.tar"] = blob(10 * KB)
    c = await proxy()
    for path in ("/", "/-/", "/-/static/status.js", "/-/downloads", "/-/entries"):
        async with c.get(path, allow_redirects=False) as r:
            assert r.status in (200, 302)
    await fetch(c, "/a.tar")
    async with c.get("/-/stats") as r:
        stats = await r.json()
    assert stats["hits"] + stats["misses"] == 1  # the shard read, not the page's requests
    async with c.get("/metrics") as r:
        text = await r.text()
    data = [ln for ln in text.splitlines() if ln.startswith("shardcache_requests_total{")]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in data) == 1.0, data
    service = [ln for ln in text.splitlines() if ln.startswith("shardcache_service_requests")]
    for route in ("status", "static", "downloads", "entries"):
        assert any(f'route="{route}"' in ln for ln in service), (route, service)


def test_the_page_is_package_data_of_the_installed_package():
    for name in statuspage.STATIC_FILES:
        assert statuspage.static_file(name), name
    with pytest.raises(KeyError):
        statuspage.static_file("../app.py")


def test_the_wheel_and_the_sdist_carry_the_page(tmp_path):
    """Built as for a release (``python -m build``: PEP 517 in an isolated environment):
    the page's files are in both the wheel and the sdist."""
    src = tmp_path / "src"
    src.mkdir()
    # a copy: a build writes *.egg-info and build/ beside the sources
    for rel in ("pyproject.toml", "README.md", "shardcache", "proxy", "dbcache"):
        p = REPO / rel
        if p.is_dir():
            shutil.copytree(p, src / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(p, src / rel)
    out = tmp_path / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tf:
        snames = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for name in statuspage.STATIC_FILES:
        assert f"proxy/static/{name}" in names, sorted(n for n in names if "static" in n)
        assert f"proxy/static/{name}" in snames, sorted(n for n in snames if "static" in n)


# --- the routes it reads ----------------------------------------------------------------


def test_display_url_hides_credentials_and_signatures():
    d = statuspage.display_url
    assert d("https://user:pw@host.example/a/b.tar") == "https://host.example/a/b.tar"
    signed = "https://b.s3.amazonaws.com/k.tar?X-Amz-Signature=abc&X-Amz-Credential=x&v=1"
    assert "Signature" not in d(signed) and "Credential" not in d(signed)
    assert d(signed).endswith("?v=1")
    assert d("file:///data/x.tar") == "file:///data/x.tar"
    assert d("s3://bucket/x.tar") == "s3://bucket/x.tar"


async def test_downloads_show_progress_while_in_flight(proxy, origin):
    gate = threading.Event()
    origin.files["slow.tar"] = blob(256 * KB, 1)
    # the first 64 KiB come at once, the rest once the gate opens
    origin.faults["slow.tar"] = Fault(chunk=64 * KB, delay=0.0)
    c = await proxy()
    async with c.get("/-/downloads") as r:
        assert (await r.json()) == {"downloads": []}
    origin.faults["slow.tar"] = Fault(gate=gate)

    async def admitted() -> list[dict]:  # listed from its start, "cached" once admitted
        return [row for row in await downloads(c) if row["cached"]]

    task = asyncio.ensure_future(fetch(c, "/slow.tar"))
    try:
        seen = (await until(admitted, 3, what="the download listed, admitted"))[0]
        assert seen["url"] == f"{origin.url}/slow.tar"
        assert seen["size"] == 256 * KB and seen["written"] == 0
        assert seen["state"] in ("opening", "streaming") and seen["reason"] == "demand"
        assert seen["clients"] == 1 and seen["cached"] is True
        async with c.get("/-/stats") as r:
            assert (await r.json())["in_flight"] == 1
    finally:
        gate.set()
    assert await task == origin.files["slow.tar"]

    async def unlisted() -> bool:
        return not await downloads(c)

    await until(unlisted, 3, what="the finished download to leave the list")


async def test_downloads_report_bytes_written_so_far(proxy, origin):
    origin.files["paced.tar"] = blob(512 * KB, 2)
    origin.faults["paced.tar"] = Fault(chunk=32 * KB, delay=0.05)
    c = await proxy()
    task = asyncio.ensure_future(fetch(c, "/paced.tar"))
    fractions = []
    for _ in range(400):  # samples while the download runs
        rows = await downloads(c)
        if rows:
            row = rows[0]
            assert 0 <= row["written"] <= row["size"] == 512 * KB
            assert row["fraction"] == pytest.approx(row["written"] / row["size"])
            fractions.append(row["fraction"])
        elif fractions:
            break
        await asyncio.sleep(0.02)
    assert await task == origin.files["paced.tar"]
    assert fractions == sorted(fractions) and 0 < max(fractions) and len(set(fractions)) > 2


async def test_entries_rank_the_largest_and_the_hottest(proxy, origin, monkeypatch):
    sizes = {"small.tar": 10 * KB, "big.tar": 300 * KB, "mid.tar": 100 * KB}
    for i, (name, n) in enumerate(sizes.items()):
        origin.files[name] = blob(n, 10 + i)
    c = await proxy()
    for name in sizes:
        await fetch(c, f"/{name}")
    for _ in range(3):
        await fetch(c, "/small.tar")
    await fetch(c, "/mid.tar")
    await committed(c, 3)
    store = c.server.app[STORE]
    await asyncio.to_thread(store.flush_access)  # hits reach the index in batches
    async with c.get("/-/entries") as r:
        body = await r.json()
    assert body["top"] == statuspage.TOP_DEFAULT
    assert [e["url"].rsplit("/", 1)[1] for e in body["largest"]] == [
        "big.tar",
        "mid.tar",
        "small.tar",
    ]
    assert [e["size"] for e in body["largest"]] == [300 * KB, 100 * KB, 10 * KB]
    assert [(e["url"].rsplit("/", 1)[1], e["hits"]) for e in body["hottest"]] == [
        ("small.tar", 3),
        ("mid.tar", 1),
        ("big.tar", 0),
    ]
    async with c.get("/-/entries", params={"top": "1"}) as r:
        one = await r.json()
    assert [e["size"] for e in one["largest"]] == [300 * KB] and len(one["hottest"]) == 1
    for bad in ("0", "abc", str(statuspage.TOP_MAX + 1)):
        async with c.get("/-/entries", params={"top": bad}) as r:
            assert r.status == 400 and "top=" in await r.text()
    # a ranking is reused for a few seconds (each is a scan of the index), then made anew
    await fetch(c, "/big.tar")
    await asyncio.to_thread(store.flush_access)
    async with c.get("/-/entries", params={"top": "1"}) as r:
        assert (await r.json()) == one
    c.server.app[statuspage.RANKING].at -= statuspage.ENTRIES_MAX_AGE + 1
    async with c.get("/-/entries", params={"top": "1"}) as r:
        assert (await r.json())["hottest"][0]["hits"] == 3  # big.tar 1, small.tar 3
    async with c.delete("/-/cache") as r:
        assert r.status == 200
    c.server.app[statuspage.RANKING].at = -1e9
    async with c.get("/-/entries") as r:
        assert (await r.json())["largest"] == []


async def test_entries_of_an_empty_new_cache(proxy):
    c = await proxy()
    async with c.get("/-/entries") as r:
        body = await r.json()
    assert body["largest"] == [] and body["hottest"] == []


async def test_entries_scan_the_index_once_whatever_top_clients_ask(proxy, origin, monkeypatch):
    """A ranking is a scan of the whole index (0.3 s for 500,000 entries): clients
    alternating ``top`` values must not have it made anew for each request."""
    for i in range(5):
        origin.files[f"s{i}.tar"] = blob((i + 1) * KB, i)
    c = await proxy()
    for i in range(5):
        await fetch(c, f"/s{i}.tar")
    await committed(c, 5)
    scans = []
    real = statuspage.top_entries

    def counted(cache_dir, n):
        scans.append(n)
        return real(cache_dir, n)

    monkeypatch.setattr(statuspage, "top_entries", counted)
    for top in (10, 11, 1, 2, 100, 3) * 3:
        async with c.get("/-/entries", params={"top": str(top)}) as r:
            body = await r.json()
        assert body["top"] == top
        assert [e["size"] for e in body["largest"]] == [k * KB for k in (5, 4, 3, 2, 1)][:top]
        assert len(body["hottest"]) == min(top, 5)
    assert len(scans) == 1, scans


async def test_with_named_upstreams_the_page_is_at_its_own_path(proxy, origin):
    """With named upstreams (the S3 front's buckets) ``/`` stays the S3 bucket list."""
    c = await proxy(upstreams=(Upstream("data", origin.url),))
    async with c.get("/-/") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
    async with c.get("/-/static/status.js") as r:
        assert r.status == 200
    for path in ("/-/downloads", "/-/entries"):
        async with c.get(path) as r:
            assert r.status == 200, path
    async with c.get("/", allow_redirects=False) as r:
        assert r.status != 302 and "ListAllMyBucketsResult" in await r.text()
