"""The whole S3 store behind the front (``--upstream s3://``): every bucket of SeaweedFS
under its own name, read through the cache, each answer compared with the store's own;
a named upstream keeps its name over a store bucket of the same name."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from conftest import BUCKET
from support.proxy import ProxyProcess
from support.s3 import OBJECTS, proxy_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

OTHER = "shardcache-whole-store"  # a second store bucket, made by the test module
SHADOWED = "shards"  # a store bucket whose name the named upstream takes
VERSIONED = "shardcache-whole-versioned"


@pytest.fixture(scope="module")
def proxy(seaweed, tmp_path_factory):
    admin = seaweed.client()
    for name in (OTHER, SHADOWED, VERSIONED):
        admin.create_bucket(Bucket=name)
    admin.put_object(Bucket=OTHER, Key="a/one.tar", Body=b"one", ContentType="x-test/one")
    admin.put_object(Bucket=OTHER, Key="a/two.tar", Body=b"two two")
    admin.put_object(Bucket=OTHER, Key="b.tar", Body=b"b")
    admin.put_object(Bucket=SHADOWED, Key="small.tar", Body=b"the store's own shards bucket")
    admin.put_bucket_versioning(Bucket=VERSIONED, VersioningConfiguration={"Status": "Enabled"})
    tmp = tmp_path_factory.mktemp("whole-store")
    p = ProxyProcess(
        tmp / "cache",
        "--upstream",
        "s3://",
        "--upstream",
        f"shards=s3://{BUCKET}/shards",
        "--s3-endpoint-url",
        seaweed.endpoint_url,
        "--s3-front-access-key",
        seaweed.access_key,
        "--s3-front-secret-key",
        seaweed.secret_key,
        "--revalidate",
        "always",
        env=proxy_env(seaweed.access_key, seaweed.secret_key, tmp),
    ).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def front(proxy, seaweed):
    """boto3 signed with the store's key pair, pointed at the front."""
    return seaweed.client(
        endpoint_url=proxy.url,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def error_of(call, **kw) -> tuple[int, str]:
    with pytest.raises(ClientError) as ei:
        call(**kw)
    resp = ei.value.response
    return resp["ResponseMetadata"]["HTTPStatusCode"], resp["Error"]["Code"]


def test_every_store_bucket_is_listed_with_the_stores_dates(front, boto):
    store = boto.list_buckets()
    mine = front.list_buckets()
    assert mine["Owner"] == store["Owner"]
    theirs = {b["Name"]: b["CreationDate"] for b in store["Buckets"]}
    dates = {b["Name"]: b["CreationDate"] for b in mine["Buckets"]}
    assert set(dates) == set(theirs) and {BUCKET, OTHER, VERSIONED} <= set(dates)
    assert dates[OTHER] == theirs[OTHER]
    # the named upstream's date is its bucket's, not that of the store bucket it hides
    assert dates[SHADOWED] == theirs[BUCKET]


def test_objects_of_any_store_bucket_are_read_and_cached(front, boto, proxy):
    for _ in range(2):  # the miss, then the hit
        got = front.get_object(Bucket=OTHER, Key="a/one.tar")
        assert got["Body"].read() == b"one"
        theirs = boto.head_object(Bucket=OTHER, Key="a/one.tar")
        assert (got["ETag"], got["ContentType"]) == (theirs["ETag"], "x-test/one")
        head = front.head_object(Bucket=OTHER, Key="a/two.tar")
        assert head["ContentLength"] == 7
    big = front.get_object(Bucket=BUCKET, Key="shards/medium.tar", Range="bytes=10-19")
    assert big["Body"].read() == OBJECTS["shards/medium.tar"][10:20]
    # a plain HTTP client reads the same entry through the proxy's own route
    with urllib.request.urlopen(f"{proxy.url}/{OTHER}/a/one.tar", timeout=30) as resp:
        assert resp.read() == b"one"
        assert resp.headers["X-Cache"] == "HIT"


def test_a_named_upstream_keeps_its_name(front):
    got = front.get_object(Bucket=SHADOWED, Key="small.tar")["Body"].read()
    assert got == OBJECTS["shards/small.tar"]


def test_bucket_facts_come_from_the_store(front, boto):
    front.head_bucket(Bucket=OTHER)
    for call, kw in (
        (front.head_bucket, {}),
        (front.get_object, {"Key": "x.tar"}),
        (front.list_objects_v2, {}),
        (front.get_bucket_location, {}),
    ):
        status, code = error_of(call, Bucket="shardcache-no-such-bucket", **kw)
        assert status == 404 and code in ("NoSuchBucket", "404"), (call, code)
    assert front.get_bucket_versioning(Bucket=VERSIONED)["Status"] == "Enabled"
    assert "Status" not in front.get_bucket_versioning(Bucket=OTHER)
    status, code = error_of(front.get_object, Bucket=OTHER, Key="nothing.tar")
    assert (status, code) == (404, "NoSuchKey")


def _listing(resp: dict) -> dict:
    return {k: v for k, v in resp.items() if k != "ResponseMetadata"}


def test_listings_are_the_stores(front, boto):
    for q in ({}, {"Delimiter": "/"}, {"Prefix": "a/", "MaxKeys": 1}, {"StartAfter": "a/one.tar"}):
        assert _listing(front.list_objects_v2(Bucket=OTHER, **q)) == _listing(
            boto.list_objects_v2(Bucket=OTHER, **q)
        ), q
        if "StartAfter" not in q:
            assert _listing(front.list_objects(Bucket=OTHER, **q)) == _listing(
                boto.list_objects(Bucket=OTHER, **q)
            ), q


def test_versions_of_a_store_bucket(front, boto):
    v1 = boto.put_object(Bucket=VERSIONED, Key="k.tar", Body=b"first")["VersionId"]
    boto.put_object(Bucket=VERSIONED, Key="k.tar", Body=b"second")
    assert front.get_object(Bucket=VERSIONED, Key="k.tar", VersionId=v1)["Body"].read() == b"first"
    assert front.get_object(Bucket=VERSIONED, Key="k.tar")["Body"].read() == b"second"
    got = front.head_object(Bucket=VERSIONED, Key="k.tar", VersionId=v1)
    assert got["VersionId"] == v1


def test_writes_are_still_refused(front, boto):
    assert error_of(front.put_object, Bucket=OTHER, Key="new.tar", Body=b"x")[0] == 405
    assert error_of(front.delete_object, Bucket=OTHER, Key="b.tar")[0] == 405
    assert error_of(front.create_bucket, Bucket="shardcache-made-by-front")[0] == 405
    assert boto.get_object(Bucket=OTHER, Key="b.tar")["Body"].read() == b"b"
    names = {b["Name"] for b in boto.list_buckets()["Buckets"]}
    assert "shardcache-made-by-front" not in names


def test_a_proxy_path_that_is_no_bucket_is_the_proxys_own(proxy):
    with urllib.request.urlopen(f"{proxy.url}/-/healthz", timeout=10) as resp:
        assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(f"{proxy.url}/{OTHER}/missing.tar", timeout=10)
    assert ei.value.code == 404


def test_listing_fields_are_encoded_as_the_store_encodes_them(front, boto):
    """boto3 asks for ``encoding-type=url``; V1 answers the Prefix as given (botocore
    decodes only Delimiter, Marker, NextMarker, keys and common prefixes there)."""
    for prefix in ("\n", "a/%", "a b"):
        for call in ("list_objects", "list_objects_v2"):
            mine = getattr(front, call)(Bucket=OTHER, Prefix=prefix, Delimiter="/")
            theirs = getattr(boto, call)(Bucket=OTHER, Prefix=prefix, Delimiter="/")
            assert mine["Prefix"] == theirs["Prefix"] == prefix, (call, prefix)
            assert _listing(mine) == _listing(theirs), (call, prefix)


def test_an_unordered_listing_with_a_delimiter_is_refused_as_by_the_store(front, boto):
    def unordered(params, **kw):
        params["url"] += "&allow-unordered=true"

    for client in (front, boto):
        client.meta.events.register("before-call.s3.ListObjects", unordered)
        client.meta.events.register("before-call.s3.ListObjectsV2", unordered)
    try:
        for call in ("list_objects", "list_objects_v2"):
            theirs = error_of(getattr(boto, call), Bucket=OTHER, Delimiter="/")
            assert error_of(getattr(front, call), Bucket=OTHER, Delimiter="/") == theirs
            assert theirs == (400, "InvalidArgument")
            assert getattr(front, call)(Bucket=OTHER)["Contents"]
    finally:
        for client in (front, boto):
            client.meta.events.unregister("before-call.s3.ListObjects", unordered)
            client.meta.events.unregister("before-call.s3.ListObjectsV2", unordered)
