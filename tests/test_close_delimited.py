"""A body framed by the connection closing (no Content-Length, not chunked) cannot tell
a cut from its end. Before it is cached the proxy asks the upstream for its last byte
again, pinned to the version: a 206 with the same total and byte confirms it. A total
larger than what arrived proves a cut (a visible error, nothing committed); an upstream
that cannot say (no validator, Range ignored) gets its body served but not cached, and
counted in ``shardcache_unconfirmed_bodies_total``.
"""

from __future__ import annotations

import os

import pytest
from support.faultclient import TRANSPORTS, check_rule, fetch, settle, stats
from support.origins import BadOrigin, Version
from support.proxy import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MiB = 1 << 20
SIZE = 1 * MiB
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
ETAG = '"v1-0123456789abcdef"'
COMMON = ("--retries", "2", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


@pytest.fixture
def proxy_args(transport: str) -> tuple[str, ...]:
    return (*COMMON, *TRANSPORTS[transport])


def unconfirmed(p: ProxyProcess) -> float:
    text = fetch(p.port, "/metrics").body.decode()
    for line in text.splitlines():
        if line.startswith("shardcache_unconfirmed_bodies_total "):
            return float(line.split()[1])
    raise AssertionError("no shardcache_unconfirmed_bodies_total in /metrics")


def test_an_orderly_close_mid_body_is_an_error(origin, proxy, transport):
    """The first GET is cut at 40 % by an orderly close (FIN), which looks exactly like
    the end of a close-delimited body; the probe of its last byte shows the object is
    larger. The client sees a broken response, never a clean short one, and nothing is
    committed; the next read (origin healthy) is complete."""
    data = os.urandom(SIZE)
    sc = origin.add(
        "/obj.tar",
        versions=[Version(data, etag=ETAG, last_modified=LM)],
        framing="close",
        cut_at=int(SIZE * 0.4) + 123,
        cut_on="first",
        cut_mode="close",
    )
    r = fetch(proxy.port, "/obj.tar")
    clean = check_rule(r, [data], proxy.log_text()[-3000:])  # clean only with every byte
    if transport != "parts":  # parts ask ranges, framed by Content-Length, and resume
        assert not clean, "a body cut by an orderly close ended cleanly"
    st = settle(proxy)
    assert st["entries"] == (1 if clean else 0), st
    sc.heal()
    r2 = fetch(proxy.port, "/obj.tar")
    assert r2.status == 200 and r2.clean and r2.body == data, r2.describe()
    if not clean:
        assert r2.headers.get("x-cache") == "MISS", "a truncated body was committed"


def test_an_unconfirmable_body_is_served_not_cached(origin, proxy, transport):
    """No validator: nothing can pin a probe to this version. The body is served (as the
    origin sent it), not cached, and counted."""
    data = os.urandom(SIZE)
    origin.add("/anon.tar", versions=[Version(data)], framing="close")
    before = unconfirmed(proxy)
    for _ in range(2):
        r = fetch(proxy.port, "/anon.tar")
        assert r.status == 200 and r.clean and r.body == data, r.describe()
        assert r.headers.get("x-cache") in ("MISS", "BYPASS"), r.describe()
        settle(proxy)
    assert stats(proxy.port)["entries"] == 0
    assert unconfirmed(proxy) >= before + 1


def test_a_confirmed_body_is_cached(origin, proxy, transport):
    data = os.urandom(SIZE)
    origin.add("/ok.tar", versions=[Version(data, etag=ETAG, last_modified=LM)], framing="close")
    r = fetch(proxy.port, "/ok.tar")
    assert r.status == 200 and r.clean and r.body == data, r.describe()
    settle(proxy)
    hit = fetch(proxy.port, "/ok.tar")
    assert hit.headers.get("x-cache") == "HIT" and hit.body == data, hit.describe()
    probes = [g.range for g in origin.log("/ok.tar", "GET") if g.range]
    if transport != "parts":  # parts are ranged answers, framed by Content-Length
        assert probes == [f"bytes={SIZE - 1}-{SIZE - 1}"], probes
