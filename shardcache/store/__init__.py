"""The on-disk shard store shared by ``cache_shards`` and the daemon.

Layout of ``cache_dir``::

    <shard_uuid(url)>                     a complete entry (bytes exactly as the upstream sent)
    <key>.<pid>.<random>.part             a download in progress (never served as an entry)
    <key>.<random>.del                    an evicted entry waiting to be unlinked
    .shardcache.sqlite (+ -wal, -shm)     the index

or, in the ``fanout`` layout (``Store(layout="fanout")``, recorded in the index when it
is made), each entry, ``.part`` and ``.del`` file one level down, in ``<first two hex
digits of the key>/``.

The store is synchronous. Async callers run each call in a thread
(``asyncio.to_thread``); each call is one transaction plus a stat or a rename (commits
of several threads ready at once share one transaction and one directory fsync). Hits
write nothing: accesses are recorded in memory and written in batches.

One public class, :class:`Store`, made of parts kept in modules named for what they
hold; each imports only the ones before it:

- ``names``: file names, keys (``key_url``), the processes behind rows, how messages
  name the settings;
- ``diskerrors``: writes the disk or the index refused, as ``StoreWriteError``;
- ``entry``: :class:`Entry`, :class:`Partial`, the row codec, the in-memory rows;
- ``index``: the SQLite index, its schema, format version and migration, connections,
  transactions, and the hook for a program's own tables (``add_schema``,
  ``transaction``);
- ``access``: lookups and hits that write nothing, access batches;
- ``space``: usage, the bound, eviction, purges;
- ``downloads``: reservations, ``.part`` files, commit and abort;
- ``reconcile``: the index and the directory made to agree, ``check``;
- ``facade``: :class:`Store` itself, its constructor and totals.
"""

from __future__ import annotations

# Names beyond __all__ stay importable from here, as before the store became a package.
# ruff: noqa: F401
from shardcache.errors import NoRoomError
from shardcache.eviction import POLICIES, choose_victims, eviction_order
from shardcache.store.diskerrors import FULL_ERRNOS, STORE_ERRNOS, disk_full, store_write_error
from shardcache.store.entry import Entry, Partial
from shardcache.store.facade import DEFAULT_CACHE_SIZE, DEFAULT_POLICY, EvictionPolicy, Store
from shardcache.store.index import BUSY_TIMEOUT_MS, FANOUT_FORMAT, FORMAT_VERSION
from shardcache.store.names import (
    DEL_SUFFIX,
    FANOUT,
    FLAT,
    HOST,
    INDEX_NAME,
    LAYOUTS,
    PART_SUFFIX,
    STALE_AGE,
    SettingNames,
    owner_gone,
)
from shardcache.store.reconcile import CheckReport
from shardcache.store.space import (
    DEFAULT_MIN_FREE_CAP,
    DEFAULT_MIN_FREE_FRACTION,
    Advice,
    resolve_min_free,
)
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
