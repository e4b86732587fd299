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

from dbcache._codec import RowDecodeError, get_codec
from dbcache._file import (
    _ROW_COLUMNS,
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYOUTS,
    SAMPLES,
    DBCacheError,
    _DBFile,
)

__all__ = ["DBCache", "DBCacheError", "get_uuid", "FORMAT_NAME", "FORMAT_VERSION"]

log = logging.getLogger(__name__)


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


class DBCache(_DBFile):
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
        size: int | None = None,
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

    # -- queries -----------------------------------------------------------------------

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
