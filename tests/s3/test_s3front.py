"""The S3 front driven by boto3, on a small aiohttp app whose body path reads SeaweedFS."""

from __future__ import annotations

import asyncio
import datetime as dt
import io

import boto3
import pytest
from aiohttp import ClientSession, web
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from conftest import BUCKET, OBJECTS

from proxy.s3front import (
    S3Error,
    S3Front,
    classify_request,
    list_params,
    render_list_v2,
    store_error,
    verify_sigv4,
)
from proxy.upstream.s3 import S3Upstream, join_key, parse_s3_url
from shardcache.errors import ConfigError, NotFound

FRONT_AK = "front-access"
FRONT_SK = "front-secret-0123456789"
S3_KEY = web.AppKey("s3", S3Upstream)
BUCKETS = {
    "shards": f"s3://{BUCKET}/shards",
    "many": f"s3://{BUCKET}/many",
    "whole": f"s3://{BUCKET}",
    "web": "http://example.invalid/data",
}


# ----------------------------------------------------------------- pure policy


def test_classify_request():
    names = ["shards"]
    assert classify_request("/", names).kind == "service"
    assert classify_request("/shards", names) == classify_request("/shards/", names)
    assert classify_request("/shards?list-type=2", names).kind == "bucket"
    r = classify_request("/shards/a/b%20c.tar", names)
    assert (r.kind, r.bucket, r.key) == ("object", "shards", "a/b%20c.tar")
    assert classify_request("/other/x", names).kind == "other"


def test_list_params():
    q = {"list-type": "2", "prefix": "a/", "max-keys": "5000", "delimiter": "/"}
    assert list_params(q, "base/") == {"Prefix": "base/a/", "MaxKeys": 1000, "Delimiter": "/"}
    q = {"continuation-token": "tok", "start-after": "k"}
    p = list_params(q, "")
    assert p["ContinuationToken"] == "tok" and p["StartAfter"] == "k"
    with pytest.raises(S3Error):
        list_params({"max-keys": "-1"}, "")
    with pytest.raises(S3Error):
        list_params({"encoding-type": "base64"}, "")


def test_render_list_v2_parses_with_botocore():
    from botocore.parsers import RestXMLParser
    from botocore.session import get_session

    result = {
        "Contents": [
            {
                "Key": "base/a b+c.tar",
                "Size": 3,
                "ETag": '"e"',
                "LastModified": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
            },
        ],
        "CommonPrefixes": [{"Prefix": "base/sub/"}],
        "IsTruncated": True,
        "NextContinuationToken": "next",
    }
    query = {"list-type": "2", "delimiter": "/", "encoding-type": "url"}
    body = render_list_v2("front", query, result, "base/")
    model = get_session().get_service_model("s3").operation_model("ListObjectsV2")
    parsed = RestXMLParser().parse(
        {"body": body, "headers": {}, "status_code": 200}, model.output_shape
    )
    assert parsed["Name"] == "front" and parsed["KeyCount"] == 2
    assert parsed["Contents"][0]["Key"] == "a%20b%2Bc.tar"  # boto3 then url-decodes it
    assert parsed["CommonPrefixes"][0]["Prefix"] == "sub/"
    assert parsed["IsTruncated"] and parsed["NextContinuationToken"] == "next"


def test_store_error_reads_an_s3_error_document():
    body = b'<?xml version="1.0"?><Error><Code>NoSuchVersion</Code><Message>gone</Message></Error>'
    assert store_error(body) == ("NoSuchVersion", "gone")
    assert store_error(b"<html>Not Found</html>") == (None, None)
    assert store_error(b"<Error><Code>bad code!</Code></Error>") == (None, None)


def test_front_needs_both_keys():
    with pytest.raises(ConfigError, match="--s3-front-access-key"):
        S3Front(buckets={}, access_key="a")


def test_verify_sigv4_with_a_botocore_signed_request():
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method="GET", url="http://h:1/shards/a%20b.tar?x-id=GetObject")
    req.headers["X-Amz-Content-SHA256"] = "UNSIGNED-PAYLOAD"
    S3SigV4Auth(Credentials(FRONT_AK, FRONT_SK), "s3", "eu-west-1").add_auth(req)
    headers = {"Host": "h:1", **dict(req.headers.items())}
    now = dt.datetime.now(dt.timezone.utc)
    args = ("GET", "/shards/a%20b.tar", [("x-id", "GetObject")])
    verify_sigv4(*args, headers, FRONT_AK, FRONT_SK, now)
    with pytest.raises(S3Error) as ei:
        verify_sigv4(*args, headers, FRONT_AK, "wrong", now)
    assert ei.value.code == "SignatureDoesNotMatch"
    with pytest.raises(S3Error) as ei:  # a different path under the same signature
        verify_sigv4("GET", "/shards/other.tar", args[2], headers, FRONT_AK, FRONT_SK, now)
    assert ei.value.code == "SignatureDoesNotMatch"
    with pytest.raises(S3Error) as ei:
        verify_sigv4(*args, headers, FRONT_AK, FRONT_SK, now + dt.timedelta(hours=1))
    assert ei.value.code == "RequestTimeTooSkewed"
    with pytest.raises(S3Error) as ei:
        verify_sigv4(*args, headers, "other", FRONT_SK, now)
    assert ei.value.code == "InvalidAccessKeyId"


# ----------------------------------------------------------------- the front, end to end


async def _body_path(request: web.Request) -> web.StreamResponse:
    """A minimal stand-in for the proxy's shard handler: stream from S3 with Range."""
    s3: S3Upstream = request.app[S3_KEY]
    name, _, key = request.raw_path.partition("?")[0][1:].partition("/")
    base = BUCKETS.get(name)
    if base is None or not key:
        raise NotFound(f"no upstream serves {request.path}")
    loc = parse_s3_url(base)
    url = f"s3://{loc.bucket}/{join_key(loc.key, key)}"
    resp = await s3.open(url, range=request.headers.get("Range"), quoted=True)
    async with resp:
        out = web.StreamResponse(status=resp.status, headers=resp.headers)
        if request.method == "HEAD":
            return web.Response(status=resp.status, headers=resp.headers)
        await out.prepare(request)
        async for chunk in resp.iter_chunks():
            await out.write(chunk)
        await out.write_eof()
        return out


@web.middleware
async def _plain_errors(request, handler):
    """Like the proxy's outer middleware: ProxyError → one-line text."""
    from shardcache.errors import ProxyError

    try:
        return await handler(request)
    except ProxyError as exc:
        return web.Response(status=exc.status_hint, text=str(exc) + "\n")


async def _front_app(seaweed, aiohttp_server, **front_kw):
    s3 = S3Upstream(
        endpoint_url=seaweed.endpoint_url,
        credentials=(seaweed.access_key, seaweed.secret_key),
    )
    await s3.start()
    front = S3Front(buckets=BUCKETS, s3=s3, **front_kw)
    app = web.Application(middlewares=[_plain_errors, front.middleware])
    app[S3_KEY] = s3
    app.router.add_route("*", "/{tail:.*}", _body_path)
    app.on_cleanup.append(lambda app: s3.close())
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}"


def _client(endpoint: str, **kw):
    cfg = Config(
        s3={"addressing_style": "path"},
        retries={"max_attempts": 1},
        signature_version=kw.pop("signature_version", None),
    )
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=cfg, **kw)


@pytest.fixture
async def anon_front(seaweed, aiohttp_server):
    return await _front_app(seaweed, aiohttp_server)


@pytest.fixture
async def signed_front(seaweed, aiohttp_server):
    return await _front_app(seaweed, aiohttp_server, access_key=FRONT_AK, secret_key=FRONT_SK)


def _exercise(client) -> None:
    """get, range get (incl. 8 MiB on a small object), head, paginated list."""
    small = OBJECTS["shards/small.tar"]
    r = client.get_object(Bucket="shards", Key="small.tar")
    assert r["Body"].read() == small and r["ContentLength"] == len(small)
    r = client.get_object(Bucket="shards", Key="small.tar", Range="bytes=10-19")
    assert r["Body"].read() == small[10:20] and r["ContentRange"] == f"bytes 10-19/{len(small)}"
    r = client.get_object(Bucket="shards", Key="small.tar", Range="bytes=0-8388607")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert (
        r["Body"].read() == small and r["ContentRange"] == f"bytes 0-{len(small) - 1}/{len(small)}"
    )
    h = client.head_object(Bucket="shards", Key="dir/x one+two.tar")
    assert h["ContentLength"] == len(OBJECTS["shards/dir/x one+two.tar"])
    client.head_bucket(Bucket="shards")

    pages = list(
        client.get_paginator("list_objects_v2").paginate(
            Bucket="many", Prefix="obj-", PaginationConfig={"PageSize": 5}
        )
    )
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
    assert keys == [f"obj-{i:03d}.bin" for i in range(23)] and len(pages) == 5
    r = client.list_objects_v2(Bucket="many", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["sub/"]
    assert len(r["Contents"]) == 23
    r = client.list_objects_v2(Bucket="shards", Prefix="dir/")
    assert [o["Key"] for o in r["Contents"]] == ["dir/x one+two.tar"]

    buf = io.BytesIO()
    client.download_fileobj("shards", "medium.tar", buf)
    assert buf.getvalue() == OBJECTS["shards/medium.tar"]


async def test_anonymous_front_with_boto3(anon_front):
    client = _client(anon_front, signature_version=UNSIGNED)
    await asyncio.to_thread(_exercise, client)
    with pytest.raises(ClientError) as ei:
        await asyncio.to_thread(client.get_object, Bucket="shards", Key="absent.tar")
    err = ei.value.response
    assert err["Error"]["Code"] == "NoSuchKey" and err["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert "absent.tar" in err["Error"]["Message"]
    # Signed requests are accepted too when the front has no keys.
    await asyncio.to_thread(
        _exercise, _client(anon_front, aws_access_key_id="x", aws_secret_access_key="y")
    )


async def test_plain_http_clients_keep_one_line_errors(anon_front):
    async with ClientSession() as session:
        async with session.get(anon_front + "/shards/absent.tar") as resp:
            assert resp.status == 404
            text = await resp.text()
            assert "<Error>" not in text and "absent.tar" in text
        async with session.get(anon_front + "/shards/small.tar") as resp:
            assert await resp.read() == OBJECTS["shards/small.tar"]


async def test_signed_front(signed_front):
    good = _client(signed_front, aws_access_key_id=FRONT_AK, aws_secret_access_key=FRONT_SK)
    await asyncio.to_thread(_exercise, good)

    bad = _client(signed_front, aws_access_key_id=FRONT_AK, aws_secret_access_key="wrong")
    for call in (
        lambda: bad.get_object(Bucket="shards", Key="small.tar"),
        lambda: bad.list_objects_v2(Bucket="many"),
    ):
        with pytest.raises(ClientError) as ei:
            await asyncio.to_thread(call)
        assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
        assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403

    unknown = _client(signed_front, aws_access_key_id="nobody", aws_secret_access_key="x")
    with pytest.raises(ClientError) as ei:
        await asyncio.to_thread(unknown.get_object, Bucket="shards", Key="small.tar")
    assert ei.value.response["Error"]["Code"] == "InvalidAccessKeyId"

    anon = _client(signed_front, signature_version=UNSIGNED)
    with pytest.raises(ClientError) as ei:
        await asyncio.to_thread(anon.get_object, Bucket="shards", Key="small.tar")
    assert ei.value.response["Error"]["Code"] == "AccessDenied"

    # The raw 403 body is S3 XML.
    async with ClientSession() as session:
        async with session.get(signed_front + "/shards/small.tar") as resp:
            assert resp.status == 403
            body = await resp.text()
            assert "<Code>AccessDenied</Code>" in body

        v2 = good.generate_presigned_url(
            "get_object", Params={"Bucket": "shards", "Key": "small.tar"}, ExpiresIn=60
        )
        async with session.get(v2) as resp:
            assert resp.status == 400 and "SigV4" in await resp.text()
        v4 = _client(
            signed_front,
            aws_access_key_id=FRONT_AK,
            aws_secret_access_key=FRONT_SK,
            signature_version="s3v4",
        )
        url = v4.generate_presigned_url(
            "get_object", Params={"Bucket": "shards", "Key": "small.tar"}, ExpiresIn=60
        )
        async with session.get(url) as resp:
            assert resp.status == 200 and await resp.read() == OBJECTS["shards/small.tar"]
        async with session.get(url.replace("small.tar", "medium.tar")) as resp:
            assert resp.status == 403 and "SignatureDoesNotMatch" in await resp.text()


async def test_front_rejects_writes_and_unsupported(anon_front):
    client = _client(anon_front, signature_version=UNSIGNED)
    with pytest.raises(ClientError) as ei:
        await asyncio.to_thread(client.put_object, Bucket="shards", Key="new.tar", Body=b"x")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 405
    with pytest.raises(ClientError) as ei:
        await asyncio.to_thread(client.list_objects_v2, Bucket="web")
    assert ei.value.response["Error"]["Code"] == "NotImplemented"
    names = [b["Name"] for b in (await asyncio.to_thread(client.list_buckets))["Buckets"]]
    assert names == sorted(BUCKETS)
