"""The S3 front's early test: a request it lets through at once is one the full
classification would have handed to the proxy unchanged too (no request id, no S3
answer), for every combination of path, Host, S3 headers and front configuration here."""

from __future__ import annotations

import itertools

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from proxy.s3front import REQUEST_ID, S3_SERVICE_ROUTE, S3Front

PATHS = [
    "/",
    "/?list-type=2",
    "/shards",
    "/shards/",
    "/shards/a.tar",
    "/shards/a.tar?x-id=GetObject",
    "/other/a.tar",
    "/other",
    "/-/healthz",
    "/metrics",
    "/a.tar",
    "/A_B/x",
    "/ab/x?X-Amz-Algorithm=AWS4-HMAC-SHA256",
    "/https://host/x.tar",
]
HOSTS = [None, "", "127.0.0.1:8080", "localhost:8080", "shards.localhost:8080",
         "other.localhost", "[::1]:8080", "shards.s3.example"]  # fmt: skip
HEADERS = [
    {},
    {"User-Agent": "Boto3/1.34 md/Botocore#1.34"},
    {"Authorization": "AWS4-HMAC-SHA256 Credential=a/b"},
    {"x-amz-content-sha256": "UNSIGNED-PAYLOAD"},
]
FRONTS = [
    {"buckets": {"shards": "http://o/s"}, "catch_all": False},
    {"buckets": {"shards": "http://o/s"}, "catch_all": True},
    {"buckets": {}, "catch_all": True},
    {"buckets": {"shards": "http://o/s"}, "catch_all": False, "domains": ()},
    {"buckets": {"shards": "http://o/s"}, "catch_all": True, "domains": ("s3.example",)},
    {"buckets": {}, "catch_all": True, "store": True},
    {"buckets": {"shards": "s3://b/p"}, "catch_all": True, "store": True},
]


@pytest.mark.parametrize("front_kw", FRONTS)
async def test_what_it_lets_through_the_full_test_lets_through(front_kw: dict) -> None:
    front = S3Front(**front_kw)
    checked = passed = 0
    for path, host, headers, method in itertools.product(
        PATHS, HOSTS, HEADERS, ("GET", "HEAD", "PUT")
    ):
        fields = CIMultiDict(headers)
        if host is not None:
            fields["Host"] = host
        request = make_mocked_request(method, path, headers=fields)
        if not front._proxys_own(request):
            continue
        passed += 1
        seen: list[web.Request] = []

        async def handler(req: web.Request, seen: list = seen) -> web.StreamResponse:
            seen.append(req)
            return web.Response(text="proxy")

        front._proxys_own = lambda _request: False  # type: ignore[method-assign]
        try:
            resp = await front.middleware(request, handler)
        finally:
            del front._proxys_own
        assert seen == [request], (path, host, headers, method)
        assert resp.text == "proxy"
        assert REQUEST_ID not in request and S3_SERVICE_ROUTE not in request
        checked += 1
    assert checked == passed > 0
    # and what it does not let through still goes through the full test
    request = make_mocked_request("GET", "/shards/a.tar", headers={"Host": "x"})
    assert not front._proxys_own(request) or "shards" not in front.buckets
