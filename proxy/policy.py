"""Pure decisions of the proxy: no I/O, no clock, no event loop.

Everything the request handlers must *decide* lives here and is tested directly: size
parsing, mapping a request path to an upstream URL, Range parsing and clipping (RFC 9110
§14), conditional requests (RFC 9110 §13), hop-by-hop header filtering and admission.
The handlers in :mod:`proxy.app` only carry out the answers.

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
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote, unquote, urlsplit

from shardcache.errors import BadRequest, Forbidden, NotFound, RangeNotSatisfiable
from shardcache.meta import is_strong_etag, parse_decimal
from shardcache.sizes import format_size

__all__ = [
    "parse_min_free",
    "parse_revalidate",
    "needs_revalidation",
    "cache_control_forbids",
    "ByteRange",
    "Upstream",
    "parse_size",
    "parse_bound",
    "format_size",
    "parse_range",
    "range_start",
    "range_applies",
    "conditional_status",
    "map_request",
    "map_url",
    "end_to_end_headers",
    "should_admit",
]

# ---------------------------------------------------------------------------------------
# sizes

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtpe", start=1):
    _UNITS[_p] = 1000**_i
    _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = 1024**_i
    _UNITS[_p + "ib"] = 1024**_i


def parse_size(text: str | int, *, unit_below: int = 0) -> int:
    """Parse a byte count: ``"500G"``, ``"1.5T"``, ``"10MiB"``, ``"4096"``.

    Suffixes K, M, G, T, P, E (optionally followed by ``B``) are powers of 1000 (``1G`` is
    10^9 bytes); ``Ki``, ``Mi``, ``Gi``… (optionally ``KiB``…) are powers of 1024 (``1GiB``
    is 2^30 bytes). Case is ignored. The result is rounded down to whole bytes. Raises
    ValueError naming the bad text, also for a negative size.

    ``unit_below``: a text without a unit that means fewer bytes than this (but not 0) is
    refused with a hint. ``--cache-size 10`` is a unit forgotten far more often than a
    wish for 10 bytes, and such a bound silently turns every shard away; ``10B`` says
    bytes on purpose.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    if str(text).strip().startswith("-"):
        raise ValueError(f"size must not be negative: {text!r}")
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 500G, 1.5T, 10MiB or bytes)")
    number, unit = m.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    value = float(number) * factor
    if not math.isfinite(value):
        raise ValueError(f"size too large: {text!r}")
    if not unit and 0 < value < unit_below:
        raise ValueError(
            f"{number} = {int(value)} bytes; did you mean {number}G? (a size without a unit "
            f"is bytes: write {number}B if bytes are meant)"
        )
    return int(value)


BARE_SIZE_MIN = 1 << 20  # a setting's size without a unit below this is refused


def parse_bound(text: str | int) -> int:
    """A size that bounds the cache (``--cache-size``, ``--min-free``, a plan's lookahead):
    :func:`parse_size`, refusing a number without a unit below 1 MiB as a forgotten unit."""
    return parse_size(text, unit_below=BARE_SIZE_MIN)


def parse_min_free(text: str) -> int | float:
    """``--min-free``: a byte count (``"2G"``, ``"0"``) -> int, or a percentage of the
    filesystem (``"5%"``) -> a fraction below 1. Raises ValueError naming the bad text."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise ValueError(f"not a percentage: {text!r}") from None
        if not 0 <= pct < 100:
            raise ValueError(f"percentage must be in [0, 100): {text!r}")
        return pct / 100.0
    return parse_bound(t)


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_revalidate(text: str) -> float | None:
    """``--revalidate``: ``never`` -> None (entries are immutable), ``always`` -> 0.0, or an
    age such as ``30s``, ``10m``, ``1h``, ``2d``, ``500ms`` or plain seconds -> seconds.
    Raises ValueError naming the bad text."""
    t = text.strip().lower()
    if t == "never":
        return None
    if t == "always":
        return 0.0
    m = _DURATION_RE.match(t)
    if not m:
        raise ValueError(f"expected never, always or an age such as 10m (got {text!r})")
    value = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if not math.isfinite(value):
        raise ValueError(f"age too large: {text!r}")
    return value


def needs_revalidation(max_age: float | None, validated: float, now: float) -> bool:
    """Whether a hit validated at ``validated`` must ask the upstream first."""
    return max_age is not None and now - validated >= max_age


# hosts an upstream may redirect to besides its own: the Hugging Face Hub's CDN and
# storage hosts, where its resolve URLs lead (see proxy.upstream.redirects)
DEFAULT_REDIRECT_HOSTS: tuple[str, ...] = ("*.hf.co", "*.huggingface.co", "huggingface.co")


# Query parameters that sign a URL or bound its validity, by the parameter whose presence
# says the URL is signed that way. Only a signed URL loses them (an ordinary query with an
# "st" or "expires" parameter keeps it): AWS SigV4 presigned URLs, SigV2 / CloudFront /
# GCS V2 signatures, GCS V4 signed URLs, Azure SAS tokens.
SIGNATURE_FAMILIES: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "x-amz-signature",
        frozenset(
            {
                "x-amz-algorithm",
                "x-amz-credential",
                "x-amz-date",
                "x-amz-expires",
                "x-amz-signedheaders",
                "x-amz-signature",
                "x-amz-security-token",
            }
        ),
    ),
    (
        "x-goog-signature",
        frozenset(
            {
                "x-goog-algorithm",
                "x-goog-credential",
                "x-goog-date",
                "x-goog-expires",
                "x-goog-signedheaders",
                "x-goog-signature",
            }
        ),
    ),
    (
        "signature",
        frozenset(
            {
                "signature",
                "expires",
                "awsaccesskeyid",
                "googleaccessid",
                "key-pair-id",
                "policy",
                "x-amz-security-token",
            }
        ),
    ),
    (
        "sig",
        frozenset(
            {
                "sig",
                "sv",
                "ss",
                "srt",
                "sp",
                "se",
                "st",
                "spr",
                "sr",
                "si",
                "sip",
                "skoid",
                "sktid",
                "skt",
                "ske",
                "sks",
                "skv",
                "saoid",
                "suoid",
                "scid",
                "sdd",
                "ses",
            }
        ),
    ),
)


def unsigned_url(url: str) -> str:
    """``url`` without the parameters that sign it or bound its validity (see
    :data:`SIGNATURE_FAMILIES`), the other parameters in their order; ``url`` itself,
    unchanged, when it is not signed. The cache key of a signed URL: the same object
    under a fresh signature is the same entry."""
    base, sep, query = url.partition("?")
    if not sep or not query:
        return url
    pairs = query.split("&")
    names = [unquote(p.partition("=")[0]).lower() for p in pairs]
    present = set(names)
    drop: set[str] = set()
    for marker, family in SIGNATURE_FAMILIES:
        if marker in present:
            drop |= family
    if not drop:
        return url
    kept = [p for p, n in zip(pairs, names, strict=True) if n not in drop]
    return base + ("?" + "&".join(kept) if kept else "")


# Request fields the proxy does not pass to an upstream: hop-by-hop fields, those the
# cache manages itself (ranges and conditionals: a shared download must be the whole
# object), the framing of this connection, the compression it asks for (identity), its
# own, and credentials (a client's Authorization or Cookie must not fetch an object that
# other clients are then served).
NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        "range",
        "if-range",
        "if-match",
        "if-none-match",
        "if-modified-since",
        "if-unmodified-since",
        "accept-encoding",
        "authorization",
        "cookie",
        "x-amz-security-token",
    }
)


def forwarded_fields(headers: Mapping[str, str]) -> dict[str, str]:
    """The end-to-end fields of a client's request that go on to the upstream with a
    miss (see :data:`NOT_FORWARDED`; also those its ``Connection`` names, the proxy's
    own ``X-Shardcache-*`` fields and the S3 front's SigV4 fields)."""
    named = {t.strip().lower() for t in (headers.get("Connection") or "").split(",")}
    out: dict[str, str] = {}
    for k, v in headers.items():
        low = k.lower()
        if low in NOT_FORWARDED or low in named or low.startswith(("x-shardcache-", "x-amz-")):
            continue
        out[k] = f"{out[k]}, {v}" if k in out else v
    return out


def _directives(value: str | None) -> dict[str, str | None]:
    """The directives of a Cache-Control value: lower-cased name -> argument or None."""
    out: dict[str, str | None] = {}
    for directive in (value or "").split(","):
        name, eq, arg = directive.partition("=")
        name = name.strip().lower()
        if name:
            out.setdefault(name, arg.strip().strip('"') if eq else None)
    return out


def must_revalidate_each_use(cache_control: str | None) -> bool:
    """Whether a stored answer with this ``Cache-Control`` may be reused only after the
    upstream confirms it, every time (``no-cache`` without field names, RFC 9111 5.2.2.4;
    the qualified form only forbids replaying the fields it names)."""
    d = _directives(cache_control)
    return "no-cache" in d and not d["no-cache"]


def vary_forbids(vary: str | None, content_encoding: str | None) -> bool:
    """Whether an answer with this ``Vary`` cannot be stored: this cache keys entries by
    URL alone, so an answer chosen by request fields is stored only when any client may
    have it. ``Vary: *`` never; ``Vary: Accept-Encoding`` on an unencoded answer (the
    proxy asks for identity, which every client accepts) is fine, and so are the CORS
    fields (:data:`HARMLESS_VARY`); any other field is not stored (each client is
    answered by the upstream, uncached)."""
    if not vary:
        return False
    fields = {f.strip().lower() for f in vary.split(",") if f.strip()}
    if not fields:
        return False
    if "*" in fields:
        return True
    encoded = (content_encoding or "identity").strip().lower() != "identity"
    return bool(fields - HARMLESS_VARY) or (encoded and "accept-encoding" in fields)


# request fields whose variation leaves the body alone: CORS (object stores answer
# ``Vary: Origin`` on every GET; only the Access-Control-* fields follow the Origin)
HARMLESS_VARY = frozenset(
    {"accept-encoding", "origin", "access-control-request-method", "access-control-request-headers"}
)


def cache_control_forbids(value: str | None) -> bool:
    """Whether an upstream ``Cache-Control`` forbids a shared cache to store the answer
    (``no-store`` or ``private``)."""
    if not value:
        return False
    for directive in value.split(","):
        name = directive.split("=", 1)[0].strip().lower()
        if name in ("no-store", "private"):
            return True
    return False


# ---------------------------------------------------------------------------------------
# ranges


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


# ---------------------------------------------------------------------------------------
# URL mapping


@dataclass(frozen=True)
class Upstream:
    """An upstream base URL, optionally mounted under ``/<name>/``."""

    name: str | None
    base: str  # no trailing slash; scheme http, https or file

    def __str__(self) -> str:
        return f"{self.name}={self.base}" if self.name else self.base


_SEGMENT_SAFE = "!$&'()*+,;=:@~"
_ABSOLUTE_RE = re.compile(r"^/(https?):/{1,2}(.*)$", re.IGNORECASE | re.DOTALL)


def _clean_segments(raw_segments: Sequence[str], what: str) -> list[str]:
    """Percent-decode path segments and reject traversal; return re-quoted segments."""
    out: list[str] = []
    for raw in raw_segments:
        seg = unquote(raw, errors="strict") if "%" in raw else raw
        if seg in (".", ".."):
            raise BadRequest(f"path traversal not allowed in {what}")
        if "/" in seg or "\\" in seg:
            raise BadRequest(f"encoded slash or backslash not allowed in {what}")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in seg):
            raise BadRequest(f"control character not allowed in {what}")
        out.append(quote(seg, safe=_SEGMENT_SAFE))
    return out


def _host_allowed(netloc_host: str, port: int | None, allow_hosts: Iterable[str]) -> bool:
    for allowed in allow_hosts:
        allowed = allowed.strip().lower()
        if not allowed:
            continue
        if ":" in allowed and not allowed.startswith("["):
            host, _, p = allowed.rpartition(":")
            if host == netloc_host and p.isdigit() and port == int(p):
                return True
        elif allowed == netloc_host:
            return True
    return False


def map_request(
    raw_target: str,
    upstreams: Sequence[Upstream],
    allow_hosts: Sequence[str] = (),
    max_length: int = 1024,
) -> str:
    """Map the raw request target (path and query, still percent-encoded) to the
    canonical upstream URL that is both fetched and used as the cache key.

    ``/<path>`` goes to the unnamed upstream, ``/<name>/<path>`` to the upstream mounted as
    ``name``, and ``/http(s)://host/<path>`` to that host only if it is in ``allow_hosts``.
    Raises BadRequest (traversal, NUL or control characters, over-long, malformed),
    Forbidden (a host not allowed) or NotFound (no upstream serves the path).
    """
    if len(raw_target) > max_length:
        raise BadRequest(f"request path longer than {max_length} characters")
    if "\x00" in raw_target or "%00" in raw_target:
        raise BadRequest("NUL byte not allowed in path")
    if not raw_target.startswith("/"):
        raise BadRequest("request target must be an absolute path")
    path, _, query = raw_target.partition("?")
    path = path.partition("#")[0]
    try:
        m = _ABSOLUTE_RE.match(path)
        if m:
            return _map_absolute(m.group(1).lower(), m.group(2), query, allow_hosts)
        segments = path[1:].split("/")
        if segments and segments[-1] == "":
            segments = segments[:-1]
        clean = _clean_segments(segments, "path")
    except UnicodeDecodeError as exc:
        raise BadRequest("path is not valid percent-encoded UTF-8") from exc
    if not clean or any(s == "" for s in clean):
        raise NotFound("empty path segment or no shard path" if clean else "no shard path given")
    named = {u.name: u for u in upstreams if u.name}
    default = next((u for u in upstreams if not u.name), None)
    if clean[0] in named and len(clean) > 1:
        base, rest = named[clean[0]].base, clean[1:]
    elif default is not None:
        base, rest = default.base, clean
    else:
        raise NotFound(f"no upstream serves /{'/'.join(clean)}")
    url = base + "/" + "/".join(rest)
    return url + ("?" + query if query else "")


def _map_absolute(scheme: str, rest: str, query: str, allow_hosts: Sequence[str]) -> str:
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise BadRequest("credentials not allowed in an absolute URL")
    parts = urlsplit(f"{scheme}://{authority}")
    try:
        host, port = (parts.hostname or ""), parts.port
    except ValueError as exc:
        raise BadRequest(f"bad host in absolute URL: {authority!r}") from exc
    if not host:
        raise BadRequest("absolute URL without a host")
    if not _host_allowed(host, port, allow_hosts):
        raise Forbidden(f"host {host} is not allowed (see --allow-host)")
    segments = path.split("/") if slash else []
    if segments and segments[-1] == "":
        segments = segments[:-1]
    clean = _clean_segments(segments, "path")
    if not clean or any(s == "" for s in clean):
        raise NotFound("no shard path given in absolute URL")
    netloc = host if port is None else f"{host}:{port}"
    url = f"{scheme}://{netloc}/" + "/".join(clean)
    return url + ("?" + query if query else "")


def map_url(
    url: str, upstreams: Sequence[Upstream], allow_hosts: Sequence[str] = (), max_length: int = 1024
) -> str:
    """Canonicalise a URL or proxy path given to an admin route (prefetch, purge).

    A proxy path (``/shard.tar``) is mapped like a request; an absolute URL must lie under
    a configured upstream or on an allowed host, otherwise Forbidden (never an open proxy).
    """
    if url.startswith("/"):
        return map_request(url, upstreams, allow_hosts, max_length)
    for u in upstreams:
        if url.startswith(u.base + "/"):
            rest = url[len(u.base) :]
            prefix = f"/{u.name}" if u.name else ""
            return map_request(prefix + rest, upstreams, allow_hosts, max_length + len(prefix))
    if re.match(r"^https?://", url, re.IGNORECASE):
        return map_request("/" + url, upstreams, allow_hosts, max_length + 1)
    raise Forbidden(f"{url} is not under a configured upstream")


# ---------------------------------------------------------------------------------------
# headers and admission

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def end_to_end_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop hop-by-hop headers (RFC 9110 §7.6.1), including those named in Connection."""
    items = list(headers)
    named = {
        token.strip().lower()
        for k, v in items
        if k.lower() == "connection"
        for token in v.split(",")
        if token.strip()
    }
    return [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def should_admit(expected_size: int | None, cache_size: int) -> bool:
    """May a download of ``expected_size`` bytes become an entry at all?

    A shard larger than the whole cache is streamed through uncached. Whether there is
    room right now (eviction, the ``keep`` policy) is the store's decision.
    """
    return expected_size is None or expected_size <= cache_size
