"""One response path: :func:`_answer` decides the headers, conditionals, Range and HEAD
for hits, followers, bypasses and cold answers alike, then hands a byte range to a body
source (RAM, file ``sendfile``, a download in progress, an upstream stream)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.context import (
    DEFAULT_TYPE,
    FETCHER,
    METRICS,
    RUNTIME,
    SETTINGS,
    T_BYTES,
    T_RESP,
    T_START,
    _abort_client,
    _error_response,
    _waited,
)
from proxy.decide import XCache
from proxy.hits import HitTier
from proxy.inflight import Download, DownloadFailed, State
from proxy.policy import (
    ByteRange,
    conditional_status,
    confine,
    current_age,
    parse_range,
    range_applies,
)
from proxy.sendfile import send_file, send_now, send_rest
from proxy.upstream import ObjectMeta
from proxy.upstream.resume import can_resume
from shardcache.compat import delimit_by_close
from shardcache.errors import (
    IncompleteDownloadError,
    ProxyError,
    RangeNotSatisfiable,
)
from shardcache.meta import whole_body_only
from shardcache.store import Entry

log = logging.getLogger(__name__)


def _decide(
    request: web.Request, size: int | None, etag: str | None, last_modified: str | None
) -> tuple[int | None, ByteRange | None]:
    """(status for a bodiless answer or None, byte range or None for the whole object)."""
    cond = conditional_status(request.method, request.headers, etag, last_modified)
    if cond is not None:
        return cond, None
    rng = request.headers.get("Range")
    if rng is None or size is None or not range_applies(request.headers, etag, last_modified):
        return None, None
    try:
        return None, parse_range(rng, size)
    except RangeNotSatisfiable as exc:
        raise RangeNotSatisfiable(str(exc), size=size) from None


def _first_byte(request: web.Request, cache: str) -> None:
    """Observe this request's time to first byte."""
    request.app[METRICS].observe_ttfb(cache, time.monotonic() - request[T_START])


async def _answer(
    request: web.Request,
    meta: ObjectMeta,
    cache: str,
    size: int | None,
    body: _Body,
    extra: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Answer with version ``meta`` of the object (``size`` bytes, None while unknown)
    and its bytes from ``body``: headers built, conditionals and Range decided (a 304/412
    without a body, RangeNotSatisfiable for a 416), the response prepared, the byte range
    sent and the response ended — or the connection aborted when ``body`` reports a
    cut. ``body`` is closed when the answer ends."""
    try:
        cond, brange = _decide(request, size, meta.etag, meta.last_modified)
        status, start, end = 200, 0, size
        if cond is None and brange is None and body.headers is not None:
            # the whole object: the header block kept with the entry (the response
            # copies it), then this answer's own fields
            headers = body.headers
        else:
            own = {"X-Cache": cache, "Accept-Ranges": "bytes"}
            if meta.etag:
                own["ETag"] = meta.etag
            if meta.last_modified:
                own["Last-Modified"] = meta.last_modified
            own.update(extra or {})
            if cond == 304:
                headers = _with_fields(meta, own, NOT_MODIFIED_FIELDS)
                return web.Response(status=304, headers=headers)
            if cond is not None:
                return _error_response(412, "precondition failed", own)
            # the upstream's type as it was sent: web.Response(content_type=) refuses one
            # with parameters ("text/plain; charset=utf-8")
            own["Content-Type"] = meta.content_type or DEFAULT_TYPE
            if brange is not None:
                status, start, end = 206, brange.start, brange.end + 1
                own["Content-Range"] = brange.content_range
            headers = _with_fields(meta, own, None, whole=brange is None)
            confine(headers)
            extra = None
        if body.data is not None:
            resp: web.StreamResponse = web.Response(
                body=body.data[start:end], status=status, headers=headers
            )
            if extra:
                resp.headers.update(extra)
            _first_byte(request, cache)
            return resp
        resp = web.StreamResponse(status=status, headers=headers)
        if extra:
            resp.headers.update(extra)
        if end is not None:
            resp.content_length = end - start
        elif meta.close_delimited and request.method != "HEAD":
            # the upstream's body ends where its connection ends, which cannot tell its
            # end from a cut: so does this one (a chunked end would vouch for bytes
            # nobody can vouch for); a cut seen as one still resets the connection
            delimit_by_close(resp)
        # else chunked
        request[T_RESP] = resp
        await resp.prepare(request)
        if request.method == "HEAD" or start == end:
            await resp.write_eof()
            return resp
        cut = await body.send(request, resp, start, end, lambda: _first_byte(request, cache))
        if cut is not None:
            log.warning("aborting %s %s: %s", request.method, request.raw_path, cut)
            _abort_client(request)
            return resp
        await resp.write_eof()
        return resp
    finally:
        body.close()


# the stored fields a 304 carries (RFC 9110 15.4.5); the rest describe a body it lacks
NOT_MODIFIED_FIELDS = frozenset({"cache-control", "content-location", "date", "expires", "vary"})


def _with_fields(
    meta: ObjectMeta,
    own: dict[str, str],
    only: frozenset[str] | None,
    *,
    whole: bool = True,
) -> CIMultiDict[str]:
    """The answer's headers: the upstream's stored end-to-end fields (those in ``only``
    when given; on a part of the body, none that describes the whole body), then the
    proxy's own (``own``), which replace fields of the same name."""
    out: CIMultiDict[str] = CIMultiDict()
    mine = {k.lower() for k in own}
    for k, v in meta.fields:
        low = k.lower()
        if low in mine:
            continue
        if only is not None and low not in only:
            continue
        if not whole and whole_body_only(k):
            continue
        out.add(k, v)
    out.update(own)
    return out


def whole_headers(meta: ObjectMeta, cache: str, extra: tuple[str, ...]) -> CIMultiDict[str]:
    """The headers of every 200 answer of the whole object ``meta`` with X-Cache
    ``cache``, but for the fields named in ``extra`` (each answer's own, added to a copy):
    what :func:`_answer` builds for such an answer (confined: bytes from an upstream
    never run as a page of the proxy's origin), made once per entry."""
    own = {"X-Cache": str(cache), "Accept-Ranges": "bytes"}
    if meta.etag:
        own["ETag"] = meta.etag
    if meta.last_modified:
        own["Last-Modified"] = meta.last_modified
    own.update(dict.fromkeys(extra, ""))
    own["Content-Type"] = meta.content_type or DEFAULT_TYPE
    headers = _with_fields(meta, own, None)
    for name in extra:
        del headers[name]
    confine(headers)
    return headers


class _Body:
    """Where the bytes of an answer come from. :func:`_answer` decides the response
    (headers, conditionals, Range, HEAD, an empty body) and hands the byte range to
    :meth:`send`; a source whose bytes are all in memory sets ``data`` and is answered
    as one ``web.Response`` instead. A source that knows the headers of an answer with
    the whole object (but for the answer's ``extra`` fields) sets ``headers``."""

    data: bytes | None = None
    headers: CIMultiDict[str] | None = None

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        """Send the object's bytes ``[start, end)`` (``end`` None: to its end) through the
        prepared ``resp``, count them in ``request[T_BYTES]`` and call ``first_byte()``
        as the first one goes out. None when every byte went out; otherwise why the body
        was cut, and the caller aborts the connection (never a clean end)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


HIT_FIELDS = ("Age",)  # the fields of a hit's answer that are its own


def hit_age(entry: Entry, now: float, base: float | None = None) -> str:
    """A hit's ``Age``: the upstream's Age when it last vouched for these bytes, or their
    apparent age by its Date (``base``, when the caller kept :func:`age_base`), plus
    the time since (RFC 9111 4.2.3, 5.1)."""
    if base is None:
        return str(int(current_age(entry.fields, entry.validated, now)))
    return str(int(base + max(0.0, now - entry.validated)))


def age_base(entry: Entry) -> float:
    """The part of a hit's ``Age`` that stays until the entry is validated again: its age
    when the upstream last vouched for it (:func:`hit_age` adds the time since)."""
    return current_age(entry.fields, entry.validated, entry.validated)


class _NoBody(_Body):
    """The body of an answer that has none (HEAD without an upstream body)."""


class _EntryBody(_Body):
    """A cache entry: a small one from the RAM tier (one ``web.Response``, no
    streaming), a larger one from its file with ``sendfile`` on the loop."""

    def __init__(self, tier: HitTier, entry: Entry):
        self.tier = tier
        self.entry = entry
        self.fobj: Any = None
        kept = self.tier.kept(entry)
        if kept is None:
            meta = entry.meta
            kept = (meta, whole_headers(meta, XCache.HIT, HIT_FIELDS))
            self.tier.keep(entry, kept)
        self.meta: ObjectMeta = kept[0]  # the entry's version, made once
        self.headers = kept[1]

    def open(self) -> bool:
        """Find the entry's bytes (and record the access); False when its file is gone
        or replaced."""
        tier, entry = self.tier, self.entry
        if tier.cacheable(entry):
            self.data = tier.small(entry)
            if self.data is None:
                self.data = tier.load(entry)
            found = self.data is not None
        else:
            self.fobj = tier.open(entry)
            found = self.fobj is not None
        if found:
            tier.store.touch(entry)
        return found

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        count = (self.entry.size if end is None else end) - start
        first_byte()
        sent = await _send_file(request, resp, self.fobj, start, count)
        return None if sent == count else f"entry file ended at byte {start + sent}"

    def close(self) -> None:
        if self.fobj is not None:
            self.fobj.close()


class _DownloadBody(_Body):
    """A download in progress: the written prefix of its ``.part`` file by threaded
    ``sendfile`` (``write`` when the response is chunked), the object's last byte held
    back until the entry is committed; a range far ahead of the download straight from
    the upstream."""

    def __init__(self, dl: Download):
        self.dl = dl

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        dl = self.dl
        if (
            end is not None
            and dl.state is State.STREAMING
            and start > dl.written + DIRECT_RANGE_AHEAD
            and can_resume(dl.meta)
            # parts: the part holding it is fetched next instead (an object of one part
            # is short to wait for)
            and not (dl.reads_ahead or request.app[FETCHER].in_parts(dl.url))
            and request.app[SETTINGS].cold_range == "fast"
        ):
            # far ahead of the download: read this version's bytes straight from the
            # upstream (the download fetches them too: counted)
            chunks = request.app[FETCHER].read_range(dl.url, start, end, meta=dl.meta)
            extra = request.app[METRICS].upstream_extra_bytes.labels(reason="ahead")
            return await _ChunkBody(_counted(chunks, extra), start).send(
                request, resp, start, end, first_byte
            )

        async def write(data: bytes) -> None:
            await resp.write(data)
            request[T_BYTES] += len(data)

        async def send(fobj: Any, offset: int, count: int) -> int:
            # a short span (a small object, a follower's last bytes) on the loop: the
            # thread hop would cost more than the copy it spreads
            threaded = count > LOOP_SEND_MAX
            return await _send_file(request, resp, fobj, offset, count, threaded=threaded)

        # followers send the written prefix of the .part file straight from the page cache;
        # a chunked response (size unknown) needs the writer's framing, so it gets write()
        framed = resp.content_length is None
        try:
            await dl.stream(
                write,
                start,
                end,
                first_byte,
                send=None if framed else send,
                on_wait=lambda since: _waited(request, since),
            )
        except DownloadFailed as exc:
            return str(exc)
        return None


class _ChunkBody(_Body):
    """An upstream body streamed to one client; its first chunk starts at the object's
    byte ``first``. The wait for every chunk counts as the client waiting."""

    def __init__(self, chunks: AsyncIterator[bytes], first: int = 0):
        self.chunks = chunks
        self.first = first

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        lo = start - self.first
        hi = None if end is None else end - self.first
        pos = 0
        first = True
        it = aiter(self.chunks)
        try:
            while True:
                since = time.monotonic()
                try:
                    chunk = await anext(it)
                except StopAsyncIteration:
                    break
                finally:
                    _waited(request, since)
                a, b = pos, pos + len(chunk)
                pos = b
                if b <= lo:
                    continue
                piece = chunk[max(0, lo - a) : (len(chunk) if hi is None else max(0, hi - a))]
                if piece:
                    if first:
                        first = False
                        first_byte()
                    await resp.write(piece)
                    request[T_BYTES] += len(piece)
                if hi is not None and pos >= hi:
                    break
        except (IncompleteDownloadError, ProxyError) as exc:
            request.app[METRICS].failed_downloads.inc()
            return str(exc)
        if hi is not None and pos < hi:
            return f"upstream ended at byte {self.first + pos}"
        return None


async def _send_file(
    request: web.Request,
    resp: web.StreamResponse,
    fobj: Any,
    offset: int,
    count: int,
    *,
    threaded: bool = False,
) -> int:
    """Send ``count`` bytes of ``fobj`` from ``offset``: ``sendfile`` on a plain transport,
    else (TLS, no native sendfile, ``sendfile=False``) ``pread`` into ``resp.write``.
    ``threaded``: each ``sendfile`` call on a worker thread (followers of a download: many
    clients copying at once spread over the cores; measured 1.13 s against 1.50 s for 16
    clients of one cold 256 MiB shard) rather than on the event loop (hits: one call
    usually sends it all, and the thread hop costs more than it spreads: 1 MiB hits at
    0.58x nginx threaded against 0.80x on the loop).

    Returns the bytes sent; fewer than ``count`` only when the file ended early, in which
    case the client connection has been aborted (never a clean end). The response must
    not be chunked: sendfile bypasses the writer's framing.
    """
    loop = asyncio.get_running_loop()
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("client gone")
    if request.app[RUNTIME].sendfile:
        try:
            sent = await send_file(transport, fobj, offset, count) if threaded else None
            if sent is None and (now := send_now(transport, fobj, offset, count)) is not None:
                # on the loop, at once: a hit usually goes out whole in this one call
                sent, ended = now
                if sent < count and not ended:
                    sent += await send_rest(
                        transport, fobj, offset + sent, count - sent, pause=True
                    )
            if sent is None:
                sent = await loop.sendfile(transport, fobj, offset, count, fallback=False)
            request[T_BYTES] += sent
            if sent < count:
                _abort_client(request)  # the file shrank under us: never end cleanly
            return sent
        except (NotImplementedError, RuntimeError):
            pass
    fd = fobj.fileno()
    pos, end = offset, offset + count
    while pos < end:
        data = await loop.run_in_executor(None, os.pread, fd, min(1 << 20, end - pos), pos)
        if not data:
            _abort_client(request)  # the file shrank under us: never end cleanly
            break
        await resp.write(data)
        pos += len(data)
        request[T_BYTES] += len(data)
    return pos - offset


LOOP_SEND_MAX = 64 << 10  # a download's span up to this long is sent from the event loop
DIRECT_RANGE_AHEAD = 4 << 20  # a range this far past a download's bytes is read directly


async def _counted(chunks: AsyncIterator[bytes], counter: Any) -> AsyncIterator[bytes]:
    """``chunks``, their sizes added to ``counter`` as they pass."""
    async for chunk in chunks:
        counter.inc(len(chunk))
        yield chunk
