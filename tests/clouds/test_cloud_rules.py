"""The pure rules of the gs:// and az:// upstreams: URLs, error mapping, Range values."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, parse_settings
from proxy.upstream.cloud import _object_key, _range
from proxy.upstream.cloudurl import CloudLocation, parse_cloud_url
from proxy.upstream.errors import cloud_error
from shardcache.errors import (
    BadRequest,
    Forbidden,
    NotFound,
    ObjectChanged,
    RangeNotSatisfiable,
    UpstreamCut,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)


def test_urls():
    assert parse_cloud_url("gs://my-bucket/a/b.tar") == CloudLocation("gs", "my-bucket", "a/b.tar")
    assert parse_cloud_url("az://acct1/shards/x%20y.tar?q", quoted=True) == CloudLocation(
        "az", "shards", "x y.tar", "acct1"
    )
    assert parse_cloud_url("az://acct1/shards").store_url == "az://acct1/shards"
    for bad in (
        "gs://UPPER/x",
        "az://acct1",
        "az://Bad_Account/c/k",
        "az://acct1/c_x/k",
        "s3://b/k",
    ):
        with pytest.raises(BadRequest):
            parse_cloud_url(bad)


def test_settings_accept_gs_and_az_upstreams_and_refuse_bad_ones():
    s = parse_settings(
        [
            "--cache-dir", "/tmp/x", "--upstream", "g=gs://bkt/prefix", "--upstream",
            "a=az://acct1/cont", "--azure-endpoint-url", "http://127.0.0.1:10000/{account}",
        ]
    )  # fmt: skip
    assert [u.base for u in s.upstreams] == ["gs://bkt/prefix", "az://acct1/cont"]
    assert s.azure_endpoint_url == "http://127.0.0.1:10000/{account}"
    with pytest.raises(ConfigError, match="container"):
        parse_settings(["--cache-dir", "/tmp/x", "--upstream", "a=az://acct1"])


class PermissionDeniedError(Exception):
    pass


class PreconditionError(Exception):
    pass


class GenericError(Exception):
    pass


def _generic(status: str) -> GenericError:
    return GenericError(
        "Generic GCS error: Error performing GET http://h/b/k?sig=SECRET in 1ms - Server "
        f"returned non-2xx status code: {status}: <?xml version='1.0'?>\n<Code>Busy</Code>"
    )


@pytest.mark.parametrize(
    "exc, body, expected",
    [
        (FileNotFoundError("Object at location k not found"), False, NotFound),
        (PermissionDeniedError("lacked the necessary privileges"), False, Forbidden),
        (PreconditionError("Request precondition failure"), False, ObjectChanged),
        (_generic("401 Unauthorized"), False, Forbidden),
        (_generic("404 Not Found"), False, NotFound),
        (_generic("412 Precondition Failed"), False, ObjectChanged),
        (_generic("416 Range Not Satisfiable"), False, RangeNotSatisfiable),
        (_generic("429 Too Many Requests"), False, UpstreamThrottled),
        (_generic("503 Service Unavailable"), False, UpstreamThrottled),
        (_generic("500 Internal Server Error"), False, UpstreamThrottled),
        (_generic("504 Gateway Timeout"), False, UpstreamTimeout),
        (_generic("502 Bad Gateway"), False, UpstreamError),
        (GenericError("Generic GCS error: operation timed out"), True, UpstreamTimeout),
        (GenericError("Generic GCS error: error decoding response body"), True, UpstreamCut),
        (GenericError("Generic GCS error: error sending request"), False, UpstreamError),
        (GenericError("Error fetching token from metadata server"), False, Forbidden),
    ],
)
def test_cloud_error_table(exc, body, expected):
    got = cloud_error("gs://b/k", "gs", exc, body=body)
    assert type(got) is expected, got
    assert "SECRET" not in str(got)
    if expected is Forbidden:
        assert "GOOGLE_APPLICATION_CREDENTIALS" in str(got)


def test_range_values():
    assert _range(None) is None
    assert _range("bytes=0-99") == (0, 99)
    assert _range("bytes=100-") == (100, None)
    assert _range("bytes=-10") == -10
    assert _range("bytes=0-1,5-6") is None  # several: the whole object answers
    assert _range("items=0-1") is None


def test_keys_obstore_would_rewrite_are_refused():
    """obstore reads ``dir/`` as ``dir`` and cannot name ``a//b``: never another object."""
    assert _object_key("gs://bkt/a/b.tar", parse_cloud_url("gs://bkt/a/b.tar")) == "a/b.tar"
    for key in ("dir/", "a//b", "a/./b", "a/../b", ""):
        with pytest.raises(BadRequest):
            _object_key(f"gs://bkt/{key}", parse_cloud_url(f"gs://bkt/{key}"))


def test_a_request_that_never_left_is_sent_again_once():
    """obstore's "error sending request" (a kept-alive connection the service closed
    between two requests) is asked again at once on a fresh connection, once; any other
    failure, or a second such one, is the caller's."""
    import asyncio

    from proxy.upstream.cloud import CloudUpstream
    from shardcache.errors import UpstreamError

    calls: list[int] = []

    async def flaky(times: int) -> str:
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError("Generic HTTP error: error sending request for url (...)")
        return "object"

    up = CloudUpstream()
    assert asyncio.run(up._call("gs://b/k", "gs", None, flaky, 1)) == "object"
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(UpstreamError, match="cannot reach"):
        asyncio.run(up._call("gs://b/k", "gs", None, flaky, 2))
    assert len(calls) == 2
