"""proxy.upstream.s3.S3Upstream against a real SeaweedFS, plus fault injection for throttling."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import ClientSession, web
from conftest import BUCKET, OBJECTS
from hypothesis import given
from hypothesis import strategies as st

from proxy.upstream import Fetcher
from proxy.upstream.errors import s3_error
from proxy.upstream.options import UpstreamOptions
from proxy.upstream.parts import fetch_parts
from proxy.upstream.s3 import S3Transport, S3Upstream, format_range, join_key, parse_s3_url
from shardcache.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    NotFound,
    ObjectChanged,
    RangeNotSatisfiable,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)

SMALL = f"s3://{BUCKET}/shards/small.tar"


async def read_all(resp) -> bytes:
    async with resp:
        return b"".join([c async for c in resp.iter_chunks(4096)])


# ----------------------------------------------------------------- pure policy


def test_parse_s3_url():
    loc = parse_s3_url("s3://my-bucket/a/b/c.tar")
    assert (loc.bucket, loc.key, loc.url) == ("my-bucket", "a/b/c.tar", "s3://my-bucket/a/b/c.tar")
    assert parse_s3_url("s3://bkt").key == ""
    assert loc.params() == {"Bucket": "my-bucket", "Key": "a/b/c.tar"}


def test_a_version_is_part_of_the_url():
    """The proxy's canonical URL of a version read carries ``?versionId=``: the version
    goes to S3 with the key, and the URL (the cache key) differs from the latest's."""
    loc = parse_s3_url("s3://bkt/a%20b.tar?versionId=v%2B1&x-id=GetObject", quoted=True)
    assert (loc.key, loc.version_id) == ("a b.tar", "v+1")
    assert loc.params() == {"Bucket": "bkt", "Key": "a b.tar", "VersionId": "v+1"}
    assert parse_s3_url("s3://bkt/a.tar", quoted=True).version_id is None


def test_parse_s3_url_rejects():
    for bad in ("http://x/y", "s3:///key", "s3://a/key", "s3://bad bucket/k", "s3://bkt/a\x00b"):
        with pytest.raises(BadRequest):
            parse_s3_url(bad)


@given(st.text(alphabet="ab/", max_size=6), st.text(alphabet="xy/", max_size=6))
def test_join_key_has_no_double_slash_at_the_seam(prefix, path):
    key = join_key(prefix, path)
    p = prefix.strip("/")
    rest = path.lstrip("/")
    assert key == (f"{p}/{rest}" if p else rest)


def test_format_range():
    assert format_range(None) is None
    assert format_range((0, 9)) == "bytes=0-9"
    assert format_range((5, None)) == "bytes=5-"
    assert format_range("bytes=1-2") == "bytes=1-2"
    with pytest.raises(RangeNotSatisfiable):
        format_range((5, 4))


@pytest.mark.parametrize(
    "code,status,exc,hint",
    [
        ("NoSuchKey", 404, NotFound, 404),
        ("404", 404, NotFound, 404),
        ("NoSuchBucket", 404, NotFound, 404),
        ("AccessDenied", 403, Forbidden, 403),
        ("", 401, Forbidden, 403),
        ("InvalidAccessKeyId", 403, Forbidden, 403),
        ("SignatureDoesNotMatch", 403, Forbidden, 403),
        ("PreconditionFailed", 412, ObjectChanged, 502),
        ("InvalidRange", 416, RangeNotSatisfiable, 416),
        ("SlowDown", 503, UpstreamThrottled, 503),
        ("RequestLimitExceeded", 400, UpstreamThrottled, 503),
        ("InternalError", 500, UpstreamThrottled, 503),
        ("InvalidArgument", 400, UpstreamError, 502),
    ],
)
def test_error_mapping(code, status, exc, hint):
    err = s3_error("s3://b/k", code, status, "msg")
    assert type(err) is exc and err.status_hint == hint
    assert "s3://b/k" in str(err)
    if exc is Forbidden:
        assert "AWS_ACCESS_KEY_ID" in str(err)


# ----------------------------------------------------------------- against SeaweedFS


@pytest.fixture
async def s3(seaweed):
    async with S3Upstream(
        endpoint_url=seaweed.endpoint_url,
        region=seaweed.region,
        credentials=(seaweed.access_key, seaweed.secret_key),
    ) as client:
        yield client


async def test_get_head_range(s3):
    data = OBJECTS["shards/small.tar"]
    resp = await s3.open(SMALL)
    assert resp.status == 200 and resp.meta.size == len(data)
    assert resp.headers["Content-Length"] == str(len(data))
    assert resp.meta.etag and resp.meta.last_modified.endswith("GMT")
    assert await read_all(resp) == data

    info = await s3.head(SMALL)
    assert (info.size, info.etag) == (len(data), resp.meta.etag)

    resp = await s3.open(SMALL, range=(100, 199), if_match=info.etag)
    assert (resp.status, resp.start, resp.length, resp.meta.size) == (206, 100, 100, len(data))
    assert resp.headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    assert await read_all(resp) == data[100:200]

    # A range past the end is clipped, as S3 clients expect.
    resp = await s3.open(SMALL, range="bytes=0-8388607")
    assert (resp.status, resp.length) == (206, len(data))
    assert await read_all(resp) == data


async def test_keys_with_spaces_and_plus(s3):
    resp = await s3.open(f"s3://{BUCKET}/shards/dir/x one+two.tar")
    assert await read_all(resp) == OBJECTS["shards/dir/x one+two.tar"]


async def test_if_match_mismatch_is_object_changed(s3):
    with pytest.raises(ObjectChanged) as ei:
        await s3.open(SMALL, range=(0, 9), if_match='"0123456789abcdef0123456789abcdef"')
    assert SMALL in str(ei.value)


async def test_the_stores_412_and_416_are_answers_for_the_transport(s3):
    """S3's own 412 and 416 reach the upstream layer as answers, as an HTTP origin's
    would (the 416 with the object's size), never as exceptions made into responses;
    a direct caller of ``open`` gets them as errors."""
    size = len(OBJECTS["shards/small.tar"])
    other = '"0123456789abcdef0123456789abcdef"'
    resp = await s3.open(SMALL, range=(0, 9), if_match=other, answers=(412, 416))
    assert (resp.status, resp.length) == (412, 0)
    resp = await s3.open(SMALL, range=f"bytes={size + 10}-", answers=(412, 416))
    assert (resp.status, resp.headers["Content-Range"]) == (416, f"bytes */{size}")
    with pytest.raises(RangeNotSatisfiable):
        await s3.open(SMALL, range=f"bytes={size + 10}-")
    transport = S3Transport(s3)
    resp = await transport.request("GET", SMALL, {"Range": f"bytes={size}-", "If-Match": other})
    assert resp.status == 412
    resp = await transport.request("GET", SMALL, {"Range": f"bytes={size + 1}-"})
    assert (resp.status, resp.headers["Content-Range"]) == (416, f"bytes */{size}")


async def test_missing_key_and_bucket(s3):
    with pytest.raises(NotFound, match="NoSuchKey"):
        await s3.open(f"s3://{BUCKET}/nope.tar")
    with pytest.raises(NotFound):
        await s3.head(f"s3://{BUCKET}/nope.tar")
    with pytest.raises(NotFound, match="NoSuchBucket"):
        await s3.open("s3://no-such-bucket-here/x.tar")


@pytest.mark.parametrize("which", ["secret", "access"])
async def test_bad_credentials_are_forbidden_with_hint(seaweed, which):
    creds = (seaweed.access_key, "wrong-secret") if which == "secret" else ("NOSUCHKEY", "x")
    async with S3Upstream(endpoint_url=seaweed.endpoint_url, credentials=creds) as s3:
        with pytest.raises(Forbidden) as ei:
            await s3.open(SMALL)
        assert ei.value.status_hint == 403
        assert "credentials" in str(ei.value) and SMALL in str(ei.value)
        with pytest.raises(Forbidden):
            await s3.head(SMALL)


async def test_credentials_from_environment(seaweed, aws_env):
    aws_env.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    async with S3Upstream(endpoint_url=seaweed.endpoint_url) as s3:
        # a listing needs the keys (anonymous may list too, so check signing is on)
        assert s3.client.meta.config.signature_version != "unsigned"
        assert await read_all(await s3.open(SMALL)) == OBJECTS["shards/small.tar"]
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    async with S3Upstream(endpoint_url=seaweed.endpoint_url) as s3:
        with pytest.raises(Forbidden):
            await s3.head(SMALL)


async def test_credentials_from_shared_file_and_profile(seaweed, aws_env, tmp_path):
    (tmp_path / "aws-credentials").write_text(
        f"[train]\naws_access_key_id = {seaweed.access_key}\n"
        f"aws_secret_access_key = {seaweed.secret_key}\n"
    )
    async with S3Upstream(endpoint_url=seaweed.endpoint_url, profile="train") as s3:
        assert (await s3.head(SMALL)).size == len(OBJECTS["shards/small.tar"])
    with pytest.raises(ConfigError, match="--s3-profile"):
        async with S3Upstream(endpoint_url=seaweed.endpoint_url, profile="absent"):
            pass


async def test_no_credentials_goes_unsigned(seaweed, aws_env):
    async with S3Upstream(endpoint_url=seaweed.endpoint_url) as s3:
        assert await read_all(await s3.open(SMALL)) == OBJECTS["shards/small.tar"]


async def test_list_objects_v2(s3):
    resp = await s3.list_objects_v2(BUCKET, Prefix="many/", Delimiter="/", MaxKeys=5)
    assert [o["Key"] for o in resp["Contents"]] == [f"many/obj-{i:03d}.bin" for i in range(5)]
    assert resp["IsTruncated"] and resp["NextContinuationToken"]


async def test_truncated_body_is_an_error_not_eof(s3):
    resp = await s3.open(SMALL)
    resp.length += 1  # pretend the server promised one more byte than it sent
    with pytest.raises(UpstreamError, match="ended after"):
        await read_all(resp)


# ----------------------------------------------------------------- fault injection


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@pytest.fixture
async def throttling_front(seaweed, aiohttp_server):
    """An S3 endpoint that answers 503 SlowDown ``state['fail']`` times, then proxies."""
    state = {"fail": 0, "seen": 0, "hang": False}
    session = ClientSession(auto_decompress=False)

    async def handler(request: web.Request) -> web.StreamResponse:
        state["seen"] += 1
        if state["hang"]:
            await asyncio.sleep(30)
        if state["fail"] > 0:
            state["fail"] -= 1
            return web.Response(status=503, body=SLOWDOWN, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with session.request(
            request.method, seaweed.endpoint_url + request.path_qs, headers=headers
        ) as up:
            body = await up.read()
            out = {k: v for k, v in up.headers.items() if k.lower() not in ("transfer-encoding",)}
            return web.Response(status=up.status, body=body, headers=out)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = await aiohttp_server(app)
    yield f"http://127.0.0.1:{server.port}", state
    await session.close()


async def test_throttling_is_retried_then_503(throttling_front):
    url, state = throttling_front
    async with S3Upstream(
        endpoint_url=url, anonymous=True, options=UpstreamOptions(retries=3, retry_backoff=0.01)
    ) as s3:
        state["fail"] = 2
        assert await read_all(await s3.open(SMALL)) == OBJECTS["shards/small.tar"]
        assert state["seen"] == 3
        state["fail"], state["seen"] = 10, 0
        with pytest.raises(UpstreamError) as ei:
            await s3.open(SMALL)
        assert ei.value.status_hint == 503 and "SlowDown" in str(ei.value)
        assert state["seen"] == 4  # one try + three retries


async def test_timeout_and_connection_refused(throttling_front):
    url, state = throttling_front
    state["hang"] = True
    async with S3Upstream(
        endpoint_url=url, anonymous=True, options=UpstreamOptions(read_timeout=0.5, retries=0)
    ) as s3:
        with pytest.raises(UpstreamTimeout) as ei:
            await s3.open(SMALL)
        assert ei.value.status_hint == 504
    dead = f"http://127.0.0.1:{free_port()}"
    async with S3Upstream(
        endpoint_url=dead, anonymous=True, options=UpstreamOptions(retries=0)
    ) as s3:
        with pytest.raises(UpstreamError) as ei:
            await s3.open(SMALL)
        assert ei.value.status_hint == 502 and not isinstance(ei.value, UpstreamTimeout)


# ----------------------------------------------------------------- parts and the fetcher


async def test_fetcher_streams_large_object_in_parts(s3):
    outcomes: list[str] = []
    counted: list[int] = []
    fetcher = Fetcher(
        s3=s3, part_size=1024 * 1024, parallel=3, observe=outcomes.append, on_bytes=counted.append
    )
    body = await fetcher.open(f"s3://{BUCKET}/shards/medium.tar")
    data = OBJECTS["shards/medium.tar"]
    assert body.meta.size == len(data)
    assert body.meta.etag and body.meta.last_modified
    got = b"".join([c async for c in body.chunks()])
    body.close()
    assert got == data and sum(counted) == len(data) and outcomes == ["ok"]


async def test_fetcher_small_object_and_quoted_key(s3):
    fetcher = Fetcher(s3=s3, part_size=1024 * 1024, parallel=3)
    body = await fetcher.open(f"s3://{BUCKET}/shards/dir/x%20one+two.tar")
    assert b"".join([c async for c in body.chunks()]) == OBJECTS["shards/dir/x one+two.tar"]
    body.close()
    with pytest.raises(NotFound):
        await fetcher.open(f"s3://{BUCKET}/shards/absent.tar")


async def test_s3_object_replaced_between_parts(s3, boto, tmp_path):
    key = "replace/obj.bin"
    old = bytes(range(256)) * (12 * 1024)  # 3 MiB
    boto.put_object(Bucket=BUCKET, Key=key, Body=old)
    transport = S3Transport(s3)
    url = f"s3://{BUCKET}/{key}"
    meta = await s3.head(url)

    class Replacing:
        async def request(self, method, url, headers):
            if not (headers.get("Range") or "bytes=0-").startswith("bytes=0-"):
                await asyncio.to_thread(
                    boto.put_object, Bucket=BUCKET, Key=key, Body=b"N" * len(old)
                )
            return await transport.request(method, url, headers)

        async def close(self) -> None:
            pass

    path = tmp_path / "x.part"
    with open(path, "wb") as f:

        async def sink(data: bytes) -> None:
            f.write(data)
            f.flush()

        with pytest.raises(ObjectChanged):
            await fetch_parts(Replacing(), url, meta, sink, part_size=1024 * 1024, parallel=1)
    got = path.read_bytes()
    assert len(got) == 1024 * 1024 and got == old[: len(got)]
