"""What the origin said about its bytes travels with them, on every path and transport.

An origin answering ``Content-Encoding: gzip`` (an object stored compressed, an nginx with
gzip on) sends compressed bytes; a cache that drops the header hands a client those
bytes labelled as the object itself. Every answer — the miss, a client that joined it, a
hit from RAM or from disk, after a restart, a Range, a HEAD, the S3 front — carries the
origin's end-to-end fields (Content-Encoding, Content-Language, Content-Disposition,
Cache-Control, user metadata, the Content-Type with its parameters); ranges are ranges
of the encoded bytes; fields that describe the whole body (Content-MD5) are not sent on
a 206; hits say their Age.
"""

from __future__ import annotations

import base64
import concurrent.futures
import gzip
import hashlib
import os

import pytest
from support.badorigin import BadOrigin, Version
from support.faultclient import TRANSPORTS, fetch, settle
from support.proxy_helpers import ProxyProcess
from support.s3 import front_client
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

KiB = 1 << 10
MiB = 1 << 20
ETAG = '"gz-0123456789abcdef"'
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
COMMON = ("--retries", "2", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")


def gz_object(n: int) -> tuple[bytes, bytes]:
    """(the plain bytes, their gzip encoding) of an incompressible object."""
    plain = os.urandom(n)
    return plain, gzip.compress(plain, compresslevel=1)


FIELDS = {
    "Content-Encoding": "gzip",
    "Content-Language": "de-CH",
    "Content-Disposition": 'attachment; filename="shard-000001.tar.gz"',
    "Cache-Control": "max-age=60",
    "x-amz-meta-color": "blue",
    "X-Repo-Commit": "0123456789abcdef0123456789abcdef01234567",
}
CTYPE = "application/x-tar; charset=binary"


def assert_fields(r, what: str) -> None:
    for k, v in FIELDS.items():
        assert r.headers.get(k.lower()) == v, f"{what}: {k} is {r.headers.get(k.lower())!r}"
    assert r.headers.get("content-type") == CTYPE, what
    assert r.headers.get("etag") == ETAG, what


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


@pytest.mark.parametrize("size", [64 * KiB, 1 * MiB], ids=["ram-tier", "disk"])
def test_content_encoding_on_every_path(origin, transport, tmp_path, size):
    _, encoded = gz_object(size)
    md5 = base64.b64encode(hashlib.md5(encoded).digest()).decode()
    sc = origin.add(
        "/obj.tar.gz",
        versions=[
            Version(
                encoded,
                etag=ETAG,
                last_modified=LM,
                content_type=CTYPE,
                headers={**FIELDS, "Content-MD5": md5},
            )
        ],
    )
    sc.rate = 4 * MiB  # slow enough that a second client joins the download
    args = ("--upstream", origin.url, *COMMON, *TRANSPORTS[transport])
    p = ProxyProcess(tmp_path / "cache", *args).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(fetch, p.port, "/obj.tar.gz")
            wait_until(lambda: origin.log("obj.tar.gz", "GET"), 10, 0.01, "the first download")
            second = pool.submit(fetch, p.port, "/obj.tar.gz")
            replies = [first.result(), second.result()]
        for r in replies:
            assert r.status == 200 and r.clean and r.body == encoded, r.describe()
            assert_fields(r, f"cold {r.headers.get('x-cache')}")
            assert r.headers.get("content-md5") == md5
        # (a small object may be complete before the second client asks: then a HIT)
        assert replies[0].headers.get("x-cache") == "MISS", replies[0].describe()
        settle(p)
        sc.rate = None
        hit = fetch(p.port, "/obj.tar.gz")
        assert hit.status == 200 and hit.headers.get("x-cache") == "HIT", hit.describe()
        assert hit.body == encoded
        assert_fields(hit, "hit")
        assert hit.headers.get("content-md5") == md5
        assert hit.headers.get("age") is not None and int(hit.headers["age"]) >= 0
        rng = fetch(p.port, "/obj.tar.gz", headers={"Range": "bytes=10-109"})
        assert rng.status == 206 and rng.body == encoded[10:110], rng.describe()
        assert rng.headers.get("content-range") == f"bytes 10-109/{len(encoded)}"
        assert_fields(rng, "range of a hit")
        assert "content-md5" not in rng.headers, "a whole-body digest on a 206"
        head = fetch(p.port, "/obj.tar.gz", method="HEAD")
        assert head.status == 200 and head.headers.get("content-length") == str(len(encoded))
        assert_fields(head, "HEAD of a hit")
        nm = fetch(p.port, "/obj.tar.gz", headers={"If-None-Match": ETAG})
        assert nm.status == 304, nm.describe()
        assert nm.headers.get("cache-control") == FIELDS["Cache-Control"]
        assert "content-encoding" not in nm.headers
    finally:
        p.stop(timeout=10)
    # the fields are kept with the entry: a restarted proxy serves them from its index
    p = ProxyProcess(tmp_path / "cache", *args).start()
    try:
        again = fetch(p.port, "/obj.tar.gz")
        assert again.headers.get("x-cache") == "HIT" and again.body == encoded, again.describe()
        assert_fields(again, "hit after a restart")
    finally:
        p.stop(timeout=10)
    assert len(origin.log("/obj.tar.gz", "GET")) >= 1


def test_content_encoding_on_cold_head_and_cold_range(origin, tmp_path):
    """A HEAD and a far Range of an object neither cached nor downloading are answered
    from the upstream's own answers: with its fields too."""
    _, encoded = gz_object(6 * MiB)
    origin.add(
        "/big.tar.gz",
        versions=[
            Version(encoded, etag=ETAG, last_modified=LM, content_type=CTYPE, headers=FIELDS)
        ],
    )
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *COMMON).start()
    try:
        head = fetch(p.port, "/big.tar.gz", method="HEAD")
        assert head.status == 200, head.describe()
        assert_fields(head, "cold HEAD")
        start = 5 * MiB
        r = fetch(p.port, "/big.tar.gz", headers={"Range": f"bytes={start}-{start + 99}"})
        assert r.status == 206 and r.body == encoded[start : start + 100], r.describe()
        assert_fields(r, "cold range")
    finally:
        p.stop(timeout=10)


def test_uncached_answers_carry_the_fields(origin, tmp_path):
    """An object not cached (Cache-Control: no-store) is streamed through with its fields."""
    _, encoded = gz_object(64 * KiB)
    fields = dict(FIELDS, **{"Cache-Control": "no-store"})
    origin.add(
        "/ns.tar.gz",
        versions=[
            Version(encoded, etag=ETAG, last_modified=LM, content_type=CTYPE, headers=fields)
        ],
    )
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *COMMON).start()
    try:
        r = fetch(p.port, "/ns.tar.gz")
        assert r.status == 200 and r.body == encoded, r.describe()
        assert r.headers.get("x-cache") == "BYPASS"
        assert r.headers.get("content-encoding") == "gzip"
        assert r.headers.get("cache-control") == "no-store"
        assert r.headers.get("x-amz-meta-color") == "blue"
    finally:
        p.stop(timeout=10)


def test_hop_by_hop_and_cookies_are_not_replayed(origin, tmp_path):
    """Fields that belong to one connection or one client stay with it."""
    data = os.urandom(32 * KiB)
    origin.add(
        "/plain.tar",
        versions=[
            Version(
                data,
                etag=ETAG,
                last_modified=LM,
                headers={
                    "Set-Cookie": "session=secret",
                    "Connection": "X-Private-Hop",
                    "X-Private-Hop": "1",
                    "Keep-Alive": "timeout=5",
                    "X-Custom": "kept",
                },
            )
        ],
    )
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *COMMON).start()
    try:
        for expect in ("MISS", "HIT"):
            r = fetch(p.port, "/plain.tar")
            assert r.status == 200 and r.body == data and r.headers.get("x-cache") == expect
            assert r.headers.get("x-custom") == "kept"
            assert "set-cookie" not in r.headers
            assert "x-private-hop" not in r.headers
            assert r.headers.get("keep-alive") != "timeout=5"
            settle(p)
    finally:
        p.stop(timeout=10)


def test_s3_front_reports_content_encoding(origin, tmp_path):
    """GetObject and HeadObject through the S3 front report the object's ContentEncoding,
    ContentLanguage, ContentDisposition and user metadata, as S3 does."""
    pytest.importorskip("boto3")
    _, encoded = gz_object(64 * KiB)
    origin.add(
        "/obj.tar.gz",
        versions=[
            Version(encoded, etag=ETAG, last_modified=LM, content_type=CTYPE, headers=FIELDS)
        ],
    )
    p = ProxyProcess(tmp_path / "cache", "--upstream", f"data={origin.url}", *COMMON).start()
    try:
        s3 = front_client(p.url)
        for _ in range(2):  # the miss, then the hit
            got = s3.get_object(Bucket="data", Key="obj.tar.gz")
            assert got["Body"].read() == encoded
            assert got["ContentEncoding"] == "gzip"
            assert got["ContentLanguage"] == "de-CH"
            assert got["ContentDisposition"] == FIELDS["Content-Disposition"]
            assert got["Metadata"] == {"color": "blue"}
            settle(p)
        head = s3.head_object(Bucket="data", Key="obj.tar.gz")
        assert head["ContentEncoding"] == "gzip" and head["Metadata"] == {"color": "blue"}
    finally:
        p.stop(timeout=10)
