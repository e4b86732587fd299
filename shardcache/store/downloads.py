"""Downloads: a reservation and a unique ``.part`` file (:meth:`Downloads.begin`),
more room as bytes arrive (:meth:`Downloads.grow`), and the end, either an entry
(:meth:`Downloads.commit`: verified size, fsync, an atomic rename inside the transaction
that records the row) or nothing (:meth:`Downloads.abort`).

Commit and eviction rename under the write lock, so a file and its row change together as
far as other processes can tell; evicted files become ``*.del`` and are unlinked after the
transaction commits. A write the disk refuses raises
:class:`~shardcache.errors.StoreWriteError`, naming the operation and errno.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from pathlib import Path

from shardcache.errors import CacheError, IncompleteDownloadError, NoRoomError
from shardcache.meta import ObjectMeta
from shardcache.store.diskerrors import store_write_error
from shardcache.store.entry import (
    ENTRY_INSERT,
    Entry,
    Partial,
    Stamp,
    digests_json,
    fields_json,
    file_stamp,
    row_to_entry,
)
from shardcache.store.index import Rollback
from shardcache.store.names import HOST, part_name, size_of
from shardcache.store.space import Space


class _Commit:
    """One download's commit as it waits for its group (:meth:`Downloads._group_commit`)."""

    __slots__ = ("partial", "row", "size", "ready", "lead", "error", "evicted", "stamp")

    def __init__(self, partial: Partial, row: tuple, size: int) -> None:
        self.partial = partial
        self.row = row
        self.size = size
        self.ready = threading.Event()  # done (either way), or this one leads the next group
        self.lead = False
        self.error: BaseException | None = None  # Rollback: no room
        self.evicted: list[tuple[Entry, Path | None]] = []
        self.stamp: Stamp | None = None


class Downloads(Space):
    """Downloads in progress and their end (a part of :class:`Store`)."""

    # commits waiting for their group, whether a thread leads one now, and whose they are
    _commits: list[_Commit]
    _committing: bool
    _commits_lock: threading.Lock
    _commits_pid: int

    def begin(
        self, url: str, expected_size: int | None, *, streamed: bool = True
    ) -> Partial | None:
        """Reserve room for a download of ``url`` and create its unique, empty ``.part`` file.

        ``streamed``: a client reads this download as it arrives (False: it is fetched
        ahead, for a reader still to come). With read plans, a streamed download of the
        shard a reader is about to read is worth caching only for its use after that.

        Evicts per policy so that entries plus all live reservations stay within
        ``cache_size``. Returns None when the shard cannot be admitted (bigger than
        ``cache_size``, or no room can be made, e.g. policy ``keep`` when full): the caller
        streams it through uncached. ``expected_size=None`` reserves 0 bytes; use
        :meth:`grow` as bytes arrive.
        """
        if expected_size is not None and expected_size < 0:
            raise ValueError(f"expected_size must be >= 0, got {expected_size}")
        key = self.key(url)
        need = expected_size or 0
        if need > self.cache_size:
            return None
        name = part_name(key)
        path = self._place(name)  # beside its entry: the commit's rename stays in one directory
        planned = self._planned()  # outside the transaction: it may take a while
        with self._tx() as conn:
            dead = self._drop_dead_reservations(conn)
            evicted = self._make_room(conn, need, incoming=key, streamed=streamed, planned=planned)
            if evicted is not None:
                conn.execute(
                    "INSERT INTO reservations (name, key, url, pid, host, created, expected, "
                    "bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        name,
                        key,
                        self.recorded_url(url),
                        os.getpid(),
                        HOST,
                        time.time(),
                        expected_size,
                        need,
                    ),
                )
        for p in dead:
            self._unlink(p)
        if evicted is None:
            return None
        self._finish_evictions(evicted)
        partial = Partial(url=url, key=key, path=path, expected_size=expected_size, reserved=need)
        try:
            try:
                with open(path, "xb"):
                    pass
            except FileNotFoundError:
                if path.parent == self.cache_dir:
                    raise
                path.parent.mkdir(exist_ok=True)  # a fan-out subdirectory removed by hand
                self._fsync_dir(self.cache_dir)
                with open(path, "xb"):
                    pass
        except OSError as exc:
            with contextlib.suppress(CacheError):
                self.abort(partial)
            raise store_write_error("create", path, exc) or CacheError(
                f"{path}: cannot create download file: {exc}"
            ) from exc
        return partial

    def grow(self, partial: Partial, size: int) -> bool:
        """Ensure ``size`` bytes are reserved for ``partial``, evicting as needed.

        False when the download can no longer fit: the caller should :meth:`abort` it and
        stream the rest through uncached.
        """
        if size <= partial.reserved:
            return True
        if size > self.cache_size:
            return False
        planned = self._planned()  # outside the transaction: it may take a while
        with self._tx() as conn:
            row = conn.execute(
                "SELECT bytes FROM reservations WHERE name = ?", (partial.path.name,)
            ).fetchone()
            if row is None:
                return False  # reservation was dropped (aborted or declared stale)
            dead = self._drop_dead_reservations(conn)
            evicted = self._make_room(
                conn,
                size - int(row[0]),
                exclude=(partial.key,),
                incoming=partial.key,
                planned=planned,
            )
            if evicted is not None:
                conn.execute(
                    "UPDATE reservations SET bytes = ? WHERE name = ?", (size, partial.path.name)
                )
        for p in dead:
            self._unlink(p)
        if evicted is None:
            return False
        partial.reserved = size
        self._finish_evictions(evicted)
        return True

    def commit(
        self,
        partial: Partial,
        size: int,
        *,
        etag: str | None = None,
        last_modified: str | None = None,
        content_type: str | None = None,
        meta: ObjectMeta | None = None,
    ) -> Entry:
        """Turn a finished download into an entry (its version from ``meta`` when given,
        else from ``etag``, ``last_modified`` and ``content_type``).

        Verifies that the ``.part`` file holds exactly ``size`` bytes and, when known,
        ``expected_size``; otherwise deletes it, releases the reservation and raises
        :class:`IncompleteDownloadError`. Then fsyncs, renames it into place atomically
        (a concurrent committer of the same URL simply replaces it), records the row and
        releases the reservation. Raises :class:`NoRoomError` (after discarding the
        download) if a download of unknown size turned out too big to keep.
        """
        fields: tuple[tuple[str, str], ...] = ()
        digests: tuple[tuple[str, str], ...] = ()
        if meta is not None:
            etag, last_modified, content_type = meta.etag, meta.last_modified, meta.content_type
            fields, digests = meta.fields, meta.digests
        expected = partial.expected_size if partial.expected_size is not None else size
        actual = size_of(partial.path)
        if actual is None or actual != size or size != expected:
            self.abort(partial)
            raise IncompleteDownloadError(partial.url, actual or 0, expected)
        try:
            fd = os.open(partial.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(CacheError):
                self.abort(partial)
            raise store_write_error("commit", partial.path, exc) or CacheError(
                f"{partial.path}: cannot flush download: {exc}"
            ) from exc
        target = self._place(partial.key)
        # A new version of a cached URL: the old entry goes first, in a transaction of its
        # own. Renaming the new file over the old one inside the transaction that updates
        # the row would leave, after a crash between the rename and the commit, the new
        # bytes under the old row (its ETag and digests); this way a crash leaves a miss.
        if self._mem.get(partial.key) is not None or target.exists():
            try:
                self._remove_key(partial.key)
            except CacheError:
                with contextlib.suppress(CacheError):
                    self.abort(partial)
                raise
        now = time.time()
        # the row as inserted, in ENTRY_COLS order: created, last access and validated now
        row = (partial.key, self.recorded_url(partial.url), size, etag, last_modified)
        row += (content_type, now, now, 0, now, fields_json(fields), digests_json(digests))
        done = self._group_commit(_Commit(partial, row, size))
        if done.error is not None:
            self._mem.pop(partial.key, None)
            with contextlib.suppress(CacheError):
                self.abort(partial)
            if isinstance(done.error, Rollback):
                raise NoRoomError(partial.url, size, self.cache_size) from None
            raise done.error
        partial.reserved = 0
        self._finish_evictions(done.evicted)
        entry = row_to_entry(self.cache_dir, row, self.layout)
        self._mem.put(entry, done.stamp)
        with self._touch_lock:
            self._touched.pop(partial.key, None)  # accesses of a replaced entry
        return entry

    def _group_commit(self, mine: _Commit) -> _Commit:
        """Rename ``mine`` into place and record its row, durably (the directory fsynced),
        together with the commits of other threads that are ready at the same time: one
        thread at a time leads, taking every commit queued so far into one transaction
        and one fsync of the directory, and wakes each committer only after both; commits
        queued meanwhile make the next group, led by the first of them. A commit alone
        costs what it did by itself; sixteen at once share one transaction and one
        directory fsync instead of taking turns."""
        if self._commits_pid != os.getpid():  # a forked child: none of its parent's
            self._commits_lock = threading.Lock()
            self._commits, self._committing = [], False
            self._commits_pid = os.getpid()
        with self._commits_lock:
            self._commits.append(mine)
            if not self._committing:
                self._committing = True
                mine.lead = True
        if not mine.lead:
            mine.ready.wait()  # its result, or the lead of the next group
            if not mine.lead:
                return mine
        with self._commits_lock:
            group, self._commits = self._commits, []
        try:
            self._commit_group(group)
        finally:
            with self._commits_lock:
                if self._commits:
                    nxt = self._commits[0]
                    nxt.lead = True
                    nxt.ready.set()
                else:
                    self._committing = False
        return mine

    def _commit_group(self, group: list[_Commit]) -> None:
        """One transaction for ``group``: each commit in a savepoint of its own (one that
        finds no room or cannot be renamed is rolled back alone, its error kept), then
        one fsync of the directory; then every committer of the group is woken."""
        try:
            with self._tx() as conn:
                for c in group:
                    conn.execute("SAVEPOINT one_commit")
                    try:
                        c.evicted = self._commit_row(conn, c)
                    except (Rollback, CacheError) as exc:
                        conn.execute("ROLLBACK TO one_commit")
                        c.error = exc
                    conn.execute("RELEASE one_commit")
            # each directory a rename went into, once (the fan-out layout: the entries'
            # own subdirectories)
            for directory in dict.fromkeys(
                self._place(c.partial.key).parent for c in group if c.error is None
            ):
                self._fsync_dir(directory)
        except CacheError as exc:  # the transaction as a whole: none of the group is in
            for c in group:
                if c.error is None:
                    c.error = exc
        except BaseException as exc:
            for c in group:
                if c.error is None:
                    c.error = CacheError(f"{c.partial.path}: commit interrupted: {exc!r}")
            raise
        finally:
            for c in group:
                c.ready.set()

    def _commit_row(self, conn: sqlite3.Connection, c: _Commit) -> list[tuple[Entry, Path | None]]:
        """Inside the transaction: release the reservation, make room, insert the row and
        rename the file into place (last: a failed rename rolls the row back with it)."""
        partial = c.partial
        target = self._place(partial.key)
        conn.execute("DELETE FROM reservations WHERE name = ?", (partial.path.name,))
        # Replacing an entry of the same URL frees its bytes first.
        conn.execute("DELETE FROM entries WHERE key = ?", (partial.key,))
        evicted = self._make_room(conn, c.size, exclude=(partial.key,))
        if evicted is None:
            raise Rollback
        conn.execute(ENTRY_INSERT, c.row)
        try:
            os.replace(partial.path, target)
        except OSError as exc:
            raise store_write_error("commit", target, exc) or CacheError(
                f"{target}: cannot move download into place: {exc}"
            ) from exc
        try:  # under the write lock: this row's file, before anyone replaces it
            c.stamp = file_stamp(os.stat(target))
        except OSError:
            c.stamp = None
        return evicted

    def _fsync_dir(self, directory: Path) -> None:
        """Make the renames into ``directory`` durable."""
        with contextlib.suppress(OSError):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self, partial: Partial) -> None:
        """Delete the ``.part`` file (missing is fine) and release its reservation.

        Idempotent.
        """
        self._unlink(partial.path)
        reserved, partial.reserved = partial.reserved, 0
        try:
            with self._tx() as conn:
                conn.execute("DELETE FROM reservations WHERE name = ?", (partial.path.name,))
        except CacheError:
            # the index cannot take the write now (disk full, read-only): never keep the
            # space reserved for good; the next access flush releases it
            with self._touch_lock:
                self._unreleased[partial.path.name] = reserved
            raise
