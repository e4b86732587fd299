"""The proxy application in-process (aiohttp test server) against a real origin server."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import aiohttp
import pytest
from support.data import blob
from support.proxy import committed, downloads_done
from support.proxy_helpers import Fault, free_port, raw_request
from support.wait import until

from proxy.app import METRICS, STORE, make_app
from proxy.config import Settings
from proxy.policy import Upstream

pytestmark = pytest.mark.timeout(60)

KB = 1024


@pytest.fixture(params=["sendfile", "no_sendfile"])
def sendfile(request):
    return request.param == "sendfile"


@pytest.fixture
def proxy(aiohttp_client, tmp_path, origin):
    """Factory: an in-process proxy in front of ``origin`` with Settings overrides."""

    async def make(sendfile: bool = True, **overrides):
        base = Settings(
            cache_dir=tmp_path / "cache",
            upstreams=(Upstream(None, origin.url),),
            cache_size=100 << 20,
            read_timeout=5.0,
            retries=2,
            retry_backoff=0.01,
            chunk_size=64 << 10,
        )
        settings = dataclasses.replace(base, **overrides)
        return await aiohttp_client(make_app(settings, sendfile=sendfile))

    return make


def part_files(client) -> list[str]:
    store = client.server.app[STORE]
    return [n for n in os.listdir(store.cache_dir) if n.endswith(".part")]


async def get(client, path, **kw):
    async with client.get(path, **kw) as r:
        return r.status, r.headers, await r.read()


# --- miss, hit, headers -----------------------------------------------------------------


async def test_miss_then_hit(proxy, origin, sendfile):
    data = blob(300 * KB)
    origin.files["a.tar"] = data
    c = await proxy(sendfile=sendfile)
    st, h, body = await get(c, "/a.tar")
    assert (st, h["X-Cache"], body) == (200, "MISS", data)
    assert h["Content-Length"] == str(len(data))
    assert h["ETag"] == origin.etag("a.tar")
    assert h["Accept-Ranges"] == "bytes"
    st, h, body = await get(c, "/a.tar")
    assert (st, h["X-Cache"], body) == (200, "HIT", data)
    assert h["ETag"] == origin.etag("a.tar")
    assert h["Last-Modified"] == "Mon, 01 Jan 2024 00:00:00 GMT"
    assert h["Content-Type"] == "application/x-tar"
    assert origin.gets["a.tar"] == 1
    await downloads_done(c.server.app)
    assert part_files(c) == []


async def test_coalescing_one_upstream_get(proxy, origin):
    data = blob(1 << 20, 1)
    origin.files["c.tar"] = data
    origin.faults["c.tar"] = Fault(delay=0.01)
    c = await proxy()
    results = await asyncio.gather(*(get(c, "/c.tar") for _ in range(10)))
    assert all(st == 200 and body == data for st, _, body in results)
    caches = sorted(h["X-Cache"] for _, h, _ in results)
    assert caches == ["COALESCED"] * 9 + ["MISS"]
    assert origin.gets["c.tar"] == 1


async def test_joiners_and_ranges_mid_download(proxy, origin):
    data = blob(1 << 20, 2)
    origin.files["j.tar"] = data
    origin.faults["j.tar"] = Fault(delay=0.02, chunk=32 * KB)
    c = await proxy()
    async with c.get("/j.tar") as first:
        head = await first.content.readexactly(100 * KB)  # the download is under way
        (st2, h2, body2), (st3, h3, body3) = await asyncio.gather(
            get(c, "/j.tar"), get(c, "/j.tar", headers={"Range": "bytes=500000-600000"})
        )
        rest = await first.read()
    assert head + rest == data
    assert (st2, h2["X-Cache"], body2) == (200, "COALESCED", data)
    assert (st3, h3["X-Cache"]) == (206, "COALESCED")
    assert body3 == data[500000:600001]
    assert h3["Content-Range"] == f"bytes 500000-600000/{len(data)}"
    assert origin.gets["j.tar"] == 1
    assert all(r is None for _, r, _ in origin.ranges)  # no Range went upstream


# --- ranges, HEAD, conditionals ---------------------------------------------------------


@pytest.mark.parametrize("warm", [False, True], ids=["miss", "hit"])
async def test_ranges(proxy, origin, warm, sendfile):
    data = blob(10000, 3)
    origin.files["r.tar"] = data
    c = await proxy(sendfile=sendfile)
    if warm:
        await get(c, "/r.tar")
    cases = {
        "bytes=0-99": (206, data[:100], "bytes 0-99/10000"),
        "bytes=9990-": (206, data[9990:], "bytes 9990-9999/10000"),
        "bytes=-10": (206, data[-10:], "bytes 9990-9999/10000"),
        "bytes=0-8388607": (206, data, "bytes 0-9999/10000"),  # end past the object: clipped
        "bytes=5000-99999999": (206, data[5000:], "bytes 5000-9999/10000"),
        "bytes=0-9,20-29": (200, data, None),  # multi-range: the whole object
        "items=0-5": (200, data, None),
    }
    for rng, (status, body, crange) in cases.items():
        st, h, got = await get(c, "/r.tar", headers={"Range": rng})
        assert (rng, st, got) == (rng, status, body)
        assert h.get("Content-Range") == crange
        assert h["X-Cache"] == ("HIT" if warm else "MISS" if rng == "bytes=0-99" else h["X-Cache"])
    for bad in ("bytes=10000-", "bytes=20000-30000", "bytes=-0", "bytes=5-3", "bytes=x-"):
        st, h, got = await get(c, "/r.tar", headers={"Range": bad})
        assert st == 416, bad
        assert h["Content-Range"] == "bytes */10000"
        assert got.decode().count("\n") == 1
    assert origin.gets["r.tar"] == 1


async def test_head_and_conditionals(proxy, origin):
    data = blob(5000, 4)
    origin.files["h.tar"] = data
    c = await proxy()
    async with c.head("/h.tar") as r:  # a HEAD on a miss starts the download
        assert r.status == 200 and r.headers["Content-Length"] == "5000"
        assert await r.read() == b""
    await get(c, "/h.tar")
    async with c.head("/h.tar") as r:
        assert (r.status, r.headers["X-Cache"], r.headers["Content-Length"]) == (200, "HIT", "5000")
    etag = origin.etag("h.tar")
    for headers in (
        {"If-None-Match": etag},
        {"If-None-Match": f'"other", W/{etag}'},
        {"If-None-Match": "*"},
        {"If-Modified-Since": "Tue, 02 Jan 2024 00:00:00 GMT"},
    ):
        st, h, body = await get(c, "/h.tar", headers=headers)
        assert (st, body, h["ETag"]) == (304, b"", etag), headers
    st, _, body = await get(c, "/h.tar", headers={"If-None-Match": '"other"'})
    assert (st, body) == (200, data)
    st, _, body = await get(
        c, "/h.tar", headers={"If-Modified-Since": "Sun, 31 Dec 2023 00:00:00 GMT"}
    )
    assert (st, body) == (200, data)
    st, _, _ = await get(c, "/h.tar", headers={"If-Match": '"other"'})
    assert st == 412
    # If-Range with a different validator: Range ignored, whole object
    st, _, body = await get(c, "/h.tar", headers={"Range": "bytes=0-9", "If-Range": '"other"'})
    assert (st, body) == (200, data)
    st, _, body = await get(c, "/h.tar", headers={"Range": "bytes=0-9", "If-Range": etag})
    assert (st, body) == (206, data[:10])
    assert origin.gets["h.tar"] == 1


# --- upstream failures -------------------------------------------------------------------


async def test_truncated_upstream_aborts_every_client(proxy, origin):
    data = blob(600 * KB, 5)
    origin.files["t.tar"] = data
    origin.faults["t.tar"] = Fault(truncate_at=200 * KB, delay=0.01)
    c = await proxy()

    async def read_fails():
        with pytest.raises(aiohttp.ClientPayloadError):
            async with c.get("/t.tar") as r:
                assert r.status == 200
                await r.read()

    await asyncio.gather(*(read_fails() for _ in range(3)))
    assert part_files(c) == []
    assert await asyncio.to_thread(c.server.app[STORE].get, f"{origin.url}/t.tar") is None
    metrics = c.server.app[METRICS]
    assert metrics.failed_downloads._value.get() == 1
    assert origin.gets["t.tar"] == 3  # one GET plus two resume attempts
    assert origin.ranges[-1][1] == f"bytes={200 * KB}-"


async def test_chunked_truncation_aborts(proxy, origin):
    origin.files["tc.tar"] = blob(300 * KB, 6)
    origin.faults["tc.tar"] = Fault(truncate_at=100 * KB, chunked=True)
    c = await proxy(retries=0)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with c.get("/tc.tar") as r:
            await r.read()
    assert part_files(c) == []


async def test_resume_with_range_and_if_match(proxy, origin):
    data = blob(700 * KB, 7)
    origin.files["d.tar"] = data
    origin.faults["d.tar"] = Fault(drop_once_at=250 * KB)
    c = await proxy()
    st, h, body = await get(c, "/d.tar")
    assert (st, body) == (200, data)
    assert origin.gets["d.tar"] == 2
    name, rng, if_match = origin.ranges[1]
    assert rng == f"bytes={250 * KB}-" and if_match == origin.etag("d.tar")
    st, h, body = await get(c, "/d.tar")
    assert (h["X-Cache"], body) == ("HIT", data)


async def test_resume_refused_when_object_changed(proxy, origin):
    data = blob(300 * KB, 8)
    origin.files["e.tar"] = data
    origin.faults["e.tar"] = Fault(drop_once_at=100 * KB, ignore_range=True)
    c = await proxy()
    with pytest.raises(aiohttp.ClientPayloadError):
        await get(c, "/e.tar")
    assert part_files(c) == []


async def test_md5_mismatch_is_not_cached(proxy, origin):
    origin.files["m.tar"] = blob(100 * KB, 9)
    origin.faults["m.tar"] = Fault(bad_md5=True)
    c = await proxy()
    with pytest.raises(aiohttp.ClientPayloadError):
        await get(c, "/m.tar")
    assert await asyncio.to_thread(c.server.app[STORE].get, f"{origin.url}/m.tar") is None


async def test_chunked_upstream_unknown_length(proxy, origin):
    data = blob(400 * KB, 10)
    origin.files["u.tar"] = data
    origin.faults["u.tar"] = Fault(chunked=True)
    c = await proxy()
    st, h, body = await get(c, "/u.tar")
    assert (st, h["X-Cache"], body) == (200, "MISS", data)
    st, h, body = await get(c, "/u.tar", headers={"Range": "bytes=10-19"})
    assert (st, h["X-Cache"], body) == (206, "HIT", data[10:20])


async def test_upstream_error_mapping(proxy, origin, tmp_path):
    origin.faults["500.tar"] = Fault(status=500)
    origin.faults["403.tar"] = Fault(status=403)
    origin.faults["hang.tar"] = Fault(hang=True)
    c = await proxy(read_timeout=0.5)
    # the upstream's answers are passed on as they were, the proxy's account in a header
    for path, status, origin_body in (
        ("/missing.tar", 404, "not found\n"),
        ("/500.tar", 500, "fault 500\n"),
        ("/403.tar", 403, "fault 403\n"),
    ):
        st, h, body = await get(c, path)
        assert (st, body.decode()) == (status, origin_body), path
        assert path[1:] in h["X-Shardcache-Error"]
    # the proxy's own errors: a one-line message naming the path
    st, _, body = await get(c, "/hang.tar")
    text = body.decode()
    assert st == 504 and text.endswith("\n") and text.count("\n") == 1 and "hang.tar" in text
    await get(c, "/missing.tar")
    assert origin.gets["missing.tar"] == 2  # a 404 is not cached
    dead = await proxy(
        upstreams=(Upstream(None, f"http://127.0.0.1:{free_port()}"),), cache_dir=tmp_path / "c2"
    )
    st, _, body = await get(dead, "/x.tar")
    assert st == 502 and b"unreachable" in body


async def test_file_upstream(proxy, tmp_path):
    src = tmp_path / "src" / "sub"
    src.mkdir(parents=True)
    data = blob(200 * KB, 11)
    (src / "f.tar").write_bytes(data)
    c = await proxy(upstreams=(Upstream("local", (tmp_path / "src").as_uri()),))
    st, h, body = await get(c, "/local/sub/f.tar")
    assert (st, h["X-Cache"], body) == (200, "MISS", data)
    st, h, body = await get(c, "/local/sub/f.tar")
    assert (st, h["X-Cache"], body) == (200, "HIT", data)
    st, _, _ = await get(c, "/local/sub/nope.tar")
    assert st == 404


# --- eviction, bypass, keep ------------------------------------------------------------


async def test_lru_eviction_under_pressure(proxy, origin):
    size = 100 * KB
    for name in "abcd":
        origin.files[f"{name}.tar"] = blob(size, ord(name))
    c = await proxy(cache_size=int(2.5 * size))
    store = c.server.app[STORE]
    for name in ("a", "b", "a", "c"):  # a is used again, so b is least recently used
        st, _, body = await get(c, f"/{name}.tar")
        assert body == origin.files[f"{name}.tar"]
        await downloads_done(c.server.app)
        on_disk = sum(e.size for e in store.entries())
        assert on_disk <= 2.5 * size
    caches = {n: (await get(c, f"/{n}.tar"))[1]["X-Cache"] for n in ("a", "c", "b")}
    assert caches == {"a": "HIT", "c": "HIT", "b": "MISS"}
    await downloads_done(c.server.app)
    m = c.server.app[METRICS]
    assert m.evictions._value.get() >= 1
    files = [n for n in os.listdir(store.cache_dir) if not n.startswith(".")]
    assert sum(os.path.getsize(store.cache_dir / n) for n in files) <= 2.5 * size


async def test_bypass_too_big(proxy, origin):
    data = blob(300 * KB, 12)
    origin.files["big.tar"] = data
    c = await proxy(cache_size=100 * KB)
    for _ in range(2):
        st, h, body = await get(c, "/big.tar")
        assert (st, h["X-Cache"], body) == (200, "BYPASS", data)
    st, h, body = await get(c, "/big.tar", headers={"Range": "bytes=1000-1999"})
    assert (st, h["X-Cache"], body) == (206, "BYPASS", data[1000:2000])
    assert c.server.app[STORE].entries() == []
    results = await asyncio.gather(*(get(c, "/big.tar") for _ in range(3)))
    assert all(b == data for _, _, b in results)


async def test_keep_policy_stops_admitting(proxy, origin):
    for name in "abc":
        origin.files[f"{name}.tar"] = blob(100 * KB, ord(name))
    c = await proxy(cache_size=250 * KB, eviction="keep")
    assert [(await get(c, f"/{n}.tar"))[1]["X-Cache"] for n in "abc"] == ["MISS", "MISS", "BYPASS"]
    assert [(await get(c, f"/{n}.tar"))[1]["X-Cache"] for n in "abc"] == ["HIT", "HIT", "BYPASS"]


# --- bad input ---------------------------------------------------------------------------


async def test_bad_requests(proxy, origin):
    origin.files["ok.tar"] = b"fine"
    origin.files["sub/ok.tar"] = b"fine too"
    c = await proxy(allow_hosts=(f"127.0.0.1:{origin.port}",), max_path_length=200)
    port = c.server.port
    cases = {
        "/../etc/passwd": 400,
        "/a/../../etc/passwd": 400,
        "/%2e%2e/etc/passwd": 400,
        "/a/%2E%2E/%2e%2e/etc": 400,
        "/a%2F..%2Fb": 400,
        "/x%00.tar": 400,
        "/" + "a" * 300: 400,
        "/https://evil.example.com/x.tar": 403,
        "/http://127.0.0.1:1/x.tar": 403,
        f"/http://127.0.0.1:{origin.port}/ok.tar": 200,
        f"/http://127.0.0.1:{origin.port}/sub/ok.tar": 200,
        "/sub/ok.tar": 200,
    }
    for target, status in cases.items():
        st, body = await asyncio.to_thread(raw_request, port, target)
        assert (target, st) == (target, status), body
        if status >= 400:
            assert body.count("\n") == 1 and len(body) < 300
    st, body = await asyncio.to_thread(raw_request, port, "/ok.tar", "POST")
    assert st == 405
    st, body = await asyncio.to_thread(raw_request, port, "/ok.tar", "PUT")
    assert st == 405
    st, _ = await asyncio.to_thread(raw_request, port, "/-/stats", "POST")
    assert st == 405


# --- admin ------------------------------------------------------------------------------


async def test_admin_token_stats_metrics_prefetch_purge(proxy, origin):
    for i in range(3):
        origin.files[f"shard-{i}.tar"] = blob(50 * KB, 100 + i)
    c = await proxy(admin_token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    body = {"pattern": "/shard-{0..2}.tar"}
    async with c.post("/-/prefetch", json=body) as r:
        assert r.status == 401 and "token" in await r.text()
    async with c.post("/-/prefetch", json=body, headers={"Authorization": "Bearer nope"}) as r:
        assert r.status == 403
    async with c.post(
        "/-/prefetch", json={"urls": ["https://evil.example.com/x.tar"]}, headers=auth
    ) as r:
        # a URL under no upstream is a bad request (as for /-/plans) that names them
        assert r.status == 400 and "under none of this proxy's upstreams" in await r.text()
    async with c.post("/-/prefetch", data=b"{not json", headers=auth) as r:
        assert r.status == 400
    async with c.post("/-/prefetch", json=body, headers=auth) as r:
        assert r.status == 202 and (await r.json()) == {"accepted": 3}
    stats = await committed(c, 3)
    assert stats["bytes"] == 150 * KB
    for key in ("limit", "hit_ratio", "in_flight", "upstream_bytes", "served_bytes"):
        assert key in stats
    assert (await get(c, "/shard-1.tar"))[1]["X-Cache"] == "HIT"
    async with c.post(
        "/-/prefetch", json={"urls": [f"{origin.url}/shard-0.tar"]}, headers=auth
    ) as r:
        assert r.status == 202
    async with c.delete("/-/cache", params={"url": "/shard-0.tar"}) as r:
        assert r.status == 401
    async with c.delete("/-/cache", params={"url": "/shard-0.tar"}, headers=auth) as r:
        assert (await r.json()) == {"removed": 1}
    assert (await get(c, "/shard-0.tar"))[1]["X-Cache"] == "MISS"
    await downloads_done(c.server.app)
    async with c.delete("/-/cache", headers=auth) as r:
        assert (await r.json()) == {"removed": 3}
    assert (await get(c, "/shard-2.tar"))[1]["X-Cache"] == "MISS"
    assert origin.gets == {"shard-0.tar": 2, "shard-1.tar": 1, "shard-2.tar": 2}
    async with c.get("/metrics") as r:
        text = await r.text()
    for name in (
        "shardcache_requests_total",
        "shardcache_response_bytes_total",
        "shardcache_upstream_requests_total",
        "shardcache_upstream_bytes_total",
        "shardcache_cache_size_bytes",
        "shardcache_cache_limit_bytes",
        "shardcache_cache_entries",
        "shardcache_evictions_total",
        "shardcache_evicted_bytes_total",
        "shardcache_downloads_in_progress",
        "shardcache_time_to_first_byte_seconds_bucket",
    ):
        assert name in text, name
    assert 'shardcache_requests_total{cache="HIT",code="200"} 1.0' in text
    async with c.get("/-/healthz") as r:
        assert r.status == 200
    async with c.get("/-/readyz") as r:
        assert r.status == 200


async def test_gated_download_then_shutdown_leaves_no_partial(proxy, origin):
    origin.files["g.tar"] = blob(200 * KB, 13)
    gate = threading.Event()
    origin.faults["g.tar"] = Fault(gate=gate)
    c = await proxy()
    task = asyncio.ensure_future(get(c, "/g.tar"))
    await until(lambda: part_files(c), 2, what="the download's .part file")
    assert len(part_files(c)) == 1
    await c.server.app.cleanup()  # as on shutdown: downloads cancelled, partials deleted
    assert part_files(c) == []
    gate.set()
    with pytest.raises(aiohttp.ClientError):
        await task


async def test_service_routes_are_counted_apart_from_shard_reads(tmp_path, aiohttp_client):
    """Scrapes, probes and admin calls never enter requests_total (the base of the hit
    ratio): they are counted in service_requests_total by route."""
    from aiohttp import web as _web

    from proxy.app import METRICS, make_app
    from proxy.config import parse_settings

    async def shard(request):
        return _web.Response(body=b"x" * 100)

    origin_app = _web.Application()
    origin_app.router.add_get("/{name}", shard)
    origin = await aiohttp_client(origin_app)
    settings = parse_settings(
        ["--cache-dir", str(tmp_path / "c"), "--upstream", str(origin.make_url("/"))], {}
    )
    client = await aiohttp_client(make_app(settings))
    for path in ("/-/healthz", "/-/readyz", "/metrics", "/-/stats", "/-/nope"):
        await (await client.get(path)).read()
    for _ in range(2):
        r = await client.get("/a.tar")
        assert await r.read() == b"x" * 100
    m = client.app[METRICS]

    def counted() -> dict:
        out: dict = {}
        for metric in m.exposed.collect():
            for s in metric.samples:
                if s.name in ("shardcache_requests_total", "shardcache_service_requests_total"):
                    key = (s.name, s.labels.get("cache") or s.labels.get("route"))
                    out[key] = out.get(key, 0) + s.value
        return out

    # a response is counted once its handler returns, a moment after the client has it
    def both() -> dict | None:
        totals = counted()
        n = sum(v for k, v in totals.items() if k[0] == "shardcache_requests_total")
        return totals if n >= 2 else None

    totals = await until(both, 2, what=lambda: f"two requests counted: {counted()}")
    assert totals[("shardcache_requests_total", "MISS")] == 1, totals
    assert totals.get(("shardcache_requests_total", "HIT")) == 1, sorted(totals.items())
    assert ("shardcache_requests_total", "NONE") not in totals
    for route in ("healthz", "readyz", "metrics", "stats", "other"):
        assert totals[("shardcache_service_requests_total", route)] >= 1, route


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "proxy.internal"])
async def test_mutating_admin_routes_closed_on_a_network_address_without_a_token(
    proxy, origin, host, caplog
):
    import logging

    with caplog.at_level(logging.WARNING, logger="proxy.app"):
        c = await proxy(host=host)
    assert "without --admin-token" in caplog.text
    async with c.post("/-/prefetch", json={"urls": ["/a.tar"]}) as r:
        assert r.status == 403
        assert "--admin-token" in await r.text()
    async with c.delete("/-/cache") as r:
        assert r.status == 403
    async with c.post("/-/plans", json={"urls": ["/a.tar"]}) as r:
        assert r.status == 403
        assert "--admin-token" in await r.text()
    async with c.delete("/-/plans/p-000000000000") as r:
        assert r.status == 403
    async with c.get("/-/stats") as r:  # reading stays open
        assert r.status == 200
    async with c.get("/-/plans") as r:
        assert r.status == 200
    # with a token the routes open again
    c = await proxy(host=host, admin_token="t0k")
    async with c.delete("/-/cache", headers={"Authorization": "Bearer t0k"}) as r:
        assert r.status == 200, await r.text()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
async def test_mutating_admin_routes_open_on_loopback_without_a_token(proxy, host):
    c = await proxy(host=host)
    async with c.delete("/-/cache") as r:
        assert r.status == 200, await r.text()


async def test_passing_probes_and_scrapes_are_logged_at_debug_shard_reads_at_info(
    proxy, origin, caplog
):
    import logging

    origin.files["a.tar"] = b"x" * 1000
    c = await proxy()
    with caplog.at_level(logging.DEBUG, logger="shardcache.access"):
        for path in ("/-/healthz", "/-/readyz", "/metrics", "/a.tar", "/-/stats"):
            async with c.get(path) as r:
                assert r.status == 200, path
                await r.read()
    levels = {
        rec.getMessage().split('"')[1].split()[1]: rec.levelno
        for rec in caplog.records
        if rec.name == "shardcache.access"
    }
    assert levels == {
        "/-/healthz": logging.DEBUG,
        "/-/readyz": logging.DEBUG,
        "/metrics": logging.DEBUG,
        "/a.tar": logging.INFO,
        "/-/stats": logging.INFO,
    }, levels


async def test_readyz_says_why_it_is_not_ready(proxy):
    from proxy.app import _on_shutdown

    c = await proxy()
    async with c.get("/-/readyz") as r:
        assert r.status == 200 and await r.text() == "ready\n"
    await _on_shutdown(c.server.app)
    async with c.get("/-/readyz") as r:
        text = await r.text()
    assert r.status == 503
    assert text.startswith("not ready: shutting down") and text.count("\n") == 1


async def test_a_content_type_with_parameters_is_served_as_sent(aiohttp_client, tmp_path):
    """A small entry (RAM tier), a large one (sendfile) and a miss, each typed
    ``text/plain; charset=utf-8`` by the upstream: 200 with that type, never a 500."""
    from aiohttp import web as _web

    from proxy.app import make_app
    from proxy.config import parse_settings

    bodies = {"small.txt": b"a" * 10, "large.txt": b"b" * (600 << 10)}

    async def handler(request):
        return _web.Response(
            body=bodies[request.match_info["name"]],
            headers={"Content-Type": "text/plain; charset=utf-8"},
        )

    origin_app = _web.Application()
    origin_app.router.add_get("/{name}", handler)
    origin = await aiohttp_client(origin_app)
    settings = parse_settings(
        ["--cache-dir", str(tmp_path / "c"), "--upstream", str(origin.make_url("/"))], {}
    )
    client = await aiohttp_client(make_app(settings))
    for name, body in bodies.items():
        for _ in range(3):  # miss, then hits (after the commit)
            async with client.get(f"/{name}") as r:
                assert r.status == 200, await r.text()
                assert r.headers["Content-Type"] == "text/plain; charset=utf-8"
                assert await r.read() == body
            await downloads_done(client.server.app)
        async with client.get(f"/{name}", headers={"Range": "bytes=2-4"}) as r:
            assert r.status == 206 and await r.read() == body[2:5]
