"""Byte ranges (RFC 9110 §14) and conditional requests (RFC 9110 §13), decided from the
request's fields and the stored version's validators. Pure: no I/O.

Range choices (documented behaviour):

* A single byte range whose end lies past the object is clipped to the object: ``206``.
  Only a first byte at or past the end (or a zero-length suffix, or any range on an empty
  object) is unsatisfiable: ``416`` with ``Content-Range: bytes */size``.
* A syntactically invalid byte range (``bytes=5-3``, ``bytes=x-``) is answered ``416``.
* A multi-range request (``bytes=0-9,20-29``) is answered ``200`` with the full object;
  RFC 9110 §14.2 lets a server ignore Range, and no shard reader asks for several ranges.
* A Range in another unit than ``bytes`` is ignored (``200``).
* While the size of a download is still unknown (chunked upstream), Range is ignored.
"""

from __future__ import annotations

import email.utils
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from shardcache.errors import RangeNotSatisfiable
from shardcache.meta import is_strong_etag, parse_decimal

__all__ = ["ByteRange", "conditional_status", "parse_range", "range_applies", "range_start"]


@dataclass(frozen=True)
class ByteRange:
    """An inclusive byte range ``start..end`` of an object of ``size`` bytes."""

    start: int
    end: int
    size: int

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    @property
    def content_range(self) -> str:
        return f"bytes {self.start}-{self.end}/{self.size}"

    @property
    def reaches_end(self) -> bool:
        return self.end == self.size - 1


_SPEC_RE = re.compile(r"^\s*([0-9]*)\s*-\s*([0-9]*)\s*$")


def _single_byte_range(header: str) -> str | None:
    """The spec (``0-99``, ``-5``) of a ``Range`` header that asks one byte range; None
    for another unit or several ranges (both served as the whole object)."""
    unit, sep, spec = header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes" or "," in spec:
        return None
    return spec


def range_start(header: str) -> int | None:
    """Where the one byte range of a ``Range`` header starts, before the object's size is
    known: -1 for a suffix range, None when the header is not one byte range (several, or
    another unit) or its start is not a sane number. A spec longer than two positions
    of any object's size needs is None too, so that it is never forwarded upstream as
    written: the download serves it, and answers 416 where it is invalid."""
    spec = _single_byte_range(header)
    if spec is None or len(spec) > _MAX_RANGE_SPEC:
        return None
    first = spec.partition("-")[0].strip()
    if not first:
        return -1
    return parse_decimal(first)


_MAX_RANGE_SPEC = 48  # two positions of 18 digits, with room for spaces


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """Decide what a ``Range`` header asks of an object of ``size`` bytes.

    Returns None to serve the whole object (no Range, another unit, or several ranges),
    a clipped :class:`ByteRange` for a satisfiable single range, and raises
    :class:`RangeNotSatisfiable` (416) for an unsatisfiable or invalid byte range.

    A position of more digits than any object's size has (``bytes=99…9-``, thousands of
    digits) means what its value means: a first byte past the end is unsatisfiable, a
    last byte or a suffix length past the end is clipped to the object.
    """
    if header is None:
        return None
    spec = _single_byte_range(header)
    if spec is None:
        return None
    shown = _shown(header)
    m = _SPEC_RE.match(spec)
    if not m or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(f"invalid range {shown}")
    first, last = m.groups()
    if not first:  # suffix range: the last N bytes
        n = _position(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"range {shown} not satisfiable for {size} bytes")
        return ByteRange(max(0, size - n), size - 1, size)
    start = _position(first)
    if last:
        end = _position(last)
        if end < start:
            raise RangeNotSatisfiable(f"invalid range {shown}: end before start")
    else:
        end = size - 1
    if start >= size:
        raise RangeNotSatisfiable(f"range {shown} starts past the end ({size} bytes)")
    return ByteRange(start, min(end, size - 1), size)


_PAST_ANY_OBJECT = 1 << 63


def _position(digits: str) -> int:
    """A byte position of ASCII digits (checked by the caller's pattern): its value, or
    a number past any object when it has more digits than a size can have."""
    n = parse_decimal(digits)
    return _PAST_ANY_OBJECT if n is None else n


def _shown(header: str, limit: int = 64) -> str:
    """A header value quoted for a one-line error message, cut short when it is long."""
    text = header.strip()
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


@functools.lru_cache(maxsize=1024)  # the same few dates come back with every request
def _parse_http_date(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt


def _etags(value: str) -> list[tuple[bool, str]]:
    """Split an If-Match/If-None-Match list into (weak, opaque-tag) pairs; '*' kept."""
    out: list[tuple[bool, str]] = []
    for m in re.finditer(r'\s*(W/)?("(?:[^"]*)"|\*)\s*(?:,|$)', value):
        out.append((m.group(1) is not None, m.group(2)))
    return out


def _strong(etag: str | None) -> str | None:
    return etag if is_strong_etag(etag) else None


def _weak_value(etag: str) -> str:
    return etag[2:] if etag.startswith("W/") else etag


def range_applies(headers: Mapping[str, str], etag: str | None, last_modified: str | None) -> bool:
    """RFC 9110 §13.1.5 If-Range: True when a Range header should be honoured."""
    if_range = headers.get("If-Range")
    if if_range is None:
        return True
    if_range = if_range.strip()
    if if_range.startswith('"') or if_range.startswith("W/"):
        strong = _strong(etag)
        return strong is not None and not if_range.startswith("W/") and if_range == strong
    # a date: must equal Last-Modified exactly (strong validator)
    return last_modified is not None and if_range == last_modified.strip()


def conditional_status(
    method: str, headers: Mapping[str, str], etag: str | None, last_modified: str | None
) -> int | None:
    """RFC 9110 §13.2.2 evaluation order; returns 304, 412 or None (serve normally).
    ``last_modified`` is parsed only when a date precondition asks for it: most requests
    carry none, and parsing an HTTP-date costs more than the rest of this together."""
    if_match = headers.get("If-Match")
    if if_match is not None:
        tags = _etags(if_match)
        strong = _strong(etag)
        ok = any(t == "*" for _, t in tags) or (
            strong is not None and any(not w and t == strong for w, t in tags)
        )
        if not ok:
            return 412
    else:
        ius = _parse_http_date(headers.get("If-Unmodified-Since"))
        lm = _parse_http_date(last_modified) if ius is not None else None
        if ius is not None and lm is not None and lm > ius:
            return 412
    if_none_match = headers.get("If-None-Match")
    if if_none_match is not None:
        tags = _etags(if_none_match)
        if any(t == "*" for _, t in tags) or (
            etag is not None and any(t == _weak_value(etag) for _, t in tags)
        ):
            return 304 if method in ("GET", "HEAD") else 412
    elif method in ("GET", "HEAD"):
        ims = _parse_http_date(headers.get("If-Modified-Since"))
        lm = _parse_http_date(last_modified) if ims is not None else None
        if ims is not None and lm is not None and lm <= ims:
            return 304
    return None
