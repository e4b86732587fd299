"""Shard naming, expansion, shard lists and proxy URL rewriting."""

from __future__ import annotations

import re
import shutil
import uuid

import pytest
import webdataset as wds
from hypothesis import given, settings
from hypothesis import strategies as st
from support.pipeline_helpers import serve_directory, wds_samples, write_tar

from shardcache import ShardcacheError
from shardcache.tariterators import tarfile_samples
from shardcache.urls import (
    ProxyURLError,
    expand_urls,
    guess_shard,
    proxied,
    shard_uuid,
    shardlist,
)

pytestmark = pytest.mark.fast

P = "http://127.0.0.1:8080"


def test_shard_uuid():
    url = "https://a.example/x/shard-000000.tar"
    assert shard_uuid(url) == str(uuid.uuid3(uuid.NAMESPACE_URL, url))
    assert shard_uuid(url) != shard_uuid("https://b.example/x/shard-000000.tar")
    assert re.fullmatch(r"[0-9a-f-]{36}", shard_uuid(url))


@pytest.mark.parametrize(
    "path,name",
    [
        ("https://h/d/shard-000001.tar", "shard-000001.tar"),
        ("https://h/d/shard-000001.tar?X-Amz-Signature=a/b", "shard-000001.tar"),
        ("/data/x.tar", "x.tar"),
        ("x.tar", "x.tar"),
        ("s3://bucket/a/b.tar.gz", "b.tar.gz"),
    ],
)
def test_guess_shard(path, name):
    assert guess_shard(path) == name


def test_expand_urls():
    assert expand_urls("a-{0..2}.tar") == ["a-0.tar", "a-1.tar", "a-2.tar"]
    assert expand_urls("a-{0,1}.tar::b-{00..01}.tar") == [
        "a-0.tar",
        "a-1.tar",
        "b-00.tar",
        "b-01.tar",
    ]
    assert expand_urls(["x.tar", "y-{1..2}.tar"]) == ["x.tar", "y-1.tar", "y-2.tar"]
    assert expand_urls("pipe:curl -s https://h/a-{0..1}.tar") == [
        "pipe:curl -s https://h/a-0.tar",
        "pipe:curl -s https://h/a-1.tar",
    ]
    with pytest.raises(TypeError):
        expand_urls([1, 2])


def test_shardlist_matches_webdataset():
    urls = "https://h/s-{000..019}.tar"
    assert list(shardlist(urls)) == [{"url": u} for u in expand_urls(urls)]
    assert list(shardlist(urls)) == list(wds.SimpleShardList(urls))
    shuffled = list(shardlist(urls, shuffle=True, seed=7))
    assert shuffled == list(wds.SimpleShardList(urls, seed=7))
    assert shuffled == list(shardlist(urls, shuffle=True, seed=7))
    assert shuffled != list(shardlist(urls))
    assert sorted(d["url"] for d in shuffled) == expand_urls(urls)


# ---------------------------------------------------------------------------
# proxied: examples


def test_proxied_unnamed_upstream_keeps_braces():
    pattern = "https://h/d/s-{000..009}.tar"
    assert proxied(pattern, P, upstream="https://h") == f"{P}/d/s-{{000..009}}.tar"
    assert proxied(pattern, P, upstream="https://h/") == f"{P}/d/s-{{000..009}}.tar"
    assert proxied(pattern, P, upstream="https://h/d") == f"{P}/s-{{000..009}}.tar"


def test_proxied_named_and_longest_match():
    ups = ["https://h", "imagenet=https://h/datasets/imagenet", "laion=s3://laion-bucket"]
    assert (
        proxied("https://h/datasets/imagenet/train-0.tar", P, upstream=ups)
        == f"{P}/imagenet/train-0.tar"
    )
    assert proxied("https://h/other/x.tar", P, upstream=ups) == f"{P}/other/x.tar"
    assert (
        proxied("s3://laion-bucket/a/b-{0..3}.tar", P, upstream=ups)
        == f"{P}/laion/a/b-{{0..3}}.tar"
    )


def test_proxied_absolute_form():
    assert (
        proxied("https://other.example/x/s-{0..3}.tar", P, absolute=True)
        == f"{P}/https://other.example/x/s-{{0..3}}.tar"
    )
    got = proxied("s3://bucket/key.tar", P, upstream="https://h", absolute=True)
    assert got == f"{P}/s3://bucket/key.tar"
    # a URL that only looks like it is under an upstream (no "/" after the base)
    got = proxied("https://h.evil/x.tar", P, upstream="https://h", absolute=True)
    assert got == f"{P}/https://h.evil/x.tar"
    # URLs under an upstream still get its short path
    assert proxied("https://h/x.tar", P, upstream="https://h", absolute=True) == f"{P}/x.tar"


def test_proxied_absolute_form_for_the_named_hosts_only():
    """``absolute`` as the proxy's --allow-host values: the form for those hosts (with or
    without their port), an error for the others; nothing is asked of the proxy."""
    allowed = ["Data.Example", "o:8080"]
    ups = ["https://h"]
    assert proxied("https://h/x.tar", P, upstream=ups, absolute=allowed) == f"{P}/x.tar"
    for url in (
        "https://data.example/d/a.tar",
        "https://data.example:443/a.tar",
        "http://o:8080/a",
    ):
        assert proxied(url, P, upstream=ups, absolute=allowed) == f"{P}/{url}"
    for url in ("https://o/a.tar", "https://evil.example/a.tar", "s3://data.example/a.tar"):
        with pytest.raises(ProxyURLError, match="is under none of the upstreams"):
            proxied(url, P, upstream=ups, absolute=allowed)
    with pytest.raises(ProxyURLError, match="no upstream given"):
        proxied("https://o/a.tar", P, absolute=frozenset())  # None: not asked either


@pytest.mark.parametrize(
    "url, named",
    [
        ("https://h.evil/x.tar", "'https://h.evil/x.tar'"),
        # a typo in the host: the pattern is named as given
        ("https://data.exmaple.com/d/s-{0..3}.tar", "'https://data.exmaple.com/d/s-{0..3}.tar'"),
        ("s3://bucket/key.tar", "'s3://bucket/key.tar'"),
        (["https://h/a.tar", "https://o/b.tar"], "'https://o/b.tar'"),
        ("https://h/a.tar::https://o/b.tar", "'https://o/b.tar'"),
    ],
)
def test_proxied_url_under_no_upstream_is_an_error_naming_url_and_upstreams(url, named):
    with pytest.raises(ProxyURLError) as err:
        proxied(url, P, upstream=["https://h", "ds=https://data.example.com/d"])
    text = str(err.value)
    assert text.startswith(named + " is under none of the upstreams")
    assert "(https://h, ds=https://data.example.com/d)" in text
    assert "absolute=True" in text and "--allow-host" in text


def test_proxied_without_upstream_needs_the_absolute_form():
    # upstream=(): no upstream, without asking the proxy (upstream=None asks it)
    with pytest.raises(ProxyURLError, match="'https://o/x.tar': no upstream given.*absolute=True"):
        proxied("https://o/x.tar", P, upstream=())
    assert proxied("https://o/x.tar", P, absolute=True) == f"{P}/https://o/x.tar"


def test_proxied_lists_and_double_colon():
    urls = ["https://h/a.tar", "https://h/b-{0..1}.tar"]
    assert proxied(urls, P, upstream="https://h") == [f"{P}/a.tar", f"{P}/b-{{0..1}}.tar"]
    assert proxied("https://h/a.tar::https://o/b.tar", P, upstream="https://h", absolute=True) == (
        f"{P}/a.tar::{P}/https://o/b.tar"
    )


def test_proxied_braces_in_the_prefix_fall_back_to_a_list():
    pattern = "https://{a,b}.example/s-{0..1}.tar"
    got = proxied(pattern, P, upstream="https://a.example", absolute=True)
    assert isinstance(got, str)
    assert expand_urls(got) == [
        f"{P}/s-0.tar",
        f"{P}/s-1.tar",
        f"{P}/https://b.example/s-0.tar",
        f"{P}/https://b.example/s-1.tar",
    ]


def test_proxied_proxy_address_forms(monkeypatch):
    assert (
        proxied("https://h/x.tar", "127.0.0.1:9", upstream="https://h")
        == "http://127.0.0.1:9/x.tar"
    )
    assert proxied("https://h/x.tar", "http://p:1/", upstream="https://h") == "http://p:1/x.tar"
    monkeypatch.setenv("SHARDCACHE_PROXY", "http://from-env:1")
    assert proxied("https://h/x.tar", upstream="https://h") == "http://from-env:1/x.tar"
    monkeypatch.delenv("SHARDCACHE_PROXY")
    with pytest.raises(ProxyURLError, match="SHARDCACHE_PROXY"):
        proxied("https://h/x.tar")
    with pytest.raises(ProxyURLError, match="ftp://p"):
        proxied("https://h/x.tar", "ftp://p")


def test_proxied_errors():
    with pytest.raises(ProxyURLError, match="/data/x.tar.*absolute"):
        proxied("/data/x.tar", P)
    with pytest.raises(ProxyURLError, match="upstream"):
        proxied("https://h/x.tar", P, upstream="not a url")
    with pytest.raises(ProxyURLError, match="at most one unnamed"):
        proxied("https://h/x.tar", P, upstream=["https://a", "https://b"])
    # an unnamed upstream's path that the proxy would route to a named upstream
    with pytest.raises(ProxyURLError, match="named upstream"):
        proxied("https://h/ds/x.tar", P, upstream=["https://h", "ds=https://o"])
    assert issubclass(ProxyURLError, ShardcacheError) and issubclass(ProxyURLError, ValueError)


# ---------------------------------------------------------------------------
# proxied: properties


def reference_upstream(proxy_url: str, rules: list[str]) -> str:
    """What a proxy with these ``--upstream`` flags fetches for ``proxy_url``.

    An independent statement of DESIGN's mapping: ``/NAME/<path>`` → named URL,
    ``/<scheme>://...`` → that URL, anything else → the unnamed URL.
    """
    assert proxy_url.startswith(P + "/")
    path = proxy_url[len(P) + 1 :]
    named, unnamed = {}, None
    for rule in rules:
        name, sep, url = rule.partition("=")
        if sep and "://" in url and "/" not in name and ":" not in name:
            named[name] = url.rstrip("/")
        else:
            unnamed = rule.rstrip("/")
    first, _, rest = path.partition("/")
    if first in named:
        return f"{named[first]}/{rest}"
    if re.match(r"^[a-z0-9]+://", path):
        return path
    assert unnamed is not None, proxy_url
    return f"{unnamed}/{path}"


segments = st.text(st.sampled_from("abs0-_."), min_size=1, max_size=5).filter(
    lambda s: s not in (".", "..")
)
braces = st.sampled_from(["{0..2}", "{a,b}", "{00..01}", "{ds,d}", "{h,o}"])
schemes = st.sampled_from(["https://", "http://", "s3://"])
hosts = st.sampled_from(["h", "o", "h.x", "bucket"])
upstream_sets = st.lists(
    st.sampled_from(
        ["https://h", "https://h/d", "ds=https://o/data", "s3=s3://bucket", "http://h.x/d/"]
    ),
    unique=True,
    max_size=3,
).filter(lambda ups: sum("=" not in u for u in ups) <= 1)


@st.composite
def patterns(draw):
    parts = [draw(schemes), draw(hosts)]
    for _ in range(draw(st.integers(1, 3))):
        parts.append("/" + draw(segments))
    parts.append("/" + draw(segments) + ".tar")
    if draw(st.booleans()):
        i = draw(st.integers(1, len(parts) - 1))
        parts[i] = parts[i] + draw(braces)
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(pattern=patterns(), ups=upstream_sets, absolute=st.booleans())
def test_proxied_pattern_equals_proxying_each_url(pattern, ups, absolute):
    each = []
    try:
        for url in expand_urls(pattern):
            each.append(proxied(url, P, upstream=ups, absolute=absolute))
    except ProxyURLError:
        with pytest.raises(ProxyURLError):
            proxied(pattern, P, upstream=ups, absolute=absolute)
        return
    whole = proxied(pattern, P, upstream=ups, absolute=absolute)
    assert expand_urls(whole) == each
    # and the proxy, reading those paths with the same flags, fetches the original URLs
    assert [reference_upstream(u, ups) for u in each] == expand_urls(pattern)


@settings(max_examples=100, deadline=None)
@given(pattern=patterns(), ups=upstream_sets)
def test_proxied_keeps_braces_when_the_prefix_decides(pattern, ups):
    fixed = pattern.split("{", 1)[0]
    if "{" not in pattern or "/" not in fixed.split("://", 1)[-1]:
        return
    try:
        got = proxied(pattern, P, upstream=ups, absolute=True)
    except ProxyURLError:
        return
    if "::" not in got:
        assert got.endswith(pattern[len(fixed) :])


# ---------------------------------------------------------------------------
# end to end: webdataset reading proxied URLs from a real HTTP server


@pytest.fixture
def served_shards(tmp_path):
    """Shards on disk, and the same files under a directory an HTTP server serves."""
    local = tmp_path / "local"
    local.mkdir()
    for s in range(3):
        write_tar(
            local / f"s-{s:03d}.tar",
            [
                (f"k{s}{i}.{ext}", f"{s}-{i}-{ext}".encode())
                for i in range(4)
                for ext in ("txt", "seg.png")
            ],
        )
    root = tmp_path / "served"
    shutil.copytree(local, root / "d")  # what `--upstream https://data.example` serves
    shutil.copytree(local, root / "ds")  # what `--upstream ds=https://data.example/d` serves
    return local, root


def _strip(samples):
    return [{k: v for k, v in s.items() if k not in ("__url__", "__local_path__")} for s in samples]


def test_webdataset_reads_proxied_urls(served_shards):
    local, root = served_shards
    expected = _strip(wds_samples(str(local / "s-{000..002}.tar")))
    assert len(expected) == 12
    origin = "https://data.example/d/s-{000..002}.tar"
    with serve_directory(root) as server:
        for upstream, path in [
            ("https://data.example", "/d/"),
            ("ds=https://data.example/d", "/ds/"),
        ]:
            urls = proxied(origin, server, upstream=upstream)
            assert urls == f"{server}{path}s-{{000..002}}.tar"
            assert _strip(wds_samples(urls)) == expected  # webdataset, unmodified (curl)
            assert _strip(tarfile_samples(shardlist(urls))) == expected  # and ours (http.client)


def test_webdataset_gopen_rewrite_alternative(served_shards, monkeypatch):
    """webdataset 1.0.2 also rewrites URL prefixes itself, from GOPEN_REWRITE."""
    local, root = served_shards
    expected = _strip(wds_samples(str(local / "s-{000..002}.tar")))
    with serve_directory(root) as server:
        monkeypatch.setenv("GOPEN_REWRITE", f"https://data.example/={server}/")
        got = wds_samples("https://data.example/d/s-{000..002}.tar")
    assert _strip(got) == expected
    assert got[0]["__url__"].startswith("https://data.example/")
