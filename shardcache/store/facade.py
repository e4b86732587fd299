"""The :class:`Store`: one class made of the parts in this package, each in its module
(naming, index, access, space, downloads, reconciliation); its constructor holds the
state they share."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Literal

from shardcache.errors import CacheError, StoreUnusable, StoreWriteError
from shardcache.eviction import POLICIES
from shardcache.store.entry import Entry, Memo
from shardcache.store.index import uid
from shardcache.store.names import FANOUT, FANOUT_DIRS, FLAT, LAYOUTS, SettingNames
from shardcache.store.reconcile import Reconcile
from shardcache.store.space import Advice, resolve_min_free

EvictionPolicy = Literal["lru", "fifo", "keep"]
Layout = Literal["flat", "fanout"]
DEFAULT_POLICY: EvictionPolicy = "lru"  # the proxy's --eviction default too
# the library's bound when none is given: none in practice (webdataset's cache_size default)
DEFAULT_CACHE_SIZE: int = 10**15


class Store(Reconcile):
    """An on-disk shard store: entry files named by ``shard_uuid(url)`` plus an SQLite index.

    Process-safe (several processes may share ``cache_dir``) and thread-safe (one
    connection per process, guarded by a lock, reopened after ``fork``).

    ``cache_size`` bounds entry bytes plus the bytes reserved by downloads in progress in
    every process. ``policy`` is ``"lru"`` (default), ``"fifo"`` or ``"keep"`` (never evict;
    stop admitting when full). ``on_evict`` is called with each evicted :class:`Entry`
    after its row is gone.

    Opening reconciles the index with the directory and repairs it (stale downloads,
    orphans, missing files, the size bound); ``reconcile=False`` skips that, e.g. to
    report with ``check()`` before repairing anything. Above 100,000 entries the names
    are compared only after an unclean end (a process died with the store open, or left
    a reservation): a clean store opens in time independent of its size, and trust does
    not rest on the pass (a file without a row is never served; a row whose file is gone
    is dropped when a hit finds it). With ``defer_names_above``, a pass due on a store
    of more entries than that is left to :meth:`reconcile_names`, to be run while the
    store serves (the daemon does, in a thread, once ready): the open then takes the
    same time after a crash as after a clean end.

    ``min_free`` is kept free on the cache's filesystem: bytes (int), a fraction of the
    filesystem (float below 1) or None for the default, 5% of the filesystem and at most
    1 GiB. When ``cache_size`` exceeds what the filesystem can hold (the cache's bytes plus
    the free space, less ``min_free``), the smaller bound is used and
    :attr:`size_warning` says so with both numbers.

    ``layout`` is where the entry files go: ``"flat"``, all in ``cache_dir``, or
    ``"fanout"``, each in the subdirectory named by the first two hex digits of its key
    (256 of them; choose it above a few million entries on ext4 without ``large_dir``,
    which holds ~9.4M names in one directory). It is chosen when the store is created
    and recorded in its index: every later open (other processes, DataLoader workers,
    ``shardcache check``, direct readers) follows the record. ``None`` (default) opens
    any store as recorded and creates a flat one; a layout other than the recorded one
    raises :class:`~shardcache.errors.StoreUnusable` naming both.

    A program on top keeps tables of its own in the index with :meth:`add_schema` and
    :meth:`transaction`, and has messages name its own settings with :attr:`names`.
    """

    # how messages name the settings (a subclass gives its flags)
    names: ClassVar[SettingNames] = SettingNames()

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
        defer_names_above: int | None = None,
        layout: Layout | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
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
        self.planner: Callable[[], Advice] | None = None
        # the URL an entry is keyed and recorded by, from the URL fetched (the proxy drops
        # signatures here, so a URL signed afresh is the same entry); None: as it is
        self.key_url: Callable[[str], str] | None = None
        self.layout: str = FLAT  # until the index says (below)
        self._asked_layout: str | None = layout
        self.min_free_spec = min_free
        self.min_free = 0
        self.size_warning: str | None = None
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._readers = threading.local()
        self._schemas: list[str] = []  # statements of a program's own tables (add_schema)
        self._schema_done = 0
        # what a hit needs, in memory: key -> Entry (this process's view of the index)
        self._mem = Memo(self.cache_dir, memo_entries)
        # accesses not yet in the index: key -> [last_access, hits to add, validated or 0]
        self._touched: dict[str, list] = {}
        self._touch_lock = threading.Lock()
        self._touch_pid = os.getpid()
        # commits waiting to be made in one transaction with others (Downloads.commit)
        self._commits: list = []
        self._committing = False
        self._commits_lock = threading.Lock()
        self._commits_pid = os.getpid()
        self._touch_since: float | None = None  # when the oldest of them was recorded
        # reservations whose release failed (index not writable): .part name -> bytes,
        # released by the next flush and not counted as reserved meanwhile
        self._unreleased: dict[str, int] = {}
        self._session_pid: int | None = None  # this process's row in the sessions table
        self.defer_names_above = defer_names_above
        self.names_pass = None
        self._names_stop = threading.Event()
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnusable(
                f"{self.cache_dir}: cannot create the cache directory ({exc.strerror or exc}); "
                f"running as uid {uid()}: create it and make it writable by this uid, or "
                f"choose another {self.names.cache_dir}"
            ) from exc
        self.layout = self._recorded_layout()  # made now, recording ours, if new
        self._mem.layout = self.layout
        if layout is not None and layout != self.layout:
            self._close_index()
            raise StoreUnusable(
                f"{self.cache_dir}: the store was created with the {self.layout} layout, "
                f"and {self.names.layout} {layout} asks for the {layout} one; a store keeps "
                f"the layout it was created with: leave {self.names.layout} unset (or "
                f"{self.layout}) to open it, or choose another {self.names.cache_dir} for a "
                f"{layout} store"
            )
        if self.layout == FANOUT:
            self._make_subdirs()
        total, _ = self._disk()
        self.min_free = resolve_min_free(min_free, total)
        if reconcile:
            # names only: with 100,000 entries a stat of each would cost seconds; sizes
            # are checked on every hit (fstat) and by check()
            try:
                self._reconcile(fix=True, verify_sizes=False, opening=True)
            except StoreWriteError as exc:
                raise self._unusable(exc) from exc
            self._fit_to_disk()

    def _make_subdirs(self) -> None:
        """The 256 subdirectories of the fan-out layout (those that exist are kept),
        made durable before an entry is renamed into one."""
        made = 0
        for name in FANOUT_DIRS:
            try:
                os.mkdir(self.cache_dir / name)
                made += 1
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreUnusable(
                    f"{self.cache_dir / name}: cannot create the subdirectory of the fan-out "
                    f"layout ({exc.strerror or exc}); running as uid {uid()}: make "
                    f"{self.cache_dir} writable by this uid, or choose another "
                    f"{self.names.cache_dir}"
                ) from exc
        if made:
            self._fsync_dir(self.cache_dir)

    def close(self) -> None:
        """Record pending accesses, then close the index connection (the store reopens it
        if used again)."""
        self._names_stop.set()  # a deferred name pass under way stops (it stays owed)
        with contextlib.suppress(CacheError):
            self.flush_access()
        with contextlib.suppress(CacheError):
            self._end_session()
        self._close_index()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Store({str(self.cache_dir)!r}, cache_size={self.cache_size}, policy={self.policy!r}"
            + (f", layout={self.layout!r})" if self.layout != FLAT else ")")
        )

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
