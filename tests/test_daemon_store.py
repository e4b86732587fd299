"""The daemon's own tables (claims, plans) in the store's index, through the store's
public hook: the library knows nothing of them, an index made by the library gains them
when the daemon opens it, and an index made before they moved keeps its rows."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from proxy.claims_table import ClaimsTable
from proxy.daemonstore import DaemonStore
from shardcache.errors import StoreWriteError
from shardcache.store import FORMAT_VERSION, HOST, INDEX_NAME, Store


def tables(cache: Path) -> set[str]:
    with sqlite3.connect(cache / INDEX_NAME) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def test_the_library_store_has_no_daemon_tables_nor_their_methods(tmp_path):
    store = Store(tmp_path)
    store.check_writable()
    assert not {"claims", "plans"} & tables(tmp_path)
    for name in ("claim", "release_claim", "plan_put", "plan_delete", "plans_sync"):
        assert not hasattr(store, name), name
    store.close()


def test_the_daemon_adds_its_tables_to_an_index_the_library_made(tmp_path):
    Store(tmp_path).close()
    store = DaemonStore(tmp_path)
    assert not store.plans_exist()  # a read before the tables exist: nothing registered
    store.check_writable()  # the startup check creates them
    assert {"claims", "plans"} <= tables(tmp_path)
    with sqlite3.connect(tmp_path / INDEX_NAME) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    assert store.claim("http://o/a.tar", 1234) == ("mine", None)
    store.release_claim("http://o/a.tar")
    store.close()
    # the library opens it as before, tables and all
    library = Store(tmp_path)
    assert library.check().ok
    library.close()


def test_claims_of_an_index_made_before_the_move_keep_working(tmp_path):
    """Format 4 indexes made by the store itself hold the claims table: its rows count."""
    Store(tmp_path).close()
    with sqlite3.connect(tmp_path / INDEX_NAME) as conn:
        conn.execute(  # the table as the store made it
            "CREATE TABLE claims (key TEXT PRIMARY KEY, pid INTEGER NOT NULL, "
            "host TEXT NOT NULL, port INTEGER, created REAL NOT NULL)"
        )
        live, dead = "http://o/live.tar", "http://o/dead.tar"
        store = Store(tmp_path, reconcile=False)
        conn.executemany(
            "INSERT INTO claims VALUES (?, ?, ?, ?, strftime('%s', 'now'))",
            [
                (store.key(live), os.getppid(), HOST, 4321),  # another live process
                (store.key(dead), 2**22 + 7919, HOST, 4322),  # no such pid
            ],
        )
        store.close()
    claims = ClaimsTable(DaemonStore(tmp_path))
    assert claims.claim(live, 1) == ("owner", 4321)
    assert claims.claim(dead, 1) == ("mine", None)  # a dead owner's claim is taken over
    assert claims.claim(dead, 1) == ("mine", None)  # and is this process's now
    claims.store.close()


def test_a_transaction_commits_or_rolls_back_and_runs_a_programs_schema(tmp_path):
    store = Store(tmp_path)
    store.add_schema("CREATE TABLE IF NOT EXISTS notes (k TEXT PRIMARY KEY, v TEXT);")
    assert "notes" not in tables(tmp_path)  # nothing written before a transaction
    with store.transaction() as conn:
        conn.execute("INSERT INTO notes VALUES ('a', '1')")
    with pytest.raises(RuntimeError), store.transaction() as conn:
        conn.execute("INSERT INTO notes VALUES ('b', '2')")
        raise RuntimeError("rolled back")
    with store.reading() as conn:
        assert conn.execute("SELECT k, v FROM notes").fetchall() == [("a", "1")]
    with pytest.raises(StoreWriteError), store.transaction():
        raise sqlite3.OperationalError("database or disk is full")
    store.close()
