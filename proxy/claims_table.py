"""The claims table: one download per entry across the processes of one proxy
(``serve --workers N``), kept in the store's index beside the entries.

A worker claims an entry before downloading it, in the same ``BEGIN IMMEDIATE``
transaction that finds it not cached; another worker finding a live claim forwards its
request to the owner's loopback port. The table is the daemon's own: created through
:meth:`~shardcache.store.Store.add_schema`, written through
:meth:`~shardcache.store.Store.transaction`, with the columns it always had (format 3 and
4 indexes made by the store itself have it already).
"""

from __future__ import annotations

import os
import time

from shardcache.store import HOST, Store, owner_gone

__all__ = ["CLAIMS_SCHEMA", "ClaimsTable"]

CLAIMS_SCHEMA = """
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY,           -- one download per entry across processes
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    port INTEGER,                   -- where the owner answers followers (127.0.0.1)
    created REAL NOT NULL
)
"""


class ClaimsTable:
    """Claims on downloads, shared by every process of the store's directory."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.add_schema(CLAIMS_SCHEMA)

    def claim(self, url: str, port: int | None = None) -> tuple[str, int | None]:
        """Claim the download of ``url`` for this process, across processes.

        ``("cached", None)``: the entry exists (look it up again); ``("mine", None)``: this
        process downloads it (call :meth:`release` when done, however it ends);
        ``("owner", port)``: a live process downloads it and answers followers on
        ``127.0.0.1:port``. A claim of a dead process is taken over.
        """
        key = self.store.key(url)
        me, now = os.getpid(), time.time()
        with self.store.transaction() as conn:
            # the entries table is the store's format: a committed entry has its row
            if conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone():
                return "cached", None
            row = conn.execute(
                "SELECT pid, host, port, created FROM claims WHERE key = ?", (key,)
            ).fetchone()
            if row is not None:
                pid, host, owner_port, created = row
                if pid == me and host == HOST:
                    return "mine", None
                if owner_port and not owner_gone(pid, host, created, now):
                    return "owner", int(owner_port)
            conn.execute(
                "INSERT OR REPLACE INTO claims (key, pid, host, port, created) "
                "VALUES (?, ?, ?, ?, ?)",
                (key, me, HOST, port, now),
            )
        return "mine", None

    def release(self, url: str) -> None:
        """Drop this process's claim on ``url`` (idempotent)."""
        with self.store.transaction() as conn:
            conn.execute(
                "DELETE FROM claims WHERE key = ? AND pid = ? AND host = ?",
                (self.store.key(url), os.getpid(), HOST),
            )
