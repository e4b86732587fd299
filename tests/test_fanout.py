"""The fan-out layout (issue 24: one ext4 directory without large_dir holds ~9.4M names):
entries, downloads and evicted files in 256 subdirectories by the key's first two hex
digits, chosen when the store is created and recorded in its index; every process that
opens the store follows the record; a flat store stays flat; asking for the other layout
is refused. The store in-process first, then the proxy end to end (subprocesses)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support.proxy import part_files, stats
from support.proxy_helpers import Fault, ProxyProcess
from support.wait import wait_until

from shardcache.cli.check import stray_files
from shardcache.errors import StoreUnusable
from shardcache.store import FANOUT_FORMAT, FORMAT_VERSION, INDEX_NAME, Store, shard_uuid
from shardcache.store.names import FANOUT_DIRS

KiB = 1024


def put(store: Store, url: str, data: bytes) -> Path:
    """Download ``data`` for ``url`` through the store's own begin/commit; its path."""
    part = store.begin(url, len(data))
    assert part is not None
    part.path.write_bytes(data)
    return store.commit(part, len(data)).path


def user_version(cache: Path) -> int:
    with sqlite3.connect(cache / INDEX_NAME) as c:
        return c.execute("PRAGMA user_version").fetchone()[0]


def files_under(cache: Path) -> list[str]:
    """Every file of the cache directory but the index, relative to it."""
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if p.is_file() and not p.name.startswith(INDEX_NAME)
    )


# --------------------------------------------------------------------------- the store


def test_a_fanout_store_keeps_entries_and_downloads_in_the_keys_subdirectory(tmp_path):
    cache = tmp_path / "c"
    with Store(cache, layout="fanout") as store:
        assert store.layout == "fanout"
        assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == list(FANOUT_DIRS)
        url = "http://h/a.tar"
        key = shard_uuid(url)
        part = store.begin(url, 3)
        assert part is not None
        assert part.path.parent == cache / key[:2]  # beside its entry: one rename
        part.path.write_bytes(b"abc")
        entry = store.commit(part, 3)
        assert entry.path == cache / key[:2] / key == store.entry_path(url)
        assert files_under(cache) == [f"{key[:2]}/{key}"]
        hit = store.open_hit(url)
        assert hit is not None
        assert hit[1].read() == b"abc"
        hit[1].close()
        store.flush_access()
    with Store(cache) as again:  # another open, no layout given: as recorded
        assert again.layout == "fanout"
        assert again.lookup(url).path == cache / key[:2] / key
        hit = again.open_hit(url)
        assert hit is not None and hit[1].read() == b"abc"
        hit[1].close()
    assert user_version(cache) == FANOUT_FORMAT > FORMAT_VERSION  # older releases refuse it


def test_a_subdirectory_removed_while_open_is_made_again_by_the_next_download(tmp_path):
    cache = tmp_path / "c"
    url = "http://h/again.tar"
    sub = cache / shard_uuid(url)[:2]
    with Store(cache, layout="fanout") as store:
        sub.rmdir()  # empty: removed by hand
        assert put(store, url, b"again").parent == sub
        hit = store.open_hit(url)
        assert hit is not None and hit[1].read() == b"again"
        hit[1].close()


def test_eviction_removes_the_victim_from_its_subdirectory(tmp_path):
    cache = tmp_path / "c"
    with Store(cache, cache_size=10 * KiB, layout="fanout") as store:
        urls = [f"http://h/{i}.tar" for i in range(4)]
        paths = [put(store, u, bytes([i]) * (4 * KiB)) for i, u in enumerate(urls)]
        assert store.stats()["entries"] == 2  # 10 KiB hold two of the four
        assert not paths[0].exists() and not paths[1].exists()
        assert paths[2].exists() and paths[3].exists()
        assert store.get(urls[0]) is None and store.get(urls[3]) is not None
        assert files_under(cache) == sorted(str(p.relative_to(cache)) for p in paths[2:])
        assert store.remove(urls[3])
        assert not paths[3].exists()


def test_the_layout_is_recorded_and_another_one_is_refused_naming_both(tmp_path):
    fan, flat = tmp_path / "fan", tmp_path / "flat"
    Store(fan, layout="fanout").close()
    Store(flat, layout="flat").close()
    with pytest.raises(StoreUnusable) as ei:
        Store(fan, layout="flat")
    msg = str(ei.value)
    assert "created with the fanout layout" in msg and "flat" in msg and str(fan) in msg
    with pytest.raises(StoreUnusable) as ei:
        Store(flat, layout="fanout")
    assert "created with the flat layout" in str(ei.value) and "fanout" in str(ei.value)
    with Store(fan, layout="fanout") as s:  # the recorded one, asked again: fine
        assert s.layout == "fanout"
    with Store(flat) as s:
        assert s.layout == "flat"
    assert user_version(flat) == FORMAT_VERSION
    with pytest.raises(ValueError, match="unknown layout"):
        Store(tmp_path / "x", layout="levels")  # type: ignore[arg-type]


def test_an_old_flat_cache_opened_by_this_code_stays_flat_and_keeps_its_entries(tmp_path):
    cache = tmp_path / "old"
    with Store(cache) as store:
        put(store, "http://h/old.tar", b"old bytes")
    # as an earlier release left it: no layout recorded, format 4
    with sqlite3.connect(cache / INDEX_NAME) as c:
        c.execute("DROP TABLE store_meta")
    with pytest.raises(StoreUnusable, match="created with the flat layout"):
        Store(cache, layout="fanout")
    with Store(cache) as store:
        assert store.layout == "flat"
        hit = store.open_hit("http://h/old.tar")
        assert hit is not None and hit[1].read() == b"old bytes"
        hit[1].close()
        put(store, "http://h/new.tar", b"new")
        assert store.check().ok
    key = shard_uuid("http://h/new.tar")
    assert sorted(files_under(cache)) == sorted([shard_uuid("http://h/old.tar"), key])
    assert not any(p.is_dir() for p in cache.iterdir())
    assert user_version(cache) == FORMAT_VERSION


def test_opening_removes_leftovers_and_orphans_in_the_subdirectories(tmp_path):
    cache = tmp_path / "c"
    with Store(cache, layout="fanout") as store:
        kept = put(store, "http://h/kept.tar", b"k" * 100)
        gone = put(store, "http://h/gone.tar", b"g" * 100)
    gone.unlink()  # a row without a file
    orphan_key = shard_uuid("http://h/orphan.tar")
    orphan = cache / orphan_key[:2] / orphan_key
    orphan.write_bytes(b"o")  # a file without a row
    left = cache / orphan_key[:2] / f"{orphan_key}.999999.abcdef.part"
    left.write_bytes(b"partial")  # a download of a dead process
    deleted = cache / kept.name[:2] / f"{kept.name}.0123456789ab.del"
    deleted.write_bytes(b"d")
    with Store(cache) as store:  # a small store compares the names at every open
        assert store.get("http://h/kept.tar") is not None
        assert store.get("http://h/gone.tar") is None
        assert store.stats()["entries"] == 1
    assert not orphan.exists() and not left.exists() and not deleted.exists()
    assert files_under(cache) == [str(kept.relative_to(cache))]


def test_the_deferred_name_pass_walks_the_subdirectories(tmp_path):
    cache = tmp_path / "c"
    with Store(cache, layout="fanout") as store:
        put(store, "http://h/a.tar", b"a" * 10)
        gone = put(store, "http://h/b.tar", b"b" * 10)
    gone.unlink()
    key = shard_uuid("http://h/c.tar")
    orphan = cache / key[:2] / key
    orphan.write_bytes(b"c")
    left = cache / key[:2] / f"{key}.999999.abcdef.part"
    left.write_bytes(b"p")
    with sqlite3.connect(cache / INDEX_NAME) as c:  # an unclean end: a dead session
        c.execute("INSERT INTO sessions (pid, host, started) VALUES (0, '', 0)")
    with Store(cache, defer_names_above=0) as store:
        assert store.names_owed
        assert orphan.exists() and left.exists()  # left to the pass
        report = store.reconcile_names()
        assert (report.orphans, report.missing, report.stale_partials) == (1, 1, 1)
        assert store.stats()["entries"] == 1
    assert not orphan.exists() and not left.exists()


def test_check_repairs_a_fanout_store_and_lists_strays_in_its_subdirectories(tmp_path):
    cache = tmp_path / "c"
    with Store(cache, layout="fanout") as store:
        path = put(store, "http://h/a.tar", b"a" * 10)
    path.write_bytes(b"short")  # the wrong size
    (cache / path.name[:2] / "notes.txt").write_bytes(b"hand-made")
    (cache / "stray.bin").write_bytes(b"x")
    misplaced = "ff" if path.name[:2] != "ff" else "00"
    (cache / misplaced / path.name).write_bytes(b"elsewhere")  # not where its key goes
    with Store(cache, reconcile=False) as store:
        report = store.check(fix=True)
        assert report.size_mismatch == 1 and report.fixed
        assert store.check().ok
    strays = dict(stray_files(cache, "fanout"))
    assert strays == {
        "stray.bin": 1,
        f"{path.name[:2]}/notes.txt": 9,
        f"{misplaced}/{path.name}": 9,
    }


def run_check(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "check", "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------- the proxy

slow = [pytest.mark.slow, pytest.mark.timeout(180)]


def get(url: str) -> tuple[int, str | None, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers.get("X-Cache"), r.read()


def committed(cache: Path) -> None:
    wait_until(lambda: not part_files(cache), 10, 0.02, "the commit")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_proxy_serves_a_fanout_cache_end_to_end(origin, tmp_path):
    data = {f"s{i}.tar": os.urandom(40 * KiB) for i in range(4)}
    origin.files.update(data)
    cache = tmp_path / "cache"
    keys = {n: shard_uuid(f"{origin.url}/{n}") for n in data}
    args = ("--upstream", origin.url, "--cache-size", "100KiB", "--min-free", "0")
    p = ProxyProcess(cache, *args, "--cache-layout", "fanout").start()
    try:
        assert get(f"{p.url}/s0.tar") == (200, "MISS", data["s0.tar"])
        committed(cache)
        assert (cache / keys["s0.tar"][:2] / keys["s0.tar"]).is_file()
        assert get(f"{p.url}/s0.tar") == (200, "HIT", data["s0.tar"])
        for n in ("s1.tar", "s2.tar", "s3.tar"):  # 160 KiB into 100 KiB: evictions
            assert get(f"{p.url}/{n}")[2] == data[n]
            committed(cache)
        wait_until(lambda: stats(p.port)["evictions"] >= 2, 10, 0.05, "the evictions")
        on_disk = files_under(cache)
        assert len(on_disk) == 2
        assert all(f == f"{k[:2]}/{k}" for f in on_disk for k in [f.split("/")[1]])
        assert origin.gets["s0.tar"] == 1
    finally:
        assert p.stop() == 0
    # restarted without the flag: the recorded layout; the entries still hit
    p = ProxyProcess(cache, *args).start()
    try:
        assert stats(p.port)["store"]["layout"] == "fanout"
        survivors = [n for n in data if (cache / keys[n][:2] / keys[n]).exists()]
        assert len(survivors) == 2
        for n in survivors:
            assert get(f"{p.url}/{n}") == (200, "HIT", data[n])
    finally:
        assert p.stop() == 0
    assert not [f for f in os.listdir(cache) if len(f) == 36]  # nothing at the top


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_proxy_keeps_an_old_flat_cache_flat(origin, tmp_path):
    origin.files["old.tar"] = b"o" * 2000
    origin.files["new.tar"] = b"n" * 2000
    cache = tmp_path / "cache"
    with Store(cache) as store:  # as an earlier release left it: no layout recorded
        put(store, f"{origin.url}/old.tar", b"o" * 2000)
    with sqlite3.connect(cache / INDEX_NAME) as c:
        c.execute("DROP TABLE store_meta")
    p = ProxyProcess(cache, "--upstream", origin.url).start()
    try:
        assert stats(p.port)["store"]["layout"] == "flat"
        assert get(f"{p.url}/old.tar") == (200, "HIT", b"o" * 2000)
        assert get(f"{p.url}/new.tar") == (200, "MISS", b"n" * 2000)
        committed(cache)
    finally:
        assert p.stop() == 0
    keys = sorted(shard_uuid(f"{origin.url}/{n}") for n in ("old.tar", "new.tar"))
    assert files_under(cache) == keys  # both at the top, no subdirectory made
    assert user_version(cache) == FORMAT_VERSION
    res = subprocess.run(
        [sys.executable, "-m", "shardcache", "serve", "--cache-dir", str(cache), "--port", "0"]
        + ["--upstream", origin.url, "--cache-layout", "fanout"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "created with the flat layout" in res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_refuses_a_layout_other_than_the_recorded_one(origin, tmp_path):
    cache = tmp_path / "cache"
    Store(cache, layout="fanout").close()
    argv = [sys.executable, "-m", "shardcache", "serve", "--cache-dir", str(cache)]
    argv += ["--upstream", origin.url, "--port", "0", "--cache-layout", "flat"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "created with the fanout layout" in out and "--cache-layout flat" in out
    env = dict(os.environ, SHARDCACHE_CACHE_LAYOUT="flat")
    res = subprocess.run(argv[:-2], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2 and "fanout layout" in res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_mid_download_leaves_a_part_in_its_subdirectory_removed_at_restart(
    origin, tmp_path
):
    slow_bytes = os.urandom(3 << 20)
    origin.files["slow.tar"] = slow_bytes
    origin.faults["slow.tar"] = Fault(delay=0.02, chunk=32 << 10)
    cache = tmp_path / "cache"
    key = shard_uuid(f"{origin.url}/slow.tar")
    p = ProxyProcess(cache, "--upstream", origin.url, "--cache-layout", "fanout").start()
    got: dict = {}

    def reader() -> None:
        try:
            got["body"] = urllib.request.urlopen(f"{p.url}/slow.tar", timeout=60).read()
        except Exception as exc:  # noqa: BLE001 - the failure the client must see
            got["error"] = exc

    t = threading.Thread(target=reader)
    try:
        t.start()

        def under_way() -> bool:
            ps = part_files(cache)
            return bool(ps) and os.path.getsize(cache / ps[0]) > 200_000

        wait_until(under_way, 20, 0.02, "200 kB of the download on disk")
        (left,) = part_files(cache)
        assert left.startswith(f"{key[:2]}/{key}.")
    finally:
        p.stop(signal.SIGKILL)
    t.join(30)
    assert "error" in got or len(got["body"]) < len(slow_bytes)  # never a clean short body
    assert part_files(cache) == [left]
    origin.faults.pop("slow.tar")
    p = ProxyProcess(cache, "--upstream", origin.url).start()
    try:
        assert part_files(cache) == []  # removed at startup, in its subdirectory
        assert get(f"{p.url}/slow.tar") == (200, "MISS", slow_bytes)
        committed(cache)
        assert get(f"{p.url}/slow.tar") == (200, "HIT", slow_bytes)
        assert (cache / key[:2] / key).stat().st_size == len(slow_bytes)
    finally:
        assert p.stop() == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shardcache_check_reports_and_repairs_a_fanout_cache(origin, tmp_path):
    origin.files["a.tar"] = b"a" * 5000
    cache = tmp_path / "cache"
    key = shard_uuid(f"{origin.url}/a.tar")
    p = ProxyProcess(cache, "--upstream", origin.url, "--cache-layout", "fanout").start()
    try:
        assert get(f"{p.url}/a.tar")[2] == b"a" * 5000
        committed(cache)
    finally:
        assert p.stop() == 0
    res = run_check(cache)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(fanout layout): 1 entries" in res.stdout and "stray" not in res.stdout
    (cache / key[:2] / key).write_bytes(b"tampered")
    (cache / key[:2] / f"{key}.4194303.abcdefabcdef.part").write_bytes(b"left")
    (cache / "00" / "by-hand.txt").write_bytes(b"x")
    res = run_check(cache)
    assert res.returncode == 1, res.stdout
    assert "is 8 bytes, index says 5000" in res.stdout
    assert "stale partial download" in res.stdout
    assert "stray: 00/by-hand.txt (1 bytes)" in res.stdout
    res = run_check(cache, "--fix")
    assert res.returncode == 0 and "repaired" in res.stdout, res.stdout
    assert files_under(cache) == ["00/by-hand.txt"]  # strays are left alone
    p = ProxyProcess(cache, "--upstream", origin.url).start()
    try:
        assert get(f"{p.url}/a.tar") == (200, "MISS", b"a" * 5000)
    finally:
        assert p.stop() == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_workers_and_another_process_share_a_fanout_cache(origin, tmp_path):
    data = {f"w{i}.tar": os.urandom(20 * KiB) for i in range(6)}
    origin.files.update(data)
    cache = tmp_path / "cache"
    p = ProxyProcess(
        cache, "--upstream", origin.url, "--workers", "2", "--cache-layout", "fanout"
    ).start()
    try:
        for n, b in data.items():
            assert get(f"{p.url}/{n}")[2] == b
        committed(cache)
        for _ in range(3):  # each worker finds the others' entries
            for n, b in data.items():
                assert get(f"{p.url}/{n}") == (200, "HIT", b)
        assert all(origin.gets[n] == 1 for n in data)
        for _ in range(4):  # whichever worker answers, it follows the record
            assert stats(p.port)["store"]["layout"] == "fanout"
        # a library process (as a DataLoader worker) reads the same store, as recorded
        url = f"{origin.url}/w0.tar"
        code = (
            "from shardcache.store import Store\n"
            f"s = Store({str(cache)!r})\n"
            "assert s.layout == 'fanout', s.layout\n"
            f"e, f = s.open_hit({url!r})\n"
            f"assert f.read() == open({str(cache / shard_uuid(url)[:2] / shard_uuid(url))!r}, "
            "'rb').read()\n"
            "s.close()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        # and cache_shards in another process commits an entry the proxy then hits
        origin.files["lib.tar"] = b"L" * 3000
        lib = f"{origin.url}/lib.tar"
        code = (
            "from shardcache.cachestream import cache_shards\n"
            f"for s in cache_shards([{lib!r}], cache_dir={str(cache)!r}):\n"
            "    s['stream'].read()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert (cache / shard_uuid(lib)[:2] / shard_uuid(lib)).is_file()
        assert get(f"{p.url}/lib.tar") == (200, "HIT", b"L" * 3000)
        assert origin.gets["lib.tar"] == 1
    finally:
        assert p.stop() == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_direct_reads_open_committed_entries_in_the_subdirectories(origin, tmp_path):
    from shardcache import gopen
    from shardcache.direct import direct_reader

    origin.files["d.tar"] = os.urandom(30 * KiB)
    cache = tmp_path / "cache"
    p = ProxyProcess(cache, "--upstream", origin.url, "--cache-layout", "fanout").start()
    try:
        url = f"{p.url}/d.tar"
        assert get(url)[2] == origin.files["d.tar"]
        where = f"{p.url}/-/where?url=" + urllib.parse.quote(url, safe="")
        wait_until(
            lambda: b'"cached"' in urllib.request.urlopen(where, timeout=10).read(),
            20,
            0.02,
            "the commit",
        )
        before = stats(p.port)
        reader = direct_reader(url, cache)
        with gopen(url, proxy_cache_dir=cache) as f:
            assert f.read() == origin.files["d.tar"]
        assert reader.off is None and reader.hits == 1
        after = stats(p.port)
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
        reader.close()
    finally:
        assert p.stop() == 0


def test_an_index_another_process_made_meanwhile_keeps_its_layout(tmp_path):
    # two processes create one cache: the second read user_version 0 before the first
    # made the index, and migrates after it: the fan-out record and format stay
    cache = tmp_path / "c"
    first = Store(cache, layout="fanout")
    second = Store.__new__(Store)
    second.cache_dir, second._asked_layout = cache, "flat"
    conn = sqlite3.connect(cache / INDEX_NAME, isolation_level=None)
    try:
        Store._migrate(second, conn, 0)
    finally:
        conn.close()
    first.close()
    assert user_version(cache) == FANOUT_FORMAT
    with pytest.raises(StoreUnusable, match="created with the fanout layout"):
        Store(cache, layout="flat")


@pytest.mark.parametrize("links", [False, True], ids=["files", "links"])
def test_bench_index_scale_seeds_a_consistent_fanout_store(tmp_path, monkeypatch, links):
    # the repository root on the path, not bench/ (whose dbcache.py would shadow the package)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        from bench import index_scale
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(index_scale, "LINKS_PER_INODE", 70)  # links across subdirectories
    cache = tmp_path / "seeded"
    index_scale.seed(cache, "http://o", 600, 512, procs=2, links=links, layout="fanout")
    assert index_scale.layout_of(cache) == "fanout"
    with Store(cache) as store:
        assert store.layout == "fanout"
        report = store.check()
        assert report.ok and report.entries == 600, report.problems[:3]
        entry = store.lookup("http://o/obj/7")
        assert entry is not None and entry.path.parent.name == entry.key[:2]
    assert not [n for n in os.listdir(cache) if len(n) == 36]
    assert user_version(cache) == FANOUT_FORMAT
