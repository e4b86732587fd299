"""DBCache: keep a fixed set of samples (a validation set) in one SQLite file.

The first pass streams samples from a source and stores them until ``size`` are held;
every later pass reads them back from the file, with no source and no network. Several
processes (DataLoader workers, several jobs) may fill and read one file at once: the file
is in WAL mode with a busy timeout, each batch of samples is inserted in one
``BEGIN IMMEDIATE`` transaction that checks the count first, and samples are identified
by (``__url__``, ``__key__``), so the file never holds a duplicate or more than ``size``
samples.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import sqlite_utils

from dbcache._codec import RowDecodeError, get_codec
from shardcache.errors import ShardcacheError

__all__ = ["DBCache", "DBCacheError", "get_uuid", "FORMAT_NAME", "FORMAT_VERSION"]

log = logging.getLogger(__name__)


class DBCacheError(ShardcacheError):
    """A DBCache file cannot be used. The message names the file and the problem.

    Defined here, not in the library's error tree: dbcache builds on the library, and the
    library names it only among its lazily loaded public names (``shardcache.DBCacheError``).
    """


FORMAT_NAME = "shardcache.dbcache"
# 2: a sample is the columns (url, key, fields, data, payload), see dbcache._codec
# 3: ``fields`` lives once in the layouts table; a sample row holds its integer id
FORMAT_VERSION = 3
RESERVED_META = frozenset({"format", "format_version", "codec", "size"})
SAMPLES = "samples"
LAYOUTS = "layouts"  # (id, fields): the distinct field tables, written once each
_ROW_COLUMNS = "url, key, layout, data, payload"  # the columns a codec reads
META = "meta"
TABLES = frozenset({SAMPLES, LAYOUTS, META})


def get_uuid(data: str | bytes) -> str:
    """A stable name for ``data``: ``str(uuid.uuid3(uuid.NAMESPACE_URL, data))``."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", "surrogateescape")
    return str(uuid.uuid3(uuid.NAMESPACE_URL, data))


def sample_ident(sample: Any) -> tuple[str, str]:
    """The (``__url__``, ``__key__``) pair that identifies a sample.

    ``__url__`` may be missing (then ""); ``__key__`` must be a str.
    """
    if not isinstance(sample, Mapping):
        raise TypeError(
            f"DBCache stores samples that are dicts with '__key__', got {type(sample).__qualname__}"
        )
    key = sample.get("__key__")
    url = sample.get("__url__", "")
    if not isinstance(key, str):
        raise ValueError(f"sample has no str '__key__' (got {type(key).__qualname__})")
    if not isinstance(url, str):
        raise ValueError(f"sample {key!r}: '__url__' is a {type(url).__qualname__}, not a str")
    return url, key


def _worker_slice() -> tuple[int, int]:
    """(index, count) of the current DataLoader worker; (0, 1) outside one.

    torch is only consulted when something already imported it.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return 0, 1
    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0, 1
    return int(info.id), int(info.num_workers)


class DBCache:
    """A fixed set of samples in an SQLite file, filled once from ``source``.

    Args:
        dbname: path of the SQLite file (created if missing); ``None`` passes the source
            through untouched.
        size: how many samples the file holds when full. ``None`` opens an existing file
            with the size it records.
        source: an iterable of sample dicts (e.g. a ``webdataset.WebDataset`` or a
            ``shardcache.ShardDataset``); needed only until the file is full.
        shuffle: read the stored samples in a different order each pass (seedable with
            ``seed``); otherwise in insertion order. The filling pass yields in source order.
        verbose: log progress of the filling pass at INFO level.
        codec: ``"safe"`` (default; no pickle, a tampered file cannot run code) or
            ``"pickle"`` (stores anything picklable; DANGEROUS: opening a file written by
            someone else with it can run their code; only for files you trust).
        seed: seed of the shuffling order.
        batch_size: samples per write transaction.
        busy_timeout: seconds to wait for another process's write lock.

    The file records its ``size``, codec and format version; opening it with another
    size, codec or an unknown format raises :class:`DBCacheError` naming the file.
    """

    def __init__(
        self,
        dbname: str | os.PathLike[str] | None,
        size: int | None,
        source: Iterable[Any] | None = None,
        shuffle: bool = False,
        verbose: bool = True,
        *,
        codec: str = "safe",
        seed: int | None = None,
        batch_size: int = 256,
        busy_timeout: float = 60.0,
    ) -> None:
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.codec = get_codec(codec)
        self.dbname = None if dbname is None else os.fspath(dbname)
        self.source = source
        self.shuffle = shuffle
        self.verbose = verbose
        self.seed = seed
        self.batch_size = batch_size
        self.busy_timeout = busy_timeout
        self._rng = random.Random(seed)
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self.size: int | None = size
        if self.dbname is not None:
            self.size = self._open()

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

    # -- queries -----------------------------------------------------------------------

    def _need_db(self) -> None:
        if self.dbname is None:
            raise DBCacheError("DBCache(None, ...) passes its source through and has no database")

    def count(self) -> int:
        """How many samples the file holds now."""
        self._need_db()
        return self.conn.execute(f"SELECT count(*) FROM {SAMPLES}").fetchone()[0]

    def __len__(self) -> int:
        """Samples held in the file (``size`` once full); for ``dbname=None``, len(source)."""
        if self.dbname is None:
            return len(self.source)  # type: ignore[arg-type]
        return self.count()

    def is_full(self) -> bool:
        """Whether the file holds ``size`` samples."""
        return self.count() >= (self.size or 0)

    def key_exists(self, key: str | Mapping[str, Any], url: str | None = None) -> bool:
        """Whether a sample is stored.

        ``key_exists("k")``: any stored sample has ``__key__`` ``"k"`` (from any shard);
        ``key_exists("k", url)``: the sample ``"k"`` of the shard ``url`` is stored (``""``
        for samples without ``__url__``); ``key_exists(sample)``: that sample (its
        ``__key__`` and ``__url__``) is stored.
        """
        self._need_db()
        if isinstance(key, Mapping):
            url, key = sample_ident(key)
        if url is None:
            row = self.conn.execute(f"SELECT 1 FROM {SAMPLES} WHERE key = ? LIMIT 1", (key,))
        else:
            row = self.conn.execute(
                f"SELECT 1 FROM {SAMPLES} WHERE url = ? AND key = ?", (url, key)
            )
        return row.fetchone() is not None

    def nbytes(self) -> int:
        """Total bytes of the stored records."""
        self._need_db()
        return (
            self.conn.execute(
                f"SELECT coalesce(sum(length(data) + coalesce(length(payload), 0)), 0) FROM {SAMPLES}"
            ).fetchone()[0]
            + self.conn.execute(
                f"SELECT coalesce(sum(length(fields)), 0) FROM {LAYOUTS}"
            ).fetchone()[0]
        )

    def _row_error(self, exc: RowDecodeError) -> DBCacheError:
        """The error for a row that does not decode, naming the file and the row."""
        where = f"__key__ {exc.key!r} of __url__ {exc.url!r}"
        try:
            found = self.conn.execute(
                f"SELECT id FROM {SAMPLES} WHERE url = ? AND key = ?", (exc.url, exc.key)
            ).fetchone()
        except sqlite3.Error:
            found = None
        if found is not None:
            where = f"row {found[0]} ({where})"
        return self._fail(f"{where}: {exc}")

    def dbiter(
        self, *, shuffle: bool | None = None, worker: tuple[int, int] = (0, 1)
    ) -> Iterator[Any]:
        """Yield the stored samples, decoded: in insertion order, or shuffled.

        ``worker=(index, count)`` yields only every count-th sample starting at index (the
        order is the same in every worker, so the workers' shares are disjoint).
        """
        self._need_db()
        shuffle = self.shuffle if shuffle is None else shuffle
        index, nworkers = worker
        conn = self.conn
        decode_rows = self.codec.decode_rows
        try:
            layouts = dict(conn.execute(f"SELECT id, fields FROM {LAYOUTS}"))
            if not shuffle and nworkers == 1:
                yield from decode_rows(
                    conn.execute(f"SELECT {_ROW_COLUMNS} FROM {SAMPLES} ORDER BY id"), layouts
                )
                return
            ids = [r[0] for r in conn.execute(f"SELECT id FROM {SAMPLES} ORDER BY id")]
            if shuffle:
                self._rng.shuffle(ids)
            ids = ids[index::nworkers]
            for start in range(0, len(ids), self.batch_size):
                chunk = ids[start : start + self.batch_size]
                marks = ",".join("?" * len(chunk))
                rows = {
                    row[0]: row[1:]
                    for row in conn.execute(
                        f"SELECT id, {_ROW_COLUMNS} FROM {SAMPLES} WHERE id IN ({marks})", chunk
                    )
                }
                yield from decode_rows([rows[rowid] for rowid in chunk], layouts)
        except RowDecodeError as exc:
            raise self._row_error(exc) from exc
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    # -- filling ------------------------------------------------------------------------

    def source_(self, source: Iterable[Any]) -> DBCache:
        """Set the source and return self (for chaining)."""
        self.source = source
        return self

    def __call__(self, source: Iterable[Any] | None = None) -> Iterator[Any]:
        """Use as a pipeline stage: ``DataPipeline(..., DBCache(name, size))``.

        As the first stage (no source) it reads the file.
        """
        if source is not None:
            self.source = source
        return iter(self)

    def __iter__(self) -> Iterator[Any]:
        if self.dbname is None:
            if self.source is None:
                raise ValueError("DBCache(None, ...) needs a source to pass through")
            yield from self.source
            return
        held = self.count()
        if held >= self.size:  # type: ignore[operator]
            yield from self.dbiter(worker=_worker_slice())
            return
        if self.source is None:
            raise self._fail(
                f"holds {held} of {self.size} samples and has no source to fill it from"
            )
        yield from self._fill()

    def _layout_ids(self, batch: list[tuple]) -> list[tuple]:
        """``batch`` with each row's ``fields`` replaced by its id in the layouts table.

        Runs inside the write transaction, so processes filling one file at once agree
        on the ids; a new layout is inserted there and committed with its rows.
        """
        conn = self.conn
        ids: dict[bytes, int] = {}
        for fields in dict.fromkeys(row[2] for row in batch):  # in order of first use
            found = conn.execute(f"SELECT id FROM {LAYOUTS} WHERE fields = ?", (fields,)).fetchone()
            if found is None:
                found = (
                    conn.execute(f"INSERT INTO {LAYOUTS} (fields) VALUES (?)", (fields,)).lastrowid,
                )
            ids[fields] = found[0]
        return [(url, key, ids[fields], data, payload) for url, key, fields, data, payload in batch]

    def _store(self, batch: list[tuple]) -> tuple[list[bool], int]:
        """Insert ``batch`` of (url, key, fields, data, payload) rows in one transaction,
        never past ``size``.

        Returns, for each row, whether it is in the file now (inserted, or there already),
        and the count after the transaction.
        """
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")  # the write lock: the count can't change under us
        try:
            batch = self._layout_ids(batch)
            held = conn.execute(f"SELECT count(*) FROM {SAMPLES}").fetchone()[0]
            room = self.size - held  # type: ignore[operator]
            present = [False] * len(batch)
            if room >= len(batch):
                before = conn.total_changes
                conn.executemany(
                    f"INSERT OR IGNORE INTO {SAMPLES} ({_ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                    batch,
                )
                held += conn.total_changes - before
                present = [True] * len(batch)
            else:
                for i, row in enumerate(batch):
                    if room > 0:
                        cur = conn.execute(
                            f"INSERT OR IGNORE INTO {SAMPLES} ({_ROW_COLUMNS})"
                            " VALUES (?, ?, ?, ?, ?)",
                            row,
                        )
                        room -= cur.rowcount
                        held += cur.rowcount
                        present[i] = True
                    else:
                        present[i] = (
                            conn.execute(
                                f"SELECT 1 FROM {SAMPLES} WHERE url = ? AND key = ?", row[:2]
                            ).fetchone()
                            is not None
                        )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return present, held

    def _fill(self) -> Iterator[Any]:
        """The filling pass: store and yield source samples until the file is full."""
        name, size, encode = self.dbname, int(self.size or 0), self.codec.encode_row
        seen: set[tuple[str, str]] = set()
        rows: list[tuple] = []
        samples: list[Any] = []
        pending = 0
        held = self.count()
        stored_here = 0
        last_log = time.monotonic()
        if self.verbose:
            log.info("%s: filling from the source, %d of %d samples held", name, held, size)

        # A batch is flushed early once it could fill the file, so that no shard is read
        # past the one that fills it; when a flush adds nothing (samples stored by an
        # earlier pass, or by another process) the early size doubles, so a resumed fill
        # does not commit one sample at a time.
        early = 1

        def flush() -> Iterator[Any]:
            nonlocal held, stored_here, rows, samples, pending, early
            before = held
            try:
                present, held = self._store(rows)
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc
            if held == before:
                early = min(early * 2, self.batch_size)
            batch_samples = samples
            rows, samples, pending = [], [], 0
            for sample, ok in zip(batch_samples, present, strict=True):
                if ok:
                    stored_here += 1
                    yield sample

        for sample in self.source:  # type: ignore[union-attr]
            ident = sample_ident(sample)
            if ident in seen:
                continue
            seen.add(ident)
            try:
                fields, data, payload = encode(sample)
            except TypeError as exc:
                raise TypeError(f"{name}: sample {ident[1]!r} from {ident[0]!r}: {exc}") from None
            rows.append((ident[0], ident[1], fields, data, payload))
            samples.append(sample)
            pending += len(data) + (0 if payload is None else len(payload))
            if (
                len(rows) >= self.batch_size
                or pending >= 64 << 20
                or (held + len(rows) >= size and len(rows) >= early)
            ):
                yield from flush()
                if self.verbose and time.monotonic() - last_log >= 5.0:
                    last_log = time.monotonic()
                    log.info("%s: %d of %d samples held", name, held, size)
                if held >= size:
                    break
        else:
            if rows:
                yield from flush()
        if held >= size:
            if self.verbose:
                log.info("%s: full with %d samples; later passes read from the file", name, size)
        else:
            log.warning(
                "%s: the source ended with %d of %d samples held; the next pass reads the"
                " source again to fill the rest",
                name,
                held,
                size,
            )

    def __repr__(self) -> str:
        return f"DBCache({self.dbname!r}, size={self.size}, codec={self.codec.name!r})"
