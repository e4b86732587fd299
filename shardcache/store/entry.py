"""An entry as the index records it (:class:`Entry`), a download in progress
(:class:`Partial`), the row codec, and :class:`Memo`: what hits need of the entries a
process has seen, in memory."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardcache.meta import ObjectMeta


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


Stamp = tuple[int, int, int]  # (st_ino, st_mtime_ns, st_ctime_ns) of an entry file


def file_stamp(st: os.stat_result) -> Stamp:
    """What tells one entry file from another put at the same path: a replacement by a
    new version (the same size or not) is a new inode, written and renamed at its own
    times."""
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


class Memo:
    """What hits need of the entries this process has seen, compactly: key -> a tuple of
    the row, at most ``limit`` keys (the least recently stored dropped first). An
    :class:`Entry` is made from it on each lookup.

    With each row, the stamp of the file it was seen with (:func:`file_stamp`): another
    process that replaces the entry (a new version, at the same path) leaves this row
    stale, and a file of the same size would otherwise be served under the old
    version's ETag, Last-Modified and digests."""

    def __init__(self, cache_dir: Path, limit: int) -> None:
        self.cache_dir = cache_dir
        self.limit = limit
        self._rows: dict[str, tuple] = {}
        self._stamps: dict[str, Stamp] = {}

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

    def put(self, entry: Entry, stamp: Stamp | None = None) -> None:
        """Remember ``entry`` (a row read from the index or just committed), seen with
        the file of ``stamp`` when given."""
        self._stamps.pop(entry.key, None)
        if self.limit <= 0:
            return
        rows = self._rows
        rows.pop(entry.key, None)
        if stamp is not None:
            self._stamps[entry.key] = stamp
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
            oldest = next(iter(rows))
            del rows[oldest]
            self._stamps.pop(oldest, None)

    def refresh(self, entry: Entry) -> None:
        """Replace the remembered row of ``entry`` (a newer view of the same version,
        whose file it keeps), if there is one."""
        if entry.key in self._rows:
            self.put(entry, self._stamps.get(entry.key))

    def same_file(self, key: str, st: os.stat_result) -> bool:
        """Whether the file of ``st`` (opened for the remembered row of ``key``) is the one
        that row was seen with. A row seen with no file yet takes this one."""
        stamp = file_stamp(st)
        known = self._stamps.get(key)
        if known is None:
            if key in self._rows:
                self._stamps[key] = stamp
            return True
        return known == stamp

    def pop(self, key: str, default: object = None) -> None:
        self._rows.pop(key, None)
        self._stamps.pop(key, None)

    def clear(self) -> None:
        self._rows.clear()
        self._stamps.clear()


ENTRY_COLS = (
    "key, url, size, etag, last_modified, content_type, created, last_access, hits, validated, "
    "fields, digests"
)
ENTRY_INSERT = f"INSERT INTO entries ({ENTRY_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


def fields_json(fields: Sequence[tuple[str, str]]) -> str | None:
    return json.dumps([list(f) for f in fields], separators=(",", ":")) if fields else None


def digests_json(digests: Sequence[tuple[str, str]]) -> str | None:
    return json.dumps(dict(digests), separators=(",", ":"), sort_keys=True) if digests else None


def fields_from(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    try:
        return tuple((str(k), str(v)) for k, v in json.loads(text))
    except (ValueError, TypeError):
        return ()


def digests_from(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    try:
        return tuple(sorted((str(k), str(v)) for k, v in json.loads(text).items()))
    except (ValueError, TypeError, AttributeError):
        return ()


def row_to_entry(cache_dir: Path, row: Sequence) -> Entry:
    """The :class:`Entry` of an index row (its columns in :data:`ENTRY_COLS` order)."""
    key, url, size, etag, lm, ctype, created, last_access, hits, validated, fields, dg = row
    return Entry(
        key=key,
        url=url,
        path=cache_dir / key,
        size=size,
        etag=etag,
        last_modified=lm,
        content_type=ctype,
        created=created,
        last_access=last_access,
        hits=hits,
        validated=created if validated is None else validated,
        fields=fields_from(fields),
        digests=digests_from(dg),
    )
