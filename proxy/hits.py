"""The hit path's view of the store: entry files opened on the event loop, small hot
entries served from RAM.

A hit needs no thread hop: the entry comes from :meth:`shardcache.store.Store.lookup`
(memory), the file is opened and checked with ``fstat`` on the loop (a local ``open`` is a
few microseconds, as nginx does it), and the bytes go out with ``sendfile``. Entries of at
most ``max_object`` bytes are kept in a RAM tier bounded by ``max_bytes`` (least recently
used dropped first; once it is full, an entry goes in on its second read, see
:meth:`HitTier.read`); each RAM hit still ``stat``s the entry file, so an entry evicted or
replaced by another process sharing the directory is never served from RAM.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import IO, Any

from shardcache.store import Entry, Store

__all__ = ["HitTier"]

Stamp = tuple[int, int, int]
ITEM_OVERHEAD = 200  # bytes of Python objects per RAM item beyond its data, for the bound


MAX_KEPT = 4096  # entries whose derived header block is kept
# entries read while the RAM tier was full and not taken in, remembered (their keys only)
# so that a second read takes one in: a hot entry gets in, one read once does not
SEEN_KEPT = 65536


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _described(entry: Entry) -> tuple[Any, ...]:
    """Everything of ``entry`` its answers' headers are made from."""
    return (
        entry.size,
        entry.etag,
        entry.last_modified,
        entry.content_type,
        entry.fields,
        entry.digests,
    )


class HitTier:
    """Opens entry files for hits and keeps the bytes of small hot entries in RAM."""

    def __init__(self, store: Store, max_bytes: int = 32 << 20, max_object: int = 256 << 10):
        self.store = store
        self.max_bytes = max_bytes
        self.max_object = max_object
        # key -> (the file's stamp, its bytes, its path as a string: what a hit stats)
        self._ram: OrderedDict[str, tuple[Stamp, bytes, str]] = OrderedDict()
        self._bytes = 0
        self._seen: dict[str, bool] = {}  # see read()
        # what the answer path derived from an entry's stored fields (its header block),
        # kept with what it was derived from: an entry updated (a 304's new fields) or
        # replaced gets it derived afresh
        self._kept: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self.max_kept = MAX_KEPT

    def __len__(self) -> int:
        return len(self._ram)

    @property
    def bytes(self) -> int:
        return self._bytes

    def cacheable(self, entry: Entry) -> bool:
        return 0 < entry.size <= self.max_object and self.max_bytes > 0

    def _drop(self, key: str) -> None:
        item = self._ram.pop(key, None)
        if item is not None:
            self._bytes -= len(item[1]) + ITEM_OVERHEAD

    def small(self, entry: Entry) -> bytes | None:
        """The RAM copy of ``entry`` if it is still the file on disk, else None."""
        return self.small_key(entry.key, entry.size)

    def small_key(self, key: str, size: int) -> bytes | None:
        """The RAM copy of the entry of ``key`` (``size`` bytes) if it is still the file
        on disk, else None."""
        item = self._ram.get(key)
        if item is None:
            return None
        try:
            st = os.stat(item[2])
        except OSError:
            self._drop(key)
            return None
        if _stamp(st) != item[0] or st.st_size != size:
            self._drop(key)
            return None
        self._ram.move_to_end(key)
        return item[1]

    def kept(self, entry: Entry) -> Any:
        """What :meth:`keep` kept for ``entry`` as it is now, or None."""
        item = self._kept.get(entry.key)
        if item is None or item[0] != _described(entry):
            return None
        return item[1]

    def keep(self, entry: Entry, value: Any) -> None:
        """Keep ``value``, derived from ``entry``'s stored description, for the entry's
        next hits (at most ``max_kept`` entries, the oldest dropped first)."""
        self._kept.pop(entry.key, None)
        while len(self._kept) >= self.max_kept > 0:
            del self._kept[next(iter(self._kept))]
        if self.max_kept > 0:
            self._kept[entry.key] = (_described(entry), value)

    def load(self, entry: Entry) -> bytes | None:
        """Read a small entry (into the RAM tier when it is admitted, see :meth:`read`);
        None if its file is missing or no longer has the indexed size."""
        return self.read(entry.key, entry.path, entry.size)

    def read(self, key: str, path: str | os.PathLike[str], size: int) -> bytes | None:
        """Read the small entry of ``key`` (its file ``path``, ``size`` bytes by the index);
        None if its file is missing, has another size or is another file than the one
        the store's row was seen with. On the loop: at most ``max_object`` bytes of a
        local file, which costs what a sendfile of it would, without a thread hop.

        The bytes go into the RAM tier when they fit beside what it holds, or when the
        entry was read before while the tier was full (its second read of late, see
        :data:`SEEN_KEPT`): so entries read once each (a pass over more small entries
        than the tier holds) do not push the hot ones out, each costing a read and an
        eviction for nothing."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != size or not self.store.same_file_key(key, st):
                return None
            data = os.pread(fd, size, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) != size:
            return None
        self._drop(key)
        cost = len(data) + ITEM_OVERHEAD
        if cost > self.max_bytes:
            return data
        if self._bytes + cost > self.max_bytes:
            seen = self._seen
            if not seen.pop(key, False):
                seen[key] = True
                if len(seen) > SEEN_KEPT:
                    del seen[next(iter(seen))]
                return data
        self._ram[key] = (_stamp(st), data, os.fspath(path))
        self._bytes += cost
        while self._bytes > self.max_bytes and self._ram:
            _, (_, old, _) = self._ram.popitem(last=False)
            self._bytes -= len(old) + ITEM_OVERHEAD
        return data

    def open(self, entry: Entry) -> IO[bytes] | None:
        """The entry file opened for reading (on the loop), or None if it is missing, has
        another size than the index says or is another file than the one ``entry`` was
        read with (evicted or replaced by another process)."""
        return self.open_key(entry.key, entry.path, entry.size)

    def open_key(self, key: str, path: str | os.PathLike[str], size: int) -> IO[bytes] | None:
        """:meth:`open` for the entry of ``key`` (its file ``path``, ``size`` bytes)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            self._drop(key)
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != size or not self.store.same_file_key(key, st):
                os.close(fd)
                self._drop(key)
                return None
        except OSError:
            os.close(fd)
            return None
        return open(fd, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
