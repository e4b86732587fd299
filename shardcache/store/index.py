"""The index: one SQLite file beside the entries, its schema and format version, its
connections, and the one way to write it (a ``BEGIN IMMEDIATE`` transaction).

The index is plain :mod:`sqlite3` in WAL mode. Every change is one short ``BEGIN
IMMEDIATE`` transaction, which takes SQLite's write lock up front: the read-decide-write
steps of space accounting run serialised across every process sharing the directory, with
no deadlock-prone lock upgrade. Readers use a read-only connection per thread, which never
waits for a writer in WAL mode. SQLite's locking needs a local filesystem (WAL does not
work over NFS).

The index carries a format version (``PRAGMA user_version``): an older index is migrated
when opened, a newer one is refused with :class:`~shardcache.errors.StoreUnusable`. A
program on top of the store keeps tables of its own in the same file through
:meth:`Index.add_schema` and :meth:`Index.transaction`; they are not part of the format.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from shardcache.errors import CacheError, StoreUnusable
from shardcache.store.diskerrors import store_write_error
from shardcache.store.names import FANOUT, FLAT, INDEX_NAME, LAYOUTS, SettingNames

log = logging.getLogger("shardcache.store")

BUSY_TIMEOUT_MS = 60_000
# 1: no version recorded (0 in user_version); 3: entries.validated, claims, totals kept
# by triggers (2 was never released; the claims table is now the daemon's own, made by
# its add_schema, with the same columns)
FORMAT_VERSION = 4  # 4: header fields and digests kept with each entry
# the index of a store in the fan-out layout: format 4 with its files in subdirectories.
# Its own number, so that a shardcache that reads only format 4 (and knows one flat
# directory, where it would find no file of any row and drop them all) refuses it; a flat
# store stays format 4, which every release since reads
FANOUT_FORMAT = 5


class Rollback(Exception):
    """Raised inside a transaction to roll it back."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    size INTEGER NOT NULL,
    etag TEXT,
    last_modified TEXT,
    content_type TEXT,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    validated REAL,
    fields TEXT,                    -- JSON [[name, value], ...]: the upstream's header fields
    digests TEXT                    -- JSON {algorithm: hex}: computed as the bytes were written
);
CREATE TABLE IF NOT EXISTS reservations (
    name TEXT PRIMARY KEY,          -- the .part file name
    key TEXT NOT NULL,
    url TEXT NOT NULL,
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    created REAL NOT NULL,
    expected INTEGER,
    bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS store_meta (
    name TEXT PRIMARY KEY,          -- 'layout': flat or fanout, set when the index is made
    value TEXT NOT NULL
);
"""

# eviction order, one index per policy (the columns of eviction.eviction_order's sort):
# choosing victims reads the first rows of one of them, not every row. They replace the
# single-column indexes of earlier releases; an index without them gains them when opened
# (no format change: an older shardcache reads and writes the index as before).
_ORDER_INDEXES = (
    "CREATE INDEX IF NOT EXISTS entries_lru ON entries(last_access, created, key)",
    "CREATE INDEX IF NOT EXISTS entries_fifo ON entries(created, last_access, key)",
    "DROP INDEX IF EXISTS entries_last_access",
    "DROP INDEX IF EXISTS entries_created",
    # the processes that opened the store and have not closed it: a row of a dead one
    # means an unclean end, after which opening compares every name (reconcile)
    "CREATE TABLE IF NOT EXISTS sessions (pid INTEGER NOT NULL, host TEXT NOT NULL, "
    "started REAL NOT NULL)",
)
# a sessions row standing for the processes of an earlier release, which kept none: the
# first open after it compares every name
UNTRACKED = "INSERT INTO sessions (pid, host, started) VALUES (0, '', 0)"

# entry count and bytes kept by the database itself: no SUM over 100,000 rows per miss
_TOTALS = (
    "CREATE TABLE IF NOT EXISTS totals (id INTEGER PRIMARY KEY CHECK (id = 0), "
    "entries INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "INSERT OR REPLACE INTO totals (id, entries, bytes) "
    "SELECT 0, COUNT(*), COALESCE(SUM(size), 0) FROM entries",
    "CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN "
    "UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.size WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN "
    "UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.size WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS entries_resized AFTER UPDATE OF size ON entries BEGIN "
    "UPDATE totals SET bytes = bytes - OLD.size + NEW.size WHERE id = 0; END",
)


def uid() -> str:
    """This process's uid, for messages about permissions."""
    getuid = getattr(os, "getuid", None)
    return str(getuid()) if getuid is not None else "?"


class Index:
    """The index connections and transactions (a part of :class:`Store`)."""

    cache_dir: Path
    names: SettingNames
    layout: str  # FLAT or FANOUT: as recorded in the index (FLAT until it is read)
    _asked_layout: str | None  # the layout a new index records (None: FLAT)
    _lock: threading.RLock
    _conn: sqlite3.Connection | None
    _pid: int
    _readers: threading.local
    _schemas: list[str]  # statements of a program's own tables (add_schema)
    _schema_done: int  # how many of them a transaction of this process has run

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        # After a fork the inherited connection must not be used (nor closed) here.
        try:
            conn = sqlite3.connect(
                self.cache_dir / INDEX_NAME,
                isolation_level=None,
                timeout=BUSY_TIMEOUT_MS / 1000,
                check_same_thread=False,
            )
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > FANOUT_FORMAT:
                conn.close()
                raise StoreUnusable(
                    f"{self.cache_dir / INDEX_NAME}: the index is format {version}, from a "
                    f"newer shardcache (this one reads formats {FORMAT_VERSION} and "
                    f"{FANOUT_FORMAT}); upgrade shardcache, or use another "
                    f"{self.names.cache_dir} (running as uid {uid()})"
                )
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            if version < FORMAT_VERSION:
                self._migrate(conn, version)
            elif (
                conn.execute(
                    "SELECT COUNT(*) FROM sqlite_master WHERE (type = 'index' AND name = "
                    "'entries_fifo') OR (type = 'table' AND name = 'sessions')"
                ).fetchone()[0]
                < 2
            ):
                self._add_order_indexes(conn)
        except sqlite3.Error as exc:
            raise self._unusable(exc) from exc
        self._conn = conn
        self._pid = os.getpid()
        return conn

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        """Create the tables, or bring an index of an older format up to this one."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("PRAGMA user_version").fetchone()[0] >= FORMAT_VERSION:
                # made or migrated by another process since the version was read: a
                # fan-out index must not be taken for an older one (and made format 4)
                conn.execute("COMMIT")
                return
            existed = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'entries'"
            ).fetchone()
            cols = {r[1] for r in conn.execute("PRAGMA table_info(entries)").fetchall()}
            if existed and "validated" not in cols:
                conn.execute("ALTER TABLE entries ADD COLUMN validated REAL")
            for col in ("fields", "digests"):
                if existed and col not in cols:
                    conn.execute(f"ALTER TABLE entries ADD COLUMN {col} TEXT")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            for statement in _ORDER_INDEXES:
                conn.execute(statement)
            if existed:
                conn.execute(UNTRACKED)
            for statement in _TOTALS:
                conn.execute(statement)
            layout = FLAT  # an index made by an earlier release: one flat directory
            if not existed:  # a new store: the layout asked for, recorded with the index
                layout = getattr(self, "_asked_layout", None) or FLAT
                conn.execute(
                    "INSERT OR REPLACE INTO store_meta (name, value) VALUES ('layout', ?)",
                    (layout,),
                )
            conn.execute(
                f"PRAGMA user_version = {FANOUT_FORMAT if layout == FANOUT else FORMAT_VERSION}"
            )
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        if existed:
            log.info(
                "%s: index migrated from format %d to %d",
                self.cache_dir,
                max(version, 1),
                FORMAT_VERSION,
            )

    def _recorded_layout(self) -> str:
        """The layout the index records (an index without a record, made before
        layouts were, is flat); the index is made first if there is none, recording the
        layout asked for. :class:`StoreUnusable` for a layout this shardcache does not
        know."""
        with self._lock:
            conn = self._connect()
            try:
                has_meta = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'store_meta'"
                ).fetchone()
                row = (
                    conn.execute("SELECT value FROM store_meta WHERE name = 'layout'").fetchone()
                    if has_meta
                    else None
                )
            except sqlite3.Error as exc:
                raise self._unusable(exc) from exc
        layout = FLAT if row is None else str(row[0])
        if layout not in LAYOUTS:
            raise StoreUnusable(
                f"{self.cache_dir / INDEX_NAME}: the index records the layout {layout!r}, "
                f"which this shardcache does not know ({', '.join(LAYOUTS)}); upgrade "
                f"shardcache, or use another {self.names.cache_dir}"
            )
        return layout

    def _add_order_indexes(self, conn: sqlite3.Connection) -> None:
        """Give an index of this format made by an earlier release the eviction-order
        indexes and the sessions table (once; a minute or so for ten million rows)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _ORDER_INDEXES:
                conn.execute(statement)
            conn.execute(UNTRACKED)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        log.info("%s: eviction-order indexes and sessions added to the index", self.cache_dir)

    def _unusable(self, exc: BaseException) -> StoreUnusable:
        index = self.cache_dir / INDEX_NAME
        owners = []
        for p in (index, Path(f"{index}-wal"), Path(f"{index}-shm"), self.cache_dir):
            with contextlib.suppress(OSError):
                st = p.stat()
                if not os.access(p, os.W_OK):
                    owners.append(f"{p} (owner uid {st.st_uid}, not writable)")
        where = "; ".join(owners) if owners else str(index)
        return StoreUnusable(
            f"{where}: cannot open the index for writing ({exc}); running as uid {uid()}: "
            f"make the cache directory and its .shardcache.sqlite* files writable by this "
            f"uid (e.g. chown -R {uid()} {self.cache_dir}), or choose another "
            f"{self.names.cache_dir}"
        )

    def check_writable(self) -> None:
        """Prove the directory and the index take writes; raise :class:`StoreUnusable`
        naming the path, the uid and what to do otherwise. For startup, before listening."""
        probe = self.cache_dir / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"shardcache")
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(probe)
        except OSError as exc:
            raise StoreUnusable(
                f"{self.cache_dir}: cache directory is not writable ({exc.strerror or exc}); "
                f"running as uid {uid()}: make it writable by this uid (e.g. chown -R "
                f"{uid()} {self.cache_dir}), mount it read-write, or choose another "
                f"{self.names.cache_dir}"
            ) from exc
        for p in (
            self.cache_dir / INDEX_NAME,
            Path(f"{self.cache_dir / INDEX_NAME}-wal"),
            Path(f"{self.cache_dir / INDEX_NAME}-shm"),
        ):
            if p.exists() and not os.access(p, os.W_OK):
                raise self._unusable(PermissionError(f"{p} is not writable"))
        try:
            with self.transaction() as conn:  # also creates a program's own tables
                version = FANOUT_FORMAT if self.layout == FANOUT else FORMAT_VERSION
                conn.execute(f"PRAGMA user_version = {version}")
        except CacheError as exc:
            raise self._unusable(exc) from exc

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): serialised across processes."""
        with self._lock:
            conn = self._connect()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._index_error(exc, "cannot lock index") from exc
            try:
                yield conn
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise self._index_error(exc, "index write failed") from exc
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise
            else:
                try:
                    conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise self._index_error(exc, "index commit failed") from exc

    def _index_error(self, exc: sqlite3.Error, what: str) -> CacheError:
        """A refused write (disk full, read-only) as StoreWriteError, else CacheError."""
        index = self.cache_dir / INDEX_NAME
        return store_write_error("index", index, exc) or CacheError(f"{index}: {what}: {exc}")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction on the index, for a program's own tables
        (:meth:`add_schema`): ``BEGIN IMMEDIATE``, so it is serialised with every process
        sharing the directory; committed when the block ends, rolled back when it raises.
        A refused write raises :class:`~shardcache.errors.StoreWriteError` (disk full,
        read-only), another index failure :class:`~shardcache.errors.CacheError`. Keep it
        short: every writer of the directory waits for it."""
        with self._tx() as conn:
            due = len(self._schemas)
            if due > self._schema_done:
                for statement in self._schemas:
                    conn.execute(statement)
            yield conn
        self._schema_done = max(self._schema_done, due)

    @contextlib.contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """This process's index connection, for reads outside a transaction (each
        statement sees the last commit), under the store's lock."""
        with self._lock:
            yield self._connect()

    def add_schema(self, statements: str) -> None:
        """Keep a program's own tables in the index: ``statements`` are ``CREATE TABLE IF
        NOT EXISTS`` (and ``CREATE INDEX IF NOT EXISTS``) statements separated by ``;``,
        run at the start of this process's next :meth:`transaction` (or
        :meth:`check_writable`, the startup check), so an index made without them gains
        them. They are not part of the entry format: the store neither reads nor migrates
        them, nor counts them in :data:`FORMAT_VERSION`.
        """
        with self._lock:
            for statement in statements.split(";"):
                if statement.strip() and statement not in self._schemas:
                    self._schemas.append(statement)

    def _close_index(self) -> None:
        """Close this process's index connections (they are reopened if used again)."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
        reader = getattr(self._readers, "conn", None)
        if reader is not None and getattr(self._readers, "pid", None) == os.getpid():
            reader.close()
        self._readers.conn = None

    def _reader(self) -> sqlite3.Connection:
        """A read-only connection of this thread: readers never wait for a writer in WAL."""
        conn = getattr(self._readers, "conn", None)
        if conn is not None and getattr(self._readers, "pid", None) == os.getpid():
            return conn
        self._connect()  # creates or migrates the index first
        try:
            conn = self._open_read_only()
        except sqlite3.Error as exc:
            raise self._unusable(exc) from exc
        self._readers.conn, self._readers.pid = conn, os.getpid()
        return conn

    def _open_read_only(self) -> sqlite3.Connection:
        """A new read-only connection to the index, usable from any thread; sqlite3.Error
        when it cannot be opened."""
        return sqlite3.connect(
            f"file:{self.cache_dir / INDEX_NAME}?mode=ro",
            uri=True,
            isolation_level=None,
            timeout=BUSY_TIMEOUT_MS / 1000,
            check_same_thread=False,
        )
