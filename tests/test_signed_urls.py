"""Signed URLs (S3 presigned, CloudFront/CDN, GCS, Azure SAS) generated afresh for each
job or epoch are the same entry: the cache key drops the signature and expiry
parameters (``--strip-signatures``, on by default when the proxy listens on loopback),
the request upstream still uses the URL the client gave."""

from __future__ import annotations

import hashlib
import os
import time
from urllib.parse import urlencode

import pytest
from support.faultclient import fetch, settle
from support.huborigin import Hub, sign
from support.proxy_helpers import ProxyProcess

from proxy.policy import unsigned_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MiB = 1 << 20
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")


@pytest.mark.parametrize(
    "signed, key",
    [
        (
            "https://b.s3.amazonaws.com/k.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
            "AK%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z&"
            "X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Security-Token=tok&"
            "X-Amz-Signature=abc&versionId=v1",
            "https://b.s3.amazonaws.com/k.tar?versionId=v1",
        ),
        (
            "https://d111.cloudfront.net/k.tar?Expires=1700000000&Signature=s~x&Key-Pair-Id=K1",
            "https://d111.cloudfront.net/k.tar",
        ),
        (
            "https://storage.googleapis.com/b/k.tar?X-Goog-Algorithm=GOOG4-RSA-SHA256&"
            "X-Goog-Credential=sa%40p.iam&X-Goog-Date=20260101T000000Z&X-Goog-Expires=900&"
            "X-Goog-SignedHeaders=host&X-Goog-Signature=0a1b",
            "https://storage.googleapis.com/b/k.tar",
        ),
        (
            "https://acct.blob.core.windows.net/c/k.tar?sv=2022-11-02&ss=b&srt=o&sp=r&"
            "se=2026-01-01T00%3A00%3A00Z&st=2025-12-31T00%3A00%3A00Z&spr=https&sig=abc%3D",
            "https://acct.blob.core.windows.net/c/k.tar",
        ),
        # not signed: unchanged, whatever its parameters are called
        ("https://h/k.tar?st=1&se=2&expires=3", "https://h/k.tar?st=1&se=2&expires=3"),
        ("https://h/k.tar", "https://h/k.tar"),
    ],
)
def test_unsigned_url(signed, key):
    assert unsigned_url(signed) == key


def cdn_path(sha: str, expires: int) -> str:
    return f"/blob/{sha}?" + urlencode({"Expires": expires, "Signature": sign(sha, expires)})


@pytest.mark.parametrize("mode, hits", [("auto", True), ("off", False)])
def test_a_url_signed_afresh_is_a_hit(tmp_path, mode, hits):
    data = os.urandom(MiB)
    with Hub({"org/ds/a.tar": data}) as hub:
        sha = hashlib.sha256(data).hexdigest()
        p = ProxyProcess(
            tmp_path / "cache", "--upstream", hub.cdn.url, "--strip-signatures", mode, *COMMON
        ).start()
        try:
            now = int(time.time())
            seen = []
            for i in range(3):  # three epochs, each with a signature of its own
                r = fetch(p.port, cdn_path(sha, now + 600 + i))
                assert r.status == 200 and r.body == data, r.describe()
                seen.append(r.headers.get("x-cache"))
                settle(p)
            assert seen == (["MISS", "HIT", "HIT"] if hits else ["MISS", "MISS", "MISS"]), seen
            assert len(hub.cdn_gets(sha)) == (1 if hits else 3)
            # a signature the CDN refuses, for an object not cached: its 403 is passed on
            r = fetch(p.port, cdn_path("0" * 64, now + 600))
            assert r.status in (403, 404), r.describe()
            assert "Signature=" not in p.log_text().split("serving on")[0]
        finally:
            p.stop(timeout=10)


def test_not_stripped_by_default_off_loopback(tmp_path):
    """Listening beyond loopback, ``auto`` keeps signatures in the key: a shared tier must
    not serve what one signed URL fetched to anyone who asks without one."""
    data = os.urandom(64 << 10)
    with Hub({"org/ds/b.tar": data}) as hub:
        sha = hashlib.sha256(data).hexdigest()
        p = ProxyProcess(
            tmp_path / "cache",
            "--upstream",
            hub.cdn.url,
            "--host",
            "0.0.0.0",
            "--admin-token",
            "t",
            *COMMON,
        ).start()
        try:
            now = int(time.time())
            a = fetch(p.port, cdn_path(sha, now + 600))
            settle(p)
            b = fetch(p.port, cdn_path(sha, now + 601))
            assert a.status == b.status == 200
            assert (a.headers.get("x-cache"), b.headers.get("x-cache")) == ("MISS", "MISS")
        finally:
            p.stop(timeout=10)
