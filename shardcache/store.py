"""The on-disk shard store shared by ``cache_shards`` and the proxy.

Layout of ``cache_dir``::

    <shard_uuid(url)>                     a complete entry (bytes exactly as the upstream sent)
    <key>.<pid>.<random>.part             a download in progress (never served as an entry)
    <key>.<random>.del                    an evicted entry waiting to be unlinked
    .shardcache.sqlite (+ -wal, -shm)     the index

The index is plain :mod:`sqlite3` in WAL mode. Every change is one short
``BEGIN IMMEDIATE`` transaction, which takes SQLite's write lock up front: the
read-decide-write steps of space accounting (sum entries and reservations, pick victims,
insert a reservation) run serialised across every process sharing the directory, with no
deadlock-prone lock upgrade. Renames of entry files (commit's ``os.replace``, eviction's
rename to ``*.del``) happen inside those transactions, so a file and its row change
together as far as other processes can tell; the slow part, unlinking evicted files, runs
after the transaction commits.

Which entries to evict is decided by :func:`choose_victims`, a pure function over rows.

The store is synchronous. Async callers run each call in a thread
(``asyncio.to_thread``); each call is one transaction plus a stat or a rename.
SQLite's locking needs a local filesystem (WAL does not work over NFS).

Hits write nothing: :meth:`Store.lookup` answers from an in-memory map of the entries this
process has seen (falling back to a read-only query of the index, which never waits for a
writer in WAL mode), and :meth:`Store.touch` records the access in memory. The recorded
accesses reach the index in one transaction per :meth:`Store.flush_access` (the proxy calls
it every second and on close), and before any eviction decision, so LRU order and hit
counts survive a clean restart and a crash loses at most one batch. An entry another
process evicted is found missing when its file is opened, and becomes a miss.

Free space: besides ``cache_size``, the store keeps ``min_free`` bytes of its filesystem
free. Admission counts every reservation as not yet written, so the disk does not fill in
normal operation even when other files on it grow. A write that fails all the same (ENOSPC,
EDQUOT, EIO, EROFS) raises :class:`StoreWriteError`, naming the operation and errno.

The index carries a format version (``PRAGMA user_version``): an older index is migrated
when opened, a newer one is refused with :class:`StoreUnusable`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import secrets
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from shardcache.errors import (
    CacheError,
    IncompleteDownloadError,
    NoRoomError,
    StoreUnusable,
    StoreWriteError,
)
from shardcache.eviction import POLICIES, choose_victims, choose_victims_planned, eviction_order
from shardcache.meta import ObjectMeta
from shardcache.sizes import format_size
from shardcache.urls import shard_uuid

__all__ = [
    "EvictionPolicy",
    "Entry",
    "Partial",
    "CheckReport",
    "Store",
    "NoRoomError",
    "choose_victims",
    "eviction_order",
    "INDEX_NAME",
    "FORMAT_VERSION",
    "STORE_ERRNOS",
    "store_write_error",
    "disk_full",
]

log = logging.getLogger(__name__)

EvictionPolicy = Literal["lru", "fifo", "keep"]
DEFAULT_POLICY: EvictionPolicy = "lru"  # the proxy's --eviction default too
# the library's bound when none is given: none in practice (webdataset's cache_size default)
DEFAULT_CACHE_SIZE: int = 10**15

INDEX_NAME = ".shardcache.sqlite"
PART_SUFFIX = ".part"
DEL_SUFFIX = ".del"
STALE_AGE = 24 * 3600.0  # a .part or reservation older than this is stale whatever its pid
BUSY_TIMEOUT_MS = 60_000
# 1: no version recorded (0 in user_version); 3: entries.validated, claims, totals kept
# by triggers (2 was never released)
FORMAT_VERSION = 4  # 4: header fields and digests kept with each entry
DEFAULT_MIN_FREE_FRACTION = 0.05
DEFAULT_MIN_FREE_CAP = 1 << 30  # the default keeps 5% of the filesystem free, at most 1 GiB
# errnos that mean "the disk or index cannot take this write", not a bug or a network error
STORE_ERRNOS = frozenset(
    e
    for e in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", None),
        errno.EIO,
        errno.EROFS,
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
    )
    if e is not None
)
FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e)
_SQLITE_ERRNO = {
    "SQLITE_FULL": errno.ENOSPC,
    "SQLITE_READONLY": errno.EROFS,
    "SQLITE_READONLY_DBMOVED": errno.EROFS,
    "SQLITE_READONLY_RECOVERY": errno.EROFS,
    "SQLITE_READONLY_CANTLOCK": errno.EROFS,
    "SQLITE_READONLY_ROLLBACK": errno.EROFS,
    "SQLITE_IOERR": errno.EIO,
    "SQLITE_CANTOPEN": errno.EACCES,
    "SQLITE_PERM": errno.EPERM,
}


def store_write_error(op: str, path: object, exc: BaseException) -> StoreWriteError | None:
    """The :class:`StoreWriteError` for ``exc`` if it is a write refusal (disk full, quota,
    I/O error, read-only, permission), else None. Knows OSError and sqlite3.Error."""
    if isinstance(exc, StoreWriteError):
        return exc
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""
        code = _SQLITE_ERRNO.get(name)
        if code is None:
            code = next((v for k, v in _SQLITE_ERRNO.items() if name.startswith(k)), None)
        if code is None:
            text = str(exc).lower()
            if "disk is full" in text or "database or disk is full" in text:
                code = errno.ENOSPC
            elif "readonly" in text or "read-only" in text:
                code = errno.EROFS
            elif "disk i/o error" in text:
                code = errno.EIO
        if code is None:
            return None
        return StoreWriteError(op, str(path), code, f"{exc} ({errno.errorcode[code]})")
    if isinstance(exc, OSError) and not isinstance(exc, CacheError):
        if exc.errno in STORE_ERRNOS:
            return StoreWriteError(op, str(path), exc.errno, exc.strerror or str(exc))
    return None


class _Rollback(Exception):
    """Raised inside a transaction to roll it back."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A complete cache entry; its bytes are in ``path``."""

    key: str
    url: str
    path: Path
    size: int
    etag: str | None
    last_modified: str | None
    content_type: str | None
    created: float
    last_access: float
    hits: int
    validated: float = 0.0  # when the upstream last confirmed these bytes (created, or a 304)
    fields: tuple[tuple[str, str], ...] = ()  # the upstream's end-to-end header fields
    digests: tuple[tuple[str, str], ...] = ()  # (algorithm, hex) computed as it was written

    @property
    def meta(self) -> ObjectMeta:
        """The cached version, in the shape the upstream layer speaks."""
        cache_control = next((v for k, v in self.fields if k.lower() == "cache-control"), None)
        return ObjectMeta(
            size=self.size,
            etag=self.etag,
            last_modified=self.last_modified,
            content_type=self.content_type,
            cache_control=cache_control,
            fields=self.fields,
            digests=self.digests,
        )


@dataclass
class Partial:
    """A download in progress: a unique ``<key>.<pid>.<random>.part`` file in cache_dir.

    The caller opens ``path`` for writing (``'wb'``); readers may open it for reading to
    follow the growing file. Finish with :meth:`Store.commit` or :meth:`Store.abort`.
    """

    url: str
    key: str
    path: Path
    expected_size: int | None
    reserved: int


@dataclass
class CheckReport:
    """What :meth:`Store.check` found (``problems``) and repaired (``fixed``)."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    entries: int = 0
    bytes: int = 0
    orphans: int = 0
    missing: int = 0
    size_mismatch: int = 0
    stale_partials: int = 0
    verified: int = 0  # entries whose bytes were read and matched their digests (--verify)
    digest_mismatch: int = 0  # entries whose bytes no longer have their recorded digests


# --------------------------------------------------------------------------------------
# Pure policy


# eviction_order and choose_victims (LRU/FIFO) and the plan-aware choose_victims_planned
# live in shardcache.eviction, pure and tested without I/O.


# --------------------------------------------------------------------------------------
# Helpers


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _is_uuid(name: str) -> bool:
    """Whether ``name`` is a canonical (lower-case, hyphenated) UUID, as shard_uuid makes."""
    return len(name) == 36 and _UUID_RE.fullmatch(name) is not None


def disk_full(exc: BaseException) -> StoreWriteError | None:
    """The ENOSPC/EDQUOT error behind ``exc`` (following its causes), else None: a full
    disk is a state to wait out, not a misconfiguration."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return StoreWriteError(
                "write",
                getattr(seen, "filename", None) or "cache",
                seen.errno,
                seen.strerror or str(seen),
            )
        seen = seen.__cause__ or seen.__context__
    return None


class _Memo:
    """What hits need of the entries this process has seen, compactly: key -> a tuple of
    the row, at most ``limit`` keys (the least recently stored dropped first). An
    :class:`Entry` is made from it on each lookup."""

    def __init__(self, cache_dir: Path, limit: int) -> None:
        self.cache_dir = cache_dir
        self.limit = limit
        self._rows: dict[str, tuple] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> Entry | None:
        row = self._rows.get(key)
        if row is None:
            return None
        url, size, etag, lm, ctype, created, last_access, hits, validated, fields, dg = row
        return Entry(
            key,
            url,
            self.cache_dir / key,
            size,
            etag,
            lm,
            ctype,
            created,
            last_access,
            hits,
            validated,
            fields,
            dg,
        )

    def put(self, entry: Entry) -> None:
        if self.limit <= 0:
            return
        rows = self._rows
        rows.pop(entry.key, None)
        rows[entry.key] = (
            entry.url,
            entry.size,
            entry.etag,
            None if entry.last_modified is None else sys.intern(entry.last_modified),
            None if entry.content_type is None else sys.intern(entry.content_type),
            entry.created,
            entry.last_access,
            entry.hits,
            entry.validated,
            entry.fields,
            entry.digests,
        )
        while len(rows) > self.limit:
            del rows[next(iter(rows))]

    def pop(self, key: str, default: object = None) -> None:
        self._rows.pop(key, None)

    def clear(self) -> None:
        self._rows.clear()


class _Indexed(NamedTuple):
    url: str
    size: int


class _PathStr:
    """A directory entry's path, made into a Path only when a file is moved or removed."""

    __slots__ = ("base", "name")

    def __init__(self, base: str, name: str) -> None:
        self.base, self.name = base, name

    def __str__(self) -> str:
        return os.path.join(self.base, self.name)

    def __fspath__(self) -> str:
        return str(self)

    @property
    def path(self) -> Path:
        return Path(self.base, self.name)


def _size_of(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _parse_part(name: str) -> tuple[str, int] | None:
    """``<key>.<pid>.<random>.part`` -> (key, pid), or None if not one of ours."""
    if not name.endswith(PART_SUFFIX):
        return None
    parts = name[: -len(PART_SUFFIX)].split(".")
    if len(parts) != 3 or not _is_uuid(parts[0]) or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def _is_del(name: str) -> bool:
    if not name.endswith(DEL_SUFFIX):
        return False
    parts = name[: -len(DEL_SUFFIX)].split(".")
    return len(parts) == 2 and _is_uuid(parts[0])


_HOST = socket.gethostname()

_PLANS_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    id TEXT PRIMARY KEY,            -- read plans of a proxy with several processes
    doc TEXT NOT NULL,              -- JSON: name, urls, lookahead
    created REAL NOT NULL,
    seen REAL NOT NULL,             -- the reader's last request (wall clock)
    position INTEGER NOT NULL DEFAULT 0,
    wait REAL NOT NULL DEFAULT 0,
    hits INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0,
    behind INTEGER NOT NULL DEFAULT 0
)
"""

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
CREATE INDEX IF NOT EXISTS entries_last_access ON entries(last_access);
CREATE INDEX IF NOT EXISTS entries_created ON entries(created);
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
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY,           -- one download per entry across processes
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    port INTEGER,                   -- where the owner answers followers (127.0.0.1)
    created REAL NOT NULL
);
"""

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

_ENTRY_COLS = (
    "key, url, size, etag, last_modified, content_type, created, last_access, hits, validated, "
    "fields, digests"
)
_ENTRY_INSERT = f"INSERT INTO entries ({_ENTRY_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


def _fields_json(fields: Sequence[tuple[str, str]]) -> str | None:
    return json.dumps([list(f) for f in fields], separators=(",", ":")) if fields else None


def _digests_json(digests: Sequence[tuple[str, str]]) -> str | None:
    return json.dumps(dict(digests), separators=(",", ":"), sort_keys=True) if digests else None


def _fields_from(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    try:
        return tuple((str(k), str(v)) for k, v in json.loads(text))
    except (ValueError, TypeError):
        return ()


def _digests_from(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    try:
        return tuple(sorted((str(k), str(v)) for k, v in json.loads(text).items()))
    except (ValueError, TypeError, AttributeError):
        return ()


def _uid() -> str:
    getuid = getattr(os, "getuid", None)
    return str(getuid()) if getuid is not None else "?"


def resolve_min_free(spec: int | float | None, total: int) -> int:
    """Bytes to keep free on a filesystem of ``total`` bytes: ``spec`` bytes (int), a
    fraction of the filesystem (float below 1), or None for the default (5%, at most 1 GiB)."""
    if spec is None:
        return min(int(total * DEFAULT_MIN_FREE_FRACTION), DEFAULT_MIN_FREE_CAP)
    if isinstance(spec, float) and not spec.is_integer() or isinstance(spec, float) and spec < 1:
        if not 0 <= spec < 1:
            raise ValueError(f"min_free fraction must be in [0, 1), got {spec}")
        return int(total * spec)
    if spec < 0:
        raise ValueError(f"min_free must be >= 0, got {spec}")
    return int(spec)


# --------------------------------------------------------------------------------------
# The store


class Store:
    """An on-disk shard store: entry files named by ``shard_uuid(url)`` plus an SQLite index.

    Process-safe (several processes may share ``cache_dir``) and thread-safe (one
    connection per process, guarded by a lock, reopened after ``fork``).

    ``cache_size`` bounds entry bytes plus the bytes reserved by downloads in progress in
    every process. ``policy`` is ``"lru"`` (default), ``"fifo"`` or ``"keep"`` (never evict;
    stop admitting when full). ``on_evict`` is called with each evicted :class:`Entry`
    after its row is gone.

    Opening reconciles the index with the directory and repairs it (stale downloads,
    orphans, missing files, the size bound); ``reconcile=False`` skips that, e.g. to
    report with ``check()`` before repairing anything.

    ``min_free`` is kept free on the cache's filesystem: bytes (int), a fraction of the
    filesystem (float below 1) or None for the default, 5% of the filesystem and at most
    1 GiB. When ``cache_size`` exceeds what the filesystem can hold (the cache's bytes plus
    the free space, less ``min_free``), the smaller bound is used and
    :attr:`size_warning` says so with both numbers.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        cache_size: int = DEFAULT_CACHE_SIZE,
        policy: EvictionPolicy = DEFAULT_POLICY,
        on_evict: Callable[[Entry], None] | None = None,
        *,
        reconcile: bool = True,
        min_free: int | float | None = None,
        memo_entries: int = 100_000,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")
        cache_size = int(cache_size)
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.cache_dir = Path(cache_dir)
        self.requested_size = cache_size
        self.cache_size = cache_size
        self.policy: str = policy
        self.on_evict = on_evict
        # read plans (set by the proxy): () -> (key -> next planned use, keys never to
        # evict); with plans registered, eviction follows them (Belady), see _make_room
        self.planner: (
            Callable[[], tuple[Mapping[str, float], Collection[str], Mapping[str, float]]] | None
        ) = None
        # the URL an entry is keyed and recorded by, from the URL fetched (the proxy drops
        # signatures here, so a URL signed afresh is the same entry); None: as it is
        self.key_url: Callable[[str], str] | None = None
        self.min_free_spec = min_free
        self.min_free = 0
        self.size_warning: str | None = None
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._readers = threading.local()
        # what a hit needs, in memory: key -> Entry (this process's view of the index)
        self._mem = _Memo(self.cache_dir, memo_entries)
        # accesses not yet in the index: key -> [last_access, hits to add, validated or 0]
        self._touched: dict[str, list] = {}
        self._touch_lock = threading.Lock()
        # reservations whose release failed (index not writable): .part name -> bytes,
        # released by the next flush and not counted as reserved meanwhile
        self._unreleased: dict[str, int] = {}
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnusable(
                f"{self.cache_dir}: cannot create the cache directory ({exc.strerror or exc}); "
                f"running as uid {_uid()}: create it and make it writable by this uid, or "
                "choose another --cache-dir"
            ) from exc
        total, _ = self._disk()
        self.min_free = resolve_min_free(min_free, total)
        if reconcile:
            # names only: with 100,000 entries a stat of each would cost seconds; sizes
            # are checked on every hit (fstat) and by check()
            try:
                self._reconcile(fix=True, verify_sizes=False)
            except StoreWriteError as exc:
                raise self._unusable(exc) from exc
            self._fit_to_disk()

    # -- free space --------------------------------------------------------------------

    def _disk(self) -> tuple[int, int]:
        """(filesystem size, bytes available to this process) of the cache directory."""
        try:
            st = os.statvfs(self.cache_dir)
        except (OSError, AttributeError):
            return 0, 1 << 62
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def _fit_to_disk(self) -> None:
        """Lower ``cache_size`` to what the filesystem can hold (entries + free - min_free)."""
        total, free = self._disk()
        if total <= 0:
            return
        with self._lock:
            entries_bytes = (
                self._connect().execute("SELECT bytes FROM totals WHERE id = 0").fetchone()
            )[0]
        room = max(0, int(entries_bytes) + free - self.min_free)
        if self.requested_size > room:
            self.cache_size = room
            self.size_warning = (
                f"cache size {format_size(self.requested_size)} exceeds what the filesystem "
                f"of {self.cache_dir} can hold ({format_size(room)}: "
                f"{format_size(entries_bytes)} cached + {format_size(free)} free - "
                f"{format_size(self.min_free)} kept free by --min-free); using "
                f"{format_size(room)}"
            )
            log.debug("%s", self.size_warning)

    def disk_limit(self, entries_bytes: int) -> int:
        """The bound in force now: ``cache_size``, lowered to keep ``min_free`` free."""
        _, free = self._disk()
        return max(0, min(self.cache_size, entries_bytes + free - self.min_free))

    def describe_bound(self, entries_bytes: int | None = None) -> str:
        """The bound in force now and why, for messages: ``"the cache size, 40.0 MiB"``,
        or the cache size lowered to keep ``min_free`` free (at startup or now)."""
        if entries_bytes is None:
            entries_bytes = self.used()[0]
        limit = self.disk_limit(entries_bytes)
        if limit >= self.requested_size:
            return f"the cache size, {format_size(self.requested_size)}"
        return (
            f"{format_size(limit)}: the cache size {format_size(self.requested_size)} lowered "
            f"to keep {format_size(self.min_free)} free on the filesystem (--min-free)"
        )

    def used(self) -> tuple[int, int]:
        """(bytes of the entries, bytes reserved by downloads in progress), from the index."""
        with self._lock:
            return self._used(self._connect())

    def why_no_room(self, need: int | None) -> str:
        """Why a download of ``need`` bytes (None: unknown) is not admitted: too large for
        the bound in force, or the bound is full of entries and reservations that the
        policy will not evict. Names the bound, why it is what it is, and what fills it."""
        entries_bytes, reserved = self.used()
        bound = self.describe_bound(entries_bytes)
        size = "" if need is None else f"size {format_size(need)}"
        if need is not None and need > self.disk_limit(entries_bytes):
            return f"{size} exceeds the bound in force, {bound}"
        full = (
            f"{format_size(entries_bytes)} cached + {format_size(reserved)} reserved by "
            f"downloads in progress, bound {bound}"
        )
        if self.policy == "keep":
            why = "the cache is full and --eviction keep evicts nothing"
        elif self.planner is not None:
            why = "caching it would evict entries read sooner (read plans)"
        else:
            why = "downloads in progress hold the rest of the bound"
        return f"no room{' for ' + size if size else ''}: {why} ({full})"

    # -- connection ------------------------------------------------------------------

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
            if version > FORMAT_VERSION:
                conn.close()
                raise StoreUnusable(
                    f"{self.cache_dir / INDEX_NAME}: the index is format {version}, from a "
                    f"newer shardcache (this one reads format {FORMAT_VERSION}); upgrade "
                    f"shardcache, or use another --cache-dir (running as uid {_uid()})"
                )
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            if version < FORMAT_VERSION:
                self._migrate(conn, version)
        except sqlite3.Error as exc:
            raise self._unusable(exc) from exc
        self._conn = conn
        self._pid = os.getpid()
        return conn

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        """Create the tables, or bring an index of an older format up to this one."""
        conn.execute("BEGIN IMMEDIATE")
        try:
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
            for statement in _TOTALS:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
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
            f"{where}: cannot open the index for writing ({exc}); running as uid {_uid()}: "
            f"make the cache directory and its .shardcache.sqlite* files writable by this "
            f"uid (e.g. chown -R {_uid()} {self.cache_dir}), or choose another --cache-dir"
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
                f"running as uid {_uid()}: make it writable by this uid (e.g. chown -R "
                f"{_uid()} {self.cache_dir}), mount it read-write, or choose another "
                "--cache-dir"
            ) from exc
        for p in (
            self.cache_dir / INDEX_NAME,
            Path(f"{self.cache_dir / INDEX_NAME}-wal"),
            Path(f"{self.cache_dir / INDEX_NAME}-shm"),
        ):
            if p.exists() and not os.access(p, os.W_OK):
                raise self._unusable(PermissionError(f"{p} is not writable"))
        try:
            with self._tx() as conn:
                conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
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

    def close(self) -> None:
        """Record pending accesses, then close the index connection (the store reopens it
        if used again)."""
        with contextlib.suppress(CacheError):
            self.flush_access()
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
        reader = getattr(self._readers, "conn", None)
        if reader is not None and getattr(self._readers, "pid", None) == os.getpid():
            reader.close()
        self._readers.conn = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Store({str(self.cache_dir)!r}, cache_size={self.cache_size}, policy={self.policy!r})"
        )

    # -- naming ------------------------------------------------------------------------

    def key(self, url: str) -> str:
        """The entry key of ``url``: ``shard_uuid`` of the full URL (as ``key_url`` makes
        it, when set)."""
        return shard_uuid(self.key_url(url) if self.key_url is not None else url)

    def entry_path(self, url: str) -> Path:
        """Where the entry of ``url`` lives (whether or not it exists)."""
        return self.cache_dir / self.key(url)

    def _row_to_entry(self, row: Sequence) -> Entry:
        key, url, size, etag, lm, ctype, created, last_access, hits, validated, fields, dg = row
        return Entry(
            key=key,
            url=url,
            path=self.cache_dir / key,
            size=size,
            etag=etag,
            last_modified=lm,
            content_type=ctype,
            created=created,
            last_access=last_access,
            hits=hits,
            validated=created if validated is None else validated,
            fields=_fields_from(fields),
            digests=_digests_from(dg),
        )

    # -- lookup ------------------------------------------------------------------------

    def _file_size(self, path: Path) -> int | None:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None

    def _reader(self) -> sqlite3.Connection:
        """A read-only connection of this thread: readers never wait for a writer in WAL."""
        conn = getattr(self._readers, "conn", None)
        if conn is not None and getattr(self._readers, "pid", None) == os.getpid():
            return conn
        self._connect()  # creates or migrates the index first
        try:
            conn = sqlite3.connect(
                f"file:{self.cache_dir / INDEX_NAME}?mode=ro",
                uri=True,
                isolation_level=None,
                timeout=BUSY_TIMEOUT_MS / 1000,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise self._unusable(exc) from exc
        self._readers.conn, self._readers.pid = conn, os.getpid()
        return conn

    def lookup(self, url: str) -> Entry | None:
        """The entry of ``url`` as far as this process knows, without writing anything.

        Answers from memory when it can, else from one read of the index. The file may
        still have been evicted by another process: the caller opens it and, if it is
        missing or has another size, calls :meth:`forget` and treats the request as a miss.
        """
        key = self.key(url)
        entry = self._mem.get(key)
        if entry is not None:
            return entry
        try:
            row = (
                self._reader()
                .execute(f"SELECT {_ENTRY_COLS} FROM entries WHERE key = ?", (key,))
                .fetchone()
            )
        except sqlite3.Error as exc:
            raise CacheError(f"{self.cache_dir / INDEX_NAME}: cannot read index: {exc}") from exc
        if row is None:
            return None
        entry = self._row_to_entry(row)
        self._mem.put(entry)
        return entry

    def forget(self, key: str) -> None:
        """Drop ``key`` from memory (its file was missing or replaced): the next lookup
        reads the index again."""
        self._mem.pop(key, None)

    def touch(self, entry: Entry, now: float | None = None) -> None:
        """Record a hit in memory; :meth:`flush_access` writes it to the index."""
        now = time.time() if now is None else now
        with self._touch_lock:
            rec = self._touched.get(entry.key)
            if rec is None:
                self._touched[entry.key] = [now, 1, 0.0]
            else:
                rec[0] = now
                rec[1] += 1

    def mark_validated(self, entry: Entry, now: float | None = None) -> Entry:
        """Record that the upstream confirmed ``entry`` (a 304) at ``now``; returns the
        entry as this process now sees it. Written with the next access batch."""
        now = time.time() if now is None else now
        with self._touch_lock:
            rec = self._touched.setdefault(entry.key, [entry.last_access, 0, 0.0])
            rec[2] = now
        fresh = dataclasses.replace(entry, validated=now)
        if self._mem.get(entry.key) is not None:
            self._mem.put(fresh)
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
                    "UPDATE entries SET fields = ? WHERE key = ?", (_fields_json(merged), entry.key)
                )
        fresh = dataclasses.replace(entry, fields=merged)
        if self._mem.get(entry.key) is not None:
            self._mem.put(fresh)
        return fresh

    def pending_access(self) -> int:
        """How many entries have accesses not yet written to the index."""
        return len(self._touched)

    def _take_touches(self) -> dict[str, list]:
        with self._touch_lock:
            touched, self._touched = self._touched, {}
        return touched

    def _apply_touches(self, conn: sqlite3.Connection, touched: dict[str, list]) -> None:
        for key, (last_access, hits, validated) in touched.items():
            if validated:
                conn.execute(
                    "UPDATE entries SET last_access = MAX(last_access, ?), hits = hits + ?, "
                    "validated = ? WHERE key = ?",
                    (last_access, hits, validated, key),
                )
            else:
                conn.execute(
                    "UPDATE entries SET last_access = MAX(last_access, ?), hits = hits + ? "
                    "WHERE key = ?",
                    (last_access, hits, key),
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
                for key, (last, hits, validated) in touched.items():
                    rec = self._touched.setdefault(key, [last, 0, 0.0])
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
                    .execute(f"SELECT {_ENTRY_COLS} FROM entries WHERE key = ?", (key,))
                    .fetchone()
                )
            if row is None:
                return None
            entry = self._row_to_entry(row)
            if self._file_size(entry.path) == entry.size:
                return entry
            # Re-check under the write lock before dropping anything.
        now = time.time()
        bad_file: Path | None = None
        with self._tx() as conn:
            row = conn.execute(
                f"SELECT {_ENTRY_COLS} FROM entries WHERE key = ?", (key,)
            ).fetchone()
            if row is None:
                return None
            entry = self._row_to_entry(row)
            actual = self._file_size(entry.path)
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

    # -- downloads -----------------------------------------------------------------------

    def claim(self, url: str, port: int | None = None) -> tuple[str, int | None]:
        """Claim the download of ``url`` for this process, across processes.

        ``("cached", None)``: the entry exists (look it up again); ``("mine", None)``: this
        process downloads it (call :meth:`release_claim` when done, however it ends);
        ``("owner", port)``: a live process downloads it and answers followers on
        ``127.0.0.1:port``. A claim of a dead process is taken over.
        """
        key = self.key(url)
        me, now = os.getpid(), time.time()
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone():
                return "cached", None
            row = conn.execute(
                "SELECT pid, host, port, created FROM claims WHERE key = ?", (key,)
            ).fetchone()
            if row is not None:
                pid, host, owner_port, created = row
                if pid == me and host == _HOST:
                    return "mine", None
                alive = now - created < STALE_AGE and (host != _HOST or _pid_alive(pid))
                if alive and owner_port:
                    return "owner", int(owner_port)
            conn.execute(
                "INSERT OR REPLACE INTO claims (key, pid, host, port, created) "
                "VALUES (?, ?, ?, ?, ?)",
                (key, me, _HOST, port, now),
            )
        return "mine", None

    def release_claim(self, url: str) -> None:
        """Drop this process's claim on ``url`` (idempotent)."""
        with self._tx() as conn:
            conn.execute(
                "DELETE FROM claims WHERE key = ? AND pid = ? AND host = ?",
                (self.key(url), os.getpid(), _HOST),
            )

    def _used(self, conn: sqlite3.Connection) -> tuple[int, int]:
        entries = conn.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()[0]
        reserved = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM reservations").fetchone()[0]
        return int(entries), int(reserved)

    def _drop_dead_reservations(self, conn: sqlite3.Connection) -> list[Path]:
        """Delete reservation rows of dead local pids or older than STALE_AGE.

        Returns their .part paths, to unlink after the transaction.
        """
        now = time.time()
        stale = []
        for name, pid, host, created in conn.execute(
            "SELECT name, pid, host, created FROM reservations"
        ).fetchall():
            if now - created > STALE_AGE or (host == _HOST and not _pid_alive(pid)):
                stale.append(name)
        for name in stale:
            conn.execute("DELETE FROM reservations WHERE name = ?", (name,))
        return [self.cache_dir / name for name in stale]

    def _make_room(
        self,
        conn: sqlite3.Connection,
        need: int,
        exclude: Iterable[str] = (),
        incoming: str | None = None,
        streamed: bool = True,
        planned: tuple[Mapping[str, float], Collection[str], Mapping[str, float]] | None = None,
    ) -> list[tuple[Entry, Path | None]] | None:
        """Evict rows (inside the transaction) so that ``need`` more bytes fit for the
        entry ``incoming`` (a key).

        Returns the evicted entries with the ``.del`` names their files were moved to, or
        None (nothing changed) when room cannot be made. With read plans registered
        (:attr:`planner`) and an evicting policy, victims are chosen by
        :func:`~shardcache.eviction.choose_victims_planned`: no entry inside a lookahead
        window, the farthest next use first, and None when caching ``incoming`` would
        evict an entry needed sooner than it.
        """
        entries_bytes, reserved = self._used(conn)
        used = entries_bytes + reserved
        limit = self.disk_limit(entries_bytes)
        if used + need <= limit:
            return []
        # recent hits count in the LRU order before anything is chosen
        self._apply_touches(conn, self._take_touches())
        rows = [
            self._row_to_entry(r)
            for r in conn.execute(f"SELECT {_ENTRY_COLS} FROM entries").fetchall()
        ]
        if planned is not None:
            next_use, protected, admit = planned
            victims = choose_victims_planned(
                rows,
                used,
                limit,
                need,
                next_use,
                protected,
                exclude,
                None
                if incoming is None
                else (
                    admit.get(incoming, next_use.get(incoming))
                    if streamed
                    else next_use.get(incoming)
                ),
            )
        else:
            victims = choose_victims(rows, self.policy, used, limit, need, exclude)
        if victims is None:
            return None
        evicted = []
        for victim in victims:
            conn.execute("DELETE FROM entries WHERE key = ?", (victim.key,))
            self._mem.pop(victim.key, None)
            evicted.append((victim, self._move_aside(victim.path)))
        return evicted

    def _planned(
        self,
    ) -> tuple[Mapping[str, float], Collection[str], Mapping[str, float]] | None:
        """What the read plans say about the future, when any are registered and the
        policy evicts at all."""
        if self.planner is None or self.policy == "keep":
            return None
        try:
            next_use, protected, admit = self.planner()
        except Exception:  # plans are advice: a failure falls back to the policy
            log.exception("read-plan eviction advice failed; evicting by %s", self.policy)
            return None
        if not next_use and not protected:
            return None
        return next_use, protected, admit

    # -- read plans shared by the processes of one proxy (serve --workers N) -------------

    def _plans_table(self, conn: sqlite3.Connection) -> None:
        """The plans table, created on first use. It is not part of the entry format:
        an index without it, or a shardcache that does not know it, works the same."""
        conn.execute(_PLANS_SCHEMA)

    def plan_put(
        self,
        plan_id: str,
        doc: str,
        now: float | None = None,
        *,
        replace_name: str | None = None,
        max_plans: int | None = None,
    ) -> list[str] | None:
        """Register plan ``plan_id`` (``doc``: its JSON description) for every process, in
        one transaction with removing the plans named ``replace_name`` (their ids are
        returned) and checking that at most ``max_plans`` are left (else nothing changes
        and the answer is None). So concurrent registrations in several processes never
        leave more than ``max_plans``, and a replacement is never seen beside its old plan.
        """
        now = time.time() if now is None else now
        with self._tx() as conn:
            self._plans_table(conn)
            replaced: list[str] = []
            if replace_name:
                for pid, other in conn.execute("SELECT id, doc FROM plans").fetchall():
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        if json.loads(other).get("name") == replace_name:
                            replaced.append(pid)
            if max_plans is not None:
                (n,) = conn.execute("SELECT COUNT(*) FROM plans").fetchone()
                if n - len(replaced) >= max_plans:
                    return None
            conn.executemany("DELETE FROM plans WHERE id = ?", [(p,) for p in replaced])
            conn.execute(
                "INSERT INTO plans (id, doc, created, seen) VALUES (?, ?, ?, ?)",
                (plan_id, doc, now, now),
            )
            return replaced

    def plan_delete(self, plan_id: str) -> bool:
        """Remove plan ``plan_id``; False when no process knew it."""
        with self._tx() as conn:
            self._plans_table(conn)
            return conn.execute("DELETE FROM plans WHERE id = ?", (plan_id,)).rowcount > 0

    def plans_exist(self) -> bool:
        """Whether any process has registered a read plan (a read: no write lock)."""
        with self._lock:
            conn = self._connect()
            try:
                return conn.execute("SELECT 1 FROM plans LIMIT 1").fetchone() is not None
            except sqlite3.OperationalError:  # no plans table: none ever registered
                return False

    def plans_sync(
        self,
        updates: Mapping[str, tuple[int, float, float, int, int, int]],
        expire_before: float,
        known: Collection[str],
    ) -> tuple[dict[str, tuple[int, float, float, int, int, int]], dict[str, str]]:
        """Merge this process's plan progress into the shared table and read everyone's.

        ``updates``: plan id -> (position, last seen, and the wait seconds, planned hits,
        requests and bytes read since the last sync). Positions and last-seen times take
        the largest value, the rest add up. Plans not seen since ``expire_before`` are
        dropped. Returns (id -> the merged row, id -> the JSON description of each plan
        not in ``known``).
        """
        with self._tx() as conn:
            self._plans_table(conn)
            for pid, (pos, seen, wait, hits, reqs, behind) in updates.items():
                conn.execute(
                    "UPDATE plans SET position = MAX(position, ?), seen = MAX(seen, ?), "
                    "wait = wait + ?, hits = hits + ?, requests = requests + ?, "
                    "behind = behind + ? WHERE id = ?",
                    (pos, seen, wait, hits, reqs, behind, pid),
                )
            conn.execute("DELETE FROM plans WHERE seen < ?", (expire_before,))
            rows = conn.execute(
                "SELECT id, position, seen, wait, hits, requests, behind FROM plans"
            ).fetchall()
            merged = {r[0]: tuple(r[1:]) for r in rows}
            docs = {}
            for pid in merged:
                if pid not in known:
                    docs[pid] = conn.execute(
                        "SELECT doc FROM plans WHERE id = ?", (pid,)
                    ).fetchone()[0]
        return merged, docs  # type: ignore[return-value]

    def room_for(self, planned: Collection[str]) -> tuple[int, float | None]:
        """(bytes that could be admitted now without evicting an entry whose key is in
        ``planned``: the free part of the limit plus every other entry; the mean size of
        the cached entries in ``planned``, None when there are none)."""
        with self._lock:
            conn = self._connect()
            entries_bytes, reserved = self._used(conn)
            rows = conn.execute("SELECT key, size FROM entries").fetchall()
        other = mine = count = 0
        for k, n in rows:
            if k in planned:
                mine += int(n)
                count += 1
            else:
                other += int(n)
        free = max(0, self.disk_limit(entries_bytes) - entries_bytes - reserved) + other
        return free, (mine / count if count else None)

    def _move_aside(self, path: Path) -> Path | None:
        """Rename an entry file to a unique ``.del`` name (inside a transaction)."""
        target = path.with_name(f"{path.name}.{secrets.token_hex(6)}{DEL_SUFFIX}")
        try:
            os.replace(path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.error("cannot move evicted cache file %s aside: %s", path, exc)
            return path  # try to unlink it in place
        return target

    def _unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.error("cannot delete cache file %s: %s", path, exc)
            return False
        return True

    def _finish_evictions(self, evicted: Iterable[tuple[Entry, Path | None]]) -> None:
        """After the transaction: unlink evicted files; keep going past failures."""
        for entry, moved in evicted:
            if moved is not None:
                self._unlink(moved)
            log.debug("evicted %s (%s, %d bytes)", entry.key, entry.url, entry.size)
            if self.on_evict is not None:
                try:
                    self.on_evict(entry)
                except Exception:  # a metrics callback must not break eviction
                    log.exception("on_evict callback failed for %s", entry.url)

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
        name = f"{key}.{os.getpid()}.{secrets.token_hex(6)}{PART_SUFFIX}"
        path = self.cache_dir / name
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
                        self.key_url(url) if self.key_url is not None else url,
                        os.getpid(),
                        _HOST,
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
        actual = self._file_size(partial.path)
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
        target = self.cache_dir / partial.key
        now = time.time()
        try:
            with self._tx() as conn:
                conn.execute("DELETE FROM reservations WHERE name = ?", (partial.path.name,))
                # Replacing an entry of the same URL frees its bytes first.
                conn.execute("DELETE FROM entries WHERE key = ?", (partial.key,))
                evicted = self._make_room(conn, size, exclude=(partial.key,))
                if evicted is None:
                    raise _Rollback
                conn.execute(
                    _ENTRY_INSERT,
                    (
                        partial.key,
                        self.key_url(partial.url) if self.key_url is not None else partial.url,
                        size,
                        etag,
                        last_modified,
                        content_type,
                        now,
                        now,
                        0,
                        now,
                        _fields_json(fields),
                        _digests_json(digests),
                    ),
                )
                # last: a failed rename rolls the row back with it
                try:
                    os.replace(partial.path, target)
                except OSError as exc:
                    raise store_write_error("commit", target, exc) or CacheError(
                        f"{target}: cannot move download into place: {exc}"
                    ) from exc
        except _Rollback:
            self._mem.pop(partial.key, None)
            self.abort(partial)
            raise NoRoomError(partial.url, size, self.cache_size) from None
        except CacheError:
            self._mem.pop(partial.key, None)
            with contextlib.suppress(CacheError):
                self.abort(partial)
            raise
        partial.reserved = 0
        self._finish_evictions(evicted)
        self._fsync_dir()
        entry = Entry(
            key=partial.key,
            url=self.key_url(partial.url) if self.key_url is not None else partial.url,
            path=target,
            size=size,
            etag=etag,
            last_modified=last_modified,
            content_type=content_type,
            created=now,
            last_access=now,
            hits=0,
            validated=now,
            fields=fields,
            digests=tuple(sorted(digests)),
        )
        self._mem.put(entry)
        with self._touch_lock:
            self._touched.pop(partial.key, None)  # accesses of a replaced entry
        return entry

    def _fsync_dir(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self.cache_dir, os.O_RDONLY)
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

    # -- administration ----------------------------------------------------------------

    def remove(self, url: str) -> bool:
        """Purge the entry of ``url``. True if there was one."""
        key = self.key(url)
        with self._tx() as conn:
            row = conn.execute(
                f"SELECT {_ENTRY_COLS} FROM entries WHERE key = ?", (key,)
            ).fetchone()
            if row is None:
                return False
            entry = self._row_to_entry(row)
            conn.execute("DELETE FROM entries WHERE key = ?", (key,))
            self._mem.pop(key, None)
            moved = self._move_aside(entry.path)
        if moved is not None:
            self._unlink(moved)
        return True

    def clear(self) -> int:
        """Purge every entry (downloads in progress are left alone). Returns the count."""
        with self._tx() as conn:
            rows = [
                self._row_to_entry(r)
                for r in conn.execute(f"SELECT {_ENTRY_COLS} FROM entries").fetchall()
            ]
            conn.execute("DELETE FROM entries")
            self._mem.clear()
            moved = [self._move_aside(e.path) for e in rows]
        for p in moved:
            if p is not None:
                self._unlink(p)
        return len(rows)

    def entries(self) -> list[Entry]:
        """All entries in eviction order (first = next victim; by LRU order for ``keep``)."""
        with self._lock:
            rows = [
                self._row_to_entry(r)
                for r in self._connect().execute(f"SELECT {_ENTRY_COLS} FROM entries").fetchall()
            ]
        return eviction_order(rows, "lru" if self.policy == "keep" else self.policy)

    def stats(self) -> dict:
        """Totals: entries, bytes, reserved, limit, downloads (in progress, all processes)."""
        with self._lock:
            conn = self._connect()
            n, nbytes = conn.execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()
            k, reserved = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM reservations"
            ).fetchone()
        total, free = self._disk()
        with self._touch_lock:
            released = sum(self._unreleased.values())  # rows the index could not drop yet
        return {
            "entries": int(n),
            "bytes": int(nbytes),
            "reserved": max(0, int(reserved) - released),
            "limit": self.cache_size,
            "effective_limit": self.disk_limit(int(nbytes)),
            "downloads": int(k),
            "policy": self.policy,
            "free_bytes": free,
            "filesystem_bytes": total,
            "min_free_bytes": self.min_free,
        }

    def check(self, fix: bool = False, *, verify: bool = False) -> CheckReport:
        """Reconcile the index with the directory; report (and with ``fix``, repair).

        Problems: rows whose file is missing or has the wrong size, entry files with no row
        (orphans: their URL is unknown, so they are removed), stale ``.part`` files and
        reservations of dead processes, leftover ``.del`` files, totals over ``cache_size``.
        With ``verify``, also every entry whose bytes no longer have the digests recorded
        when they were written (a disk or a hand changed them; the size alone cannot
        tell): read in full, so it costs a read of the whole cache.
        """
        report = self._reconcile(fix=fix)
        if verify:
            self._verify_contents(report, fix)
            report.ok = not report.problems
        return report

    def _verify_contents(self, report: CheckReport, fix: bool) -> None:
        """Recompute each entry's recorded digests from its file; a mismatch is reported
        and, with ``fix``, its entry removed (the next request fetches it again)."""
        from shardcache.digests import file_digests

        for entry in self.entries():
            if not entry.digests:
                continue  # written before digests were recorded
            try:
                got = file_digests(str(entry.path), [a for a, _ in entry.digests])
            except FileNotFoundError:
                continue  # removed since (or reported missing above)
            except OSError as exc:
                report.problems.append(f"entry {entry.path.name} ({entry.url}) unreadable: {exc}")
                continue
            bad = [
                f"{a} recorded {want}, file has {got[a]}"
                for a, want in entry.digests
                if a in got and got[a] != want
            ]
            if not bad:
                report.verified += 1
                continue
            report.digest_mismatch += 1
            report.problems.append(
                f"entry {entry.path.name} ({entry.url}) changed on disk: " + "; ".join(bad)
            )
            if fix and self.remove(entry.url):
                report.fixed.append(f"dropped entry {entry.path.name} ({entry.url})")
                log.info(
                    "cache %s: dropped %s: its bytes changed on disk", self.cache_dir, entry.url
                )

    def _reconcile(self, fix: bool, verify_sizes: bool = True) -> CheckReport:
        report = CheckReport(ok=True)
        to_unlink: list[Path] = []
        evicted: list[tuple[Entry, Path | None]] = []
        now = time.time()
        with self._tx() as conn:
            # Reservations of dead processes.
            live_parts: set[str] = set()
            for name, pid, host, created in conn.execute(
                "SELECT name, pid, host, created FROM reservations"
            ).fetchall():
                if now - created > STALE_AGE or (host == _HOST and not _pid_alive(pid)):
                    report.problems.append(f"stale reservation {name} (pid {pid})")
                    if fix:
                        conn.execute("DELETE FROM reservations WHERE name = ?", (name,))
                        report.fixed.append(f"released reservation {name}")
                else:
                    live_parts.add(name)
            # Files in the directory (key -> (url, size): no Entry objects for 100k rows)
            rows = {
                r[0]: _Indexed(r[1], r[2])
                for r in conn.execute("SELECT key, url, size FROM entries").fetchall()
            }
            seen: set[str] = set()
            base = str(self.cache_dir)
            try:
                names = os.listdir(self.cache_dir)
            except OSError as exc:
                raise CacheError(f"{self.cache_dir}: cannot list cache directory: {exc}") from exc
            for name in names:
                if not verify_sizes and name in rows:
                    seen.add(name)  # an indexed entry: nothing more to learn without a stat
                    continue
                path = _PathStr(base, name)
                if _parse_part(name) is not None:
                    # No live reservation: its writer is gone (begin reserves before it
                    # creates the file; commit and abort remove both together).
                    if name in live_parts:
                        continue
                    report.stale_partials += 1
                    report.problems.append(f"stale partial download {name}")
                    if fix:
                        to_unlink.append(path.path)
                        report.fixed.append(f"removed {name}")
                elif _is_del(name):
                    report.problems.append(f"leftover evicted file {name}")
                    if fix:
                        to_unlink.append(path.path)
                        report.fixed.append(f"removed {name}")
                elif _is_uuid(name):
                    seen.add(name)
                    entry = rows.get(name)
                    if entry is not None and not verify_sizes:
                        continue
                    size = _size_of(str(path))
                    if size is None:
                        continue
                    if entry is None:
                        report.orphans += 1
                        report.problems.append(
                            f"orphan entry file {name} ({size} bytes, not in the index)"
                        )
                        if fix:
                            moved = self._move_aside(path.path)
                            if moved is not None:
                                to_unlink.append(moved)
                            report.fixed.append(f"removed orphan {name}")
                    elif size != entry.size:
                        report.size_mismatch += 1
                        report.problems.append(
                            f"entry {name} ({entry.url}) is {size} bytes, index says {entry.size}"
                        )
                        if fix:
                            conn.execute("DELETE FROM entries WHERE key = ?", (name,))
                            moved = self._move_aside(path.path)
                            if moved is not None:
                                to_unlink.append(moved)
                            report.fixed.append(f"dropped entry {name} ({entry.url})")
            for key, entry in rows.items():
                if key not in seen:
                    report.missing += 1
                    report.problems.append(f"entry {key} ({entry.url}) has no file")
                    if fix:
                        conn.execute("DELETE FROM entries WHERE key = ?", (key,))
                        report.fixed.append(f"dropped row {key} ({entry.url})")
            # The size bound (e.g. after cache_size was lowered between runs).
            entries_bytes, reserved = self._used(conn)
            if entries_bytes + reserved > self.cache_size:
                report.problems.append(
                    f"cache holds {entries_bytes} bytes + {reserved} reserved, over the "
                    f"limit of {self.cache_size}"
                )
                if fix:
                    made = self._make_room(conn, 0)
                    if made is not None:
                        evicted = made
                        report.fixed.append(f"evicted {len(made)} entries to fit the limit")
            n, nbytes = conn.execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()
            report.entries, report.bytes = int(n), int(nbytes)
        self._mem.clear()  # rows may have been dropped: read them again
        for path in to_unlink:
            self._unlink(path)
        self._finish_evictions(evicted)
        report.ok = not report.problems
        for line in report.fixed:
            log.info("cache %s: %s", self.cache_dir, line)
        return report
