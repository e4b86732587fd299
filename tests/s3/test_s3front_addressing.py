"""The S3 front as S3 clients address it: virtual-hosted style (``Host: BUCKET.DOMAIN``)
as well as path style, ListObjects V1 (rclone's and older SDKs' default) as well as V2,
and XML errors with a request id on every S3 answer. A real proxy in front of SeaweedFS,
read with boto3 and raw HTTP."""

from __future__ import annotations

import http.client
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.s3 import MEDIUM, OBJECTS, start_signed_front  # noqa: E402

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
MANY = sorted(k for k in OBJECTS if k.startswith("many/"))


def client(proxy, style: str):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=f"http://localhost:{proxy.port}",
        region_name="us-east-1",
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": style}),
    )


def raw(proxy, method: str, path: str, host: str | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    h = {"Host": host or f"127.0.0.1:{proxy.port}", **(headers or {})}
    conn.request(method, path, headers=h)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def error_code(body: bytes) -> str:
    root = ET.fromstring(body)
    assert root.tag == "Error", body
    assert root.findtext("RequestId"), body
    assert root.findtext("Message"), body
    return root.findtext("Code") or ""


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_boto3_reads_lists_and_heads_in_both_styles(proxy, localhost_subdomains, style):
    s3 = client(proxy, style)
    got = s3.get_object(Bucket="shards", Key="medium.tar")
    assert got["Body"].read() == MEDIUM
    assert got["ResponseMetadata"]["HTTPHeaders"].get("x-amz-request-id")
    r = s3.get_object(Bucket="shards", Key="small.tar", Range="bytes=100-199")
    assert r["Body"].read() == OBJECTS["shards/small.tar"][100:200]
    assert s3.head_object(Bucket="shards", Key="small.tar")["ContentLength"] == 10_000
    s3.head_bucket(Bucket="all")
    for api in ("list_objects_v2", "list_objects"):
        keys, pages = [], 0
        for page in s3.get_paginator(api).paginate(
            Bucket="all", Prefix="many/", PaginationConfig={"PageSize": 5}
        ):
            pages += 1
            keys.extend(o["Key"] for o in page.get("Contents", []))
        assert keys == MANY, api
        assert pages >= 5, api
    # a listing is never silently empty: the bucket's keys are there
    listed = s3.list_objects_v2(Bucket="shards")
    assert {o["Key"] for o in listed["Contents"]} >= {"medium.tar", "small.tar"}
    with pytest.raises(s3.exceptions.NoSuchKey):
        s3.get_object(Bucket="shards", Key="absent.tar")
    with pytest.raises(s3.exceptions.NoSuchBucket):
        s3.list_objects_v2(Bucket="nosuchbucket")


def test_list_objects_v1_with_delimiter_pages_over_common_prefixes(proxy):
    s3 = client(proxy, "path")
    seen_keys, seen_prefixes, marker = [], [], ""
    for _ in range(50):
        page = s3.list_objects(
            Bucket="all", Prefix="many/", Delimiter="/", MaxKeys=4, Marker=marker
        )
        seen_keys += [o["Key"] for o in page.get("Contents", [])]
        seen_prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        if not page["IsTruncated"]:
            break
        marker = page["NextMarker"]
    direct = [k for k in MANY if "/" not in k[len("many/") :]]
    assert seen_keys == direct
    assert seen_prefixes == ["many/sub/"]  # once, though two keys lie under it
    # V1 answers carry Owner on each key, V2 only when asked
    v1 = s3.list_objects(Bucket="all", Prefix="many/sub/")
    assert all("Owner" in o for o in v1["Contents"])
    v2 = s3.list_objects_v2(Bucket="all", Prefix="many/sub/")
    assert not any("Owner" in o for o in v2["Contents"])
    v2 = s3.list_objects_v2(Bucket="all", Prefix="many/sub/", FetchOwner=True)
    assert all("Owner" in o for o in v2["Contents"])


def test_v1_listing_xml_and_url_encoding(proxy):
    status, headers, body = raw(proxy, "GET", "/all?prefix=shards/dir/&encoding-type=url")
    assert status == 200, body
    root = ET.fromstring(body)
    assert root.findtext(f"{NS}Marker") == ""
    assert root.findtext(f"{NS}EncodingType") == "url"
    assert [k.text for k in root.iter(f"{NS}Key")] == ["shards/dir/x%20one%2Btwo.tar"]
    assert headers.get("x-amz-request-id")


def test_virtual_host_raw_requests(proxy):
    host = f"shards.localhost:{proxy.port}"
    status, headers, body = raw(proxy, "GET", "/medium.tar", host=host)
    assert status == 200 and body == MEDIUM
    assert headers.get("x-amz-request-id")
    status, _, body = raw(proxy, "GET", "/?list-type=2&prefix=dir/", host=host)
    assert status == 200
    root = ET.fromstring(body)
    assert root.tag == f"{NS}ListBucketResult"  # not a ListAllMyBuckets document
    assert [k.text for k in root.iter(f"{NS}Key")] == ["dir/x one+two.tar"]
    status, headers, body = raw(proxy, "HEAD", "/small.tar", host=host)
    assert status == 200 and headers["content-length"] == "10000"
    # a Host naming no bucket of this front
    status, headers, body = raw(proxy, "GET", "/medium.tar", host=f"nope.localhost:{proxy.port}")
    assert status == 404 and error_code(body) == "NoSuchBucket"
    assert headers.get("x-amz-request-id")
    status, _, body = raw(proxy, "GET", "/absent.tar", host=host)
    assert status == 404 and error_code(body) == "NoSuchKey"
    status, _, body = raw(proxy, "GET", "/?list-type=2", host=f"nope.localhost:{proxy.port}")
    assert status == 404 and error_code(body) == "NoSuchBucket"


def test_errors_are_s3_xml_on_every_route(proxy):
    sdk = {"x-amz-content-sha256": "UNSIGNED-PAYLOAD"}
    cases = [
        ("PUT", "/shards/new.tar", 405, "MethodNotAllowed"),
        ("DELETE", "/shards/small.tar", 405, "MethodNotAllowed"),
        ("POST", "/shards/small.tar?uploads", 405, "MethodNotAllowed"),
        ("PUT", "/shards", 405, "MethodNotAllowed"),
        ("GET", "/shards?lifecycle", 501, "NotImplemented"),
        ("GET", "/shards/small.tar?versionId=", 400, "InvalidArgument"),
        ("GET", "/shards/absent.tar", 404, "NoSuchKey"),
        ("GET", "/nosuchbucket/x.tar", 404, "NoSuchBucket"),
        ("GET", "/shards?list-type=3", 400, "InvalidArgument"),
        ("GET", "/shards?max-keys=x", 400, "InvalidArgument"),
    ]
    for method, path, status, code in cases:
        got, headers, body = raw(proxy, method, path, headers=sdk)
        assert got == status, (method, path, body)
        assert error_code(body) == code, (method, path, body)
        assert headers.get("x-amz-request-id"), (method, path)
        assert "read-only" in body.decode() or status != 405
    got, _, body = raw(proxy, "GET", "/shards/small.tar", headers={**sdk, "Range": "bytes=999999-"})
    assert got == 416 and error_code(body) == "InvalidRange"
    # a plain client keeps the proxy's one-line errors
    got, _, body = raw(proxy, "GET", "/shards/absent.tar")
    assert got == 404 and not body.startswith(b"<?xml")


def test_signed_virtual_hosted_requests(seaweed, tmp_path, localhost_subdomains):
    """With front keys set, boto3 signs for the virtual host (Host: BUCKET.localhost) and
    the front checks that signature; presigned URLs work in both styles; a wrong secret
    is SignatureDoesNotMatch."""
    import urllib.request

    import boto3
    from botocore.config import Config

    p = start_signed_front(seaweed, tmp_path)
    try:

        def signed(style: str, secret: str = "front-secret"):
            return boto3.client(
                "s3",
                endpoint_url=f"http://localhost:{p.port}",
                region_name="us-east-1",
                aws_access_key_id="front-key",
                aws_secret_access_key=secret,
                config=Config(signature_version="s3v4", s3={"addressing_style": style}),
            )

        for style in ("virtual", "path"):
            s3 = signed(style)
            assert s3.get_object(Bucket="shards", Key="medium.tar")["Body"].read() == MEDIUM
            keys = [o["Key"] for o in s3.list_objects(Bucket="all", Prefix="many/")["Contents"]]
            assert keys == MANY
            url = s3.generate_presigned_url(
                "get_object", Params={"Bucket": "shards", "Key": "small.tar"}, ExpiresIn=60
            )
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.read() == OBJECTS["shards/small.tar"]
            with pytest.raises(s3.exceptions.ClientError) as ei:
                signed(style, "wrong").get_object(Bucket="shards", Key="small.tar")
            assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
        # unsigned requests are refused when keys are set
        status, _, body = raw(p, "GET", "/medium.tar", host=f"shards.localhost:{p.port}")
        assert status == 403 and error_code(body) == "AccessDenied"
    finally:
        p.stop()


def test_listings_page_over_more_than_1000_keys(proxy, boto):
    """1,100 keys under one prefix: V1 and V2 each page at 1,000 (the S3 maximum) and
    together return every key once, in order, in both addressing styles."""
    import concurrent.futures

    from conftest import BUCKET

    keys = [f"big-listing/k-{i:05d}" for i in range(1100)]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: boto.put_object(Bucket=BUCKET, Key=k, Body=b"x"), keys))
    try:
        s3 = client(proxy, "path")
        first = s3.list_objects_v2(Bucket="all", Prefix="big-listing/")
        assert first["IsTruncated"] and first["KeyCount"] == 1000
        first = s3.list_objects(Bucket="all", Prefix="big-listing/")
        assert first["IsTruncated"] and len(first["Contents"]) == 1000
        for api in ("list_objects_v2", "list_objects"):
            got = [
                o["Key"]
                for page in s3.get_paginator(api).paginate(Bucket="all", Prefix="big-listing/")
                for o in page.get("Contents", [])
            ]
            assert got == keys, api
        v2 = s3.list_objects_v2(Bucket="all", Prefix="big-listing/", StartAfter=keys[1049])
        assert [o["Key"] for o in v2["Contents"]] == keys[1050:]
    finally:  # other tests list this bucket
        for i in range(0, len(keys), 1000):
            boto.delete_objects(
                Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
            )


def test_list_buckets_for_an_anonymous_client_without_s3_headers(proxy):
    """rclone without credentials sends GET / with no Authorization and no x-amz-*
    header: it gets the ListAllMyBuckets document, not the proxy's 404."""
    status, headers, body = raw(proxy, "GET", "/")
    assert status == 200, body
    root = ET.fromstring(body)
    assert root.tag == f"{NS}ListAllMyBucketsResult"
    assert sorted(b.text for b in root.iter(f"{NS}Name")) == ["all", "shards"]
    assert headers.get("x-amz-request-id")


CRT_AGENT = "s3torchconnector/1.5.0 mountpoint-s3-client/0.14.1 CRTS3NativeClient/0.1.x"


def test_an_empty_object_read_the_way_the_crt_does(proxy):
    """aws-c-s3 (s3torchconnector) asks a first part with a Range and no S3 header; on
    an empty object it needs S3's 416 InvalidRange with ActualObjectSize, then asks
    ?partNumber=1 without a range."""
    ua = {"User-Agent": CRT_AGENT}
    status, headers, body = raw(
        proxy, "GET", "/shards/empty.tar", headers={**ua, "Range": "bytes=0-8388607"}
    )
    assert status == 416, body
    assert headers["content-type"].startswith("application/xml")
    assert error_code(body) == "InvalidRange"
    assert ET.fromstring(body).findtext("ActualObjectSize") == "0"
    status, _, body = raw(proxy, "GET", "/shards/empty.tar?partNumber=1", headers=ua)
    assert status == 200 and body == b""
    status, _, body = raw(proxy, "GET", "/shards/small.tar?partNumber=1", headers=ua)
    assert status == 200 and body == OBJECTS["shards/small.tar"]
    status, _, body = raw(proxy, "GET", "/shards/small.tar?partNumber=2", headers=ua)
    assert status == 416 and error_code(body) == "InvalidPartNumber"
    # past the end of a non-empty object: the size too
    status, _, body = raw(
        proxy, "GET", "/shards/small.tar", headers={**ua, "Range": "bytes=20000-"}
    )
    assert status == 416 and ET.fromstring(body).findtext("ActualObjectSize") == "10000"
