"""What an upstream says about one object, in one shape from the first response headers
through a download to the cache entry: :class:`ObjectMeta`.

The validators decide whether two answers are the same version of an object: a strong
ETag when there is one, else Last-Modified; with neither, two answers cannot be proven to
be the same version, so nothing may be joined across them.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = [
    "ObjectMeta",
    "is_strong_etag",
    "md5_from_headers",
    "origin_headers",
    "parse_content_range",
    "parse_decimal",
]

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+([0-9]+)-([0-9]+)/([0-9]+|\*)\s*$", re.IGNORECASE)
_DECIMAL = re.compile(r"[0-9]+")
MAX_DIGITS = 18  # 10**18 bytes, an exabyte: past any object's size or offset


def parse_decimal(text: str) -> int | None:
    """A header field's non-negative decimal number, or None when the text is not one.

    Only ASCII digits count (``str.isdigit`` also accepts ``'²'``, which ``int`` then
    refuses), and leading zeros do not. A number of more than :data:`MAX_DIGITS`
    significant digits is None as well: it is past any object's size, and past about
    4,300 digits ``int`` raises instead of converting, so a client or an upstream could
    otherwise turn one header into an internal error."""
    t = text.strip()
    if not _DECIMAL.fullmatch(t):
        return None
    t = t.lstrip("0") or "0"
    return int(t) if len(t) <= MAX_DIGITS else None


def is_strong_etag(etag: str | None) -> bool:
    """True for an ETag usable with ``If-Match``/``If-Range`` (present and not weak)."""
    return bool(etag) and not etag.startswith("W/")  # type: ignore[union-attr]


def parse_content_range(value: str | None) -> tuple[int, int, int | None]:
    """Parse ``bytes first-last/size`` into ``(first, last_inclusive, size or None)``;
    ValueError naming the value when it is not one."""
    m = _CONTENT_RANGE.match(value or "")
    if not m:
        raise ValueError(f"bad Content-Range {(value or '')[:100]!r}")
    first, last = parse_decimal(m.group(1)), parse_decimal(m.group(2))
    size = None if m.group(3) == "*" else parse_decimal(m.group(3))
    if (
        first is None
        or last is None
        or (m.group(3) != "*" and size is None)
        or last < first
        or (size is not None and last >= size)
    ):
        raise ValueError(f"bad Content-Range {(value or '')[:100]!r}")
    return first, last, size


# Header fields never stored with an entry nor replayed from it: hop-by-hop fields
# (RFC 9110 7.6.1), the framing and validators the proxy sets itself on every answer, the
# per-request identifiers of object stores, and cookies (a shared cache never replays one
# client's Set-Cookie to another). The upstream's Age is kept: a hit's Age adds the time
# since to it (RFC 9111 4.2.3), and an answer from an entry always says its own Age.
NOT_STORED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-range",
        "accept-ranges",
        "etag",
        "last-modified",
        "content-type",
        "set-cookie",
        "set-cookie2",
        "x-cache",
        "x-amz-request-id",
        "x-amz-id-2",
        "x-ms-request-id",  # Azure's and GCS's per-request ids
        "x-ms-client-request-id",
        "x-guploader-uploadid",
    }
)
# Header fields that describe the whole body's bytes: true of a 200, wrong on a 206.
WHOLE_BODY_ONLY = frozenset({"content-md5", "x-goog-hash", "digest", "repr-digest"})
WHOLE_BODY_PREFIXES = ("x-amz-checksum-",)
MAX_STORED_HEADER_BYTES = 32 << 10  # a bigger header block is not cached (logged)


def origin_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The end-to-end header fields of an upstream answer that travel with its bytes:
    every field except the hop-by-hop ones (and those its ``Connection`` names), the
    framing and validators the proxy writes itself, per-request ids and cookies.
    Content-Encoding, Content-Language, Content-Disposition, Cache-Control, Expires,
    Vary, user metadata (``x-amz-meta-*``) and digests are among those kept, in order."""
    named = {
        t.strip().lower()
        for v in _all_values(headers, "Connection")
        for t in v.split(",")
        if t.strip()
    }
    out = []
    for k, v in headers.items():
        low = k.lower()
        if low in NOT_STORED or low in named:
            continue
        out.append((k, v))
    return tuple(out)


def _all_values(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    v = headers.get(name)
    return [] if v is None else [v]


def whole_body_only(name: str) -> bool:
    """Whether header field ``name`` describes the whole body (never sent on a 206)."""
    low = name.lower()
    return low in WHOLE_BODY_ONLY or low.startswith(WHOLE_BODY_PREFIXES)


def md5_from_headers(headers: Mapping[str, str]) -> bytes | None:
    """The MD5 an upstream declared for the body (``Content-MD5``, or GCS's
    ``x-goog-hash: md5=``), or None."""
    value = headers.get("Content-MD5")
    if not value:
        for part in (headers.get("x-goog-hash") or "").split(","):
            k, _, v = part.strip().partition("=")
            if k == "md5":
                value = v
    if not value:
        return None
    try:
        digest = base64.b64decode(value.strip(), validate=True)
    except ValueError:
        return None
    return digest if len(digest) == 16 else None


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """One version of one object: its size (None while unknown), validators and type."""

    size: int | None
    etag: str | None = None
    last_modified: str | None = None  # an HTTP-date, as the upstream sent it
    content_type: str | None = None
    md5: bytes | None = None  # declared digest of the whole body, verified when present
    cache_control: str | None = None
    accept_ranges: bool = False
    # the upstream's end-to-end header fields, stored with the entry and replayed on
    # every answer (see :func:`origin_headers`)
    fields: tuple[tuple[str, str], ...] = ()
    # digests of the whole body, as (algorithm, lowercase hex), checked before a commit
    # (declared by the upstream) and recorded with the entry (computed)
    digests: tuple[tuple[str, str], ...] = ()
    # a 200 framed by the connection closing (no Content-Length, not chunked): its end
    # cannot be told from a cut, so it is confirmed before it is cached
    close_delimited: bool = False

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], status: int = 200) -> ObjectMeta:
        """The object described by a response's headers: a 200's Content-Length is the
        size (None when chunked or close-delimited), a 206's size is the total of its
        Content-Range. The digest is kept only from a 200 (it covers the whole body)."""
        size: int | None = None
        close_delimited = False
        if status == 206:
            try:
                size = parse_content_range(headers.get("Content-Range"))[2]
            except ValueError:
                size = None
        else:
            length = headers.get("Content-Length")
            chunked = "chunked" in (headers.get("Transfer-Encoding") or "").lower()
            if length is not None and not chunked:
                size = parse_decimal(length)
            # no Content-Length, or one that is not a number (which http.client, too,
            # reads as none: the body runs to the close)
            close_delimited = size is None and not chunked and status == 200
        return cls(
            size=size,
            etag=headers.get("ETag"),
            last_modified=headers.get("Last-Modified"),
            content_type=headers.get("Content-Type"),
            md5=md5_from_headers(headers) if status == 200 else None,
            cache_control=headers.get("Cache-Control"),
            accept_ranges="bytes" in (headers.get("Accept-Ranges") or "").lower(),
            fields=origin_headers(headers),
            close_delimited=close_delimited,
        )

    @property
    def strong_etag(self) -> str | None:
        return self.etag if is_strong_etag(self.etag) else None

    @property
    def validator(self) -> str | None:
        """What pins this version in ``If-Range``: the strong ETag, else Last-Modified."""
        return self.strong_etag or self.last_modified

    def same_version(self, other: ObjectMeta) -> bool:
        """Whether ``other`` (another answer's metadata) is provably this version: equal
        strong ETags, or (with no ETag here) equal Last-Modified; and no size contradiction.
        False when this version has no validator: nothing proves it."""
        if self.size is not None and other.size is not None and self.size != other.size:
            return False
        if self.strong_etag is not None:
            return other.etag == self.strong_etag
        if self.etag is not None and other.etag is not None and other.etag != self.etag:
            return False  # a weak ETag that changed says the version changed
        return self.last_modified is not None and other.last_modified == self.last_modified

    def field(self, name: str) -> str | None:
        """The first stored header field ``name`` (case-insensitive), or None."""
        low = name.lower()
        for k, v in self.fields:
            if k.lower() == low:
                return v
        return None

    @property
    def content_encoding(self) -> str | None:
        return self.field("Content-Encoding")

    def with_size(self, size: int) -> ObjectMeta:
        return replace(self, size=size)

    def headers(self) -> dict[str, str]:
        """Response headers naming this version (ETag, Last-Modified)."""
        h: dict[str, str] = {}
        if self.etag:
            h["ETag"] = self.etag
        if self.last_modified:
            h["Last-Modified"] = self.last_modified
        return h
