"""Space: what the entries and the downloads in progress use, the bound in force, and
eviction.

``cache_size`` bounds the bytes of the entries plus the bytes reserved by downloads in
progress in every process (reservations live in the index with pid and host). Besides it,
the store keeps ``min_free`` bytes of its filesystem free: admission counts every
reservation as not yet written, so the disk does not fill in normal operation even when
other files on it grow. Which entries to evict is decided by the pure functions of
:mod:`shardcache.eviction` (LRU/FIFO, or Belady's rule over read plans when a planner is
set); :meth:`Space._make_room` carries the choice out inside a transaction. The rules
see only the rows that can matter: the first ones in the policy's order, read from an
index on its columns until they cover the excess, and with read plans the planned rows,
looked up by key; so a decision costs what it evicts (and the plans), not the cache's
size.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from shardcache.eviction import choose_victims, choose_victims_planned, eviction_order
from shardcache.sizes import format_size
from shardcache.store.access import Access
from shardcache.store.entry import ENTRY_COLS, Entry, row_to_entry
from shardcache.store.names import OwnerCheck

log = logging.getLogger("shardcache.store")

# what read plans say about the future: (key -> next planned use, keys never to evict,
# key -> the use a streamed download of it is cached for)
Advice = tuple[Mapping[str, float], Collection[str], Mapping[str, float]]

# eviction order as SQL, per policy: the columns of eviction_order's sort, each order an
# index scan (entries_lru, entries_fifo in the schema)
ORDER_BY = {"lru": "last_access, created, key", "fifo": "created, last_access, key"}
EVICTION_BATCH = 256  # rows read at a time while choosing victims
KEYS_PER_QUERY = 500  # keys per "key IN (...)" lookup (SQLite allows 999 at least)

DEFAULT_MIN_FREE_FRACTION = 0.05
DEFAULT_MIN_FREE_CAP = 1 << 30  # the default keeps 5% of the filesystem free, at most 1 GiB


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


class Space(Access):
    """Usage, the bound, admission's eviction (a part of :class:`Store`)."""

    requested_size: int
    cache_size: int
    min_free: int
    size_warning: str | None
    policy: str
    planner: Callable[[], Advice] | None
    on_evict: Callable[[Entry], None] | None

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
                f"{format_size(self.min_free)} kept free by {self.names.min_free}); using "
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
            f"to keep {format_size(self.min_free)} free on the filesystem ({self.names.min_free})"
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
            why = f"the cache is full and {self.names.keep} evicts nothing"
        elif self.planner is not None:
            why = "caching it would evict entries read sooner (read plans)"
        else:
            why = "downloads in progress hold the rest of the bound"
        return f"no room{' for ' + size if size else ''}: {why} ({full})"

    def _used(self, conn: sqlite3.Connection) -> tuple[int, int]:
        entries = conn.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()[0]
        reserved = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM reservations").fetchone()[0]
        return int(entries), int(reserved)

    def _drop_dead_reservations(self, conn: sqlite3.Connection) -> list[Path]:
        """Delete reservation rows of dead local pids or older than STALE_AGE.

        Returns their .part paths, to unlink after the transaction.
        """
        owners = OwnerCheck(time.time())  # each process looked up once, not once per row
        stale = [
            name
            for name, pid, host, created in conn.execute(
                "SELECT name, pid, host, created FROM reservations"
            ).fetchall()
            if owners.gone(pid, host, created)
        ]
        for name in stale:
            conn.execute("DELETE FROM reservations WHERE name = ?", (name,))
        return [self._place(name) for name in stale]

    def _make_room(
        self,
        conn: sqlite3.Connection,
        need: int,
        exclude: Iterable[str] = (),
        incoming: str | None = None,
        streamed: bool = True,
        planned: Advice | None = None,
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
        excess = used + need - limit
        if planned is not None:
            next_use, protected, admit = planned
            skip = set(exclude)
            skip.update(protected)
            # the least recently used unplanned rows that cover the excess, then (only if
            # they do not) the planned rows: choose_victims_planned takes the unplanned in
            # LRU order first, so it chooses from these as from every row
            rows = self._in_order(conn, "lru", excess, skip, next_use)
            if sum(r.size for r in rows) < excess:
                rows += self._rows_of(conn, [k for k in next_use if k not in skip])
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
            rows = (
                [] if self.policy == "keep" else self._in_order(conn, self.policy, excess, exclude)
            )
            victims = choose_victims(rows, self.policy, used, limit, need, exclude)
        if victims is None:
            return None
        evicted = []
        for victim in victims:
            conn.execute("DELETE FROM entries WHERE key = ?", (victim.key,))
            self._mem.pop(victim.key, None)
            evicted.append((victim, self._move_aside(victim.path)))
        return evicted

    def _in_order(
        self,
        conn: sqlite3.Connection,
        policy: str,
        excess: int,
        skip: Collection[str] = (),
        planned: Collection[str] = (),
    ) -> list[Entry]:
        """The first rows in ``policy``'s eviction order (lru or fifo, as
        :func:`~shardcache.eviction.eviction_order` sorts them), leaving out keys in
        ``skip`` and ``planned``, until their sizes add up to ``excess``: read from the
        index in that order (an index scan), so a decision costs the rows it evicts, not
        every row."""
        skip = skip if isinstance(skip, (set, frozenset, dict)) else set(skip)
        rows: list[Entry] = []
        total = 0
        if excess <= 0:
            return rows
        cur = conn.execute(f"SELECT {ENTRY_COLS} FROM entries ORDER BY {ORDER_BY[policy]}")
        try:
            while total < excess:
                batch = cur.fetchmany(EVICTION_BATCH)
                if not batch:
                    break
                for r in batch:
                    if r[0] in skip or r[0] in planned:
                        continue
                    rows.append(row_to_entry(self.cache_dir, r, self.layout))
                    total += r[2]
                    if total >= excess:
                        break
        finally:
            cur.close()
        return rows

    def _rows_of(self, conn: sqlite3.Connection, keys: Iterable[str]) -> list[Entry]:
        """The rows of ``keys`` that are in the index, looked up by key in chunks."""
        keys = list(keys)
        rows: list[Entry] = []
        for i in range(0, len(keys), KEYS_PER_QUERY):
            chunk = keys[i : i + KEYS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            rows.extend(
                row_to_entry(self.cache_dir, r, self.layout)
                for r in conn.execute(
                    f"SELECT {ENTRY_COLS} FROM entries WHERE key IN ({marks})", chunk
                )
            )
        return rows

    def _planned(self) -> Advice | None:
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

    def room_for(self, planned: Collection[str]) -> tuple[int, float | None]:
        """(bytes that could be admitted now without evicting an entry whose key is in
        ``planned``: the free part of the limit plus every other entry; the mean size of
        the cached entries in ``planned``, None when there are none)."""
        with self._lock:
            conn = self._connect()
            entries_bytes, reserved = self._used(conn)
            keys = list(dict.fromkeys(planned))
            mine = count = 0
            for i in range(0, len(keys), KEYS_PER_QUERY):  # the planned set, not every row
                chunk = keys[i : i + KEYS_PER_QUERY]
                n, nbytes = conn.execute(
                    "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries WHERE key IN "
                    f"({','.join('?' * len(chunk))})",
                    chunk,
                ).fetchone()
                mine += int(nbytes)
                count += int(n)
        other = entries_bytes - mine
        free = max(0, self.disk_limit(entries_bytes) - entries_bytes - reserved) + other
        return free, (mine / count if count else None)

    # -- purges -------------------------------------------------------------------------

    def remove(self, url: str) -> bool:
        """Purge the entry of ``url``. True if there was one."""
        return self._remove_key(self.key(url))

    def _remove_key(self, key: str) -> bool:
        """Purge the entry of ``key``: its row and its file (moved aside under the write
        lock, unlinked once the transaction commits). True if there was one."""
        with self._tx() as conn:
            row = conn.execute(f"SELECT {ENTRY_COLS} FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                return False
            entry = row_to_entry(self.cache_dir, row, self.layout)
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
                row_to_entry(self.cache_dir, r, self.layout)
                for r in conn.execute(f"SELECT {ENTRY_COLS} FROM entries").fetchall()
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
                row_to_entry(self.cache_dir, r, self.layout)
                for r in self._connect().execute(f"SELECT {ENTRY_COLS} FROM entries").fetchall()
            ]
        return eviction_order(rows, "lru" if self.policy == "keep" else self.policy)

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
