"""The on-disk store: naming, verified commits, eviction, reservations, reconciliation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardcache.errors import IncompleteDownloadError
from shardcache.store import (
    INDEX_NAME,
    NoRoomError,
    Store,
    choose_victims,
    eviction_order,
    shard_uuid,
)

pytestmark = pytest.mark.fast


def put(store: Store, url: str, data: bytes, **kw) -> object:
    partial = store.begin(url, len(data))
    assert partial is not None, f"{url} not admitted"
    partial.path.write_bytes(data)
    return store.commit(partial, len(data), **kw)


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(INDEX_NAME))


# -- naming ----------------------------------------------------------------------------


def test_key_is_uuid3_of_full_url(tmp_path):
    store = Store(tmp_path)
    url = "https://a.example/bucket/shard-000000.tar"
    assert store.key(url) == str(uuid.uuid3(uuid.NAMESPACE_URL, url)) == shard_uuid(url)
    assert store.entry_path(url) == tmp_path / store.key(url)


def test_same_base_name_different_urls_do_not_collide(tmp_path):
    store = Store(tmp_path)
    a, b = "http://one/x/shard-000000.tar", "http://two/y/shard-000000.tar"
    put(store, a, b"AAAA")
    put(store, b, b"BBBBBB")
    assert store.get(a).path.read_bytes() == b"AAAA"
    assert store.get(b).path.read_bytes() == b"BBBBBB"
    assert store.get(a).path != store.get(b).path
    assert store.stats()["entries"] == 2


# -- commit ----------------------------------------------------------------------------


def test_commit_renames_into_place_and_records_metadata(tmp_path):
    store = Store(tmp_path)
    url = "http://h/s.tar"
    partial = store.begin(url, 5)
    assert partial.path.exists() and partial.path.name.endswith(".part")
    assert partial.path.name.startswith(store.key(url) + f".{os.getpid()}.")
    assert store.get(url) is None  # a download in progress is not an entry
    partial.path.write_bytes(b"hello")
    entry = store.commit(
        partial,
        5,
        etag='"e1"',
        last_modified="Mon, 01 Jan 2024 00:00:00 GMT",
        content_type="application/x-tar",
    )
    assert not partial.path.exists()
    assert entry.path.read_bytes() == b"hello"
    got = store.get(url)
    assert (got.etag, got.last_modified, got.content_type) == (
        '"e1"',
        "Mon, 01 Jan 2024 00:00:00 GMT",
        "application/x-tar",
    )
    assert got.hits == 1
    st = store.stats()
    assert {k: st[k] for k in ("entries", "bytes", "reserved", "downloads", "policy")} == {
        "entries": 1,
        "bytes": 5,
        "reserved": 0,
        "downloads": 0,
        "policy": "lru",
    }
    # 10**15 is more than the filesystem holds: the bound in force is what it can hold
    assert st["limit"] == store.cache_size < 10**15
    assert store.size_warning is not None and "909.5 TiB" in store.size_warning  # 10**15
    assert st["effective_limit"] <= st["limit"]


@pytest.mark.parametrize("written", [b"shor", b"too long!"])
def test_commit_with_wrong_byte_count_raises_and_leaves_no_entry(tmp_path, written):
    store = Store(tmp_path)
    url = "http://h/s.tar"
    partial = store.begin(url, 5)
    partial.path.write_bytes(written)
    with pytest.raises(IncompleteDownloadError) as info:
        store.commit(partial, len(written))
    assert info.value.expected == 5 and info.value.received == len(written)
    assert url in str(info.value)
    assert store.get(url) is None
    assert files(tmp_path) == []
    assert store.stats()["reserved"] == 0 and store.stats()["downloads"] == 0


def test_commit_size_must_match_file_when_size_unknown(tmp_path):
    store = Store(tmp_path)
    partial = store.begin("http://h/u.tar", None)
    partial.path.write_bytes(b"abc")
    with pytest.raises(IncompleteDownloadError):
        store.commit(partial, 4)  # caller counted 4, disk has 3
    assert files(tmp_path) == []


def test_commit_replaces_existing_entry_of_same_url(tmp_path):
    store = Store(tmp_path, cache_size=10)
    url = "http://h/s.tar"
    put(store, url, b"old--")
    put(store, url, b"new--")
    assert store.get(url).path.read_bytes() == b"new--"
    assert store.stats()["bytes"] == 5


def test_abort_is_idempotent(tmp_path):
    store = Store(tmp_path, cache_size=10)
    partial = store.begin("http://h/s.tar", 8)
    assert store.stats()["reserved"] == 8
    store.abort(partial)
    store.abort(partial)
    assert store.stats()["reserved"] == 0
    assert files(tmp_path) == []


# -- eviction policy (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    key: str
    size: int
    created: float
    last_access: float


rows_st = st.lists(
    st.builds(
        Row,
        key=st.uuids().map(str),
        size=st.integers(0, 100),
        created=st.floats(0, 1000),
        last_access=st.floats(0, 1000),
    ),
    max_size=20,
    unique_by=lambda r: r.key,
)


@given(rows_st)
def test_eviction_order_by_policy(rows):
    lru = eviction_order(rows, "lru")
    fifo = eviction_order(rows, "fifo")
    assert sorted(lru, key=lambda r: r.key) == sorted(rows, key=lambda r: r.key)
    assert all(a.last_access <= b.last_access for a, b in zip(lru, lru[1:], strict=False))
    assert all(a.created <= b.created for a, b in zip(fifo, fifo[1:], strict=False))
    assert eviction_order(rows, "keep") == []


@given(rows_st, st.integers(0, 500), st.integers(0, 300), st.integers(0, 200))
def test_choose_victims_frees_enough_and_no_more_than_needed(rows, limit, extra, need):
    used = sum(r.size for r in rows) + extra  # extra = other processes' reservations
    victims = choose_victims(rows, "lru", used, limit, need)
    if victims is None:
        # Impossible only if even evicting everything would not make room.
        assert need > limit or extra + need > limit
        return
    freed = sum(v.size for v in victims)
    assert used - freed + need <= limit
    # Minimal prefix: without the last victim it would not have fitted.
    if victims:
        assert used - (freed - victims[-1].size) + need > limit
    assert victims == eviction_order(rows, "lru")[: len(victims)]


@given(rows_st, st.integers(1, 200))
def test_keep_policy_never_evicts(rows, need):
    used = sum(r.size for r in rows)
    victims = choose_victims(rows, "keep", used, used + need - 1, need)
    assert victims is None


def test_choose_victims_respects_exclude():
    rows = [Row("a", 10, 0, 0), Row("b", 10, 1, 1)]
    assert choose_victims(rows, "lru", 20, 20, 5, exclude={"a"}) == [rows[1]]


def test_unknown_policy_rejected(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        Store(tmp_path, policy="random")


# -- eviction in the store -----------------------------------------------------------------


def test_lru_evicts_least_recently_used(tmp_path):
    evicted = []
    store = Store(tmp_path, cache_size=30, on_evict=evicted.append)
    for name in "abc":
        put(store, f"http://h/{name}", b"x" * 10)
        time.sleep(0.01)
    store.get("http://h/a")  # a is now the most recent
    put(store, "http://h/d", b"y" * 10)
    assert [e.url for e in evicted] == ["http://h/b"]
    assert store.get("http://h/b") is None
    assert store.get("http://h/a") is not None
    assert store.stats()["bytes"] <= 30


def test_fifo_evicts_oldest_created(tmp_path):
    store = Store(tmp_path, cache_size=30, policy="fifo")
    for name in "abc":
        put(store, f"http://h/{name}", b"x" * 10)
        time.sleep(0.01)
    store.get("http://h/a")
    put(store, "http://h/d", b"y" * 10)
    assert store.get("http://h/a", touch=False) is None
    assert [e.url for e in store.entries()] == ["http://h/b", "http://h/c", "http://h/d"]


def test_keep_policy_stops_admitting_when_full(tmp_path):
    store = Store(tmp_path, cache_size=25, policy="keep")
    put(store, "http://h/a", b"x" * 10)
    put(store, "http://h/b", b"x" * 10)
    assert store.begin("http://h/c", 10) is None  # BYPASS
    assert store.begin("http://h/c", 5) is not None
    assert {e.url for e in store.entries()} == {"http://h/a", "http://h/b"}


def test_bigger_than_cache_is_bypassed(tmp_path):
    store = Store(tmp_path, cache_size=10)
    put(store, "http://h/a", b"x" * 10)
    assert store.begin("http://h/huge", 11) is None
    assert store.get("http://h/a") is not None  # nothing evicted for a shard we cannot keep


def test_size_bound_held_after_many_commits(tmp_path):
    store = Store(tmp_path, cache_size=100)
    for i in range(40):
        put(store, f"http://h/{i}", os.urandom(7 + i % 13))
        st_ = store.stats()
        assert st_["bytes"] + st_["reserved"] <= 100
        on_disk = sum(
            p.stat().st_size for p in tmp_path.iterdir() if not p.name.startswith(INDEX_NAME)
        )
        assert on_disk == st_["bytes"]


def test_reservations_count_against_the_bound(tmp_path):
    store = Store(tmp_path, cache_size=100)
    put(store, "http://h/a", b"x" * 40)
    p1 = store.begin("http://h/b", 50)
    assert store.stats()["reserved"] == 50
    # 40 + 50 + 30 > 100: the entry a must go to admit c
    p2 = store.begin("http://h/c", 30)
    assert p2 is not None
    assert store.get("http://h/a") is None
    # Two reservations hold 80; a 30-byte download cannot fit with nothing left to evict.
    assert store.begin("http://h/d", 30) is None
    store.abort(p1)
    assert store.begin("http://h/d", 30) is not None
    # Another Store object (as another process would) sees the same reservations.
    assert Store(tmp_path, cache_size=100).stats()["reserved"] == 60


def test_grow_for_unknown_size(tmp_path):
    store = Store(tmp_path, cache_size=100)
    put(store, "http://h/a", b"x" * 60)
    partial = store.begin("http://h/u", None)
    assert partial.reserved == 0
    assert store.grow(partial, 30)
    assert store.get("http://h/a") is not None
    assert store.grow(partial, 70)  # evicts a
    assert store.get("http://h/a") is None
    assert not store.grow(partial, 101)
    partial.path.write_bytes(b"z" * 70)
    store.commit(partial, 70)
    assert store.stats()["bytes"] == 70


def test_commit_of_unknown_size_that_cannot_fit_raises_no_room(tmp_path):
    store = Store(tmp_path, cache_size=10, policy="keep")
    put(store, "http://h/a", b"x" * 8)
    partial = store.begin("http://h/u", None)
    partial.path.write_bytes(b"z" * 5)
    with pytest.raises(NoRoomError):
        store.commit(partial, 5)
    assert store.get("http://h/u") is None
    assert files(tmp_path) == [store.key("http://h/a")]


def test_remove_and_clear(tmp_path):
    store = Store(tmp_path)
    put(store, "http://h/a", b"a")
    put(store, "http://h/b", b"b")
    assert store.remove("http://h/a") is True
    assert store.remove("http://h/a") is False
    partial = store.begin("http://h/c", 1)
    assert store.clear() == 1
    assert files(tmp_path) == [partial.path.name]  # downloads in progress survive clear


# -- restart and reconciliation ------------------------------------------------------------


def test_index_survives_restart(tmp_path):
    store = Store(tmp_path)
    put(store, "http://h/a", b"abc", etag="E")
    store.get("http://h/a")
    store.close()
    again = Store(tmp_path)
    entry = again.get("http://h/a")
    assert entry.etag == "E" and entry.hits == 2 and entry.path.read_bytes() == b"abc"


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def test_stale_part_files_removed_at_open(tmp_path):
    Store(tmp_path)
    key = shard_uuid("http://h/a")
    stale = tmp_path / f"{key}.{_dead_pid()}.abcdef.part"
    stale.write_bytes(b"half")
    unrelated = tmp_path / "notes.txt.part"
    unrelated.write_bytes(b"not ours")
    Store(tmp_path)
    assert not stale.exists()
    assert unrelated.exists()  # only files named like ours are touched


def test_reservation_of_a_dead_process_is_released(tmp_path):
    code = (
        "import os, sys; from shardcache.store import Store\n"
        "s = Store(sys.argv[1], cache_size=100)\n"
        "p = s.begin('http://h/a', 80)\n"
        "p.path.write_bytes(b'x' * 10)\n"
        "os._exit(0)\n"  # dies mid-download
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    store = Store(tmp_path, cache_size=100)
    assert store.stats()["reserved"] == 0
    assert files(tmp_path) == []
    assert store.begin("http://h/b", 90) is not None


def test_live_reservation_of_another_process_survives_open(tmp_path):
    store = Store(tmp_path, cache_size=100)
    partial = store.begin("http://h/a", 50)
    other = Store(tmp_path, cache_size=100)  # same pid is alive: must not be touched
    assert partial.path.exists()
    assert other.stats()["reserved"] == 50


def test_reconcile_drops_missing_and_removes_orphans(tmp_path):
    store = Store(tmp_path)
    put(store, "http://h/a", b"aaa")
    put(store, "http://h/b", b"bbb")
    store.close()
    os.unlink(tmp_path / shard_uuid("http://h/a"))
    orphan = tmp_path / shard_uuid("http://h/orphan")
    orphan.write_bytes(b"who am i")
    again = Store(tmp_path)
    assert [e.url for e in again.entries()] == ["http://h/b"]
    assert not orphan.exists()
    assert again.stats()["bytes"] == 3


def test_get_drops_row_whose_file_vanished_or_changed(tmp_path):
    store = Store(tmp_path)
    put(store, "http://h/a", b"aaa")
    put(store, "http://h/b", b"bbb")
    os.unlink(store.entry_path("http://h/a"))
    store.entry_path("http://h/b").write_bytes(b"truncated-or-tampered")
    assert store.get("http://h/a", touch=False) is None
    assert store.get("http://h/b") is None
    assert store.stats()["entries"] == 0
    assert files(tmp_path) == []


def test_check_reports_then_fixes(tmp_path):
    store = Store(tmp_path, cache_size=100)
    put(store, "http://h/a", b"aaa")
    put(store, "http://h/b", b"bbb")
    put(store, "http://h/c", b"ccc")
    os.unlink(store.entry_path("http://h/a"))
    store.entry_path("http://h/b").write_bytes(b"bb")
    (tmp_path / shard_uuid("http://h/orphan")).write_bytes(b"o")
    (tmp_path / f"{shard_uuid('http://h/p')}.{_dead_pid()}.aa.part").write_bytes(b"p")
    report = store.check()
    assert not report.ok
    assert (report.missing, report.size_mismatch, report.orphans, report.stale_partials) == (
        1,
        1,
        1,
        1,
    )
    assert report.fixed == []
    assert any("http://h/a" in line and "no file" in line for line in report.problems)
    assert len(files(tmp_path)) == 4  # nothing touched without fix
    fixed = store.check(fix=True)
    assert len(fixed.fixed) == 4
    assert store.check().ok
    assert files(tmp_path) == [shard_uuid("http://h/c")]
    assert store.stats()["bytes"] == 3


def test_check_fix_evicts_when_limit_lowered(tmp_path):
    store = Store(tmp_path, cache_size=100)
    for i in range(5):
        put(store, f"http://h/{i}", b"x" * 20)
    smaller = Store(tmp_path, cache_size=50)  # reconciled at open
    assert smaller.stats()["bytes"] <= 50
    assert smaller.check().ok


def test_unlink_failures_do_not_stop_the_sweep(tmp_path, caplog):
    evicted = []
    store = Store(tmp_path, cache_size=50, on_evict=evicted.append)
    for i in range(5):
        put(store, f"http://h/{i}", b"x" * 10)
        time.sleep(0.005)
    with mock.patch("os.unlink", side_effect=PermissionError("injected")):
        put(store, "http://h/big", b"y" * 30)  # needs 3 victims
    assert [e.url for e in evicted] == ["http://h/0", "http://h/1", "http://h/2"]
    assert store.stats()["bytes"] == 10 + 10 + 30
    assert [e.url for e in store.entries()] == ["http://h/3", "http://h/4", "http://h/big"]
    assert sum("injected" in r.getMessage() for r in caplog.records) == 3
    # The evicted files were moved aside; the next check removes them.
    report = store.check(fix=True)
    assert sum("leftover" in line for line in report.problems) == 3
    assert len(files(tmp_path)) == 3


def test_open_without_reconcile_only_reports(tmp_path):
    store = Store(tmp_path)
    put(store, "http://h/a", b"aaa")
    store.close()
    os.unlink(tmp_path / shard_uuid("http://h/a"))
    orphan = tmp_path / shard_uuid("http://h/orphan")
    orphan.write_bytes(b"o")
    report = Store(tmp_path, reconcile=False).check()
    assert (report.missing, report.orphans, report.fixed) == (1, 1, [])
    assert orphan.exists()


def test_store_object_survives_fork(tmp_path):
    store = Store(tmp_path, cache_size=1000)
    put(store, "http://h/parent", b"p" * 10)
    pid = os.fork()
    if pid == 0:  # child: the inherited Store must reopen its own connection
        code = 1
        try:
            put(store, "http://h/child", b"c" * 20)
            code = 0 if store.get("http://h/parent") is not None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("http://h/child").path.read_bytes() == b"c" * 20
    assert store.stats()["bytes"] == 30


def test_threads_share_one_store(tmp_path):
    import threading

    store = Store(tmp_path, cache_size=500)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(10):
                put(store, f"http://h/{t}/{i}", bytes([t]) * (20 + i))
                entry = store.get(f"http://h/{t}/{i}")
                try:
                    data = entry.path.read_bytes() if entry is not None else None
                except FileNotFoundError:  # evicted by another thread since get()
                    continue
                if data is not None and data != bytes([t]) * (20 + i):
                    errors.append((t, i))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    assert store.stats()["bytes"] <= 500 and store.stats()["reserved"] == 0
    assert store.check().ok


def test_an_index_of_format_1_is_migrated_and_keeps_its_entries(tmp_path):
    import sqlite3

    from shardcache.store import FORMAT_VERSION, INDEX_NAME

    url = "http://h/old.tar"
    key = Store(tmp_path).key(url)
    (tmp_path / key).write_bytes(b"12345")
    (tmp_path / INDEX_NAME).unlink(missing_ok=True)
    for extra in ("-wal", "-shm"):
        (tmp_path / (INDEX_NAME + extra)).unlink(missing_ok=True)
    conn = sqlite3.connect(tmp_path / INDEX_NAME)
    conn.executescript(
        """CREATE TABLE entries (key TEXT PRIMARY KEY, url TEXT NOT NULL, size INTEGER NOT NULL,
        etag TEXT, last_modified TEXT, content_type TEXT, created REAL NOT NULL,
        last_access REAL NOT NULL, hits INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE reservations (name TEXT PRIMARY KEY, key TEXT NOT NULL, url TEXT NOT NULL,
        pid INTEGER NOT NULL, host TEXT NOT NULL, created REAL NOT NULL, expected INTEGER,
        bytes INTEGER NOT NULL);"""
    )
    conn.execute(
        "INSERT INTO entries VALUES (?, ?, 5, '\"e\"', NULL, NULL, 100.0, 200.0, 7)", (key, url)
    )
    conn.commit()
    conn.close()
    store = Store(tmp_path)
    entry = store.lookup(url)
    assert (entry.size, entry.hits, entry.validated) == (5, 7, 100.0)  # validated := created
    st = store.stats()
    assert (st["entries"], st["bytes"]) == (1, 5)  # totals filled from the old rows
    with sqlite3.connect(tmp_path / INDEX_NAME) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    partial = store.begin("http://h/new.tar", 3)
    partial.path.write_bytes(b"abc")
    store.commit(partial, 3)
    store.remove(url)
    st = store.stats()
    assert (st["entries"], st["bytes"]) == (1, 3)  # kept by the triggers


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_leaves_its_parents_accesses_to_the_parent(tmp_path):
    """Hits write nothing but a batch in memory; a process forked meanwhile (a DataLoader
    worker) inherits that batch and must not write it a second time."""
    url = "http://a.example/s.tar"
    store = Store(tmp_path)
    put(store, url, b"x" * 10)
    hit = store.open_hit(url)
    assert hit is not None
    hit[1].close()
    assert store.pending_access() == 1
    pid = os.fork()
    if pid == 0:  # the child: its own hit, then close (which flushes)
        code = 1
        try:
            child_hit = store.open_hit(url)
            if child_hit is not None and store.pending_access() == 1:
                child_hit[1].close()
                store.close()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.close()
    entry = Store(tmp_path).get(url, touch=False)
    assert entry is not None and entry.hits == 2  # the parent's hit and the child's, once each


def test_a_hit_after_another_process_replaced_the_entry_is_the_new_version(tmp_path):
    """``open_hit`` answers from this process's memory of the row; another process that
    replaced the entry (a new version at the same path, of the same size) must not have
    its bytes handed out with the old version's ETag and digests."""
    from shardcache.meta import ObjectMeta

    url = "http://a.example/s.tar"
    mine, other = Store(tmp_path), Store(tmp_path, reconcile=False)
    put(mine, url, b"1" * 100, meta=ObjectMeta(size=100, etag='"v1"'))
    entry, stream = mine.open_hit(url)
    stream.close()
    assert entry.etag == '"v1"'
    put(other, url, b"2" * 100, meta=ObjectMeta(size=100, etag='"v2"'))
    entry, stream = mine.open_hit(url)
    with stream:
        assert (entry.etag, stream.read()) == ('"v2"', b"2" * 100)
    # and a version this process commits is known with its own file
    put(mine, url, b"3" * 100, meta=ObjectMeta(size=100, etag='"v3"'))
    entry, stream = mine.open_hit(url)
    with stream:
        assert (entry.etag, stream.read()) == ('"v3"', b"3" * 100)
    mine.close()
    other.close()


def test_hits_reach_the_index_within_a_second_for_the_other_processes_evictions(tmp_path):
    """A process that only hits (a DataLoader worker on a warm cache) writes its accesses
    in a batch a second old at most: another process's miss evicts by them, so the
    entry read over and over is not taken for the least recently used one."""
    import time as _time

    from shardcache.store.access import ACCESS_BATCH_SECONDS

    hot, cold, warm = (f"http://a.example/{n}.tar" for n in ("hot", "cold", "warm"))
    reader = Store(tmp_path, 3000)
    other = Store(tmp_path, 3000, reconcile=False)
    for url in (hot, cold, warm):  # hot is the oldest entry
        put(other, url, b"x" * 1000)
        _time.sleep(0.01)
    entry, stream = reader.open_hit(hot)
    stream.close()
    assert other.get(hot, touch=False).hits == 0  # a hit writes nothing at once...
    _time.sleep(ACCESS_BATCH_SECONDS + 0.05)
    entry, stream = reader.open_hit(hot)
    stream.close()
    assert other.get(hot, touch=False).hits == 2  # ... but its batch, a second on
    assert reader.pending_access() == 0
    put(other, "http://a.example/new.tar", b"y" * 1000)  # evicts one entry: cold, not hot
    assert other.get(hot, touch=False) is not None
    assert other.get(cold, touch=False) is None
    reader.close()
    other.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_a_reservation_left_by_a_predecessor_with_this_pid_is_released(tmp_path):
    """In a container a restarted program often has the pid its predecessor had (1, or
    the one after an init) and the same host name: the reservations and ``.part`` files
    a predecessor killed mid-download left (kill -9, the OOM killer, the exit guard's
    hard exit) are not this process's, and must not hold their room for a day."""
    from shardcache.store import HOST

    with open("/proc/self/stat", "rb") as f:  # this process's start, ticks after boot
        ticks = int(f.read().rpartition(b")")[2].split()[19])
    with open("/proc/uptime", "rb") as f:
        uptime = float(f.read().split()[0])
    started = time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    store = Store(tmp_path, cache_size=10_000)
    live = store.begin("http://h/live", 4000)  # this process's own: kept
    assert live is not None
    key = store.key("http://h/old")
    old = tmp_path / f"{key}.{os.getpid()}.0123456789ab.part"
    old.write_bytes(b"x" * 100)
    before = started - 60  # written a minute before this process started
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO reservations (name, key, url, pid, host, created, expected, bytes) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (old.name, key, "http://h/old", os.getpid(), HOST, before, 5000, 5000),
        )
    assert store.stats()["reserved"] == 9000
    reopened = Store(tmp_path, cache_size=10_000)
    assert reopened.stats()["reserved"] == 4000
    assert not old.exists() and live.path.exists()
    assert reopened.begin("http://h/new", 6000) is not None  # the room is there again
    store.abort(live)
    reopened.close()
    store.close()


def test_a_crash_while_an_entry_is_replaced_never_leaves_new_bytes_under_the_old_row(tmp_path):
    """A process killed right after moving a new version into place, before its index
    transaction commits, must not leave the new file under the old version's row (a
    same-size file would then be served under the old ETag and digests): after the
    restart the URL is either a miss or the new version with its own row."""
    url = "http://h/s.tar"
    store = Store(tmp_path, cache_size=1 << 20)
    partial = store.begin(url, 5)
    partial.path.write_bytes(b"old--")
    store.commit(partial, 5, etag='"old"')
    store.close()
    code = (
        "import os, sys\n"
        "from shardcache.store import Store\n"
        "store = Store(sys.argv[1], cache_size=1 << 20)\n"
        "p = store.begin('http://h/s.tar', 5)\n"
        "p.path.write_bytes(b'new--')\n"
        "real = os.replace\n"
        "def replace_then_die(src, dst):\n"
        "    real(src, dst)\n"
        "    if str(dst).endswith(p.key):\n"
        "        os._exit(9)  # killed between the rename into place and the COMMIT\n"
        "os.replace = replace_then_die\n"
        "store.commit(p, 5, etag='\"new\"')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    assert done.returncode == 9
    again = Store(tmp_path, cache_size=1 << 20)
    try:
        hit = again.open_hit(url)
        if hit is not None:
            entry, f = hit
            with f:
                body = f.read()
            assert (entry.etag, body) in ((('"new"', b"new--")), ('"old"', b"old--")), (
                entry.etag,
                body,
            )
    finally:
        again.close()
