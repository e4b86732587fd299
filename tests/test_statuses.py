"""Statuses as the origin sent them: an answer the proxy does not serve as the object
(an error, a success other than 200) reaches the client with its status, end-to-end
fields and body, uncached, the proxy's own account in ``X-Shardcache-Error``; a retry
of an overloaded upstream never hands the client an answer meant for another request."""

from __future__ import annotations

from collections import defaultdict

import pytest
from aiohttp import web
from support.faultclient import fetch, settle
from support.huborigin import Server
from support.proxy_helpers import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

COMMON = ("--retries", "2", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")


class Scripted:
    """Each path answers from its list of (status, headers, body), one per request (the
    last one repeats)."""

    def __init__(self) -> None:
        self.script: dict[str, list[tuple[int, dict[str, str], bytes]]] = {}
        self.count: dict[str, int] = defaultdict(int)
        self.server = Server("127.0.0.1", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        steps = self.script.get(request.path)
        if not steps:
            return web.Response(status=404, text="none")
        n = self.count[request.path]
        self.count[request.path] += 1
        status, headers, body = steps[min(n, len(steps) - 1)]
        return web.Response(status=status, headers=headers, body=body)


@pytest.fixture
def origin():
    o = Scripted()
    o.server.start()
    try:
        yield o
    finally:
        o.server.stop()


@pytest.fixture
def proxy(origin, tmp_path):
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.server.url, *COMMON).start()
    try:
        yield p
    finally:
        p.stop(timeout=10)


@pytest.mark.parametrize(
    "status", [201, 202, 203, 299, 400, 403, 409, 410, 418, 500, 502, 504, 599]
)
def test_status_and_body_are_passed_on(origin, proxy, status):
    body = f"<html>the origin's own page for {status}</html>".encode()
    validators = {"ETag": '"e1"', "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT"}
    origin.script["/s.tar"] = [
        (
            status,
            {"Content-Type": "text/html; charset=utf-8", "X-Origin": "yes", **validators},
            body,
        )
    ]
    for _ in range(2):  # never cached: each request asks again
        r = fetch(proxy.port, "/s.tar")
        assert r.status == status, r.describe()
        assert r.body == body and r.clean
        assert r.headers.get("content-type") == "text/html; charset=utf-8"
        assert r.headers.get("x-origin") == "yes"
        assert r.headers.get("etag") == validators["ETag"]  # its own validators too
        assert r.headers.get("last-modified") == validators["Last-Modified"]
        assert "x-shardcache-error" in r.headers
        settle(proxy)
    assert origin.count["/s.tar"] == 2


@pytest.mark.parametrize("status", [203, 301, 404, 500])
def test_validators_and_age_are_passed_on(origin, proxy, status):
    """A passed-on answer keeps the origin's ETag, Last-Modified and Age (the proxy sets
    them itself on the answers it serves from the object, never on these)."""
    fields = {"ETag": '"e1"', "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT", "Age": "30"}
    origin.script["/v.tar"] = [(status, fields, b"page")]
    r = fetch(proxy.port, "/v.tar")
    assert r.status == status, r.describe()
    for name, value in fields.items():
        assert r.headers.get(name.lower()) == value, (name, r.headers)


def test_204_has_no_body(origin, proxy):
    origin.script["/n.tar"] = [(204, {"X-Origin": "yes"}, b"")]
    r = fetch(proxy.port, "/n.tar")
    assert r.status == 204 and r.body == b"" and r.headers.get("x-origin") == "yes"


def test_a_retry_answer_never_reaches_the_client(origin, proxy):
    """503 first, then 409 (an answer meant for someone else): the client is told 503."""
    origin.script["/r.tar"] = [
        (503, {"Retry-After": "0"}, b"busy"),
        (409, {}, b"conflict meant for another request"),
    ]
    r = fetch(proxy.port, "/r.tar")
    assert r.status == 503, r.describe()
    assert r.body == b"busy"


def test_503_then_success_is_retried(origin, proxy):
    origin.script["/ok.tar"] = [(503, {}, b"busy"), (200, {"ETag": '"x"'}, b"the object")]
    r = fetch(proxy.port, "/ok.tar")
    assert r.status == 200 and r.body == b"the object", r.describe()


def test_401_is_told_as_403_without_a_challenge(origin, proxy):
    origin.script["/a.tar"] = [(401, {"WWW-Authenticate": 'Basic realm="x"'}, b"denied")]
    r = fetch(proxy.port, "/a.tar")
    assert r.status == 403 and r.body == b"denied", r.describe()
    assert "www-authenticate" not in r.headers


def test_a_large_error_body_is_not_held(origin, proxy):
    """An error body over 1 MiB is not passed on (nor kept in memory): the proxy's own
    one-line message, with the status."""
    origin.script["/big.tar"] = [(500, {}, b"x" * (2 << 20))]
    r = fetch(proxy.port, "/big.tar")
    assert r.status == 502 and len(r.body) < 4096, r.describe()
