"""The one rule for asking an upstream for bytes of one version of an object, checking
its answer, and deciding what to do after a failure. Pure: no I/O, tested alone.

Every ranged request (a resumed body, a parallel part, a client's range read from the
upstream) is built by :func:`range_headers` and its answer checked by :func:`verify`
before a byte of it is used; every failure goes through :func:`next_try`, with the one
backoff :func:`backoff_delay`.

- A request for bytes of a known version names it: ``If-Range`` (so an honest origin
  answers 200 with the whole new version instead of a range of it) and ``If-Match`` with
  a strong ETag, else ``If-Unmodified-Since`` with Last-Modified.
- The answer must be a 206 whose ``Content-Range`` start, end and total are exactly those
  asked, whose validators equal the version's (strong ETag; else Last-Modified) — or a
  200 when the whole object from byte 0 was asked. Anything else raises.
- Its framing must agree with itself (:func:`check_framing`): a 206's ``Content-Length``
  is its ``Content-Range`` span, or the bytes on the wire are not the bytes it names.
- A version with neither a strong ETag nor a Last-Modified is never resumed: nothing
  could prove that the continuation is of the same version.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardcache.errors import ObjectChanged, UpstreamCut, UpstreamError
from shardcache.meta import ObjectMeta, parse_content_range

__all__ = [
    "MAX_BACKOFF",
    "backoff_delay",
    "can_resume",
    "check_framing",
    "next_try",
    "range_headers",
    "verify",
]

MAX_BACKOFF = 5.0


def backoff_delay(attempt: int, base: float, cap: float = MAX_BACKOFF, rand: float = 1.0) -> float:
    """Seconds to wait before try ``attempt`` (1 for the first retry): ``base``, doubling
    each time up to ``cap``; ``rand`` in [0, 1] jitters it between half and all of that."""
    nominal = min(cap, base * 2 ** max(0, attempt - 1))
    return nominal * (0.5 + 0.5 * rand)


def can_resume(meta: ObjectMeta) -> bool:
    """Whether a continuation of ``meta`` can be proven to be the same version."""
    return meta.strong_etag is not None or meta.last_modified is not None


def next_try(
    meta: ObjectMeta | None,
    received: int,
    attempt: int,
    retries: int,
    base: float,
    rand: float = 1.0,
) -> float | None:
    """After failure number ``attempt`` (1, 2, ...) of a read that had ``received`` bytes
    of version ``meta``: the delay before asking again, or None to give up (retries spent,
    or bytes already received of a version that cannot be pinned)."""
    if attempt > retries:
        return None
    if received and (meta is None or not can_resume(meta)):
        return None
    return backoff_delay(attempt, base, rand=rand)


def range_headers(meta: ObjectMeta | None, start: int, end: int | None) -> dict[str, str]:
    """Request headers for bytes ``[start, end)`` (to the object's end when ``end`` is
    None) of version ``meta`` (any version when None)."""
    headers: dict[str, str] = {}
    size = meta.size if meta is not None else None
    whole_tail = end is None or (size is not None and end == size)
    if start or not whole_tail:
        # open-ended when the range runs to the object's end: every origin knows that form
        headers["Range"] = f"bytes={start}-" + ("" if whole_tail else str(end - 1))  # type: ignore[operator]
    if meta is not None:
        if meta.strong_etag:
            headers["If-Match"] = meta.strong_etag
        elif meta.last_modified:
            headers["If-Unmodified-Since"] = meta.last_modified
        if "Range" in headers and meta.validator:
            headers["If-Range"] = meta.validator
    return headers


def check_framing(url: str, status: int, headers: Mapping[str, str]) -> None:
    """Raise UpstreamCut when a 206's ``Content-Length`` is not the span of its
    ``Content-Range``: whichever of the two is wrong, the body cannot be both the bytes
    it names and the bytes that frame it (a short length leaves the rest of the range on
    the wire, to be read as the next answer; a long one waits for bytes that are not
    the range's). None of its bytes is used, so the request may be asked again from the
    same position, like a body that broke off before its first byte (:func:`next_try`).
    A Content-Range that cannot be parsed is :func:`verify`'s to refuse."""
    if status != 206:
        return
    length = (headers.get("Content-Length") or "").strip()
    if not length or "chunked" in (headers.get("Transfer-Encoding") or "").lower():
        return  # chunked or close-delimited: the body's end is its framing
    try:
        first, last, _ = parse_content_range(headers.get("Content-Range"))
    except ValueError:
        return
    if not length.isdigit() or int(length) != last - first + 1:
        raise UpstreamCut(
            f"upstream {url}: Content-Length {length} disagrees with Content-Range "
            f"bytes {first}-{last} ({last - first + 1} bytes)"
        )


def verify(
    url: str,
    meta: ObjectMeta | None,
    start: int,
    end: int | None,
    status: int,
    headers: Mapping[str, str],
) -> ObjectMeta:
    """Check an answer to :func:`range_headers` ``(meta, start, end)``; return the
    version it carries. Raises ObjectChanged when another version answered, UpstreamError
    when the answer is not the bytes asked for. Statuses other than 200/206/412 are the
    caller's to translate (its backend's table) before calling this."""
    got = ObjectMeta.from_headers(headers, status)
    if meta is not None and start == 0 and not can_resume(meta):
        # nothing received can be contradicted: from byte 0 any answer of the announced
        # size (and weak ETag, if any) will do
        if (meta.size is None or got.size in (None, meta.size)) and meta.etag in (None, got.etag):
            meta = None
    if status == 412:
        raise ObjectChanged(f"upstream {url}: object changed (412 Precondition Failed)")
    if status == 200:
        if meta is not None and not meta.same_version(got):
            raise ObjectChanged(f"upstream {url}: {_difference(meta, got)}")
        if start != 0 or (end is not None and end != got.size):
            raise UpstreamError(
                f"upstream {url}: answered 200 (the whole object) to a request for bytes "
                f"{start}-{'' if end is None else end - 1}; it ignores Range"
            )
        return got
    if status != 206:
        raise UpstreamError(f"upstream {url}: answered {status} where 206 was due")
    check_framing(url, status, headers)
    try:
        first, last, total = parse_content_range(headers.get("Content-Range"))
    except ValueError as exc:
        raise UpstreamError(f"upstream {url}: {exc}") from None
    size = meta.size if meta is not None else None
    if meta is not None and size is not None and total is not None and total != size:
        raise ObjectChanged(f"upstream {url}: size is now {total}, was {size}")
    want_last = (end - 1) if end is not None else (None if total is None else total - 1)
    if first != start or (want_last is not None and last != want_last):
        raise UpstreamError(
            f"upstream {url}: asked bytes {start}-{'' if end is None else end - 1}, "
            f"got {first}-{last}"
        )
    if meta is not None and not meta.same_version(got):
        raise ObjectChanged(f"upstream {url}: {_difference(meta, got)}")
    return got if total is not None else got.with_size(size) if size is not None else got


def _difference(was: ObjectMeta, now: ObjectMeta) -> str:
    if was.strong_etag:
        return f"ETag is now {now.etag}, was {was.etag}"
    if was.last_modified:
        return f"Last-Modified is now {now.last_modified}, was {was.last_modified}"
    return "no validator (strong ETag or Last-Modified) proves it is the same version"
