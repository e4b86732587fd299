"""The seeding of bench/index_scale.py makes a store the store itself finds consistent:
the figures of the index-scale benchmark are only worth what its seeded store is."""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

import pytest

from shardcache.store import INDEX_NAME, Store, shard_uuid

# the repository root, as the other benchmark tests do: bench/ itself on the path would
# make bench/dbcache.py shadow the dbcache package for every later test
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import index_scale  # noqa: E402

ORIGIN = "http://127.0.0.1:9"


def test_names_are_the_shard_uuids():
    raw = index_scale.digests(ORIGIN, 500)
    names = [index_scale.name_of(raw[16 * i : 16 * i + 16]) for i in range(500)]
    assert names == [shard_uuid(f"{ORIGIN}/obj/{i}") for i in range(500)]
    order = index_scale.key_order(raw, 500)
    assert [names[i] for i in order] == sorted(names)


def _schema(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
        ).fetchall()


@pytest.mark.parametrize("links", [False, True])
def test_a_seeded_store_is_consistent(tmp_path, monkeypatch, links):
    monkeypatch.setattr(index_scale, "LINKS_PER_INODE", 700)  # several linked inodes
    monkeypatch.setattr(index_scale, "CHUNK", 1_000)  # several executemany
    n, size = 3_000, 4096
    fresh = tmp_path / "fresh"
    with Store(fresh, reconcile=False) as store:
        store.used()
    cache = tmp_path / "cache"
    index_scale.seed(cache, ORIGIN, n, size, procs=2, links=links)

    # the store's own indexes, triggers and journal mode, as a fresh store has them
    assert _schema(cache / INDEX_NAME) == _schema(fresh / INDEX_NAME)
    with sqlite3.connect(cache / INDEX_NAME) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = conn.execute("SELECT key, url, size FROM entries").fetchall()
    assert len(rows) == n
    assert {url for _, url, _ in rows} == {f"{ORIGIN}/obj/{i}" for i in range(n)}
    assert all(key == shard_uuid(url) and s == size for key, url, s in rows)
    names = {p.name for p in cache.iterdir() if not p.name.startswith(INDEX_NAME)}
    names -= {p.name for p in fresh.iterdir()}
    assert names == {key for key, _, _ in rows}
    assert all(os.stat(cache / key).st_size == size for key, _, _ in rows)
    if links:
        assert max(os.stat(cache / key).st_nlink for key, _, _ in rows) == 700

    # opening compares every name with the index (under 100,000 entries): nothing to drop
    with Store(cache, cache_size=n * size) as store:
        stats = store.stats()
        assert (stats["entries"], stats["bytes"]) == (n, n * size)
        i = n // 2
        entry = store.get(f"{ORIGIN}/obj/{i}", touch=False)
        assert entry is not None and entry.size == size
    with sqlite3.connect(cache / INDEX_NAME) as conn:
        assert conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == n
        # the totals triggers work again: a delete is counted
        conn.execute("DELETE FROM entries WHERE key = ?", (rows[0][0],))
        assert conn.execute("SELECT entries, bytes FROM totals").fetchone() == (
            n - 1,
            (n - 1) * size,
        )


def test_reuse_finds_the_seeded_origin_and_warm_reads_the_store(tmp_path):
    cache = tmp_path / "cache"
    index_scale.seed(cache, "http://127.0.0.1:45678", 300, 4096, procs=1, links=True)
    assert index_scale.seeded_port(cache) == 45678
    assert index_scale.warm(cache) >= 0.0
    with Store(cache, cache_size=300 * 4096) as store:  # listing and reading changed nothing
        assert store.stats()["entries"] == 300
