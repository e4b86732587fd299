"""CacheStream and cache_shards: only complete downloads become entries, never silently short."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
from support.httporigin import Origin

from shardcache.cachestream import CacheStream, cache_shards, stream_length
from shardcache.errors import GopenError, HTTPStatusError, IncompleteDownloadError
from shardcache.store import INDEX_NAME, Store


class Trickle(io.RawIOBase):
    """A source whose reads return at most ``step`` bytes and that may end early."""

    def __init__(self, data: bytes, step: int = 3, stop_at: int | None = None) -> None:
        self.data = data
        self.pos = 0
        self.step = step
        self.stop_at = len(data) if stop_at is None else stop_at

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.step, self.stop_at - self.pos)
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def make_tar(n: int, seed: int = 0, size: int = 300) -> bytes:
    rng = random.Random(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            for ext in ("txt", "bin"):
                payload = rng.randbytes(rng.randint(0, size)) if ext == "bin" else b"%d" % i
                info = tarfile.TarInfo(f"s{seed:03d}_{i:04d}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith((".part", ".del")))


def drain(stream, n: int = 100) -> bytes:
    out = []
    while True:
        data = stream.read(n)
        if not data:
            return b"".join(out)
        out.append(data)


# -- CacheStream -------------------------------------------------------------------------


def test_short_reads_are_not_end_of_file(tmp_path):
    data = os.urandom(1000)
    target = tmp_path / "shard.tar"
    cs = CacheStream(target, Trickle(data, step=3), expected_size=len(data))
    first = cs.read(100)
    assert len(first) == 3  # a short read ...
    assert not target.exists()  # ... is not the end: nothing renamed yet
    rest = drain(cs)
    assert first + rest == data
    assert target.read_bytes() == data
    assert leftovers(tmp_path) == []
    cs.close()
    assert target.read_bytes() == data


def test_short_reads_without_a_known_size_complete_at_real_eof(tmp_path):
    data = os.urandom(999)
    target = tmp_path / "shard.tar"
    cs = CacheStream(target, Trickle(data, step=10))
    assert cs.expected_size is None
    assert drain(cs, 64) == data
    cs.close()
    assert target.read_bytes() == data


def test_source_ending_early_raises_and_leaves_nothing(tmp_path):
    data = os.urandom(1000)
    target = tmp_path / "shard.tar"
    cs = CacheStream(target, Trickle(data, step=50, stop_at=600), expected_size=1000)
    with pytest.raises(IncompleteDownloadError) as info:
        drain(cs)
    assert (info.value.received, info.value.expected) == (600, 1000)
    with pytest.raises(IncompleteDownloadError):  # not a clean EOF on a second try either
        cs.read(10)
    cs.close(complete=True)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_source_longer_than_promised_raises(tmp_path):
    target = tmp_path / "shard.tar"
    cs = CacheStream(target, Trickle(b"x" * 30, step=8), expected_size=20)
    with pytest.raises(IncompleteDownloadError):
        drain(cs)
    assert list(tmp_path.iterdir()) == []


def test_close_before_the_end_discards_and_complete_close_finishes(tmp_path):
    data = os.urandom(500)
    a, b = tmp_path / "a", tmp_path / "b"
    cs = CacheStream(a, Trickle(data, step=50), expected_size=500)
    cs.read(100)
    cs.close()
    assert not a.exists() and leftovers(tmp_path) == []
    cs = CacheStream(b, Trickle(data, step=50), expected_size=500)
    cs.read(100)
    cs.close(complete=True)  # reads the rest, verifies, keeps
    assert b.read_bytes() == data


def test_readinto_through_buffered_reader_and_tarfile(tmp_path):
    data = make_tar(20, seed=1)
    target = tmp_path / "t.tar"
    cs = CacheStream(target, Trickle(data, step=1000), expected_size=len(data))
    with tarfile.open(fileobj=io.BufferedReader(cs), mode="r|") as tf:
        names = [m.name for m in tf]
    assert len(names) == 40
    cs.close(complete=True)
    assert target.read_bytes() == data


def test_with_store_commits_only_complete(tmp_path):
    store = Store(tmp_path)
    data = os.urandom(2000)
    partial = store.begin("http://h/ok", len(data))
    cs = CacheStream("ok", Trickle(data, step=7), store=store, partial=partial)
    assert drain(cs) == data
    assert store.get("http://h/ok").path.read_bytes() == data
    partial = store.begin("http://h/bad", len(data))
    cs = CacheStream("bad", Trickle(data, step=7, stop_at=1500), store=store, partial=partial)
    with pytest.raises(IncompleteDownloadError):
        drain(cs)
    assert store.get("http://h/bad") is None
    assert leftovers(tmp_path) == []
    assert store.stats()["reserved"] == 0


def test_unknown_size_grows_its_reservation_then_streams_through_when_too_big(tmp_path):
    store = Store(tmp_path, cache_size=1000)
    partial = store.begin("http://h/u", None)
    data = os.urandom(3000)
    cs = CacheStream("u", Trickle(data, step=100), store=store, partial=partial)
    assert drain(cs) == data  # the reader still gets every byte
    assert store.get("http://h/u") is None
    st = store.stats()
    assert {k: st[k] for k in ("entries", "bytes", "reserved", "limit", "downloads")} == {
        "entries": 0,
        "bytes": 0,
        "reserved": 0,
        "limit": 1000,
        "downloads": 0,
    }
    assert leftovers(tmp_path) == []


def test_stream_length_of_files_and_responses(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"12345")
    with open(p, "rb") as f:
        assert stream_length(f) == 5
    assert stream_length(Trickle(b"abc")) is None


# -- cache_shards over HTTP ----------------------------------------------------------------


@pytest.fixture
def origin():
    files = {f"a/shard-{i:06d}.tar": make_tar(5 + i, seed=i) for i in range(4)}
    with Origin(files) as o:
        yield o


def test_hits_are_served_from_disk(origin, tmp_path):
    urls = [origin.url(p) for p in origin.files]
    for _ in range(3):
        got = {}
        for item in cache_shards(urls, cache_dir=tmp_path):
            got[item["url"]] = item["stream"].read()
        assert got == {origin.url(p): data for p, data in origin.files.items()}
    assert set(origin.requests.values()) == {1}
    store = Store(tmp_path)
    assert store.stats()["entries"] == 4
    assert all(e.hits == 2 for e in store.entries())


def test_partial_consumer_still_completes_entry(origin, tmp_path):
    url = origin.url("a/shard-000003.tar")
    for item in cache_shards([url], cache_dir=tmp_path):
        item["stream"].read(10)  # the consumer stops early (as a tar reader at the end marker)
    assert Store(tmp_path).get(url).path.read_bytes() == origin.files["a/shard-000003.tar"]


def test_trickling_origin_is_cached_whole(origin, tmp_path):
    origin.trickle = True
    url = origin.url("a/shard-000002.tar")
    item = next(iter(cache_shards([url], cache_dir=tmp_path)))
    assert drain(item["stream"], 4096) == origin.files["a/shard-000002.tar"]
    assert Store(tmp_path).get(url).size == len(origin.files["a/shard-000002.tar"])


def test_connection_dropped_mid_body_is_an_error_and_no_entry(origin, tmp_path):
    path = "a/shard-000003.tar"
    url = origin.url(path)
    origin.drop_after[path] = 2000
    gen = cache_shards([url], cache_dir=tmp_path)
    item = next(gen)
    with pytest.raises((IncompleteDownloadError, GopenError)) as info:
        drain(item["stream"], 512)
    assert url in str(info.value)
    item["stream"].close()
    assert list(gen) == []
    store = Store(tmp_path)
    assert store.get(url) is None and store.stats()["reserved"] == 0
    assert leftovers(tmp_path) == []
    # Once the origin behaves, the shard is fetched again and cached.
    del origin.drop_after[path]
    item = next(iter(cache_shards([url], cache_dir=tmp_path)))
    assert item["stream"].read() == origin.files[path]
    assert Store(tmp_path).get(url) is not None


def test_same_base_name_on_different_paths(origin, tmp_path):
    origin.files["b/shard-000000.tar"] = make_tar(3, seed=99)
    urls = [origin.url("a/shard-000000.tar"), origin.url("b/shard-000000.tar")]
    for _ in range(2):
        got = [item["stream"].read() for item in cache_shards(urls, cache_dir=tmp_path)]
        assert got == [origin.files["a/shard-000000.tar"], origin.files["b/shard-000000.tar"]]
    assert Store(tmp_path).stats()["entries"] == 2


def test_cache_dir_none_passes_through(origin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    urls = [origin.url(p) for p in origin.files]
    for _ in range(2):
        for item in cache_shards(urls, cache_dir=None):
            assert item["stream"].read() == origin.files[item["url"].split("/", 3)[3]]
            item["stream"].close()
    assert set(origin.requests.values()) == {2}
    assert list(tmp_path.iterdir()) == []


def test_dict_items_keep_their_keys(origin, tmp_path):
    url = origin.url("a/shard-000000.tar")
    items = list(cache_shards([{"url": url, "epoch": 3}], cache_dir=tmp_path))
    assert items[0]["epoch"] == 3 and items[0]["url"] == url


def test_shard_bigger_than_cache_is_streamed_through(origin, tmp_path):
    url = origin.url("a/shard-000003.tar")
    for _ in range(2):
        item = next(iter(cache_shards([url], cache_dir=tmp_path, cache_size=100)))
        assert item["stream"].read() == origin.files["a/shard-000003.tar"]
    assert origin.requests["a/shard-000003.tar"] == 2
    assert Store(tmp_path).stats()["entries"] == 0


def test_cache_size_bounds_the_directory(origin, tmp_path):
    sizes = sorted(len(d) for d in origin.files.values())
    limit = sizes[-1] + sizes[-2]
    urls = [origin.url(p) for p in origin.files]
    for _ in range(2):
        for item in cache_shards(urls, cache_dir=tmp_path, cache_size=limit):
            item["stream"].read()
            on_disk = sum(
                p.stat().st_size for p in tmp_path.iterdir() if not p.name.startswith(INDEX_NAME)
            )
            assert on_disk <= limit
    assert Store(tmp_path, limit).stats()["bytes"] <= limit


def test_open_errors_go_to_the_handler(origin, tmp_path):
    urls = [origin.url("missing.tar"), origin.url("a/shard-000000.tar")]
    with pytest.raises(HTTPStatusError, match="404"):
        list(cache_shards(urls, cache_dir=tmp_path))
    seen = []
    items = list(cache_shards(urls, cache_dir=tmp_path, handler=lambda e: seen.append(e) or True))
    assert [i["url"] for i in items] == [urls[1]]
    assert isinstance(seen[0], HTTPStatusError)


def test_samples_identical_with_and_without_cache(origin, tmp_path):
    from shardcache.tariterators import group_by_keys, tar_file_expander

    urls = [origin.url(p) for p in origin.files]

    def samples(cache_dir):
        return list(group_by_keys(tar_file_expander(cache_shards(urls, cache_dir=cache_dir))))

    direct = samples(None)
    assert len(direct) == sum(5 + i for i in range(4))
    assert samples(tmp_path) == direct  # miss: through CacheStream
    assert samples(tmp_path) == direct  # hit: from disk
    assert Store(tmp_path).stats()["entries"] == 4
    assert leftovers(tmp_path) == []


# -- several processes filling one cache_dir -------------------------------------------------

WORKER = textwrap.dedent(
    """
    import hashlib, json, random, sys
    from shardcache.cachestream import cache_shards
    spec = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    urls = list(spec["digests"])
    random.Random(rank).shuffle(urls)
    bad = 0
    for item in cache_shards(urls, cache_dir=spec["cache_dir"], cache_size=spec["limit"]):
        data = item["stream"].read()
        if hashlib.sha256(data).hexdigest() != spec["digests"][item["url"]]:
            bad += 1
    print(json.dumps({"rank": rank, "bad": bad, "n": len(urls)}))
    """
)


@pytest.mark.slow
def test_several_processes_share_one_cache_dir(tmp_path):
    files = {
        f"p/shard-{i:06d}.tar": os.urandom(random.Random(i).randint(3000, 30000)) for i in range(20)
    }
    cache_dir = tmp_path / "cache"
    limit = 150_000  # about half of the 20 shards: constant eviction under contention
    with Origin(files) as origin:
        spec = {
            "cache_dir": str(cache_dir),
            "limit": limit,
            "digests": {origin.url(p): hashlib.sha256(d).hexdigest() for p, d in files.items()},
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        start = time.monotonic()
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path / "spec.json"), str(r)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(4)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out))
        assert time.monotonic() - start < 30
    assert [r["bad"] for r in results] == [0, 0, 0, 0]
    assert sum(origin.requests.values()) >= 20
    store = Store(cache_dir, limit)
    assert store.check().ok
    stats = store.stats()
    assert stats["bytes"] <= limit and stats["reserved"] == 0
    for entry in store.entries():
        assert entry.path.read_bytes() == files[entry.url.split("/", 3)[3]]
    assert leftovers(cache_dir) == []


def test_a_library_hit_writes_nothing_and_counts_for_lru_from_the_batch(tmp_path):
    """A hit through ``open_cached`` records its access in memory, with no write to the
    index; the access is written by the next miss (before its eviction decision, so the
    entry just read is not the victim) and on close, where every process sees it."""
    from shardcache.cachestream import open_cached

    src = tmp_path / "src"
    src.mkdir()
    data = {n: bytes([i + 1]) * 1000 for i, n in enumerate("abcd")}
    for n, d in data.items():
        (src / n).write_bytes(d)
    url = {n: f"http://origin.invalid/{n}.tar" for n in data}

    def opener(u: str):
        return open(src / u.rsplit("/", 1)[1].removesuffix(".tar"), "rb")

    def read_through(store: Store, n: str) -> bytes:
        stream = open_cached(store, url[n], opener)
        try:
            return stream.read()
        finally:
            if isinstance(stream, CacheStream):
                stream.close(complete=True)
            else:
                stream.close()

    cache = tmp_path / "cache"
    store = Store(cache, 2000)
    other = Store(cache, 2000, reconcile=False)  # another process's view of the index
    assert [read_through(store, n) for n in "ab"] == [data["a"], data["b"]]  # misses
    before = other.get(url["a"], touch=False)
    assert before is not None and before.hits == 0
    assert read_through(store, "a") == data["a"]  # a hit
    after = other.get(url["a"], touch=False)
    assert (after.hits, after.last_access) == (0, before.last_access)  # nothing written
    assert store.pending_access() == 1
    # a miss that must evict: the hit on a was written first, so b (read before it) goes
    assert read_through(store, "c") == data["c"]
    assert other.get(url["a"], touch=False).hits == 1
    assert other.get(url["b"], touch=False) is None
    assert sorted(e.url for e in other.entries()) == [url["a"], url["c"]]
    # hits are written on close too
    assert read_through(store, "c") == data["c"]
    assert other.get(url["c"], touch=False).hits == 0
    store.close()
    assert other.get(url["c"], touch=False).hits == 1
    # and a hit whose file another process removed is a miss, its row dropped
    reopened = Store(cache, 2000)
    os.unlink(other.entry_path(url["a"]))
    assert read_through(reopened, "a") == data["a"]
    assert other.get(url["a"], touch=False).hits == 0  # fetched again: a new entry
    reopened.close()
    other.close()
