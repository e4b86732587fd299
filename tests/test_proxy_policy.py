"""Pure policy of the proxy and its settings, tested directly (hypothesis where it fits)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.config import parse_settings
from proxy.policy import (
    Upstream,
    conditional_status,
    end_to_end_headers,
    map_request,
    map_url,
    parse_range,
    parse_size,
    range_applies,
    range_start,
    should_admit,
)
from shardcache.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    NotFound,
    RangeNotSatisfiable,
)

pytestmark = pytest.mark.fast

# --- sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("4096", 4096),
        ("500G", 500 * 10**9),
        ("500GB", 500 * 10**9),
        ("1.5T", 1_500_000_000_000),
        ("10MiB", 10 * 2**20),
        ("2Gi", 2 * 2**30),
        ("1k", 1000),
        (" 7 b ", 7),
        ("0", 0),
        (123, 123),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1", "1.5X", "ten", "1e999T", "1..5G", "5 G B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@given(st.integers(0, 10**6), st.sampled_from(["", "K", "M", "G", "T", "Ki", "Mi", "GiB"]))
def test_parse_size_units(n, unit):
    factor = {"": 1, "K": 1000, "M": 10**6, "G": 10**9, "T": 10**12}.get(
        unit, {"Ki": 1024, "Mi": 1024**2, "GiB": 1024**3}.get(unit)
    )
    assert parse_size(f"{n}{unit}") == n * factor
    assert parse_size(f"{n}{unit.lower()}") == n * factor


# --- ranges -----------------------------------------------------------------------------


@given(st.integers(1, 10**9), st.integers(0, 2 * 10**9), st.integers(0, 2 * 10**9))
def test_range_first_last(size, a, b):
    header = f"bytes={a}-{b}"
    if b < a or a >= size:
        with pytest.raises(RangeNotSatisfiable):
            parse_range(header, size)
        return
    r = parse_range(header, size)
    assert r.start == a and r.end == min(b, size - 1)  # clipped, never past the object
    assert 1 <= r.length <= size and r.content_range == f"bytes {a}-{r.end}/{size}"


@given(st.integers(0, 10**6), st.integers(0, 2 * 10**6))
def test_range_suffix_and_open(size, n):
    if n == 0 or size == 0:
        with pytest.raises(RangeNotSatisfiable):
            parse_range(f"bytes=-{n}", size)
    else:
        r = parse_range(f"bytes=-{n}", size)
        assert (r.start, r.end) == (max(0, size - n), size - 1)
    if n >= size:
        with pytest.raises(RangeNotSatisfiable):
            parse_range(f"bytes={n}-", size)
    else:
        r = parse_range(f"bytes={n}-", size)
        assert (r.start, r.end, r.reaches_end) == (n, size - 1, True)


@pytest.mark.parametrize("header", [None, "items=0-5", "bytes=0-1,5-6", "bytes = 0-1, 4-5"])
def test_range_whole_object(header):
    assert parse_range(header, 100) is None


@pytest.mark.parametrize("header", ["bytes=", "bytes=-", "bytes=a-b", "bytes=5-3", "bytes=1-2-3"])
def test_range_invalid_is_416(header):
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, 100)


@pytest.mark.parametrize(
    "header, start",
    [
        ("bytes=5-9", 5),
        (" Bytes = 7 -", 7),
        ("bytes=-20", -1),  # a suffix range
        ("bytes=0-1,5-6", None),  # several ranges: the whole object
        ("items=0-5", None),
        ("bytes=a-b", None),
    ],
)
def test_range_start_reads_the_header_as_parse_range_does(header, start):
    """Before the size is known (the cold path) a range's start comes from the same
    reading of the header as :func:`parse_range`'s."""
    assert range_start(header) == start
    if start is None and "a-b" not in header:
        assert parse_range(header, 100) is None
    elif start is not None and start >= 0:
        assert parse_range(header, 100).start == start


def test_if_range():
    etag, lm = '"abc"', "Mon, 01 Jan 2024 00:00:00 GMT"
    assert range_applies({}, etag, lm)
    assert range_applies({"If-Range": etag}, etag, lm)
    assert not range_applies({"If-Range": '"x"'}, etag, lm)
    assert not range_applies({"If-Range": f"W/{etag}"}, f"W/{etag}", lm)  # weak: never
    assert range_applies({"If-Range": lm}, etag, lm)
    assert not range_applies({"If-Range": "Tue, 02 Jan 2024 00:00:00 GMT"}, etag, lm)


def test_conditionals():
    etag, lm = '"abc"', "Mon, 01 Jan 2024 00:00:00 GMT"
    later, earlier = "Tue, 02 Jan 2024 00:00:00 GMT", "Sun, 31 Dec 2023 00:00:00 GMT"
    c = conditional_status
    assert c("GET", {}, etag, lm) is None
    assert c("GET", {"If-None-Match": etag}, etag, lm) == 304
    assert c("HEAD", {"If-None-Match": f'"x", W/{etag}'}, etag, lm) == 304
    assert c("GET", {"If-None-Match": '"x"'}, etag, lm) is None
    assert c("GET", {"If-None-Match": "*"}, None, None) == 304
    assert c("GET", {"If-Modified-Since": later}, etag, lm) == 304
    assert c("GET", {"If-Modified-Since": lm}, etag, lm) == 304
    assert c("GET", {"If-Modified-Since": earlier}, etag, lm) is None
    assert c("GET", {"If-Modified-Since": "garbage"}, etag, lm) is None
    # If-None-Match takes precedence over If-Modified-Since
    assert c("GET", {"If-None-Match": '"x"', "If-Modified-Since": later}, etag, lm) is None
    assert c("GET", {"If-Match": '"x"'}, etag, lm) == 412
    assert c("GET", {"If-Match": etag}, etag, lm) is None
    assert c("GET", {"If-Match": f"W/{etag}"}, etag, lm) == 412  # strong comparison
    assert c("GET", {"If-Unmodified-Since": earlier}, etag, lm) == 412


def test_hop_by_hop():
    headers = [
        ("Connection", "close, X-Private"),
        ("X-Private", "1"),
        ("Keep-Alive", "timeout=5"),
        ("Transfer-Encoding", "chunked"),
        ("ETag", '"e"'),
        ("Content-Type", "application/x-tar"),
    ]
    assert end_to_end_headers(headers) == [("ETag", '"e"'), ("Content-Type", "application/x-tar")]


def test_should_admit():
    assert should_admit(None, 10) and should_admit(10, 10) and not should_admit(11, 10)


# --- URL mapping ------------------------------------------------------------------------

UPS = (Upstream(None, "https://data.example.com/ds"), Upstream("local", "file:///srv/shards"))


@pytest.mark.parametrize(
    "target, url",
    [
        ("/a/b.tar", "https://data.example.com/ds/a/b.tar"),
        ("/a/b%20c.tar", "https://data.example.com/ds/a/b%20c.tar"),
        ("/a/b c.tar", "https://data.example.com/ds/a/b%20c.tar"),
        ("/%61/b.tar", "https://data.example.com/ds/a/b.tar"),  # canonical: one cache key
        ("/a/b.tar?x=1", "https://data.example.com/ds/a/b.tar?x=1"),
        ("/local/x/y.tar", "file:///srv/shards/x/y.tar"),
        ("/local", "https://data.example.com/ds/local"),
        ("/https://mirror.example.org/p/s.tar", "https://mirror.example.org/p/s.tar"),
        ("/http://127.0.0.1:9000/s.tar", "http://127.0.0.1:9000/s.tar"),
    ],
)
def test_map_request(target, url):
    allow = ("mirror.example.org", "127.0.0.1:9000")
    assert map_request(target, UPS, allow) == url


@pytest.mark.parametrize(
    "target, exc",
    [
        ("/../etc/passwd", BadRequest),
        ("/a/./b.tar", BadRequest),
        ("/%2e%2e/etc/passwd", BadRequest),
        ("/a/%2E%2e/b", BadRequest),
        ("/a%2f..%2fb", BadRequest),
        ("/a%5cb", BadRequest),
        ("/a%00b", BadRequest),
        ("/a\x00b", BadRequest),
        ("/a%0ab", BadRequest),
        ("/" + "x" * 2000, BadRequest),
        ("/%ff%fe.tar", BadRequest),
        ("relative", BadRequest),
        ("/", NotFound),
        ("/a//b.tar", NotFound),
        ("/https://evil.example.com/x.tar", Forbidden),
        ("/http://127.0.0.1:9001/s.tar", Forbidden),
        ("/https://user:pw@mirror.example.org/x", BadRequest),
        ("/https://mirror.example.org/../x", BadRequest),
    ],
)
def test_map_request_rejects(target, exc):
    with pytest.raises(exc) as info:
        map_request(target, UPS, ("mirror.example.org", "127.0.0.1:9000"))
    assert str(info.value)  # a message naming the problem


def test_map_request_without_default_upstream():
    with pytest.raises(NotFound):
        map_request("/other/x.tar", (Upstream("local", "file:///srv"),))


@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5))
def test_map_request_never_escapes(segments):
    from urllib.parse import quote

    target = "/" + "/".join(quote(s, safe="") for s in segments)
    try:
        url = map_request(target, UPS[:1], max_length=10_000)
    except (BadRequest, NotFound):
        return
    assert url.startswith("https://data.example.com/ds/")
    rest = url[len("https://data.example.com/ds/") :].split("?")[0]
    assert all(p not in ("", ".", "..") for p in rest.split("/"))


def test_map_url_for_admin_routes():
    assert map_url("/a.tar", UPS) == "https://data.example.com/ds/a.tar"
    assert map_url("https://data.example.com/ds/a.tar", UPS) == "https://data.example.com/ds/a.tar"
    assert map_url("file:///srv/shards/q.tar", UPS) == "file:///srv/shards/q.tar"
    with pytest.raises(Forbidden):
        map_url("https://evil.example.com/a.tar", UPS)
    with pytest.raises(Forbidden):
        map_url("file:///etc/passwd", UPS)


# --- settings ---------------------------------------------------------------------------


def test_settings_flags_and_env(tmp_path):
    env = {
        "SHARDCACHE_CACHE_DIR": str(tmp_path),
        "SHARDCACHE_UPSTREAM": "http://a.example.com, local=file:///srv",
        "SHARDCACHE_CACHE_SIZE": "1.5T",
        "SHARDCACHE_EVICTION": "keep",
        "SHARDCACHE_PORT": "9000",
    }
    s = parse_settings([], env)
    assert s.cache_size == 1_500_000_000_000 and s.eviction == "keep" and s.port == 9000
    assert [str(u) for u in s.upstreams] == ["http://a.example.com", "local=file:///srv"]
    s = parse_settings(["--cache-size", "10MiB", "--upstream", "http://b.example.com/"], env)
    assert s.cache_size == 10 * 2**20  # the flag wins
    assert [str(u) for u in s.upstreams] == ["http://b.example.com"]
    s = parse_settings(["--allow-host", "Mirror.example.org", "--admin-token", "t"], env)
    assert s.allow_hosts == ("mirror.example.org",) and s.admin_token == "t"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--cache-size", "lots"], "--cache-size"),
        (["--cache-size", "0"], "--cache-size"),
        (["--eviction", "random"], "--eviction"),
        (["--port", "70000"], "--port"),
        (["--port", "http"], "--port"),
        (["--log-level", "loud"], "--log-level"),
        (["--read-timeout", "-1"], "--read-timeout"),
        (["--upstream", "ftp://x/y"], "--upstream"),
        (["--upstream", "http://a", "--upstream", "http://b"], "--upstream"),
        (["--upstream", "a=http://a", "--upstream", "a=http://b"], "--upstream"),
        (["--upstream", "bad name=http://a"], "--upstream"),
        ([], "--upstream"),
    ],
)
def test_settings_errors_name_the_flag(tmp_path, argv, flag):
    base = ["--cache-dir", str(tmp_path)]
    if argv and not any(a.startswith("--upstream") for a in argv):
        base += ["--upstream", "http://up.example.com"]
    with pytest.raises(ConfigError) as info:
        parse_settings(base + argv, {})
    assert str(info.value).startswith(flag)


def test_missing_cache_dir():
    with pytest.raises(ConfigError, match="--cache-dir"):
        parse_settings(["--upstream", "http://a"], {})


@pytest.mark.slow  # a subprocess: left to `make test`
def test_serve_bad_flag_exits_nonzero_naming_it(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcache",
            "serve",
            "--cache-dir",
            str(tmp_path),
            "--upstream",
            "http://127.0.0.1:1",
            "--cache-size",
            "12 parsecs",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "--cache-size" in res.stderr and "parsecs" in res.stderr
    assert res.stderr.count("\n") == 1


def test_s3_upstream_without_the_s3_extra_fails_at_startup(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "aiobotocore", None)  # fault: the extra is missing
    with pytest.raises(ConfigError, match=r"pip install '\.\[s3\]'") as ei:
        parse_settings(["--cache-dir", str(tmp_path), "--upstream", "data=s3://bucket/prefix"], {})
    assert ei.value.flag == "--upstream"
    # the package is not on a package index: no install command that would fail there
    assert "shardcache[s3]" not in str(ei.value)
    # http upstreams need nothing more
    parse_settings(["--cache-dir", str(tmp_path), "--upstream", "http://origin"], {})


def test_s3_domains_and_tls_settings(tmp_path):
    base = ["--cache-dir", str(tmp_path), "--upstream", "http://origin"]
    s = parse_settings(base, {"SHARDCACHE_S3_DOMAINS": "localhost, S3.Example.com."})
    assert s.s3_domains == ("localhost", "s3.example.com")
    assert parse_settings(base, {}).s3_domains == ("localhost",)
    with pytest.raises(ConfigError, match="--s3-domain"):
        parse_settings(base + ["--s3-domain", "bad_name"], {})
    cert = tmp_path / "c.pem"
    cert.write_text("not a certificate")
    with pytest.raises(ConfigError, match="--tls-key"):
        parse_settings(base + ["--tls-cert", str(cert)], {})
    with pytest.raises(ConfigError, match="--tls-cert"):
        parse_settings(base + ["--tls-cert", str(cert), "--tls-key", str(cert)], {})
    with pytest.raises(ConfigError, match="--tls-cert"):
        parse_settings(
            base + ["--tls-cert", str(tmp_path / "absent.pem"), "--tls-key", str(cert)], {}
        )


def test_the_whole_store_upstream_maps_each_bucket_under_its_name(tmp_path):
    """``--upstream s3://``: ``/BUCKET/KEY`` is ``s3://BUCKET/KEY``; a named upstream
    keeps its name; a named whole store is refused (its names are the store's)."""
    s = parse_settings(
        ["--cache-dir", str(tmp_path), "--upstream", "s3://", "--upstream", "n=s3://bkt2/p"]
    )
    store = s.upstreams[0]
    assert (store.name, store.base, store.whole_store, str(store)) == (None, "s3://", True, "s3://")
    assert not s.upstreams[1].whole_store
    assert map_request("/bkt/a/b.tar?versionId=v1", s.upstreams) == "s3://bkt/a/b.tar?versionId=v1"
    assert map_request("/n/x.tar", s.upstreams) == "s3://bkt2/p/x.tar"
    assert map_url("s3://other/k.tar", s.upstreams) == "s3://other/k.tar"
    with pytest.raises(ConfigError, match="unnamed upstream"):
        parse_settings(["--cache-dir", str(tmp_path), "--upstream", "all=s3://"])
