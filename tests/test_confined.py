"""Bytes from an upstream never run as a page of the proxy's origin.

The status page (``/-/``) and the admin routes live on the proxy's origin; an object
that is an HTML page with a script (a shard is whatever the upstream holds) would,
opened in a browser through the proxy, run with that origin. Every answer whose bytes
come from an upstream therefore carries ``Content-Security-Policy: sandbox`` (an opaque
origin, no scripts) and ``X-Content-Type-Options: nosniff``: the miss, a hit from RAM
and from disk, a Range, a HEAD, a bypass, an uncached (API) path, an upstream's error
passed on, the S3 front's object reads. An origin that states its own policy is taken at
its word: its field goes on unchanged and alone. The status page keeps its own policy.
"""

from __future__ import annotations

import http.client
import os

import pytest
from support.faultclient import TRANSPORTS
from support.origins import BadOrigin, Version
from support.proxy import settle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PAGE = b"<html><script>fetch('/-/stats').then(r => r.text()).then(alert)</script></html>"
ETAG = '"page-0123456789abcdef"'
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
ORIGIN_CSP = "default-src 'self'; img-src *"


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


@pytest.fixture
def proxy_args() -> tuple[str, ...]:
    return ("--min-free", "0", "--retries", "0", *TRANSPORTS["threads"])


def get(port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None):
    """(status, the header fields as sent (a list: a repeated field stays repeated), body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


def values(fields: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in fields if k.lower() == name.lower()]


def assert_confined(fields: list[tuple[str, str]], what: str, *, origin_csp: str | None = None):
    csp = values(fields, "Content-Security-Policy")
    if origin_csp is not None:
        assert csp == [origin_csp], f"{what}: the origin's policy was not passed as it was: {csp}"
    else:
        assert csp == ["sandbox"], f"{what}: {csp}"
    assert values(fields, "X-Content-Type-Options") == ["nosniff"], f"{what}: {fields}"


@pytest.mark.parametrize("size", [len(PAGE), 3 << 20], ids=["ram", "disk"])
def test_objects_are_sandboxed_on_every_path(origin, proxy, size):
    data = PAGE + os.urandom(size - len(PAGE))
    v = Version(data, etag=ETAG, last_modified=LM, content_type="text/html")
    origin.add("/page.html", versions=[v])
    status, fields, body = get(proxy.port, "/page.html")
    assert status == 200 and body == data
    assert_confined(fields, "the miss")
    settle(proxy)
    for method, headers, want, what in (
        ("GET", {}, 200, "a hit"),
        ("HEAD", {}, 200, "a HEAD hit"),
        ("GET", {"Range": "bytes=5-20"}, 206, "a range of a hit"),
    ):
        status, fields, _ = get(proxy.port, "/page.html", method, headers)
        assert status == want, what
        assert values(fields, "X-Cache") == ["HIT"], what
        assert_confined(fields, what)


def test_a_cold_head_and_a_bypass_are_sandboxed(origin, proxy):
    nostore = Version(
        PAGE, etag=ETAG, content_type="text/html", headers={"Cache-Control": "no-store"}
    )
    origin.add("/private.html", versions=[nostore])
    origin.add("/cold.html", versions=[Version(PAGE, etag=ETAG, content_type="text/html")])
    status, fields, _ = get(proxy.port, "/cold.html", "HEAD")
    assert status == 200
    assert_confined(fields, "a cold HEAD")
    status, fields, body = get(proxy.port, "/private.html")
    assert status == 200 and body == PAGE and values(fields, "X-Cache") == ["BYPASS"]
    assert_confined(fields, "a bypass")


def test_an_origins_own_policy_goes_on_unchanged(origin, proxy):
    v = Version(
        PAGE,
        etag=ETAG,
        content_type="text/html",
        headers={"Content-Security-Policy": ORIGIN_CSP, "X-Content-Type-Options": "nosniff"},
    )
    origin.add("/own.html", versions=[v])
    _, fields, _ = get(proxy.port, "/own.html")
    assert_confined(fields, "the miss", origin_csp=ORIGIN_CSP)
    settle(proxy)
    _, fields, _ = get(proxy.port, "/own.html")
    assert values(fields, "X-Cache") == ["HIT"]
    assert_confined(fields, "the hit", origin_csp=ORIGIN_CSP)


def test_uncached_paths_and_passed_errors_are_sandboxed(origin, proxy):
    origin.add(
        "/api/datasets/x",
        versions=[
            Version(PAGE, content_type="text/html", headers={"Content-Security-Policy": ORIGIN_CSP})
        ],
    )
    status, fields, body = get(proxy.port, "/api/datasets/x")
    assert status == 200 and body == PAGE and values(fields, "X-Cache") == ["BYPASS"]
    assert_confined(fields, "an uncached path", origin_csp=ORIGIN_CSP)
    origin.add("/denied.html", versions=[Version(PAGE)], status=403)
    status, fields, body = get(proxy.port, "/denied.html")
    assert status == 403 and b"denied by the fault plan" in body  # the upstream's own body
    assert_confined(fields, "an upstream error passed on")


def test_the_status_page_keeps_its_own_policy(proxy):
    status, fields, _ = get(proxy.port, "/-/")
    assert status == 200
    csp = values(fields, "Content-Security-Policy")
    assert len(csp) == 1 and "sandbox" not in csp[0] and "script-src 'self'" in csp[0], csp
