"""Same-node direct reads (shardcache.direct): a reader given the proxy's cache directory
opens committed entries from it without HTTP; everything else goes through the proxy.
Against a real proxy subprocess, a real origin and a cache directory they share."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
import urllib.parse
import urllib.request

import pytest

from shardcache import ShardDataset, gopen, plan
from shardcache.direct import DirectReader, direct_reader
from shardcache.workers import WorkerEnvironment
from tests.proxy_helpers import Origin, ProxyProcess, make_shard

SHARDS = {f"d/s-{i:03d}.tar": make_shard(6, seed=i, size=20_000) for i in range(8)}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    origin = Origin(files=dict(SHARDS)).start()
    proxy = ProxyProcess(tmp / "cache", "--upstream", f"ds={origin.url}/d").start()
    yield origin, proxy
    proxy.stop()
    origin.stop()


def get_json(url: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def requests_seen(proxy: ProxyProcess) -> int:
    """Data requests the proxy answered (hits and misses of every kind)."""
    st = get_json(f"{proxy.url}/-/stats")
    return int(st["hits"]) + int(st["misses"])


def url_of(proxy: ProxyProcess, i: int) -> str:
    return f"{proxy.url}/ds/s-{i:03d}.tar"


def read(url: str, **kw) -> bytes:
    with gopen(url, **kw) as f:
        return f.read()


def cache(proxy: ProxyProcess, i: int) -> None:
    """Read shard ``i`` through the proxy and wait until it is committed."""
    assert read(url_of(proxy, i)) == SHARDS[f"d/s-{i:03d}.tar"]
    where = f"{proxy.url}/-/where?url=" + urllib.parse.quote(url_of(proxy, i), safe="")
    deadline = time.monotonic() + 20
    while get_json(where)["state"] != "cached":
        assert time.monotonic() < deadline, "entry not committed"
        time.sleep(0.02)


def test_committed_entries_are_read_from_the_directory(rig):
    origin, proxy = rig
    for i in (0, 1):
        cache(proxy, i)
    before, gets = requests_seen(proxy), sum(origin.gets.values())
    reader = direct_reader(url_of(proxy, 0), proxy.cache_dir)
    hits = reader.hits
    for _ in range(3):
        for i in (0, 1):
            assert (
                read(url_of(proxy, i), proxy_cache_dir=proxy.cache_dir)
                == SHARDS[f"d/s-{i:03d}.tar"]
            )
    assert reader.hits == hits + 6
    assert requests_seen(proxy) == before  # not one request reached the proxy
    assert sum(origin.gets.values()) == gets


def test_a_miss_goes_through_the_proxy_and_is_read_directly_after(rig):
    origin, proxy = rig
    url = url_of(proxy, 2)
    before = requests_seen(proxy)
    assert read(url, proxy_cache_dir=proxy.cache_dir) == SHARDS["d/s-002.tar"]
    assert requests_seen(proxy) == before + 1
    assert origin.gets["d/s-002.tar"] == 1
    cache(proxy, 2)  # one more request through the proxy, a hit, and wait for the commit
    before = requests_seen(proxy)
    assert read(url, proxy_cache_dir=proxy.cache_dir) == SHARDS["d/s-002.tar"]
    assert requests_seen(proxy) == before
    assert origin.gets["d/s-002.tar"] == 1


def test_a_direct_hit_counts_for_the_proxys_lru(rig):
    _, proxy = rig
    cache(proxy, 3)
    key = get_json(f"{proxy.url}/-/where?url=" + urllib.parse.quote(url_of(proxy, 3)))["key"]

    def row() -> tuple[float, int]:
        with sqlite3.connect(proxy.cache_dir / ".shardcache.sqlite") as conn:
            return conn.execute(
                "SELECT last_access, hits FROM entries WHERE key = ?", (key,)
            ).fetchone()

    reader = direct_reader(url_of(proxy, 3), proxy.cache_dir)
    reader.flush()
    time.sleep(1.2)  # the proxy writes its own access batch once a second
    last, hits = row()
    t0 = time.time()
    for _ in range(3):
        read(url_of(proxy, 3), proxy_cache_dir=proxy.cache_dir)
    reader.flush()
    last2, hits2 = row()
    assert hits2 == hits + 3
    assert last2 >= t0 > last


def test_an_entry_purged_while_read_keeps_its_bytes_and_is_not_read_directly_after(rig):
    origin, proxy = rig
    cache(proxy, 4)
    name = "d/s-004.tar"
    reader = direct_reader(url_of(proxy, 4), proxy.cache_dir)
    hits = reader.hits
    f = gopen(url_of(proxy, 4), proxy_cache_dir=proxy.cache_dir)
    try:
        assert reader.hits == hits + 1  # opened from the directory
        head = f.read(1000)
        purge = f"{proxy.url}/-/cache?url=" + urllib.parse.quote("/ds/s-004.tar", safe="")
        assert get_json(purge, "DELETE")["removed"] == 1
        assert head + f.read() == SHARDS[name]  # the version opened, whole
    finally:
        f.close()
    before, gets = requests_seen(proxy), origin.gets[name]
    assert read(url_of(proxy, 4), proxy_cache_dir=proxy.cache_dir) == SHARDS[name]
    assert reader.hits == hits + 1  # not read directly: the entry is gone
    assert requests_seen(proxy) == before + 1
    assert origin.gets[name] == gets + 1


def test_urls_the_library_cannot_key_go_through_the_proxy(rig):
    _, proxy = rig
    cache(proxy, 5)
    before = requests_seen(proxy)
    # a query string (the proxy may strip signatures from it) and a percent escape
    for url in (url_of(proxy, 5) + "?x=1", url_of(proxy, 5).replace("s-005", "s%2D005")):
        assert read(url, proxy_cache_dir=proxy.cache_dir) == SHARDS["d/s-005.tar"]
    assert requests_seen(proxy) == before + 2


@pytest.mark.parametrize("kind", ["missing", "not a cache"])
def test_a_directory_it_cannot_use_falls_back_with_one_log_line(rig, tmp_path, caplog, kind):
    _, proxy = rig
    where = tmp_path / "elsewhere"
    if kind == "not a cache":
        where.mkdir()
        (where / "x").write_bytes(b"")
    cache(proxy, 6)
    before = requests_seen(proxy)
    with caplog.at_level(logging.WARNING, logger="shardcache.direct"):
        for _ in range(3):
            assert read(url_of(proxy, 6), proxy_cache_dir=where) == SHARDS["d/s-006.tar"]
    assert requests_seen(proxy) == before + 3
    lines = [r.getMessage() for r in caplog.records if r.name == "shardcache.direct"]
    assert len(lines) == 1, lines
    assert "direct reads from" in lines[0] and str(where) in lines[0]
    assert not (where.exists() and (where / ".shardcache.sqlite").exists())  # nothing created


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_directory_falls_back(rig, tmp_path, caplog):
    _, proxy = rig
    cache(proxy, 6)
    where = tmp_path / "locked"
    where.mkdir()
    (where / ".shardcache.sqlite").write_bytes(b"")
    where.chmod(0)
    try:
        with caplog.at_level(logging.WARNING, logger="shardcache.direct"):
            assert read(url_of(proxy, 6), proxy_cache_dir=where) == SHARDS["d/s-006.tar"]
    finally:
        where.chmod(0o700)
    assert any("not readable" in r.getMessage() for r in caplog.records)


def test_a_planned_direct_hit_moves_the_plan(rig):
    _, proxy = rig
    for i in (0, 1, 2):
        cache(proxy, i)
    urls = [url_of(proxy, i) for i in (0, 1, 2)]
    reader = direct_reader(urls[0], proxy.cache_dir)
    p = plan(urls, proxy.url, name="direct-test")
    try:
        hits = reader.hits
        for url in urls:
            read(url, proxy_cache_dir=proxy.cache_dir, headers=p.headers)
        assert reader.hits == hits + 3
        reader.flush()  # sends the notifications still waiting
        assert p.status()["position"] == 3
    finally:
        p.close()


def test_shard_dataset_reads_directly_with_a_plan(rig, monkeypatch):
    origin, proxy = rig
    for i in range(8):
        cache(proxy, i)
    urls = [url_of(proxy, i) for i in range(8)]
    env = WorkerEnvironment(rank=0, world_size=1, worker=0, num_workers=1)
    plain = list(ShardDataset(urls, env=env, plan=False))
    monkeypatch.setenv("SHARDCACHE_PROXY_CACHE_DIR", str(proxy.cache_dir))
    ds = ShardDataset(urls, env=env, plan=True)
    assert ds.proxy_cache_dir == str(proxy.cache_dir)
    reader = direct_reader(urls[0], proxy.cache_dir)
    hits, gets = reader.hits, sum(origin.gets.values())
    got = list(ds)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in plain]
    assert got == plain
    assert reader.hits == hits + 8
    assert sum(origin.gets.values()) == gets


def test_a_revalidating_proxy_is_not_read_directly(tmp_path, caplog):
    origin = Origin(files={"d/a.tar": SHARDS["d/s-000.tar"]}).start()
    proxy = ProxyProcess(
        tmp_path / "cache", "--upstream", f"{origin.url}/d", "--revalidate", "always"
    ).start()
    try:
        url = f"{proxy.url}/a.tar"
        read(url)
        with caplog.at_level(logging.WARNING, logger="shardcache.direct"):
            before = requests_seen(proxy)
            assert read(url, proxy_cache_dir=proxy.cache_dir) == SHARDS["d/s-000.tar"]
            assert requests_seen(proxy) == before + 1
        assert any("revalidates" in r.getMessage() for r in caplog.records)
    finally:
        proxy.stop()
        origin.stop()


def test_a_mapping_the_proxy_does_not_confirm_is_not_used(rig, caplog):
    _, proxy = rig
    cache(proxy, 7)
    url = url_of(proxy, 7)
    good = DirectReader(proxy.url, proxy.cache_dir)
    f = good.open(url)
    assert f is not None and f.read() == SHARDS["d/s-007.tar"]
    f.close()
    bad = DirectReader(proxy.url, proxy.cache_dir)
    bad._setup()
    assert bad._rules is not None
    bad._rules["ds"] += "/elsewhere"  # a mapping that disagrees with the proxy's
    with caplog.at_level(logging.WARNING, logger="shardcache.direct"):
        assert bad.open(url) is None
        assert bad.open(url) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "shardcache.direct"]
    assert len(lines) == 1 and "not" in lines[0] and "go through the proxy" in lines[0]
    good.close()
    bad.close()


def _read_in_child(url: str, cache_dir: str, expected: bytes) -> None:
    reader = direct_reader(url, cache_dir)
    hits = reader.hits
    with gopen(url, proxy_cache_dir=cache_dir) as f:
        ok = f.read() == expected
    if not ok or reader.hits != hits + 1:
        raise SystemExit(3)  # multiprocessing then ends the process without atexit handlers


def test_a_forked_worker_reads_directly_and_its_hits_reach_the_index(rig):
    import multiprocessing

    _, proxy = rig
    cache(proxy, 1)
    url = url_of(proxy, 1)
    key = get_json(f"{proxy.url}/-/where?url=" + urllib.parse.quote(url))["key"]
    read(url, proxy_cache_dir=proxy.cache_dir)  # this process's reader and its thread first
    direct_reader(url, proxy.cache_dir).flush()

    def hits() -> int:
        with sqlite3.connect(proxy.cache_dir / ".shardcache.sqlite") as conn:
            return conn.execute("SELECT hits FROM entries WHERE key = ?", (key,)).fetchone()[0]

    before = hits()
    ctx = multiprocessing.get_context("fork")
    # a multiprocessing child ends without atexit handlers, as a DataLoader worker does
    child = ctx.Process(
        target=_read_in_child, args=(url, str(proxy.cache_dir), SHARDS["d/s-001.tar"])
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert hits() == before + 1
