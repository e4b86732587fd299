"""An entry as the index records it (:class:`Entry`), a download in progress
(:class:`Partial`), the row codec, and :class:`Memo`: what hits need of the entries a
process has seen, in memory."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardcache.meta import ObjectMeta
from shardcache.store.names import FANOUT, FANOUT_CHARS, FLAT


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
    """What hits need of the entries this process has seen, compactly, at most ``limit``
    keys (the least recently stored dropped first): the key as its 16 bytes, the row as
    one ``bytes`` (the numbers packed, then the texts, header fields and digests). About
    a third of the memory of a tuple of objects per row; an :class:`Entry` is made from
    it on each lookup.

    With each row, the stamp of the file it was seen with (:func:`file_stamp`), packed
    in the row: another process that replaces the entry (a new version, at the same
    path) leaves this row stale, and a file of the same size would otherwise be served
    under the old version's ETag, Last-Modified and digests."""

    def __init__(self, cache_dir: Path, limit: int, layout: str = FLAT) -> None:
        self.cache_dir = cache_dir
        self.layout = layout
        self.limit = limit
        self._rows: dict[bytes | str, bytes] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> Entry | None:
        packed = self._rows.get(_memo_key(key))
        if packed is None:
            return None
        size, hits, created, last_access, validated, nones, *_ = _MEMO_HEAD.unpack_from(packed)
        url, etag, lm, ctype, fields, dg = (
            packed[_MEMO_HEAD.size :].decode("utf-8", "surrogatepass").split("\0")
        )
        return Entry(
            key,
            url,
            entry_file(self.cache_dir, self.layout, key),
            size,
            None if nones & 2 else etag,
            None if nones & 4 else lm,
            None if nones & 8 else ctype,
            created,
            last_access,
            hits,
            validated,
            _unpairs(fields),
            _unpairs(dg),
        )

    def put(self, entry: Entry, stamp: Stamp | None = None) -> None:
        """Remember ``entry`` (a row read from the index or just committed), seen with
        the file of ``stamp`` when given."""
        rows = self._rows
        key = _memo_key(entry.key)
        rows.pop(key, None)
        if self.limit <= 0:
            return
        plain = (entry.url, entry.etag, entry.last_modified, entry.content_type)
        if any(
            t is not None and _SEPARATORS.search(t)
            for t in (*plain, *(x for pair in (*entry.fields, *entry.digests) for x in pair))
        ):
            return  # cannot be packed (no URL nor header field holds them): not kept
        texts = (*plain, _pairs(entry.fields), _pairs(entry.digests))
        nones = sum(1 << i for i, t in enumerate(texts) if t is None)
        if stamp is None:
            nones |= _NO_STAMP
        ino, mtime, ctime = stamp or (0, 0, 0)
        head = _MEMO_HEAD.pack(
            entry.size,
            entry.hits,
            entry.created,
            entry.last_access,
            entry.validated,
            nones,
            ino,
            mtime,
            ctime,
        )
        rows[key] = head + "\0".join(t or "" for t in texts).encode("utf-8", "surrogatepass")
        while len(rows) > self.limit:
            del rows[next(iter(rows))]

    def token(self, key: str) -> object | None:
        """What tells whether the remembered row of ``key`` changed: the same object for
        as long as the row is the same (every :meth:`put`, :meth:`refresh`, stamp taken,
        :meth:`pop` and :meth:`clear` replaces or drops it), None without a row. A
        caller that derived something from the row keeps the token with it and compares
        by identity (it holds the old row alive, so a new one is never the same object)."""
        return self._rows.get(_memo_key(key))

    def _stamp(self, key: bytes | str) -> Stamp | None:
        packed = self._rows.get(key)
        if packed is None:
            return None
        *_, nones, ino, mtime, ctime = _MEMO_HEAD.unpack_from(packed)
        return None if nones & _NO_STAMP else (ino, mtime, ctime)

    def refresh(self, entry: Entry) -> None:
        """Replace the remembered row of ``entry`` (a newer view of the same version,
        whose file it keeps), if there is one."""
        key = _memo_key(entry.key)
        if key in self._rows:
            self.put(entry, self._stamp(key))

    def same_file(self, key: str, st: os.stat_result) -> bool:
        """Whether the file of ``st`` (opened for the remembered row of ``key``) is the one
        that row was seen with. A row seen with no file yet takes this one."""
        stamp = file_stamp(st)
        mkey = _memo_key(key)
        packed = self._rows.get(mkey)
        if packed is None:
            return True
        known = self._stamp(mkey)
        if known is None:
            ino, mtime, ctime = stamp
            head = bytearray(packed[: _MEMO_HEAD.size])
            fields = list(_MEMO_HEAD.unpack_from(head))
            fields[5] &= ~_NO_STAMP
            fields[6:9] = [ino, mtime, ctime]
            self._rows[mkey] = _MEMO_HEAD.pack(*fields) + packed[_MEMO_HEAD.size :]
            return True
        return known == stamp

    def pop(self, key: str, default: object = None) -> None:
        self._rows.pop(_memo_key(key), None)

    def clear(self) -> None:
        self._rows.clear()


# a memo row's numbers: size, hits, created, last access, validated, which texts are
# None (and _NO_STAMP), then the stamp of the file the row was seen with
_MEMO_HEAD = struct.Struct("<qqdddBqqq")
_NO_STAMP = 1 << 7


# between a memo row's texts (NUL), its pairs (RS) and a name and its value (US): control
# characters no URL nor header field holds (a row that does is not kept in the memo)
_SEPARATORS = re.compile("[\0\x1e\x1f]")


def _pairs(pairs: tuple[tuple[str, str], ...]) -> str:
    return "\x1e".join(f"{k}\x1f{v}" for k, v in pairs)


def _unpairs(text: str) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    return tuple(tuple(p.split("\x1f", 1)) for p in text.split("\x1e"))  # type: ignore[misc]


def _memo_key(key: str) -> bytes | str:
    """An entry key (a UUID) as its 16 bytes in the memo (49 bytes of memory, not 85)."""
    try:
        return bytes.fromhex(key.replace("-", ""))
    except ValueError:
        return key


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


def entry_file(cache_dir: Path, layout: str, key: str) -> Path:
    """The path of the entry file of ``key`` in ``cache_dir`` of ``layout``."""
    if layout == FANOUT:
        return cache_dir / key[:FANOUT_CHARS] / key
    return cache_dir / key


def row_to_entry(cache_dir: Path, row: Sequence, layout: str = FLAT) -> Entry:
    """The :class:`Entry` of an index row (its columns in :data:`ENTRY_COLS` order), its
    file where ``layout`` puts it."""
    key, url, size, etag, lm, ctype, created, last_access, hits, validated, fields, dg = row
    return Entry(
        key=key,
        url=url,
        path=entry_file(cache_dir, layout, key),
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
