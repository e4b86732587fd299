"""The proxy over HTTP origins: parallel ranged parts only for shards above --part-size
with --parallel > 1; otherwise one GET per shard. Also the S3 flags of ``serve``."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from test_parts import DATA, Origin

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
    "flags, parts",
    [
        (("--http-parts", "on", "--part-size", "128KiB", "--parallel", "4"), True),
        (("--part-size", "128KiB", "--parallel", "4"), False),  # http parts are opt-in
        (("--http-parts", "on", "--part-size", "128KiB", "--parallel", "1"), False),
        (("--http-parts", "on", "--part-size", "0"), False),
        (("--http-parts", "on"), False),  # default 8 MiB parts: a 1 MB shard stays one GET
    ],
)
async def test_http_parts_only_above_part_size_and_with_parallel(
    aiohttp_client, aiohttp_server, tmp_path, flags, parts
):
    origin, client = await _proxy(aiohttp_client, aiohttp_server, tmp_path, DATA, *flags)
    for _ in range(2):  # cold, then warm from the cache
        resp = await client.get("/obj.tar")
        assert resp.status == 200
        assert await resp.read() == DATA
    gets = [r for m, r in origin.requests if m == "GET"]
    whole = [r for r in gets if r is None]
    assert len(whole) == 1  # one logical fetch per shard
    ranged = [r for r in gets if r is not None]
    assert bool(ranged) == parts
    if parts:
        assert len(ranged) == -(-len(DATA) // (128 * KIB)) - 1  # the first part rides the GET
    m = client.app[METRICS]
    assert m.upstream_bytes._value.get() == len(DATA)  # bytes fetched = 1x the shard


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
