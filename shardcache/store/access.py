"""Hits and their accesses: lookups that write nothing, accesses recorded in memory and
written in batches.

:meth:`Access.lookup` answers from an in-memory map of the entries this process has seen
(falling back to a read-only query of the index, which never waits for a writer in WAL
mode), and :meth:`Access.touch` records the access in memory; :meth:`Access.open_hit` is
the two together with the entry file opened, the library's hit (``cache_shards``,
``CachedSource``) as the daemon's. The recorded accesses reach the index in one
transaction per :meth:`Access.flush_access` (the daemon calls it every second; a library
hit when the batch is :data:`ACCESS_BATCH_SECONDS` old; the store on close), and before
any eviction decision, so LRU order and hit counts survive a clean restart, a crash loses
at most one batch, and the other processes sharing the directory evict by accesses at
most a second old. An entry another process evicted is found
missing when its file is opened, and becomes a miss.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from shardcache.errors import CacheError
from shardcache.store.entry import (
    ENTRY_COLS,
    Entry,
    Memo,
    Stamp,
    fields_json,
    file_stamp,
    row_to_entry,
)
from shardcache.store.index import Index
from shardcache.store.names import INDEX_NAME, Naming, size_of

log = logging.getLogger("shardcache.store")

# a library hit writes the batch of accesses once its oldest is this old: a process that
# only hits (every DataLoader worker once the cache is warm) would otherwise keep them
# until its next miss or its close, while the others evict its hot entries as unread
ACCESS_BATCH_SECONDS = 1.0

# this process's id, kept up to date across fork: every hit asks which process's batch it
# records into, and os.getpid() is a system call
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


class Access(Index, Naming):
    """Lookups, hits and the batches of accesses (a part of :class:`Store`)."""

    _mem: Memo
    _touched: dict[str, list]  # key -> [last_access, hits to add, validated or 0]
    _touch_lock: threading.Lock
    _touch_pid: int  # the process whose accesses _touched holds
    _touch_since: float | None  # monotonic time of the oldest access in _touched
    _unreleased: dict[str, int]  # .part name -> bytes whose release the index refused

    def lookup(self, url: str, key: str | None = None) -> Entry | None:
        """The entry of ``url`` (whose key the caller may have made: ``key``) as far as
        this process knows, without writing anything.

        Answers from memory when it can, else from one read of the index. The file may
        still have been evicted by another process: the caller opens it and, if it is
        missing or has another size, calls :meth:`forget` and treats the request as a miss.
        """
        if key is None:
            key = self.key(url)
        entry = self._mem.get(key)
        if entry is not None:
            return entry
        try:
            row = (
                self._reader()
                .execute(f"SELECT {ENTRY_COLS} FROM entries WHERE key = ?", (key,))
                .fetchone()
            )
        except sqlite3.Error as exc:
            raise CacheError(f"{self.cache_dir / INDEX_NAME}: cannot read index: {exc}") from exc
        if row is None:
            return None
        entry = row_to_entry(self.cache_dir, row, self.layout)
        try:  # the file this row describes, as near the read as can be
            stamp: Stamp | None = file_stamp(os.stat(entry.path))
        except OSError:
            stamp = None  # gone: the caller's open finds it missing
        self._mem.put(entry, stamp)
        return entry

    def open_hit(self, url: str) -> tuple[Entry, BinaryIO] | None:
        """The entry of ``url`` and its file opened for reading, or None (a miss).

        Writes nothing: the entry comes from :meth:`lookup`, the access is recorded by
        :meth:`touch`. A file that is gone or has another size than the index says
        (evicted or replaced by another process) has its row dropped, as :meth:`get` does,
        and the index is asked once more.
        """
        for _ in range(2):
            entry = self.lookup(url)
            if entry is None:
                return None
            try:
                stream = open(entry.path, "rb")  # noqa: SIM115 - handed to the caller
            except FileNotFoundError:
                pass
            else:
                st = os.fstat(stream.fileno())
                if st.st_size == entry.size and self.same_file(entry, st):
                    self.touch(entry)
                    if self._batch_due():
                        try:
                            self.flush_access()
                        except CacheError as exc:  # kept for the next flush
                            log.debug("accesses not written yet: %s", exc)
                    return entry, stream
                stream.close()
            self.forget(entry.key)
            self.get(url, touch=False)  # drops the row of a missing or resized file
            self.forget(entry.key)
        return None

    def same_file(self, entry: Entry, st: os.stat_result) -> bool:
        """Whether the file of ``st``, opened for ``entry`` (from :meth:`lookup`), is the
        file that entry describes. False when another process replaced the entry since
        this process read its row (a new version at the same path, perhaps of the same
        size): the caller calls :meth:`forget` and looks it up again."""
        return self._mem.same_file(entry.key, st)

    def row_token(self, key: str) -> object | None:
        """An identity token of the row this process remembers for ``key`` (the entry
        :meth:`lookup` answers from memory), None when it remembers none: the same object
        exactly while that row is unchanged (not replaced, revalidated, updated, forgotten
        or evicted). What is derived from a looked-up entry can be kept with it and reused
        while ``row_token(key) is token``."""
        return self._mem.token(key)

    def same_file_key(self, key: str, st: os.stat_result) -> bool:
        """:meth:`same_file` for the entry of ``key``."""
        return self._mem.same_file(key, st)

    def forget(self, key: str) -> None:
        """Drop ``key`` from memory (its file was missing or replaced): the next lookup
        reads the index again."""
        self._mem.pop(key, None)

    def touch(self, entry: Entry, now: float | None = None) -> None:
        """Record a hit in memory; :meth:`flush_access` writes it to the index."""
        self.touch_key(entry.key, now)

    def touch_key(self, key: str, now: float | None = None) -> None:
        """:meth:`touch` for the entry of ``key``."""
        now = time.time() if now is None else now
        with self._touch_lock:
            batch = self._batch()
            if not batch:
                self._touch_since = time.monotonic()
            rec = batch.get(key)
            if rec is None:
                batch[key] = [now, 1, 0.0]
            else:
                rec[0] = now
                rec[1] += 1

    def mark_validated(self, entry: Entry, now: float | None = None) -> Entry:
        """Record that the upstream confirmed ``entry`` (a 304) at ``now``; returns the
        entry as this process now sees it. Written with the next access batch."""
        now = time.time() if now is None else now
        with self._touch_lock:
            batch = self._batch()
            if not batch:
                self._touch_since = time.monotonic()
            rec = batch.setdefault(entry.key, [entry.last_access, 0, 0.0])
            rec[2] = now
        fresh = dataclasses.replace(entry, validated=now)
        self._mem.refresh(fresh)
        return fresh

    def update_fields(self, entry: Entry, fields: Sequence[tuple[str, str]]) -> Entry:
        """Merge header fields the upstream sent with a 304 into the entry's stored ones
        (RFC 9111 4.3.4: a field of the 304 replaces the stored fields of its name);
        returns the entry as this process now sees it. The index is written only when
        more than the Date changed."""
        names = {k.lower() for k, _ in fields}
        merged = tuple((k, v) for k, v in entry.fields if k.lower() not in names) + tuple(fields)
        if merged == entry.fields:
            return entry

        def significant(fs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
            return sorted((k.lower(), v) for k, v in fs if k.lower() != "date")

        if significant(merged) != significant(entry.fields):
            with self._tx() as conn:
                conn.execute(
                    "UPDATE entries SET fields = ? WHERE key = ?", (fields_json(merged), entry.key)
                )
        fresh = dataclasses.replace(entry, fields=merged)
        self._mem.refresh(fresh)
        return fresh

    def pending_access(self) -> int:
        """How many entries have accesses not yet written to the index."""
        with self._touch_lock:
            return len(self._batch())

    def _batch(self) -> dict[str, list]:
        """This process's accesses not yet written (call under ``_touch_lock``). A batch
        inherited over ``fork`` is the parent's to write: a child starts its own."""
        if self._touch_pid != _PID[0]:
            self._touched, self._touch_pid = {}, _PID[0]
            self._touch_since = None
        return self._touched

    def _batch_due(self) -> bool:
        """Whether the oldest access not yet written is :data:`ACCESS_BATCH_SECONDS` old."""
        with self._touch_lock:
            since = self._touch_since if self._batch() else None
        return since is not None and time.monotonic() - since >= ACCESS_BATCH_SECONDS

    def _take_touches(self) -> dict[str, list]:
        with self._touch_lock:
            touched = self._batch()
            self._touched = {}
            self._touch_since = None
        return touched

    def _apply_touches(self, conn: sqlite3.Connection, touched: dict[str, list]) -> None:
        # one statement each for all the plain accesses and all the validations: a batch
        # of random hits over many entries is an update per entry, and a statement run
        # for each costs more than the hits it records
        conn.executemany(
            "UPDATE entries SET last_access = MAX(last_access, ?), hits = hits + ? WHERE key = ?",
            [(last_access, hits, key) for key, (last_access, hits, v) in touched.items() if not v],
        )
        validated = [(la, hits, v, key) for key, (la, hits, v) in touched.items() if v]
        if validated:
            conn.executemany(
                "UPDATE entries SET last_access = MAX(last_access, ?), hits = hits + ?, "
                "validated = ? WHERE key = ?",
                validated,
            )

    def flush_access(self) -> int:
        """Write the recorded accesses (last access, hit counts, validations) to the index
        in one transaction. Returns how many entries were updated. On failure the batch is
        kept for the next flush (merged with newer accesses)."""
        touched = self._take_touches()
        with self._touch_lock:
            unreleased, self._unreleased = self._unreleased, {}
        if not touched and not unreleased:
            return 0
        try:
            with self._tx() as conn:
                self._apply_touches(conn, touched)
                for name in unreleased:
                    conn.execute("DELETE FROM reservations WHERE name = ?", (name,))
        except BaseException:
            with self._touch_lock:
                self._unreleased.update(unreleased)
            with self._touch_lock:
                if touched and not self._batch():
                    self._touch_since = time.monotonic()  # tried again a batch later
                for key, (last, hits, validated) in touched.items():
                    rec = self._batch().setdefault(key, [last, 0, 0.0])
                    rec[0] = max(rec[0], last)
                    rec[1] += hits
                    rec[2] = max(rec[2], validated)
            raise
        return len(touched)

    def get(self, url: str, *, touch: bool = True) -> Entry | None:
        """The entry of ``url`` if complete and its file exists with the indexed size.

        A row whose file is missing or has the wrong size is dropped and None returned.
        ``touch=True`` records the access (last_access, hits) for LRU.
        """
        key = self.key(url)
        if not touch:
            with self._lock:
                row = (
                    self._connect()
                    .execute(f"SELECT {ENTRY_COLS} FROM entries WHERE key = ?", (key,))
                    .fetchone()
                )
            if row is None:
                return None
            entry = row_to_entry(self.cache_dir, row, self.layout)
            if size_of(entry.path) == entry.size:
                return entry
            # Re-check under the write lock before dropping anything.
        now = time.time()
        bad_file: Path | None = None
        with self._tx() as conn:
            row = conn.execute(f"SELECT {ENTRY_COLS} FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            entry = row_to_entry(self.cache_dir, row, self.layout)
            actual = size_of(entry.path)
            if actual != entry.size:
                log.warning(
                    "cache entry %s for %s is %s, dropping it",
                    entry.path,
                    url,
                    "missing" if actual is None else f"{actual} bytes, not {entry.size}",
                )
                conn.execute("DELETE FROM entries WHERE key = ?", (key,))
                if actual is not None:
                    bad_file = self._move_aside(entry.path)
                entry = None
            elif touch:
                conn.execute(
                    "UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ?", (now, key)
                )
                entry = dataclasses.replace(entry, last_access=now, hits=entry.hits + 1)
        if bad_file is not None:
            self._unlink(bad_file)
        return entry
