"""The index at scale: eviction reads the victims in order from an SQL index, not every
row; planned eviction reads only the planned rows; opening reads names a chunk at a time;
an index made before gains the order indexes. Victims stay exactly those the pure rules
of :mod:`shardcache.eviction` choose over every row."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import sqlite3
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from shardcache.eviction import choose_victims, choose_victims_planned
from shardcache.meta import ObjectMeta
from shardcache.store import FORMAT_VERSION, INDEX_NAME, Entry, Store, reconcile, shard_uuid
from shardcache.store.entry import ENTRY_COLS, ENTRY_INSERT, Memo, row_to_entry
from shardcache.store.index import Rollback
from shardcache.store.space import ORDER_BY


def seed(store: Store, n: int, size: int, seed: int = 0, ties: bool = False) -> list[str]:
    """``n`` entries of ``size`` bytes (files and rows), distinct or tied access times."""
    rng = random.Random(seed)
    keys = []
    rows = []
    for i in range(n):
        url = f"http://origin/s/{i}.tar"
        key = shard_uuid(url)
        keys.append(key)
        (store.cache_dir / key).write_bytes(b"x" * size)
        created = 1000.0 + (rng.randrange(5) if ties else rng.random())
        last = 2000.0 + (rng.randrange(5) if ties else rng.random())
        rows.append((key, url, size, None, None, None, created, last, 0, created, None, None))
    with store._tx() as conn:
        conn.executemany(ENTRY_INSERT, rows)
    return keys


def all_rows(store: Store) -> list:
    with store.reading() as conn:
        return [
            row_to_entry(store.cache_dir, r)
            for r in conn.execute(f"SELECT {ENTRY_COLS} FROM entries").fetchall()
        ]


def statements(store: Store, action) -> list[str]:
    """The SQL statements the store's write connection runs during ``action()``."""
    seen: list[str] = []
    conn = store._connect()
    conn.set_trace_callback(seen.append)
    try:
        action()
    finally:
        conn.set_trace_callback(None)
    return seen


def full_scans(sql: list[str]) -> list[str]:
    """Statements reading every row of entries: a SELECT from it with no WHERE and no
    ORDER BY (an ordered read stops at the victims)."""
    return [
        s
        for s in sql
        if re.search(r"SELECT .* FROM entries\b", s, re.S)
        and "WHERE" not in s
        and "ORDER BY" not in s
    ]


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize("ties", [False, True])
def test_sql_order_chooses_the_victims_the_pure_rule_chooses(tmp_path, policy, ties):
    store = Store(tmp_path, cache_size=200 * 10, policy=policy)
    seed(store, 200, 10, seed=7, ties=ties)
    rows = all_rows(store)
    rng = random.Random(3)
    for _ in range(30):
        need = rng.randrange(1, 400)
        exclude = {r.key for r in rng.sample(rows, 5)}
        want = choose_victims(rows, policy, 2000, 2000, need, exclude)
        with pytest.raises(Rollback), store._tx() as conn:
            got = store._make_room(conn, need, exclude=exclude)
            raise Rollback
        assert (None if got is None else [v.key for v, _ in got]) == (
            None if want is None else [v.key for v in want]
        )
    # rolled back: every row and file still there
    assert store.stats()["entries"] == 200
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(INDEX_NAME)]) == 200


def test_planned_eviction_chooses_as_over_every_row(tmp_path):
    store = Store(tmp_path, cache_size=100 * 10)
    keys = seed(store, 100, 10, seed=11)
    rows = all_rows(store)
    rng = random.Random(5)
    for _ in range(40):
        planned = rng.sample(keys, rng.randrange(0, 100))
        next_use = {k: float(rng.randrange(50)) for k in planned}
        protected = set(rng.sample(planned, min(3, len(planned))))
        incoming = rng.choice([None, 10.0, 49.0])
        need = rng.randrange(1, 600)
        want = choose_victims_planned(rows, 1000, 1000, need, next_use, protected, (), incoming)
        admit = {} if incoming is None else {"new": incoming}
        with pytest.raises(Rollback), store._tx() as conn:
            got = store._make_room(conn, need, incoming="new", planned=(next_use, protected, admit))
            raise Rollback
        assert (None if got is None else [v.key for v, _ in got]) == (
            None if want is None else [v.key for v in want]
        )


def test_an_evicting_miss_reads_the_victims_not_every_row(tmp_path):
    store = Store(tmp_path, cache_size=500 * 10)
    seed(store, 500, 10)
    sql = statements(store, lambda: store.begin("http://origin/new.tar", 25))
    assert store.stats()["entries"] == 497
    assert any("ORDER BY last_access, created, key" in s for s in sql)
    assert full_scans(sql) == []


def test_planned_eviction_reads_only_the_planned_rows(tmp_path):
    store = Store(tmp_path, cache_size=500 * 10)
    keys = seed(store, 500, 10)
    planned = keys[:20]
    store.planner = lambda: ({k: float(i) for i, k in enumerate(planned)}, set(planned[:2]), {})
    sql = statements(store, lambda: store.begin("http://origin/new.tar", 25))
    assert full_scans(sql) == []
    assert store.stats()["entries"] == 497
    assert all((tmp_path / k).exists() for k in planned)  # unplanned rows went first
    # 5 bytes free (4,970 cached, 25 reserved) + the 477 unplanned entries
    assert store.room_for(set(planned)) == (5 + 477 * 10, 10.0)


def test_room_for_counts_only_the_planned_keys_present(tmp_path):
    store = Store(tmp_path, cache_size=1000)
    keys = seed(store, 50, 10)
    room, mean = store.room_for({*keys[:10], "not-cached"})
    # 500 bytes free + the 40 unplanned entries
    assert (room, mean) == (500 + 400, 10.0)
    assert store.room_for(["absent"]) == (1000, None)


def opened_traced(store_dir: Path) -> tuple[Store, list[str]]:
    """A store opened on ``store_dir`` and the list its write connection records every SQL
    statement in, from the first (opening's own) on."""
    seen: list[str] = []

    class Traced(Store):
        def _connect(self) -> sqlite3.Connection:
            fresh = self._conn is None
            conn = super()._connect()
            if fresh:
                conn.set_trace_callback(seen.append)
            return conn

    return Traced(store_dir), seen


def test_open_reads_names_in_chunks_not_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "NAMES_PER_QUERY", 500)
    store = Store(tmp_path)
    seed(store, 1200, 1)
    store.close()
    opened, seen = opened_traced(tmp_path)
    assert opened.stats()["entries"] == 1200
    assert full_scans(seen) == []
    assert sum("WHERE key IN" in s for s in seen) >= 3  # 1,200 names, 500 a lookup


def test_open_finds_orphans_and_missing_files_together(tmp_path):
    store = Store(tmp_path)
    keys = seed(store, 1200, 3)
    store.close()
    gone = keys[:3] + keys[700:702]
    for k in gone:
        os.unlink(tmp_path / k)
    orphans = [shard_uuid(f"http://elsewhere/{i}") for i in range(4)]
    for k in orphans:
        (tmp_path / k).write_bytes(b"orphan")
    (tmp_path / f"{keys[5]}.abc.del").write_bytes(b"old")
    other = "x" * 36  # not an entry name, not the store's: left alone
    (tmp_path / other).write_bytes(b"mine")
    store = Store(tmp_path)
    assert store.stats()["entries"] == 1200 - len(gone)
    left = {p.name for p in tmp_path.iterdir() if not p.name.startswith(INDEX_NAME)}
    assert left == set(keys) - set(gone) | {other}
    for k in gone:
        assert store.lookup(f"http://origin/s/{keys.index(k)}.tar") is None


def test_an_index_of_this_format_made_before_gains_the_order_indexes(tmp_path):
    store = Store(tmp_path, cache_size=30)
    seed(store, 3, 10)
    store.close()
    # the index as the previous release made it: single-column indexes, same format
    conn = sqlite3.connect(tmp_path / INDEX_NAME)
    conn.execute("DROP INDEX entries_lru")
    conn.execute("DROP INDEX entries_fifo")
    conn.execute("DROP TABLE sessions")
    conn.execute("CREATE INDEX entries_last_access ON entries(last_access)")
    conn.execute("CREATE INDEX entries_created ON entries(created)")
    conn.commit()
    conn.close()
    store = Store(tmp_path, cache_size=30)
    with store.reading() as c:
        names = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        version = c.execute("PRAGMA user_version").fetchone()[0]
    assert {"entries_lru", "entries_fifo"} <= names
    assert not {"entries_last_access", "entries_created"} & names
    assert version == FORMAT_VERSION == 4  # an older shardcache still opens it
    assert store.stats()["entries"] == 3
    oldest = min(all_rows(store), key=lambda r: r.last_access)
    partial = store.begin("http://origin/new.tar", 10)
    assert partial is not None
    assert not (tmp_path / oldest.key).exists()
    store.abort(partial)


def test_eviction_order_query_uses_an_index(tmp_path):
    store = Store(tmp_path)
    with store.reading() as conn:
        for policy, order in ORDER_BY.items():
            plan = conn.execute(
                f"EXPLAIN QUERY PLAN SELECT {ENTRY_COLS} FROM entries ORDER BY {order}"
            ).fetchall()
            text = " ".join(str(r[-1]) for r in plan)
            assert f"USING INDEX entries_{policy}" in text
            assert "TEMP B-TREE" not in text


def test_recent_hits_count_before_the_sql_order(tmp_path):
    store = Store(tmp_path, cache_size=30)
    keys = seed(store, 3, 10)
    oldest = min(all_rows(store), key=lambda r: r.last_access)
    hit = store.lookup(f"http://origin/s/{keys.index(oldest.key)}.tar")
    store.touch(hit, now=time.time())  # in memory only, until the eviction decision
    partial = store.begin("http://origin/new.tar", 10)
    assert partial is not None
    assert (tmp_path / oldest.key).exists()
    store.abort(partial)


def memo_entry(i: int, **kw) -> Entry:
    url = f"http://127.0.0.1:8000/datasets/train/shard-{i:06d}.tar"
    etag = f'"{i:032x}"'
    lm = "Tue, 24 Nov 2026 10:00:00 GMT"
    fields = (
        ("Cache-Control", "max-age=3600"),
        ("Content-Type", "application/x-tar"),
        ("ETag", etag),
        ("Last-Modified", lm),
    )
    now = 1_800_000_000.0 + i
    row = dict(
        key=shard_uuid(url), url=url, path=Path("/c") / shard_uuid(url), size=1 << 20,
        etag=etag, last_modified=lm, content_type="application/x-tar", created=now,
        last_access=now + 0.5, hits=i % 7, validated=now + 0.25, fields=fields,
        digests=(("crc32c", f"{i:08x}"), ("md5", f"{i:032x}")),
    )  # fmt: skip
    row.update(kw)
    return Entry(**row)


@pytest.mark.parametrize(
    "entry",
    [
        memo_entry(1),
        memo_entry(2, etag=None, last_modified=None, content_type=None, fields=(), digests=()),
        memo_entry(3, url="http://o/\udcff caf\u00e9/x.tar", etag=""),
        memo_entry(4, fields=(("X-Note", "a=b; c"), ("X-Empty", ""))),
    ],
)
def test_the_memo_gives_back_the_entry_it_was_given(entry):
    memo = Memo(Path("/c"), 10)
    memo.put(entry)
    assert memo.get(entry.key) == entry
    memo.refresh(dataclasses.replace(entry, hits=99))
    assert memo.get(entry.key) == dataclasses.replace(entry, hits=99)
    memo.pop(entry.key)
    assert memo.get(entry.key) is None and len(memo) == 0


def test_a_row_the_memo_cannot_pack_is_read_from_the_index(tmp_path):
    store = Store(tmp_path)
    url = "http://origin/odd.tar"
    partial = store.begin(url, 2)
    partial.path.write_bytes(b"ab")
    meta = ObjectMeta(size=2, fields=(("X-Odd", "a\x1fb"),))
    committed = store.commit(partial, 2, meta=meta)
    assert len(store._mem) == 0  # not kept in memory
    assert store.lookup(url) == committed  # from the index, every time
    assert committed.fields == (("X-Odd", "a\x1fb"),)


def test_the_memo_holds_an_entry_in_a_third_of_the_memory(tmp_path):
    n = 5000
    entries = [memo_entry(i) for i in range(n)]
    memo = Memo(Path("/c"), n)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for e in entries:
            memo.put(e)
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    # a dict of tuples of the row's objects took some 1,500 bytes an entry
    assert per_entry < 600, per_entry
    assert memo.get(entries[123].key) == entries[123]


# -- opening after a clean end -----------------------------------------------------------


def names_compared(store_dir: Path) -> tuple[Store, bool]:
    """Open a store on ``store_dir``; whether opening compared the names with the index."""
    store, seen = opened_traced(store_dir)
    conn = store._connect()
    conn.set_trace_callback(None)
    return store, any("WHERE key IN" in s for s in seen)


def test_a_large_store_closed_cleanly_opens_without_comparing_names(tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "SCAN_ALWAYS", 10)
    store = Store(tmp_path)
    keys = seed(store, 30, 2)
    store.close()
    store, compared = names_compared(tmp_path)
    assert not compared
    assert store.stats()["entries"] == 30
    # trust holds without the pass: a file that went is dropped when found, a file
    # without a row is never served
    os.unlink(tmp_path / keys[0])
    orphan = shard_uuid("http://elsewhere/x.tar")
    (tmp_path / orphan).write_bytes(b"zz")
    assert store.open_hit("http://origin/s/0.tar") is None
    assert store.stats()["entries"] == 29
    assert store.open_hit("http://elsewhere/x.tar") is None
    store.close()
    # small stores are compared every time
    monkeypatch.setattr(reconcile, "SCAN_ALWAYS", 100)
    store, compared = names_compared(tmp_path)
    assert compared and not (tmp_path / orphan).exists()


def test_a_process_that_died_with_the_store_open_makes_the_next_open_compare(tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "SCAN_ALWAYS", 10)
    store = Store(tmp_path)
    seed(store, 30, 2)
    store.close()
    code = (
        "import os, sys; from shardcache.store import Store; "
        f"s = Store({str(tmp_path)!r}); "
        f"open(os.path.join({str(tmp_path)!r}, {shard_uuid('http://lost/1')!r}), 'wb').write(b'x'); "
        "os._exit(0)"  # dies without close(), its orphan left behind
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    store, compared = names_compared(tmp_path)
    assert compared
    assert not (tmp_path / shard_uuid("http://lost/1")).exists()
    store.close()
    store, compared = names_compared(tmp_path)  # that was a clean end again
    assert not compared


def test_a_stale_reservation_makes_the_open_compare(tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "SCAN_ALWAYS", 10)
    store = Store(tmp_path)
    seed(store, 30, 2)
    partial = store.begin("http://origin/new.tar", 1)
    with store._tx() as conn:  # as if a process that died had begun it
        conn.execute("UPDATE reservations SET pid = ?", (dead_pid(),))
    store._session_pid = None  # and that process had not closed the store either
    store.close()
    store, compared = names_compared(tmp_path)
    assert compared and not partial.path.exists()


def test_an_index_from_before_sessions_is_compared_once(tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "SCAN_ALWAYS", 10)
    store = Store(tmp_path)
    seed(store, 30, 2)
    store.close()
    conn = sqlite3.connect(tmp_path / INDEX_NAME)
    conn.execute("DROP TABLE sessions")
    conn.commit()
    conn.close()
    store, compared = names_compared(tmp_path)
    assert compared
    store.close()
    store, compared = names_compared(tmp_path)
    assert not compared


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(p.stdout)
