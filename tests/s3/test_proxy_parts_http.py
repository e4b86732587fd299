"""The proxy over HTTP origins: parallel ranged parts only for shards above --part-size
with --parallel > 1; otherwise one GET per shard. Also the S3 flags of ``serve``."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from support.data import PARTS_OBJECT as DATA
from support.origins import RangedOrigin as Origin

from proxy.app import METRICS, make_app
from proxy.config import parse_settings
from shardcache.errors import ConfigError

KIB = 1024


async def _proxy(aiohttp_client, aiohttp_server, tmp_path, data: bytes, *flags: str):
    origin = Origin(data)
    app = web.Application()

    async def handle(request: web.Request) -> web.StreamResponse:
        return await origin.handle(request)  # looked up per request: tests swap it

    app.router.add_route("*", "/obj.tar", handle)
    server = await aiohttp_server(app)
    settings = parse_settings(
        ["--cache-dir", str(tmp_path / "c"), "--upstream", str(server.make_url("")), *flags]
    )
    client = await aiohttp_client(make_app(settings))
    return origin, client


@pytest.mark.parametrize(
    "flags, first",
    [
        (("--http-parts", "on", "--part-size", "128KiB", "--parallel", "4"), "bytes=0-131071"),
        (("--part-size", "128KiB", "--parallel", "4"), None),  # http parts are opt-in
        (("--http-parts", "on", "--part-size", "128KiB", "--parallel", "1"), None),
        (("--http-parts", "on", "--part-size", "0"), None),
        # default 8 MiB parts: a 1 MB shard comes whole in the answer to the first part
        (("--http-parts", "on"), "bytes=0-8388607"),
    ],
)
async def test_http_parts_only_above_part_size_and_with_parallel(
    aiohttp_client, aiohttp_server, tmp_path, flags, first
):
    origin, client = await _proxy(aiohttp_client, aiohttp_server, tmp_path, DATA, *flags)
    for _ in range(2):  # cold, then warm from the cache
        resp = await client.get("/obj.tar")
        assert resp.status == 200
        assert await resp.read() == DATA
    gets = [r for m, r in origin.requests if m == "GET"]
    assert gets[0] == first  # the first request asks for the first part only
    parts = first is not None and first != "bytes=0-8388607"
    assert len(gets) == (-(-len(DATA) // (128 * KIB)) if parts else 1)
    assert all(r is not None for r in gets) if first else gets == [None]
    m = client.app[METRICS]
    assert m.upstream_bytes._value.get() == len(DATA)  # bytes fetched = 1x the shard
    # and bytes the origin sent: no plain GET closed after its first part with the rest
    # of the object in flight
    assert origin.sent == len(DATA)


async def test_http_parts_fall_back_to_a_plain_get_when_the_first_answer_cannot_pin_them(
    aiohttp_client, aiohttp_server, tmp_path
):
    flags = ("--http-parts", "on", "--part-size", "128KiB", "--parallel", "4")
    # an empty object: the ranged GET is not satisfiable (416), a plain GET answers
    origin, client = await _proxy(aiohttp_client, aiohttp_server, tmp_path, b"", *flags)
    inner = origin.handle

    async def empty(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Range"):
            origin.requests.append((request.method, request.headers["Range"]))
            return web.Response(status=416, headers={"Content-Range": "bytes */0"})
        return await inner(request)

    origin.handle = empty  # type: ignore[method-assign]
    resp = await client.get("/obj.tar")
    assert resp.status == 200 and await resp.read() == b""
    assert [r for m, r in origin.requests if m == "GET"] == ["bytes=0-131071", None]

    # a weak ETag cannot pin parts to one version: the whole object in one plain GET
    origin, client = await _proxy(aiohttp_client, aiohttp_server, tmp_path / "w", DATA, *flags)
    origin.etag = "W/" + origin.etag
    resp = await client.get("/obj.tar")
    assert resp.status == 200 and await resp.read() == DATA
    assert [r for m, r in origin.requests if m == "GET"] == ["bytes=0-131071", None]
    resp = await client.get("/obj.tar")
    assert resp.headers["X-Cache"] == "HIT" and await resp.read() == DATA


async def test_http_part_failing_every_time_is_never_cached(
    aiohttp_client, aiohttp_server, tmp_path
):
    origin, client = await _proxy(
        aiohttp_client,
        aiohttp_server,
        tmp_path,
        DATA,
        "--http-parts",
        "on",
        "--part-size",
        "128KiB",
        "--parallel",
        "4",
        "--retries",
        "1",
    )
    inner = origin.handle

    async def broken(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Range", "").startswith(f"bytes={3 * 128 * KIB}-"):
            origin.requests.append((request.method, request.headers["Range"]))
            return web.Response(status=500)
        return await inner(request)

    origin.handle = broken  # type: ignore[method-assign]
    resp = await client.get("/obj.tar")
    with pytest.raises(aiohttp.ClientPayloadError):  # a truncated body, never a clean EOF
        await resp.read()
    origin.handle = inner  # type: ignore[method-assign]
    resp = await client.get("/obj.tar")
    assert resp.status == 200 and await resp.read() == DATA


def test_serve_flags_for_s3(tmp_path):
    base = ["--cache-dir", str(tmp_path)]
    s = parse_settings(
        [*base, "--upstream", "shards=s3://bucket/prefix", "--s3-endpoint-url", "http://h:1"],
        environ={},
    )
    assert s.upstreams[0].base == "s3://bucket/prefix" and s.upstreams[0].name == "shards"
    assert (s.part_size, s.parallel) == (8 * 1024 * 1024, 8)
    s = parse_settings(
        [*base, "--upstream", "s3://bkt"],
        environ={
            "SHARDCACHE_PART_SIZE": "1MiB",
            "SHARDCACHE_PARALLEL": "2",
            "SHARDCACHE_S3_REGION": "eu-west-1",
            "SHARDCACHE_S3_FRONT_ACCESS_KEY": "a",
            "SHARDCACHE_S3_FRONT_SECRET_KEY": "b",
        },
    )
    assert (s.part_size, s.parallel, s.s3_region) == (1024 * 1024, 2, "eu-west-1")
    assert (s.s3_front_access_key, s.s3_front_secret_key) == ("a", "b")
    for argv, flag in [
        (["--upstream", "s3://Bad_Bucket!/x"], "--upstream"),
        (["--upstream", "s3://bkt", "--part-size", "lots"], "--part-size"),
        (["--upstream", "s3://bkt", "--parallel", "0"], "--parallel"),
        (["--upstream", "s3://bkt", "--s3-endpoint-url", "h:9000"], "--s3-endpoint-url"),
        (["--upstream", "s3://bkt", "--s3-front-access-key", "a"], "--s3-front-secret-key"),
        (["--upstream", "s3://bkt", "--s3-front-secret-key", "b"], "--s3-front-access-key"),
    ]:
        with pytest.raises(ConfigError) as ei:
            parse_settings([*base, *argv], environ={})
        assert flag in str(ei.value), (argv, str(ei.value))


async def test_http_parts_from_an_origin_that_ignores_range(
    aiohttp_client, aiohttp_server, tmp_path
):
    # like python's http.server: a 200 with the whole object whatever the Range says
    flags = ("--http-parts", "on", "--part-size", "128KiB", "--parallel", "4")
    origin, client = await _proxy(aiohttp_client, aiohttp_server, tmp_path, DATA, *flags)
    inner = origin.handle

    async def plain(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Range"):
            origin.requests.append((request.method, "ignored " + request.headers["Range"]))
        return await inner(request.clone(headers={"Host": request.host}))

    origin.handle = plain  # type: ignore[method-assign]
    for cache in ("MISS", "HIT"):
        resp = await client.get("/obj.tar")
        assert resp.status == 200 and resp.headers["X-Cache"] == cache
        assert await resp.read() == DATA
    # one GET, read whole: no parts asked of an origin that cannot serve them
    assert [r for m, r in origin.requests if m == "GET" and r] == ["ignored bytes=0-131071"]
    assert origin.sent == len(DATA)
