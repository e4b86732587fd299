"""Revalidation of cached entries (``--revalidate never|always|<age>``) and what the proxy
never caches (``Cache-Control: no-store``/``private``, directory paths, redirects).

The origin here changes its objects between requests and answers conditional requests
(``If-None-Match`` / ``If-Modified-Since``) with 304; it records every request it sees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import http.client
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import pytest
from aiohttp import web
from support.data import sha
from support.proxy import stats
from support.proxy_helpers import Origin, ProxyProcess
from support.store_faults import run_serve
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KiB = 1 << 10
BASE_MTIME = 1_704_067_200  # 2024-01-01 00:00:00 GMT


@dataclass
class Seen:
    """One request as the origin saw it."""

    method: str
    path: str  # raw, as sent (a trailing slash is kept)
    if_none_match: str | None
    if_modified_since: str | None
    range: str | None
    status: int = 0

    @property
    def conditional(self) -> bool:
        return self.if_none_match is not None or self.if_modified_since is not None


class RevalOrigin(Origin):
    """An origin whose objects change: ETag (md5 of the content) and Last-Modified move
    with :meth:`put`; conditional requests get 304; per-path Cache-Control headers and
    redirects; ``dir/`` paths answer a listing."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mtimes: dict[str, int] = {}
        self.cache_control: dict[str, str] = {}
        self.redirects: dict[str, str] = {}
        self.listings: dict[str, bytes] = {}
        self.seen: list[Seen] = []
        self.not_modified_delay = 0.0
        self._version = 0

    def put(self, name: str, data: bytes) -> None:
        self._version += 1
        self.mtimes[name] = BASE_MTIME + 100 * self._version
        self.files[name] = data

    def delete(self, name: str) -> None:
        del self.files[name]

    def last_modified(self, name: str) -> str:
        return email.utils.formatdate(self.mtimes.get(name, BASE_MTIME), usegmt=True)

    def since(self, start: int) -> list[Seen]:
        return self.seen[start:]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        rec = Seen(
            request.method,
            request.raw_path,
            request.headers.get("If-None-Match"),
            request.headers.get("If-Modified-Since"),
            request.headers.get("Range"),
        )
        self.seen.append(rec)
        if request.method == "GET":
            self.gets[name] += 1
        resp = await self._answer(request, name, rec)
        rec.status = resp.status
        return resp

    async def _answer(self, request: web.Request, name: str, rec: Seen) -> web.StreamResponse:
        if name in self.redirects:
            return web.Response(
                status=302, headers={"Location": self.redirects[name]}, text="moved\n"
            )
        if name in self.listings:
            return web.Response(body=self.listings[name], content_type="text/html")
        data = self.files.get(name)
        if data is None:
            return web.Response(status=404, text="not found\n")
        etag = self.etag(name)
        headers = {"ETag": etag, "Last-Modified": self.last_modified(name)}
        if name in self.cache_control:
            headers["Cache-Control"] = self.cache_control[name]
        not_modified = False
        if rec.if_none_match is not None:
            tags = [t.strip().removeprefix("W/") for t in rec.if_none_match.split(",")]
            not_modified = "*" in tags or etag in tags
        elif rec.if_modified_since is not None:
            since = email.utils.parsedate_to_datetime(rec.if_modified_since).timestamp()
            not_modified = self.mtimes.get(name, BASE_MTIME) <= since
        if not_modified:
            if self.not_modified_delay:
                await asyncio.sleep(self.not_modified_delay)
            return web.Response(status=304, headers=headers)
        headers["Content-Type"] = "application/x-tar"
        start, status = 0, 200
        if rec.range is not None:
            if_match = request.headers.get("If-Match")
            if if_match is not None and if_match != etag:
                return web.Response(status=412, text="precondition failed\n")
            m = re.match(r"bytes=(\d+)-$", rec.range)
            assert m, rec.range
            start, status = int(m.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        return web.Response(status=status, body=data[start:], headers=headers)


# --- fixtures and helpers --------------------------------------------------------------


@pytest.fixture
def origin():
    o = RevalOrigin().start()
    yield o
    o.stop()


@pytest.fixture
def proxies(tmp_path):
    started: list[ProxyProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ProxyProcess:
        p = ProxyProcess(tmp_path / f"cache{len(started)}", *args, env=env).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop(signal.SIGKILL)


def get(port: int, path: str, timeout: float = 30) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One GET with http.client (which follows no redirect): (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.length:  # read() does not raise on a body cut short
            raise AssertionError(f"{path}: body cut short, {resp.length} bytes missing")
        return resp.status, resp.headers, body
    finally:
        conn.close()


def got(port: int, path: str) -> tuple[int, str | None, str]:
    """(status, X-Cache, sha256 of the body)."""
    st, h, body = get(port, path)
    return st, h.get("X-Cache"), sha(body)


def settle(port: int, timeout: float = 15) -> dict:
    """Wait until the proxy has no download in flight (commits follow the last byte)."""
    seen: dict = {}

    def idle() -> dict | None:
        st = seen["stats"] = stats(port)
        return st if st["in_flight"] == 0 else None

    return wait_until(idle, timeout, 0.02, what=lambda: f"downloads to finish: {seen['stats']}")


def assert_revalidated(seen: list[Seen], etag: str, status: int) -> None:
    """Exactly one upstream request, conditional on the cached validators."""
    assert len(seen) == 1, seen
    r = seen[0]
    assert r.conditional and r.range is None, r
    assert r.if_none_match == etag or (r.if_none_match is None and r.if_modified_since), r
    assert r.status == status, r


# --- never (the default), always, max age ------------------------------------------------


def test_default_never_revalidates(origin, proxies):
    v1, v2 = os.urandom(200 * KiB), os.urandom(200 * KiB)
    origin.put("a.tar", v1)
    p = proxies("--upstream", origin.url)
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    settle(p.port)
    origin.put("a.tar", v2)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    time.sleep(1.0)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert origin.gets["a.tar"] == 1 and len(origin.seen) == 1


def test_always_revalidates_each_get(origin, proxies):
    v1, v2 = os.urandom(300 * KiB), os.urandom(300 * KiB)
    origin.put("a.tar", v1)
    p = proxies("--upstream", origin.url, "--revalidate", "always")
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    settle(p.port)
    assert len(origin.seen) == 1 and not origin.seen[0].conditional

    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)

    etag1 = origin.etag("a.tar")
    origin.put("a.tar", v2)
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v2))
    # the conditional GET saw the change; a second, plain GET may fetch the new version
    new = origin.since(n)
    assert_revalidated(new[:1], etag1, 200)
    assert all(not r.conditional and r.status == 200 for r in new[1:]) and len(new) <= 2, new
    settle(p.port)
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v2))
    assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)

    origin.delete("a.tar")
    n = len(origin.seen)
    st, _, _ = get(p.port, "/a.tar")
    assert st == 404
    assert [r.status for r in origin.since(n)] == [404]
    settle(p.port)
    assert stats(p.port)["entries"] == 0
    n = len(origin.seen)
    st, _, _ = get(p.port, "/a.tar")
    assert st == 404
    new = origin.since(n)
    assert len(new) == 1 and not new[0].conditional and new[0].status == 404, new


def test_max_age_revalidates_once_it_passes(origin, proxies):
    v1 = os.urandom(200 * KiB)
    origin.put("a.tar", v1)
    p = proxies("--upstream", origin.url, "--revalidate", "2s")
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    cached = time.monotonic()
    settle(p.port)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert time.monotonic() - cached < 1.5, "too slow to test a GET within the max age"
    assert len(origin.seen) == 1  # fresh: no upstream request at all
    time.sleep(max(0.0, cached + 2.5 - time.monotonic()))
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)


def test_revalidate_from_the_environment(origin, proxies):
    v1 = os.urandom(100 * KiB)
    origin.put("a.tar", v1)
    p = proxies("--upstream", origin.url, env={"SHARDCACHE_REVALIDATE": "always"})
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    settle(p.port)
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)


def test_revalidate_bad_value_is_a_usage_error(tmp_path):
    rc, out, served = run_serve(
        "--cache-dir",
        str(tmp_path / "cache"),
        "--upstream",
        "http://127.0.0.1:9",
        "--revalidate",
        "soon",
    )
    assert not served, out
    assert rc == 2, out
    assert "--revalidate" in out and "unrecognized arguments" not in out, out


def test_concurrent_gets_of_a_stale_entry_cost_one_conditional_request(origin, proxies):
    v1 = os.urandom(500 * KiB)
    origin.put("a.tar", v1)
    origin.not_modified_delay = 0.5  # every GET below arrives while the 304 is on its way
    p = proxies("--upstream", origin.url, "--revalidate", "1s")
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    settle(p.port)
    time.sleep(1.5)
    n = len(origin.seen)
    barrier = threading.Barrier(8, timeout=10)

    def one(_: int) -> tuple[int, str | None, str]:
        barrier.wait()
        return got(p.port, "/a.tar")

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8), timeout=60))
    assert all(st == 200 and digest == sha(v1) for st, _, digest in results), results
    assert {cache for _, cache, _ in results} <= {"HIT", "COALESCED"}, results
    assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)


# --- never cached ------------------------------------------------------------------------


@pytest.mark.parametrize("cache_control", ["no-store", "private"])
def test_no_store_and_private_are_never_cached(origin, proxies, cache_control):
    data = os.urandom(300 * KiB)
    origin.put("n.tar", data)
    origin.cache_control["n.tar"] = cache_control
    p = proxies("--upstream", origin.url)
    for i in range(3):
        assert got(p.port, "/n.tar") == (200, "BYPASS", sha(data))
        settle(p.port)
        assert origin.gets["n.tar"] == i + 1
    assert all(not r.conditional for r in origin.seen), origin.seen
    s = stats(p.port)
    assert s["entries"] == 0 and s["bytes"] == 0, s
    assert [n for n in os.listdir(p.cache_dir) if not n.startswith(".")] == []


def test_directory_path_keeps_its_slash_and_is_not_cached(origin, proxies):
    listing = b'<html><a href="a.tar">a.tar</a></html>\n'
    origin.listings["dir/"] = listing
    origin.put("dir", b"the object named dir, not the directory\n")
    p = proxies("--upstream", origin.url)
    for i in range(2):
        st, h, body = get(p.port, "/dir/")
        assert (st, h.get("X-Cache"), body) == (200, "BYPASS", listing)
        assert [r.path for r in origin.seen] == ["/dir/"] * (i + 1)
        settle(p.port)
    assert stats(p.port)["entries"] == 0


def test_redirect_is_followed_and_cached_under_the_url_asked(origin, proxies):
    """A redirect to the upstream's own host is followed inside the proxy: the client
    gets the bytes (never the redirect), cached under the URL it asked for."""
    data = os.urandom(100 * KiB)
    origin.put("real.tar", data)
    origin.redirects["moved.tar"] = f"{origin.url}/real.tar"
    p = proxies("--upstream", origin.url)
    for i in range(2):
        st, h, body = get(p.port, "/moved.tar")
        assert (st, h.get("X-Cache"), body == data) == (200, "HIT" if i else "MISS", True)
        assert "Location" not in h
        assert origin.gets["moved.tar"] == 1 and origin.gets["real.tar"] == 1
        settle(p.port)
    assert stats(p.port)["entries"] == 1
