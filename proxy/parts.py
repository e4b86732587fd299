"""Parallel ranged fetches of one object, written in order.

A large object is fetched as ``part_size`` ranges by up to ``parallel`` concurrent
requests, each pinned to the object's ETag (``If-Match``), and handed to a sink strictly
in order, so a reader following the growing partial file always sees a contiguous prefix.
The part at the write frontier streams straight through; parts ahead of it are held in
memory (at most ``parallel - 1`` parts). A part that fails is retried alone, from the byte
where it stopped (bounded, with backoff). A replaced object (412, or a different ETag or
size in a response) stops the whole fetch with :class:`ObjectChanged`: bytes of two
versions are never mixed.

The source is abstract (:class:`RangedSource`); :class:`HTTPRangedSource` serves HTTP
upstreams that advertise ``Accept-Ranges: bytes`` and a Content-Length, and
``proxy.s3.S3RangedSource`` serves S3.

Pure policy (part plan, eligibility, backoff, Content-Range parsing) is in I/O-free
functions at the top.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Protocol

import aiohttp

from shardcache.errors import Forbidden, NotFound, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)

DEFAULT_PART_SIZE = 8 * 1024 * 1024
DEFAULT_PARALLEL = 8
DEFAULT_PART_RETRIES = 3
DEFAULT_BACKOFF = 0.2
MAX_BACKOFF = 5.0
# Upper bound of one sink call when several chunks are waiting.
MAX_WRITE_BATCH = 4 * 1024 * 1024

__all__ = [
    "DEFAULT_PARALLEL",
    "DEFAULT_PART_SIZE",
    "FileSink",
    "HTTPRangedSource",
    "ObjectChanged",
    "ObjectInfo",
    "RangedSource",
    "backoff_delay",
    "can_fetch_in_parts",
    "fetch_parts",
    "is_strong_etag",
    "info_from_headers",
    "parse_content_range",
    "parts_stream",
    "plan_parts",
    "response_chunks",
]


class ObjectChanged(UpstreamError):
    """The upstream object was replaced during a fetch (412, or its ETag/size changed)."""

    status_hint = 502


@dataclass(frozen=True)
class ObjectInfo:
    """What an upstream says about one object. ``last_modified`` is an HTTP-date string."""

    size: int | None
    etag: str | None = None
    last_modified: str | None = None
    content_type: str | None = None
    accept_ranges: bool = False


class RangedSource(Protocol):
    """One upstream object that can be read by byte ranges."""

    url: str

    async def stat(self) -> ObjectInfo:
        """Size, ETag and type of the object (a HEAD)."""
        ...

    def read_range(self, start: int, end: int, etag: str | None) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` of the object, pinned to ``etag`` when given.

        Raises :class:`ObjectChanged` when the object no longer has that ETag.
        """
        ...


# --------------------------------------------------------------------------- policy


def is_strong_etag(etag: str | None) -> bool:
    """True for an ETag usable with ``If-Match`` (present and not weak)."""
    return bool(etag) and not etag.startswith("W/")


def can_fetch_in_parts(info: ObjectInfo, part_size: int) -> bool:
    """Whether ``info`` allows a parallel ranged fetch that is worth doing.

    Needs a known size above one part, byte ranges, and a strong ETag to pin the parts to
    one version of the object.
    """
    return (
        info.size is not None
        and info.size > part_size
        and info.accept_ranges
        and is_strong_etag(info.etag)
    )


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges that cover ``size`` bytes in ``part_size`` steps."""
    if part_size <= 0:
        raise ValueError(f"part_size must be positive, got {part_size}")
    if size < 0:
        raise ValueError(f"size must not be negative, got {size}")
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


def backoff_delay(attempt: int, base: float, cap: float = MAX_BACKOFF, rand: float = 1.0) -> float:
    """Exponential backoff with jitter: attempt 0 waits about ``base`` seconds.

    ``rand`` in [0, 1] scales the delay between half and all of its nominal value.
    """
    nominal = min(cap, base * (2**attempt))
    return nominal * (0.5 + 0.5 * rand)


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def parse_content_range(value: str) -> tuple[int, int, int | None]:
    """Parse ``bytes first-last/size`` into ``(first, last_inclusive, size or None)``."""
    m = _CONTENT_RANGE.match(value or "")
    if not m:
        raise ValueError(f"bad Content-Range {value!r}")
    first, last = int(m.group(1)), int(m.group(2))
    size = None if m.group(3) == "*" else int(m.group(3))
    if last < first or (size is not None and last >= size):
        raise ValueError(f"bad Content-Range {value!r}")
    return first, last, size


# --------------------------------------------------------------------------- fetch


class FileSink:
    """A sink writing to a binary file object off the event loop, flushing each write."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self.fileobj = fileobj

    def _write(self, data: bytes) -> None:
        self.fileobj.write(data)
        self.fileobj.flush()

    async def __call__(self, data: bytes) -> None:
        await asyncio.to_thread(self._write, data)


_RETRY_ANYWAY = (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
_FATAL = (ObjectChanged, NotFound, Forbidden)


class _Part:
    __slots__ = ("start", "end", "chunks", "received", "finished")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.chunks: collections.deque[bytes] = collections.deque()
        self.received = 0
        self.finished = False

    @property
    def length(self) -> int:
        return self.end - self.start


async def fetch_parts(
    source: RangedSource,
    info: ObjectInfo,
    sink: Callable[[bytes], Awaitable[None]],
    *,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    retries: int = DEFAULT_PART_RETRIES,
    backoff: float = DEFAULT_BACKOFF,
    on_progress: Callable[[int], None] | None = None,
    initial: AsyncIterator[bytes] | None = None,
) -> int:
    """Fetch the whole object described by ``info`` as parallel parts, in order into ``sink``.

    ``sink(data)`` is awaited with consecutive pieces of the object; ``on_progress(n)`` is
    called after each with the number of contiguous bytes written so far. ``initial`` may
    be an already open stream of the object from offset 0 (the response of a first plain
    GET): it serves the first part, so no request is wasted. Each part is retried alone up
    to ``retries`` times, resuming where it stopped. Returns the number of bytes written.

    Raises :class:`ObjectChanged` if the object is replaced meanwhile, or the upstream
    error of a part that kept failing; the sink then holds an incomplete prefix that the
    caller must discard.
    """
    if info.size is None:
        raise ValueError(f"{source.url}: size unknown, cannot fetch in parts")
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    parts = [_Part(s, e) for s, e in plan_parts(info.size, part_size)]
    etag = info.etag
    changed = asyncio.Condition()
    state = {"next": 0, "frontier": 0}

    async def notify() -> None:
        async with changed:
            changed.notify_all()

    async def fill(part: _Part, index: int) -> None:
        attempt = 0
        stream = initial if index == 0 else None
        while part.received < part.length:
            try:
                if stream is None:
                    stream = source.read_range(part.start + part.received, part.end, etag)
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    async for chunk in stream:
                        if not chunk:
                            continue
                        room = part.length - part.received
                        if len(chunk) > room:
                            if index == 0 and stream is initial:
                                chunk = chunk[:room]  # the full-object stream runs on
                            else:
                                raise UpstreamError(
                                    f"{source.url}: range {part.start}-{part.end - 1} "
                                    f"returned more bytes than asked"
                                )
                        part.chunks.append(chunk)
                        part.received += len(chunk)
                        await notify()
                        if part.received == part.length:
                            break
                if part.received < part.length:
                    raise UpstreamError(
                        f"{source.url}: range {part.start}-{part.end - 1} ended after "
                        f"{part.received} of {part.length} bytes"
                    )
            except _FATAL:
                raise
            except _RETRY_ANYWAY as exc:
                if attempt >= retries:
                    raise
                delay = backoff_delay(attempt, backoff, rand=random.random())
                log.warning(
                    "%s: part %d-%d failed at +%d (%s); retry %d/%d in %.2fs",
                    source.url,
                    part.start,
                    part.end - 1,
                    part.received,
                    exc,
                    attempt + 1,
                    retries,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)
            finally:
                stream = None
        part.finished = True
        await notify()

    async def worker() -> None:
        while True:
            async with changed:
                index = state["next"]
                if index >= len(parts):
                    return
                state["next"] = index + 1
                # Stay within `parallel` parts of the write frontier (bounded memory).
                await changed.wait_for(lambda i=index: i < state["frontier"] + parallel)
            await fill(parts[index], index)

    async def writer() -> int:
        written = 0
        for index, part in enumerate(parts):
            while True:
                async with changed:
                    await changed.wait_for(lambda p=part: bool(p.chunks) or p.finished)
                batch: list[bytes] = []
                size = 0
                while part.chunks and size < MAX_WRITE_BATCH:
                    chunk = part.chunks.popleft()
                    batch.append(chunk)
                    size += len(chunk)
                if batch:
                    await sink(batch[0] if len(batch) == 1 else b"".join(batch))
                    written += size
                    if on_progress is not None:
                        on_progress(written)
                elif part.finished:
                    break
            async with changed:
                state["frontier"] = index + 1
                changed.notify_all()
        return written

    workers = [asyncio.ensure_future(worker()) for _ in range(min(parallel, len(parts)))]
    write_task = asyncio.ensure_future(writer())
    pending = {write_task, *workers}
    try:
        while write_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        written = write_task.result()
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if initial is not None and hasattr(initial, "aclose"):
            with contextlib.suppress(Exception):
                await initial.aclose()  # type: ignore[attr-defined]
    if written != info.size:
        raise UpstreamError(f"{source.url}: wrote {written} of {info.size} bytes")
    return written


_DONE = object()


async def parts_stream(
    source: RangedSource,
    info: ObjectInfo,
    *,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    retries: int = DEFAULT_PART_RETRIES,
    backoff: float = DEFAULT_BACKOFF,
    initial: AsyncIterator[bytes] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> AsyncIterator[bytes]:
    """:func:`fetch_parts` as an async iterator of in-order chunks (for a tee loop).

    The iterator ends cleanly only after all ``info.size`` bytes were yielded; any
    failure (a part that kept failing, :class:`ObjectChanged`) is raised from it.
    Closing the iterator early cancels the part requests.
    """
    queue: asyncio.Queue = asyncio.Queue(maxsize=4)

    async def sink(data: bytes) -> None:
        await queue.put(data)

    async def run() -> None:
        try:
            await fetch_parts(
                source,
                info,
                sink,
                part_size=part_size,
                parallel=parallel,
                retries=retries,
                backoff=backoff,
                initial=initial,
            )
        except Exception as exc:  # handed to the consumer
            await queue.put(exc)
            raise
        await queue.put(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            if on_bytes is not None:
                on_bytes(len(item))
            yield item
        await task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def response_chunks(resp: aiohttp.ClientResponse, chunk_size: int = 256 * 1024):
    """The body of an open aiohttp response as an async generator that closes it."""
    try:
        async for chunk in resp.content.iter_chunked(chunk_size):
            yield chunk
    finally:
        resp.close()


# --------------------------------------------------------------------------- HTTP source


def _http_error(url: str, status: int, reason: str) -> UpstreamError | NotFound | Forbidden:
    if status == 404:
        return NotFound(f"{url}: upstream answered 404 {reason}".rstrip())
    if status in (401, 403):
        return Forbidden(f"{url}: upstream answered {status} {reason}".rstrip())
    if status == 412:
        return ObjectChanged(f"{url}: object changed during the fetch (412)")
    return UpstreamError(f"{url}: upstream answered {status} {reason}".rstrip())


class HTTPRangedSource:
    """An HTTP(S) object read by ranges through an ``aiohttp.ClientSession``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        chunk_size: int = 256 * 1024,
    ) -> None:
        self.session = session
        self.url = url
        self.headers = dict(headers or {})
        self.chunk_size = chunk_size

    async def stat(self) -> ObjectInfo:
        """HEAD the object: size, ETag, Last-Modified, Content-Type, Accept-Ranges."""
        try:
            async with self.session.head(
                self.url, headers=self.headers, allow_redirects=True
            ) as resp:
                if resp.status >= 400:
                    raise _http_error(self.url, resp.status, resp.reason or "")
                return info_from_headers(resp.headers)
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"{self.url}: upstream timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{self.url}: {exc}") from exc

    async def read_range(self, start: int, end: int, etag: str | None) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)``, checked against ``etag`` (If-Match and response ETag)."""
        headers = dict(self.headers)
        headers["Range"] = f"bytes={start}-{end - 1}"
        if etag:
            headers["If-Match"] = etag
        try:
            async with self.session.get(self.url, headers=headers) as resp:
                if resp.status != 206:
                    if resp.status == 200:
                        raise UpstreamError(f"{self.url}: upstream ignored the Range header")
                    raise _http_error(self.url, resp.status, resp.reason or "")
                got = resp.headers.get("ETag")
                if etag and got and got != etag:
                    raise ObjectChanged(f"{self.url}: ETag changed from {etag} to {got}")
                try:
                    first, last, _ = parse_content_range(resp.headers.get("Content-Range", ""))
                except ValueError as exc:
                    raise UpstreamError(f"{self.url}: {exc}") from exc
                if (first, last) != (start, end - 1):
                    raise UpstreamError(
                        f"{self.url}: asked bytes {start}-{end - 1}, got {first}-{last}"
                    )
                async for chunk in resp.content.iter_chunked(self.chunk_size):
                    yield chunk
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"{self.url}: upstream timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{self.url}: {exc}") from exc


def info_from_headers(headers) -> ObjectInfo:
    """An :class:`ObjectInfo` from the headers of a full (200) HTTP response."""
    length = headers.get("Content-Length")
    size = int(length) if length is not None and length.isdigit() else None
    return ObjectInfo(
        size=size,
        etag=headers.get("ETag"),
        last_modified=headers.get("Last-Modified"),
        content_type=headers.get("Content-Type"),
        accept_ranges="bytes" in headers.get("Accept-Ranges", "").lower(),
    )
