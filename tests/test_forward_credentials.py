"""Clients' credentials (``Authorization``, ``Cookie``): never forwarded by default (the
answer the proxy's own request gets is stored and shared); with ``--forward-credentials``
for an upstream they go on, and the answer is that client's alone: streamed, never
stored or joined by another client (RFC 9111 3.5)."""

from __future__ import annotations

import os

import pytest
from badorigin import BadOrigin, Version
from faultclient import fetch, settle
from proxy_helpers import ProxyProcess
from support.s3 import front_client

from proxy.config import ConfigError, parse_settings
from proxy.decide import Facts, Step, decide
from proxy.policy import (
    Upstream,
    carries_credentials,
    credentials_forwarded,
    forwarded_fields,
)

KiB = 1 << 10
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")
UPS = (Upstream(None, "http://a.example/data"), Upstream("hub", "http://h.example"))


def test_credentials_are_forwarded_only_when_asked():
    h = {"Authorization": "Bearer x", "Cookie": "s=1", "X-Trace": "t", "Range": "bytes=0-1"}
    assert forwarded_fields(h) == {"X-Trace": "t"}
    assert forwarded_fields(h, credentials=True) == {
        "Authorization": "Bearer x",
        "Cookie": "s=1",
        "X-Trace": "t",
    }
    # a field the Connection header names is hop-by-hop, credentials or not
    h2 = {"Authorization": "Bearer x", "Connection": "Authorization"}
    assert forwarded_fields(h2, credentials=True) == {}
    assert carries_credentials({"authorization": "x"}) and carries_credentials({"Cookie": "a"})
    assert not carries_credentials({"X-Trace": "t"})
    # the S3 front's own signatures are for the proxy's host, never the upstream's
    sig = "AWS4-HMAC-SHA256 Credential=AKIA/20260101/us-east-1/s3/aws4_request, Signature=ab"
    assert not carries_credentials({"Authorization": sig})
    assert not carries_credentials({"Authorization": "AWS AKIA:c2lnbmF0dXJl"})
    assert forwarded_fields({"Authorization": sig, "X-Trace": "t"}, credentials=True) == {
        "X-Trace": "t"
    }


@pytest.mark.parametrize(
    "url, allowed, forwarded",
    [
        ("http://a.example/data/x.tar", (), False),
        ("http://a.example/data/x.tar", ("*",), True),
        ("http://a.example/data/x.tar", ("-",), True),
        ("http://a.example/data/x.tar", ("hub",), False),
        ("http://h.example/x.tar", ("hub",), True),
        ("http://h.example/x.tar", ("-",), False),
        ("http://elsewhere.example/x.tar", ("-", "hub"), False),  # --allow-host URLs
        ("http://elsewhere.example/x.tar", ("*",), True),
    ],
)
def test_which_upstreams_get_credentials(url, allowed, forwarded):
    assert credentials_forwarded(url, UPS, allowed) is forwarded


def test_a_private_request_is_never_stored_but_may_use_an_entry():
    looked = Facts(looked_up=True, private=True)
    assert decide(looked) is Step.BYPASS  # no cold shortcut, no download, no claim
    assert decide(looked.learn(entry=True)) is Step.HIT
    assert decide(Facts(private=True, downloading=True)) is Step.JOIN


def test_forward_credentials_names_an_upstream(tmp_path):
    base = ["--cache-dir", str(tmp_path), "--upstream", "http://a", "--upstream", "hub=http://h"]
    s = parse_settings([*base, "--forward-credentials", "hub", "--forward-credentials", "-"], {})
    assert s.forward_credentials == ("hub", "-")
    with pytest.raises(ConfigError, match="--forward-credentials"):
        parse_settings([*base, "--forward-credentials", "nope"], {})


@pytest.fixture
def origin():
    with BadOrigin() as o:
        yield o


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_forwarded_credentials_get_an_answer_of_their_own(origin, tmp_path):
    data = os.urandom(64 * KiB)
    origin.add(
        "/p.tar",
        versions=[
            Version(data, etag='"p"', last_modified=LM, headers={"Cache-Control": "max-age=3600"})
        ],
    )
    p = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--forward-credentials", "*", *COMMON
    ).start()
    try:
        r = fetch(p.port, "/p.tar", headers={"Authorization": "Bearer alice"})
        assert r.status == 200 and r.body == data, r.describe()
        assert r.headers.get("x-cache") == "BYPASS"
        assert origin.log("/p.tar", "GET")[0].header("authorization") == "Bearer alice"
        settle(p)
        # not stored: the next client (without credentials) gets the origin's own answer
        r = fetch(p.port, "/p.tar")
        assert r.status == 200 and r.body == data and r.headers.get("x-cache") == "MISS"
        got = origin.log("/p.tar", "GET")
        assert len(got) == 2 and got[1].header("authorization") is None
        settle(p)
        # a stored entry (fetched without credentials) serves a client that has some
        r = fetch(p.port, "/p.tar", headers={"Authorization": "Bearer bob"})
        assert r.status == 200 and r.body == data and r.headers.get("x-cache") == "HIT"
        assert len(origin.log("/p.tar", "GET")) == 2
    finally:
        p.stop(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_by_default_credentials_stay_with_the_proxy(origin, tmp_path):
    data = os.urandom(64 * KiB)
    origin.add("/d.tar", versions=[Version(data, etag='"d"', last_modified=LM)])
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *COMMON).start()
    try:
        r = fetch(p.port, "/d.tar", headers={"Authorization": "Bearer alice"})
        assert r.status == 200 and r.body == data and r.headers.get("x-cache") == "MISS"
        assert origin.log("/d.tar", "GET")[0].header("authorization") is None
        settle(p)
        r = fetch(p.port, "/d.tar")
        assert r.status == 200 and r.body == data and r.headers.get("x-cache") == "HIT"
    finally:
        p.stop(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_s3_front_signatures_are_not_forwarded_credentials(origin, tmp_path):
    """With --forward-credentials, an S3 client's SigV4 Authorization (signed for the
    proxy's host) is no credential of the upstream's: the object is cached and shared,
    and the upstream never sees the signature."""
    pytest.importorskip("boto3")
    data = os.urandom(64 * KiB)
    origin.add("/obj.tar", versions=[Version(data, etag='"o"', last_modified=LM)])
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        f"data={origin.url}",
        "--forward-credentials",
        "*",
        *COMMON,
    ).start()
    try:
        s3 = front_client(p.url)
        for _ in range(2):  # the miss, then the hit
            got = s3.get_object(Bucket="data", Key="obj.tar")
            assert got["Body"].read() == data
            settle(p)
        gets = origin.log("/obj.tar", "GET")
        assert len(gets) == 1 and gets[0].header("authorization") is None
    finally:
        p.stop(timeout=10)
