"""One DBCache file: its format (the tables, the metadata it records, the format
version), the connection of each process (reopened after a fork), and the checks made
before anything is written into a file that might be someone else's."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

import sqlite_utils

from shardcache.errors import ShardcacheError

__all__ = ["DBCacheError", "FORMAT_NAME", "FORMAT_VERSION"]


class DBCacheError(ShardcacheError):
    """A DBCache file cannot be used. The message names the file and the problem.

    Defined here, not in the library's error tree: dbcache builds on the library, and the
    library names it only among its lazily loaded public names (``shardcache.DBCacheError``).
    """


FORMAT_NAME = "shardcache.dbcache"
# 2: a sample is the columns (url, key, fields, data, payload), see dbcache._format
# 3: ``fields`` lives once in the layouts table; a sample row holds its integer id
FORMAT_VERSION = 3
RESERVED_META = frozenset({"format", "format_version", "codec", "size"})
SAMPLES = "samples"
LAYOUTS = "layouts"  # (id, fields): the distinct field tables, written once each
_ROW_COLUMNS = "url, key, layout, data, payload"  # the columns a codec reads
META = "meta"
TABLES = frozenset({SAMPLES, LAYOUTS, META})


class _DBFile:
    """The file under a :class:`~dbcache.DBCache`: connection, format and metadata. The
    attributes it reads (``dbname``, ``size``, ``codec``, ``busy_timeout``, ``_conn``,
    ``_pid``) are set by ``DBCache.__init__``."""

    # -- connection ---------------------------------------------------------------

    def _fail(self, problem: str) -> DBCacheError:
        return DBCacheError(f"{self.dbname}: {problem}")

    def _translate(self, exc: sqlite3.Error) -> DBCacheError:
        text = str(exc)
        if "file is not a database" in text:
            return self._fail("not an SQLite database")
        if "unable to open database file" in text:
            return self._fail("cannot open the file (missing directory or no permission)")
        return self._fail(f"SQLite error: {text}")

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection of this process (reopened after a fork)."""
        if self._conn is None or self._pid != os.getpid():
            if self.dbname is None:
                raise DBCacheError("DBCache(None, ...) has no database")
            # A connection inherited through fork must not be used (nor closed) here.
            self._conn = sqlite3.connect(
                self.dbname,
                timeout=self.busy_timeout,
                isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE ... COMMIT
                check_same_thread=False,
            )
            self._pid = os.getpid()
        return self._conn

    def close(self) -> None:
        """Close this process's connection (it reopens on next use)."""
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_conn"] = None
        state["_pid"] = -1
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, half-initialised object
            pass

    def _open(self) -> int:
        """Create or check the file; return the size it records."""
        if self.size is None and not os.path.exists(self.dbname):  # type: ignore[arg-type]
            raise self._fail("no such file (give a size to create one)")
        try:
            conn = self.conn
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            db = sqlite_utils.Database(conn)
            tables = set(db.table_names())  # fails on a file that is not SQLite
            if not TABLES <= tables and tables - TABLES:
                raise self._fail(
                    f"not a DBCache file (it has the tables {sorted(tables)}, no"
                    f" '{META}' with format {FORMAT_NAME!r}); refusing to write into it"
                )
            if META in tables:
                # check before changing anything in a file that might be someone else's
                self._check_meta(dict(conn.execute(f"SELECT key, value FROM {META}").fetchall()))
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                # Several processes may race here; the busy timeout covers the lock.
                conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints in WAL mode
            if not TABLES <= tables:
                self._initialise(db)
            meta = dict(conn.execute(f"SELECT key, value FROM {META}").fetchall())
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        return self._check_meta(meta)

    def _initialise(self, db: sqlite_utils.Database) -> None:
        if self.size is None:
            raise self._fail("no DBCache here yet; give a size to create one")
        conn = db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            db[SAMPLES].create(
                {
                    "id": int,
                    "url": str,
                    "key": str,
                    "layout": int,
                    "data": bytes,
                    "payload": bytes,
                },
                pk="id",
                not_null={"url", "key", "layout", "data"},
                if_not_exists=True,
            )
            db[LAYOUTS].create(
                {"id": int, "fields": bytes}, pk="id", not_null={"fields"}, if_not_exists=True
            )
            db[LAYOUTS].create_index(
                ["fields"], index_name="layouts_fields", unique=True, if_not_exists=True
            )
            db[SAMPLES].create_index(
                ["url", "key"], index_name="samples_ident", unique=True, if_not_exists=True
            )
            # key_exists(key) looks samples up by key alone (files without it scan)
            db[SAMPLES].create_index(["key"], index_name="samples_key", if_not_exists=True)
            db[META].create({"key": str, "value": str}, pk="key", if_not_exists=True)
            conn.executemany(
                f"INSERT OR IGNORE INTO {META} (key, value) VALUES (?, ?)",
                [
                    ("format", FORMAT_NAME),
                    ("format_version", str(FORMAT_VERSION)),
                    ("codec", self.codec.name),
                    ("size", str(self.size)),
                ],
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _check_meta(self, meta: dict[str, str]) -> int:
        if meta.get("format") != FORMAT_NAME:
            raise self._fail(f"not a DBCache file (format is {meta.get('format')!r})")
        version = meta.get("format_version")
        if version in ("1", "2"):
            raise self._fail(
                f"format version {version} was written by an older dbcache; this version"
                f" reads version {FORMAT_VERSION} (build the file again from its source)"
            )
        if version != str(FORMAT_VERSION):
            raise self._fail(
                f"unsupported format version {version!r} (this version of dbcache reads"
                f" version {FORMAT_VERSION})"
            )
        stored_codec = meta.get("codec")
        if stored_codec != self.codec.name:
            hint = ""
            if stored_codec == "pickle":
                hint = "; open it with codec='pickle' only if you trust whoever wrote it"
            raise self._fail(
                f"written with codec {stored_codec!r}, opened with codec {self.codec.name!r}{hint}"
            )
        try:
            stored_size = int(meta.get("size", ""))
        except ValueError:
            stored_size = 0
        if stored_size < 1:
            raise self._fail(f"bad size in metadata: {meta.get('size')!r}")
        if self.size is not None and self.size != stored_size:
            raise self._fail(
                f"holds a cache of size {stored_size}, opened with size {self.size}"
                " (use another file for another size)"
            )
        return stored_size

    # -- metadata ---------------------------------------------------------------------

    def getmeta(self, key: str, default: str | None = None) -> str | None:
        """The metadata string stored under ``key`` (``default`` if absent)."""
        self._need_db()
        row = self.conn.execute(f"SELECT value FROM {META} WHERE key = ?", (key,)).fetchone()
        return default if row is None else row[0]

    def setmeta(self, key: str, value: str) -> None:
        """Store the string ``value`` under ``key``.

        ``format``, ``format_version``, ``codec`` and ``size`` are fixed when the file is
        created; setting them raises ValueError.
        """
        self._need_db()
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"metadata keys and values are str, got {type(key).__qualname__}"
                f" and {type(value).__qualname__}"
            )
        if key in RESERVED_META:
            raise ValueError(f"metadata {key!r} is fixed when the file is created")
        self.conn.execute(f"INSERT OR REPLACE INTO {META} (key, value) VALUES (?, ?)", (key, value))

    def meta(self) -> dict[str, str]:
        """All metadata as a dict."""
        self._need_db()
        return dict(self.conn.execute(f"SELECT key, value FROM {META}").fetchall())

    def _need_db(self) -> None:
        if self.dbname is None:
            raise DBCacheError("DBCache(None, ...) passes its source through and has no database")
