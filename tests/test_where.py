"""Where a URL goes: ``GET /-/where``, ``shardcache where`` (with the environment's
rewrites) and ``proxied()`` learning the upstreams from the proxy, against a real proxy
subprocess, a real origin and webdataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from shardcache import ProxyURLError, proxied, shard_uuid
from shardcache.cli.where import gopen_rewrite, same_server
from tests.proxy_helpers import Origin, ProxyProcess, free_port, make_shard

SHARDS = {f"d/s-{i:03d}.tar": make_shard(4, seed=i) for i in range(3)}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("where")
    origin = Origin(files=dict(SHARDS)).start()
    proxy = ProxyProcess(
        tmp / "cache",
        "--upstream",
        f"ds={origin.url}/d",
        "--allow-host",
        f"127.0.0.1:{origin.port}",
        "--admin-token",
        "sekrit",  # read-only routes still need none
    ).start()
    yield origin, proxy
    proxy.stop()
    origin.stop()


def where(proxy: ProxyProcess, url: str | None = None) -> dict:
    query = "" if url is None else "?url=" + urllib.parse.quote(url, safe="")
    with urllib.request.urlopen(f"{proxy.url}/-/where{query}", timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())


def run_where(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("GOPEN_REWRITE", "SHARDCACHE_PROXY")}
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "where", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


# --------------------------------------------------------------------------- the route


def test_where_maps_every_url_form_the_same_way(rig):
    origin, proxy = rig
    assert where(proxy) == {
        "upstreams": [f"ds={origin.url}/d"],
        "allow_hosts": [f"127.0.0.1:{origin.port}"],
        # what same-node direct reads need (shardcache.direct)
        "revalidate": "never",
        "strip_signatures": True,  # the default "auto" on a loopback proxy
    }
    upstream_url = f"{origin.url}/d/s-000.tar"
    answers = [
        where(proxy, upstream_url),
        where(proxy, "/ds/s-000.tar"),
        where(proxy, f"{proxy.url}/ds/s-000.tar"),
        where(proxy, f"http://localhost:{proxy.port}/ds/s-000.tar"),
    ]
    assert [a["form"] for a in answers] == ["upstream URL", "proxy path", "proxy URL", "proxy URL"]
    for a in answers:
        assert a["upstream"] == f"ds={origin.url}/d"
        assert a["upstream_url"] == upstream_url
        assert a["proxy_path"] == "/ds/s-000.tar"
        assert a["proxy_url"] == f"{proxy.url}/ds/s-000.tar"
        assert a["key"] == shard_uuid(upstream_url)
        assert a["state"] == "not cached" and a["size"] is None and a["planned"] == []
    assert origin.gets["d/s-000.tar"] == 0  # asking costs the origin nothing


def test_where_says_cached_and_planned(rig):
    origin, proxy = rig
    with urllib.request.urlopen(f"{proxy.url}/ds/s-001.tar", timeout=30) as r:
        assert r.read() == SHARDS["d/s-001.tar"]
    a = where(proxy, f"{origin.url}/d/s-001.tar")
    assert a["state"] == "cached" and a["size"] == len(SHARDS["d/s-001.tar"])
    body = json.dumps({"urls": ["/ds/s-000.tar", "/ds/s-002.tar"], "name": "epoch0"}).encode()
    req = urllib.request.Request(
        f"{proxy.url}/-/plans",
        data=body,
        method="POST",
        headers={"Authorization": "Bearer sekrit", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        plan = json.loads(r.read())
    planned = where(proxy, "/ds/s-002.tar")["planned"]
    assert planned == [{"plan": plan["id"], "name": "epoch0", "index": 1, "position": 0}]


def test_where_explains_a_url_that_maps_nowhere(rig):
    origin, proxy = rig
    a = where(proxy, "https://data.example.com/d/s-000.tar")
    assert a["form"] == "absolute URL"
    assert "under none of this proxy's upstreams" in a["error"] and f"{origin.url}/d" in a["error"]
    allowed = where(proxy, f"{origin.url}/other/x.tar")  # a host of --allow-host
    assert allowed["form"] == "URL of an allowed host"
    assert allowed["proxy_path"] == f"/{origin.url}/other/x.tar"


# --------------------------------------------------------------------------- proxied


def test_proxied_learns_the_upstreams_from_the_proxy_and_webdataset_reads_through_it(rig):
    wds = pytest.importorskip("webdataset")
    origin, proxy = rig
    pattern = f"{origin.url}/d/s-{{000..002}}.tar"
    urls = proxied(pattern, proxy.url)
    assert urls == f"{proxy.url}/ds/s-{{000..002}}.tar"  # braces kept
    # a URL of the proxy stays; a host of --allow-host takes the absolute form
    assert proxied([f"{proxy.url}/ds/a.tar", f"{origin.url}/x/b.tar"], proxy.url) == [
        f"{proxy.url}/ds/a.tar",
        f"{proxy.url}/{origin.url}/x/b.tar",
    ]
    with pytest.raises(ProxyURLError, match="under none of the upstreams"):
        proxied("https://data.example.com/d/s-000.tar", proxy.url)
    before = sum(origin.gets.values())
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(samples) == 12
    assert {s["__url__"] for s in samples} == {f"{proxy.url}/ds/s-{i:03d}.tar" for i in range(3)}
    # each shard crossed from the origin at most once (s-001 was cached before)
    assert sum(origin.gets.values()) - before <= 3
    assert all(n == 1 for n in origin.gets.values())


def test_proxied_names_a_proxy_it_cannot_ask():
    port = free_port()
    with pytest.raises(ProxyURLError, match=f"cannot ask the proxy at http://127.0.0.1:{port}"):
        proxied("https://h/x.tar", f"http://127.0.0.1:{port}")


# --------------------------------------------------------------------------- the command


def test_where_command_shows_the_mapping_and_asks_the_upstream(rig):
    origin, proxy = rig
    res = run_where(f"{origin.url}/d/s-002.tar", "--proxy", proxy.url)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"upstream URL  {origin.url}/d/s-002.tar" in out
    assert f"proxy URL     {proxy.url}/ds/s-002.tar" in out
    assert f"cache key     {shard_uuid(f'{origin.url}/d/s-002.tar')}" in out
    assert "HEAD          HTTP 200" in out and "through the proxy" in out
    assert res.stderr == ""


def test_where_command_catches_a_typo_in_gopen_rewrite(rig):
    """The report of the issue: a mistyped GOPEN_REWRITE prefix sends every read to the
    origin; where says so, with the prefix it probably meant, and exits 1."""
    origin, proxy = rig
    url = f"{origin.url}/d/s-000.tar"
    typo = {"GOPEN_REWRITE": f"{origin.url}/dd/={proxy.url}/ds/"}
    res = run_where(url, "--proxy", proxy.url, env=typo)
    assert res.returncode == 1
    assert "rewritten      no: the URL matches none of the prefixes" in res.stdout
    assert f"{url} matches none of the GOPEN_REWRITE prefixes" in res.stderr
    assert "webdataset reads it from the origin, not through the proxy" in res.stderr
    assert f"did you mean '{origin.url}/dd/'?" in res.stderr
    # the right rule: the rewritten URL is what the proxy is asked about
    good = {"GOPEN_REWRITE": f"{origin.url}/d/={proxy.url}/ds/"}
    res = run_where(url, "--proxy", proxy.url, env=good)
    assert res.returncode == 0, res.stderr
    assert f"rewritten      {proxy.url}/ds/s-000.tar" in res.stdout
    assert "form           proxy URL" in res.stdout
    # a rule to another address
    elsewhere = {"GOPEN_REWRITE": f"{origin.url}/d/=http://127.0.0.1:{free_port()}/ds/"}
    res = run_where(url, "--proxy", proxy.url, env=elsewhere)
    assert res.returncode == 1 and "which is not the proxy at" in res.stderr
    # a rule to the proxy that loses the upstream's path: the proxy maps it nowhere
    lossy = {"GOPEN_REWRITE": f"{origin.url}/d/={proxy.url}/"}
    res = run_where(url, "--proxy", proxy.url, env=lossy)
    assert res.returncode == 1 and "the proxy maps it nowhere" in res.stderr


def test_where_command_json_and_the_proxy_variable(rig):
    origin, proxy = rig
    res = run_where("/ds/s-000.tar", "--json", "--no-probe", env={"SHARDCACHE_PROXY": proxy.url})
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["proxy"] == proxy.url and "head" not in data
    assert data["where"]["upstream_url"] == f"{origin.url}/d/s-000.tar"
    assert data["warnings"] == [] and data["errors"] == []
    # --proxy and SHARDCACHE_PROXY disagree: proxied() would use the variable
    other = f"http://127.0.0.1:{free_port()}"
    res = run_where("/ds/s-000.tar", "--proxy", proxy.url, env={"SHARDCACHE_PROXY": other})
    assert res.returncode == 1 and f"SHARDCACHE_PROXY={other} is not the proxy" in res.stderr


def test_where_command_without_a_proxy_or_with_a_url_of_no_upstream(rig):
    origin, proxy = rig
    port = free_port()
    res = run_where("/x.tar", "--proxy", f"http://127.0.0.1:{port}")
    assert res.returncode == 1
    assert f"no proxy answers at http://127.0.0.1:{port}: connection refused" in res.stderr
    res = run_where("https://data.example.com/d/s-000.tar", "--proxy", proxy.url)
    assert res.returncode == 1
    assert "the proxy maps it nowhere" in res.stderr and "--allow-host" in res.stderr


# --------------------------------------------------------------------------- pure parts


def test_gopen_rewrite_reads_the_variable_as_webdataset_does(monkeypatch):
    wds_gopen = pytest.importorskip("webdataset.gopen")
    spec = "http://a.example/x/=http://p:1/;https://b.example/=http://p:1/b/"
    monkeypatch.setenv("GOPEN_REWRITE", spec)
    for url in ("http://a.example/x/s.tar", "https://b.example/s.tar", "https://c/s.tar"):
        ours = gopen_rewrite(url, spec)
        assert (ours.result or url) == wds_gopen.rewrite_url(url)
    assert gopen_rewrite("https://c/s.tar", spec).matched is None
    assert "no '='" in gopen_rewrite("x", "http://a/").error


def test_same_server():
    assert same_server("http://localhost:8080/a", "http://127.0.0.1:8080")
    assert same_server("http://h/a", "http://h:80")
    assert not same_server("http://h:81/a", "http://h:80")
    assert not same_server("https://h/a", "http://h:443")


def test_where_route_needs_no_admin_token_but_names_no_credentials(tmp_path: Path):
    origin = Origin(files={"s.tar": b"x" * 10}).start()
    base = origin.url.replace("http://", "http://user:pw@")
    proxy = ProxyProcess(tmp_path / "cache", "--upstream", base).start()
    try:
        a = where(proxy, "https://elsewhere.example/s.tar")
        assert "pw" not in json.dumps(a) and a["upstreams"] == [origin.url]
    finally:
        proxy.stop()
        origin.stop()
