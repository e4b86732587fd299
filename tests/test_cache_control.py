"""What the origin says about reuse is honoured where it matters for correctness:
``Cache-Control: no-cache`` means ask the upstream before every reuse (whatever
``--revalidate`` says), ``Vary`` is either harmless (``Accept-Encoding`` on an unencoded
answer, which every client accepts) or the answer is not stored, and a header block too
large to keep with an entry is not stored either."""

from __future__ import annotations

import os

import pytest
from support.badorigin import BadOrigin, Version
from support.faultclient import fetch, settle
from support.proxy_helpers import ProxyProcess

from proxy.policy import must_revalidate_each_use, vary_forbids

KiB = 1 << 10
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")


def test_no_cache_rule():
    assert must_revalidate_each_use("no-cache")
    assert must_revalidate_each_use("public, No-Cache, max-age=60")
    assert not must_revalidate_each_use('no-cache="Set-Cookie"')  # qualified: fields only
    assert not must_revalidate_each_use("max-age=60")
    assert not must_revalidate_each_use(None)


def test_vary_rule():
    assert not vary_forbids(None, None)
    assert not vary_forbids("Accept-Encoding", None)
    assert not vary_forbids("accept-encoding", "identity")
    assert vary_forbids("Accept-Encoding", "gzip")
    assert vary_forbids("*", None)
    assert vary_forbids("Accept-Encoding, User-Agent", None)
    assert not vary_forbids("Origin, Access-Control-Request-Method", None)  # CORS only
    assert vary_forbids("Cookie", None)


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


@pytest.fixture
def proxy_args() -> tuple[str, ...]:
    return COMMON


pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_no_cache_is_revalidated_before_each_reuse(origin, proxy):
    """Default mode (``--revalidate never``): an entry whose answer said ``no-cache`` is
    still stored, but every hit first asks the upstream (a conditional GET answered
    304); once the object changes, the new bytes are served."""
    old, new = os.urandom(64 * KiB), os.urandom(64 * KiB)
    sc = origin.add(
        "/nc.tar",
        versions=[
            Version(old, etag='"a"', last_modified=LM, headers={"Cache-Control": "no-cache"}),
            Version(new, etag='"b"', last_modified=LM, headers={"Cache-Control": "no-cache"}),
        ],
    )
    r = fetch(proxy.port, "/nc.tar")
    assert r.status == 200 and r.body == old and r.headers.get("x-cache") == "MISS"
    settle(proxy)
    for _ in range(3):
        hit = fetch(proxy.port, "/nc.tar")
        assert hit.status == 200 and hit.body == old and hit.headers.get("x-cache") == "HIT"
    conditionals = [g for g in origin.log("/nc.tar", "GET") if g.header("if-none-match")]
    assert len(conditionals) == 3, [g.headers for g in origin.log("/nc.tar")]
    sc.current = 1
    changed = fetch(proxy.port, "/nc.tar")
    assert changed.status == 200 and changed.body == new, changed.describe()


@pytest.mark.parametrize(
    "vary, encoding, stored",
    [
        ("Accept-Encoding", None, True),
        ("Accept-Encoding", "gzip", False),
        ("*", None, False),
        ("User-Agent", None, False),
    ],
)
def test_vary(origin, proxy, vary, encoding, stored):
    data = os.urandom(32 * KiB)
    headers = {"Vary": vary}
    if encoding:
        headers["Content-Encoding"] = encoding
    origin.add("/v.tar", versions=[Version(data, etag='"v"', last_modified=LM, headers=headers)])
    seen = []
    for _ in range(2):
        r = fetch(proxy.port, "/v.tar")
        assert r.status == 200 and r.body == data, r.describe()
        assert r.headers.get("vary") == vary
        seen.append(r.headers.get("x-cache"))
        settle(proxy)
    assert seen == (["MISS", "HIT"] if stored else ["BYPASS", "BYPASS"]), seen


def test_a_header_block_too_large_to_store_is_not_cached(origin, proxy):
    data = os.urandom(8 * KiB)
    headers = {f"x-amz-meta-k{i}": "v" * 1000 for i in range(40)}  # ~40 KB of fields
    origin.add(
        "/big-h.tar", versions=[Version(data, etag='"h"', last_modified=LM, headers=headers)]
    )
    for _ in range(2):
        r = fetch(proxy.port, "/big-h.tar")
        assert r.status == 200 and r.body == data, r.describe()
        assert r.headers.get("x-cache") == "BYPASS"
        assert r.headers.get("x-amz-meta-k39") == "v" * 1000
        settle(proxy)
    assert "more than the" in proxy.log_text()


def test_a_304_updates_the_stored_fields(origin, tmp_path):
    """RFC 9111 4.3.4: the fields a 304 carries replace the stored ones."""
    data = os.urandom(16 * KiB)
    v = Version(data, etag='"u"', last_modified=LM, headers={"Cache-Control": "max-age=60"})
    origin.add("/u.tar", versions=[v])
    p = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--revalidate", "always", *COMMON
    ).start()
    try:
        assert fetch(p.port, "/u.tar").headers.get("cache-control") == "max-age=60"
        settle(p)
        v.headers.update({"Cache-Control": "max-age=120", "X-Policy": "new"})
        for _ in range(2):
            r = fetch(p.port, "/u.tar")
            assert r.status == 200 and r.body == data and r.headers.get("x-cache") == "HIT"
            assert r.headers.get("cache-control") == "max-age=120", r.headers
            assert r.headers.get("x-policy") == "new"
    finally:
        p.stop(timeout=10)


def test_a_changed_object_is_fetched_once_on_revalidation(origin, tmp_path):
    """The conditional GET of a revalidation answered 200 with a new version: that very
    answer is streamed to the client and into the new entry (2 GETs in all, not 3)."""
    old, new = os.urandom(256 * KiB), os.urandom(256 * KiB)
    sc = origin.add(
        "/c.tar",
        versions=[
            Version(old, etag='"1"', last_modified=LM),
            Version(new, etag='"2"', last_modified=LM),
        ],
    )
    p = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--revalidate", "always", *COMMON
    ).start()
    try:
        assert fetch(p.port, "/c.tar").body == old
        settle(p)
        sc.current = 1
        r = fetch(p.port, "/c.tar")
        assert r.status == 200 and r.body == new and r.headers.get("x-cache") == "MISS", (
            r.describe()
        )
        settle(p)
        assert len(origin.log("/c.tar", "GET")) == 2, [g.headers for g in origin.log("/c.tar")]
        hit = fetch(p.port, "/c.tar")  # revalidated (304), then served from the new entry
        assert hit.body == new and hit.headers.get("x-cache") == "HIT", hit.describe()
    finally:
        p.stop(timeout=10)


def test_request_fields_reach_the_upstream_on_a_miss(origin, proxy):
    """End-to-end request fields go on with a miss; hop-by-hop fields, the cache's own
    (ranges, conditionals) and the client's credentials do not."""
    data = os.urandom(64 * KiB)
    origin.add("/f.tar", versions=[Version(data, etag='"f"', last_modified=LM)])
    sent = {
        "X-Trace-Id": "trace-42",
        "User-Agent": "mytrainer/1.0",
        "Accept": "application/x-tar",
        "Accept-Language": "de",
        "Authorization": "Bearer client-secret",
        "Cookie": "session=client",
        "Connection": "X-Hop",
        "X-Hop": "1",
        "Range": "bytes=0-99",
    }
    r = fetch(proxy.port, "/f.tar", headers=sent)
    assert r.status == 206 and r.body == data[:100], r.describe()
    got = origin.log("/f.tar", "GET")[0]
    for name in ("x-trace-id", "user-agent", "accept", "accept-language"):
        assert got.header(name) == sent[next(k for k in sent if k.lower() == name)], got.headers
    for name in ("authorization", "cookie", "x-hop", "range"):
        assert got.header(name) is None, (name, got.headers)
    assert got.header("accept-encoding") == "identity"


@pytest.mark.parametrize("transport", ["threads", "aiohttp"])
def test_interim_answers_are_skipped(origin, tmp_path, transport):
    """103 Early Hints and 102 Processing before the answer: a client skips them (RFC
    9110 15.2), and so does the proxy's upstream client, on both transports."""
    data = os.urandom(32 * KiB)
    origin.add("/i.tar", versions=[Version(data, etag='"i"', last_modified=LM)], interim=(102, 103))
    p = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--http-transport", transport, *COMMON
    ).start()
    try:
        for expect in ("MISS", "HIT"):
            r = fetch(p.port, "/i.tar")
            assert r.status == 200 and r.body == data, r.describe()
            assert r.headers.get("x-cache") == expect
            settle(p)
        assert fetch(p.port, "/i.tar", method="HEAD").status == 200
    finally:
        p.stop(timeout=10)


@pytest.mark.parametrize(
    "value, stored", [("no-store", False), ("private", False), ("max-age=60", True)]
)
def test_cdn_cache_control_is_honoured(origin, proxy, value, stored):
    """RFC 9213: CDN-Cache-Control speaks to caches like this one; its no-store and
    private keep an answer out of the cache as Cache-Control's do."""
    data = os.urandom(16 * KiB)
    origin.add(
        "/cdn.tar",
        versions=[
            Version(data, etag='"c"', last_modified=LM, headers={"CDN-Cache-Control": value})
        ],
    )
    seen = []
    for _ in range(2):
        r = fetch(proxy.port, "/cdn.tar")
        assert r.status == 200 and r.body == data
        seen.append(r.headers.get("x-cache"))
        settle(proxy)
    assert seen == (["MISS", "HIT"] if stored else ["BYPASS", "BYPASS"]), seen
