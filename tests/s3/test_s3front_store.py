"""The S3 front says what the store says: boto3 through a real proxy in front of SeaweedFS
(and of an http upstream that answers S3 errors), each answer compared with the store's
own answer to the same request.

Buckets of the proxy: ``shards`` (``s3://BUCKET/shards``), ``all`` (the whole BUCKET),
``ver`` (a versioned bucket), ``gone`` (a bucket the store does not have) and ``web`` (an
http upstream answering S3 XML errors).
"""

from __future__ import annotations

import datetime as dt

import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from conftest import BUCKET
from support.origins import BadOrigin, Version
from support.s3 import start_s3_proxy

VERSIONED = "shardcache-versioned"
GONE = "shardcache-no-such-bucket"


@pytest.fixture(scope="module")
def web():
    """An http upstream in S3 mode: its errors are S3 XML documents with their codes."""
    with BadOrigin(s3=True) as origin:
        yield origin


@pytest.fixture(scope="module")
def proxy(seaweed, web, tmp_path_factory):
    admin = seaweed.client()
    admin.create_bucket(Bucket=VERSIONED)
    admin.put_bucket_versioning(Bucket=VERSIONED, VersioningConfiguration={"Status": "Enabled"})
    p = start_s3_proxy(
        seaweed,
        tmp_path_factory.mktemp("s3front-store"),
        seaweed.access_key,
        seaweed.secret_key,
        "--upstream",
        f"ver=s3://{VERSIONED}",
        "--upstream",
        f"gone=s3://{GONE}",
        "--upstream",
        f"web={web.url}/site",
        "--retries",
        "0",
    )
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def front(proxy):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=proxy.url,
        region_name="us-east-1",
        config=Config(
            signature_version=UNSIGNED,
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
        ),
    )


def error_of(call, **kw) -> tuple[int, str, str]:
    """(HTTP status, S3 code, message) of a call that must fail."""
    with pytest.raises(ClientError) as ei:
        call(**kw)
    resp = ei.value.response
    return (
        resp["ResponseMetadata"]["HTTPStatusCode"],
        resp["Error"]["Code"],
        resp["Error"].get("Message", ""),
    )


OVERRIDES = {
    "ResponseContentType": "text/x-front",
    "ResponseContentLanguage": "fr-CA",
    "ResponseExpires": dt.datetime(2031, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
    "ResponseCacheControl": "no-cache",
    "ResponseContentDisposition": 'attachment; filename="x.tar"',
    "ResponseContentEncoding": "identity",
}
OVERRIDDEN = {
    "ContentType": "text/x-front",
    "ContentLanguage": "fr-CA",
    "ExpiresString": "Mon, 03 Feb 2031 04:05:06 GMT",
    "CacheControl": "no-cache",
    "ContentDisposition": 'attachment; filename="x.tar"',
    "ContentEncoding": "identity",
}


def test_response_overrides_apply_to_get_and_head(front, boto):
    boto.put_object(Bucket=BUCKET, Key="shards/override.tar", Body=b"x" * 100)
    for _ in range(2):  # the miss, then the hit
        for call in (front.get_object, front.head_object):
            got = call(Bucket="shards", Key="override.tar", **OVERRIDES)
            assert {k: got.get(k) for k in OVERRIDDEN} == OVERRIDDEN, call
        # a plain read is not affected by an earlier override
        plain = front.get_object(Bucket="shards", Key="override.tar")
        assert plain["ContentType"] != "text/x-front" and "CacheControl" not in plain
    # the store answers the same
    store = boto.get_object(Bucket=BUCKET, Key="shards/override.tar", **OVERRIDES)
    assert {k: store.get(k) for k in OVERRIDDEN} == OVERRIDDEN


def test_failed_preconditions_answer_as_the_store(front, boto):
    boto.put_object(Bucket=BUCKET, Key="shards/cond.tar", Body=b"conditional")
    etag = boto.head_object(Bucket=BUCKET, Key="shards/cond.tar")["ETag"]
    past = dt.datetime(2001, 1, 1, tzinfo=dt.timezone.utc)
    future = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
    cases = [
        ("get_object", {"IfMatch": '"not-the-etag"'}),
        ("get_object", {"IfUnmodifiedSince": past}),
        ("get_object", {"IfNoneMatch": etag}),
        ("get_object", {"IfModifiedSince": future}),
        ("head_object", {"IfMatch": '"not-the-etag"'}),
        ("head_object", {"IfNoneMatch": etag}),
    ]
    for _ in range(2):  # the miss, then the hit
        for op, kw in cases:
            theirs = error_of(getattr(boto, op), Bucket=BUCKET, Key="shards/cond.tar", **kw)
            mine = error_of(getattr(front, op), Bucket="shards", Key="cond.tar", **kw)
            assert mine[:2] == theirs[:2], (op, kw, mine, theirs)
    assert error_of(front.get_object, Bucket="shards", Key="cond.tar", IfMatch='"x"')[:2] == (
        412,
        "PreconditionFailed",
    )
    # the conditions that hold serve the object
    got = front.get_object(Bucket="shards", Key="cond.tar", IfMatch=etag, IfModifiedSince=past)
    assert got["Body"].read() == b"conditional"


def test_missing_buckets_are_no_such_bucket(front, boto):
    for bucket in (GONE, "not-a-front-bucket"):
        status, code, _ = error_of(boto.head_bucket, Bucket=bucket)
        assert status == 404
    for bucket in ("gone", "not-a-front-bucket"):
        assert error_of(front.head_bucket, Bucket=bucket)[0] == 404, bucket
        status, code, message = error_of(front.get_object, Bucket=bucket, Key="x.tar")
        assert (status, code) == (404, "NoSuchBucket"), (bucket, message)
        status, code, _ = error_of(front.list_objects_v2, Bucket=bucket)
        assert (status, code) == (404, "NoSuchBucket"), bucket
    assert error_of(boto.get_object, Bucket=GONE, Key="x.tar")[1] == "NoSuchBucket"
    # the message of an unknown name lists the buckets that exist
    message = error_of(front.get_object, Bucket="not-a-front-bucket", Key="x.tar")[2]
    assert all(name in message for name in ("shards", "all", "ver", "web")), message
    front.head_bucket(Bucket="shards")  # the buckets that exist still do


def test_list_buckets_dates_and_owner_come_from_the_store(front, boto):
    store = boto.list_buckets()
    created = {b["Name"]: b["CreationDate"] for b in store["Buckets"]}
    mine = front.list_buckets()
    dates = {b["Name"]: b["CreationDate"] for b in mine["Buckets"]}
    assert dates["shards"] == dates["all"] == created[BUCKET]
    assert dates["ver"] == created[VERSIONED]
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    assert dates["web"] == dates["gone"] == epoch  # not the store's: nothing to date
    assert mine["Owner"] == store["Owner"]


def _listing(resp: dict) -> dict:
    return {k: v for k, v in resp.items() if k not in ("ResponseMetadata", "Name")}


def test_listings_match_the_store(front, boto):
    queries = [
        {"ContinuationToken": ""},
        {"FetchOwner": True, "Prefix": "many/"},
        {"StartAfter": "many/obj-010.bin", "MaxKeys": 3},
        {"Delimiter": "/", "Prefix": "many/"},
        {"Delimiter": "/"},
        {"MaxKeys": 0},
    ]
    for q in queries:
        mine = _listing(front.list_objects_v2(Bucket="all", **q))
        theirs = _listing(boto.list_objects_v2(Bucket=BUCKET, **q))
        assert mine == theirs, q
    mine = front.list_objects_v2(Bucket="all", ContinuationToken="")
    assert mine["ContinuationToken"] == ""
    for q in ({"Prefix": "many/", "MaxKeys": 4}, {"Delimiter": "/", "Prefix": "many/"}):
        mine = _listing(front.list_objects(Bucket="all", **q))
        theirs = _listing(boto.list_objects(Bucket=BUCKET, **q))
        assert mine == theirs, q


def test_version_reads_are_served_and_cached_per_version(front, boto):
    v1 = boto.put_object(Bucket=VERSIONED, Key="k.tar", Body=b"version one")["VersionId"]
    v2 = boto.put_object(Bucket=VERSIONED, Key="k.tar", Body=b"version two!")["VersionId"]
    for _ in range(2):  # the misses, then the hits
        for version, body in ((v1, b"version one"), (v2, b"version two!")):
            # a HEAD first: the cold HEAD asks the store for that version too
            head = front.head_object(Bucket="ver", Key="k.tar", VersionId=version)
            assert head["ContentLength"] == len(body) and head["VersionId"] == version
            got = front.get_object(Bucket="ver", Key="k.tar", VersionId=version)
            assert got["Body"].read() == body and got["VersionId"] == version
            part = front.get_object(Bucket="ver", Key="k.tar", VersionId=version, Range="bytes=1-3")
            assert part["Body"].read() == body[1:4]
        latest = front.get_object(Bucket="ver", Key="k.tar")
        assert latest["Body"].read() == b"version two!" and latest["VersionId"] == v2
    assert front.get_bucket_versioning(Bucket="ver")["Status"] == "Enabled"
    assert "Status" not in front.get_bucket_versioning(Bucket="shards")
    assert error_of(front.get_bucket_versioning, Bucket="gone")[:2] == (404, "NoSuchBucket")
    theirs = error_of(boto.get_object, Bucket=VERSIONED, Key="k.tar", VersionId="nope")
    mine = error_of(front.get_object, Bucket="ver", Key="k.tar", VersionId="nope")
    assert mine[:2] == theirs[:2] == (404, "NoSuchVersion")


def test_metadata_and_tags_as_the_store_says(front, boto):
    boto.put_object(
        Bucket=BUCKET,
        Key="shards/tagged.tar",
        Body=b"s" * 1000,
        Metadata={"color": "blue"},
        Tagging="a=1&b=2",
        CacheControl="max-age=7",
    )
    fields = ("Metadata", "TagCount", "CacheControl", "ETag", "ContentType", "ContentLength")
    theirs = boto.head_object(Bucket=BUCKET, Key="shards/tagged.tar")
    for _ in range(2):  # the miss, then the hit
        for call in (front.get_object, front.head_object):
            mine = call(Bucket="shards", Key="tagged.tar")
            assert {k: mine.get(k) for k in fields} == {k: theirs.get(k) for k in fields}


SUM = "LPJNul+wow4m6DsqxbninhsWHlwfp0JecwQzYpOLmCQ="  # sha256 of b"hello", base64


def test_stored_checksums_only_to_those_that_ask(front, web, proxy):
    """The stored x-amz-checksum-* fields are sent when the client asks for them
    (``x-amz-checksum-mode: ENABLED``), as S3 does, and not otherwise; plain HTTP
    clients get every field the upstream sent."""
    import urllib.request

    fields = {"x-amz-checksum-sha256": SUM, "x-amz-checksum-type": "FULL_OBJECT"}
    web.add("/site/summed.tar", versions=[Version(b"hello", etag='"s"', headers=fields)])
    for _ in range(2):  # the miss, then the hit
        for call in (front.get_object, front.head_object):
            asked = call(Bucket="web", Key="summed.tar", ChecksumMode="ENABLED")
            assert asked["ChecksumSHA256"] == SUM, call
            got = asked["ResponseMetadata"]["HTTPHeaders"]
            assert got["x-amz-checksum-type"] == "FULL_OBJECT"
            # botocore asks on every GetObject by default: a raw signed request that
            # does not ask gets none
            plain = urllib.request.Request(
                proxy.url + "/web/summed.tar", headers={"x-amz-content-sha256": "UNSIGNED"}
            )
            with urllib.request.urlopen(plain) as resp:
                assert resp.read() == b"hello"
                assert not [k for k in resp.headers if k.lower().startswith("x-amz-checksum")]
    with urllib.request.urlopen(proxy.url + "/web/summed.tar") as resp:  # not an S3 client
        assert resp.headers["x-amz-checksum-sha256"] == SUM


def test_upstream_error_answers_keep_the_stores_code(front, web):
    empty = [Version(b"")]
    web.add("/site/denied.tar", versions=empty, status=403, error_code="AllAccessDisabled")
    web.add("/site/archived.tar", versions=empty, status=403, error_code="InvalidObjectState")
    web.add("/site/broken.tar", versions=empty, status=500, error_code="InternalError")
    web.add("/site/fine.tar", versions=[Version(b"fine", etag='"f"')])
    cases = {
        "denied.tar": (403, "AllAccessDisabled"),
        "archived.tar": (403, "InvalidObjectState"),
        "absent.tar": (404, "NoSuchKey"),
        "broken.tar": (500, "InternalError"),
    }
    for key, want in cases.items():
        status, code, message = error_of(front.get_object, Bucket="web", Key=key)
        assert (status, code) == want, (key, message)
        assert error_of(front.head_object, Bucket="web", Key=key)[0] == want[0]
    assert front.get_object(Bucket="web", Key="fine.tar")["Body"].read() == b"fine"
