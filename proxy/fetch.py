"""Upstream clients: ``http(s)://`` through one aiohttp session, ``file://`` in threads.

:meth:`Fetcher.open` returns an :class:`UpstreamBody` once the upstream has answered with
its headers; iterating :meth:`UpstreamBody.chunks` yields the bytes. When the upstream
fails mid-body, the body resumes transparently with ``Range: bytes=N-`` and
``If-Match: <ETag>`` (bounded retries, exponential backoff). Errors are translated at this
boundary into the proxy's error tree, each carrying the status to answer with::

    upstream 404/410            -> NotFound (404), never cached
    upstream other 4xx          -> ProxyError with that status
    upstream 5xx, refused, DNS  -> UpstreamError (502)
    upstream timeout            -> UpstreamTimeout (504)
    mid-body failure, no resume -> IncompleteDownloadError (the caller aborts its clients)
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import email.utils
import fcntl
import http.client
import logging
import os
import re
import select
import socket
import ssl
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp

from proxy.parts import (
    HTTPRangedSource,
    ObjectChanged,
    ObjectInfo,
    can_fetch_in_parts,
    info_from_headers,
    is_strong_etag,
    parse_content_range,
    parts_stream,
    response_chunks,
)
from proxy.s3 import S3Fetcher, S3RangedSource, S3Upstream
from shardcache._version import __version__
from shardcache.errors import (
    Forbidden,
    IncompleteDownloadError,
    NotFound,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
)

__all__ = ["Fetcher", "UpstreamBody", "UpstreamRedirect"]

log = logging.getLogger(__name__)

Observer = Callable[[str], None]
_CONTENT_RANGE_RE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


BATCH_BYTES = 1 << 20  # a worker thread hands over upstream bytes in batches of this size
BATCH_SECONDS = 0.05  # ... or whatever arrived within this long, so slow upstreams still flow


# Linux: move plain-http bodies socket -> pipe -> file without copying them through Python
SPLICE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")


def _noop(outcome: str) -> None:
    pass


def _write_all(fd: int, data: Any, hasher: Any) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    if hasher is not None:
        hasher.update(data)


@dataclass
class UpstreamBody:
    """An upstream answer: metadata known from the headers, and the bytes to come."""

    url: str
    size: int | None
    etag: str | None = None
    last_modified: str | None = None
    content_type: str | None = None
    md5: bytes | None = None  # Content-MD5 (or x-goog-hash md5) to verify, if sent
    cache_control: str | None = None  # the upstream's Cache-Control (no-store: never cached)
    _iter: AsyncIterator[bytes] | None = field(default=None, repr=False)
    _close: Callable[[], None] | None = field(default=None, repr=False)
    _pump: Callable[[int, Any], AsyncIterator[int]] | None = field(default=None, repr=False)

    def chunks(self) -> AsyncIterator[bytes]:
        """The body, resumed across upstream failures; iterate once (this or :meth:`pump`)."""
        if self._iter is None:
            raise RuntimeError("body already consumed")
        it, self._iter, self._pump = self._iter, None, None
        return it

    def pump(self, fd: int, hasher: Any = None) -> AsyncIterator[int]:
        """Write the body to ``fd`` (and feed ``hasher``), yielding the count of each batch
        once it is written; resumed across upstream failures like :meth:`chunks`. Bodies
        read by a worker thread are received and written there, off the event loop."""
        if self._pump is not None:
            pump, self._pump, self._iter = self._pump, None, None
            return pump(fd, hasher)
        if self._iter is None:
            raise RuntimeError("body already consumed")
        return self._pump_chunks(fd, hasher)

    async def _pump_chunks(self, fd: int, hasher: Any) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        async for chunk in self.chunks():
            await loop.run_in_executor(None, _write_all, fd, chunk, hasher)
            yield len(chunk)

    def close(self) -> None:
        """Release the upstream connection (idempotent)."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


def _md5_from_headers(headers: aiohttp.typedefs.LooseHeaders) -> bytes | None:
    value = headers.get("Content-MD5")  # type: ignore[union-attr]
    if not value:
        for part in (headers.get("x-goog-hash") or "").split(","):  # type: ignore[union-attr]
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


REDIRECTS = frozenset({301, 302, 303, 307, 308})


class UpstreamRedirect(ProxyError):
    """The upstream redirected: the client gets the same status and Location, and
    nothing is cached under the requested URL."""

    def __init__(self, url: str, status: int, location: str) -> None:
        # absolute, so that the client follows it to the upstream's target, not to a path
        # of the proxy that maps somewhere else
        location = urljoin(url, location)
        super().__init__(f"upstream {url} redirects to {location}", status_hint=status)
        self.headers = {"Location": location, "X-Cache": "BYPASS"}


class _ConnectError(Exception):
    """Connecting to the upstream failed (the OSError is the cause)."""


def _resumes_at(body: UpstreamBody, pos: int, headers: Mapping[str, str]) -> bool:
    """Whether a resume response continues ``body`` at ``pos``: its Content-Range starts
    there, names the same total size, and the ETag (when both sides have one) matches."""
    m = _CONTENT_RANGE_RE.match(headers.get("Content-Range", ""))
    if not m or int(m.group(1)) != pos:
        return False
    if body.size is not None and m.group(3) != "*" and int(m.group(3)) != body.size:
        return False
    etag = headers.get("ETag")
    return not (body.etag and etag not in (None, body.etag))


class _SinkError(Exception):
    """Writing received bytes to the partial file failed (the OSError is the cause): a
    local failure, not one of the upstream's, so it is never resumed."""


class _ThreadedResponse:
    """A blocking ``http.client`` response whose body a worker thread receives into one
    reused buffer. Only :meth:`shutdown` and :meth:`close` may be called from another
    thread while :meth:`batch` runs."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.conn = conn
        self.resp = resp
        # bytes still due when the length is known and not chunked; else None (read1)
        self.remaining: int | None = None if resp.chunked else resp.length
        self._buf: bytearray | None = None
        self._closed = False
        self._error: BaseException | None = None  # raised by the next batch
        self._first = True  # the first batch is whatever the first read returns

    def batch(self, sink: tuple[int, Any] | None) -> tuple[int, bytes | None]:
        """Receive up to BATCH_BYTES (less if BATCH_SECONDS pass after the first bytes or
        the body ends), then write them to ``sink`` (fd, hasher) or return them. Returns
        (0, None) at the end of the body; raises OSError/HTTPException on a failure,
        ConnectionError if the connection ends before Content-Length."""
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        if self._buf is None:
            self._buf = bytearray(BATCH_BYTES)
        view = memoryview(self._buf)
        n = 0
        t0 = 0.0
        fp = self.resp.fp
        while n < BATCH_BYTES:
            try:
                if self.remaining is not None:
                    if self.remaining == 0:
                        break
                    if fp is None:
                        raise ConnectionError("connection closed")
                    k = fp.readinto1(view[n : n + min(BATCH_BYTES - n, self.remaining)])
                    if not k:
                        raise ConnectionError(f"connection closed with {self.remaining} bytes due")
                    self.remaining -= k
                else:
                    data = self.resp.read1(BATCH_BYTES - n)
                    k = len(data)
                    if not k:
                        break
                    view[n : n + k] = data
                if not n:
                    t0 = time.monotonic()
                n += k
                if self._first or time.monotonic() - t0 >= BATCH_SECONDS:
                    break  # the first bytes go out at once: time to first byte
            except (OSError, http.client.HTTPException) as exc:
                if not n:
                    raise
                self._error = exc  # hand over what arrived first
                break
        self._first = False
        if not n:
            return 0, None
        if sink is None:
            return n, bytes(view[:n])
        try:
            _write_all(sink[0], view[:n], sink[1])
        except OSError as exc:
            raise _SinkError(exc) from exc
        return n, None

    def run(self, sink: tuple[int, Any], report: Callable[[int], None]) -> None:
        """Receive and write batches until the body ends, calling ``report`` with the size
        of each batch once written. Raises like :meth:`batch`."""
        while True:
            n, _ = self.batch(sink)
            if not n:
                return
            report(n)
            if self._can_splice(sink):
                # the parser's buffer is drained: the rest moves socket -> pipe -> file
                # in the kernel, never copied through this process
                self._splice_rest(sink[0], report)

    def _can_splice(self, sink: tuple[int, Any]) -> bool:
        sock = self.conn.sock
        return (
            SPLICE
            and sink[1] is None  # nothing to hash
            and bool(self.remaining)
            and self._error is None
            and isinstance(sock, socket.socket)
            and not isinstance(sock, ssl.SSLSocket)
        )

    def _splice_rest(self, fd: int, report: Callable[[int], None]) -> None:
        """Move the rest of a Content-Length body from the socket to ``fd`` with splice,
        in batches of up to BATCH_BYTES (or what arrived within BATCH_SECONDS). Raises
        TimeoutError after read_timeout without a byte, ConnectionError on an early end,
        _SinkError when writing to ``fd`` fails."""
        sock = self.conn.sock
        sfd = sock.fileno()
        timeout = sock.gettimeout()
        idle_ms = None if timeout is None else max(1, int(timeout * 1000))
        poller = select.poll()
        poller.register(sfd, select.POLLIN)
        r, w = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, BATCH_BYTES)
            flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
            while self.remaining:
                n = 0
                t0 = 0.0
                failure: BaseException | None = None
                while self.remaining and n < BATCH_BYTES:
                    try:
                        k = os.splice(sfd, w, min(BATCH_BYTES - n, self.remaining), flags=flags)
                    except BlockingIOError:
                        if n:
                            left = BATCH_SECONDS - (time.monotonic() - t0)
                            # the pipe may be full, or the socket empty: flush if either
                            if left <= 0 or not poller.poll(int(left * 1000)):
                                break
                            try:
                                k = os.splice(
                                    sfd, w, min(BATCH_BYTES - n, self.remaining), flags=flags
                                )
                            except BlockingIOError:
                                break  # readable but the pipe is full
                        else:
                            if not poller.poll(idle_ms):
                                failure = TimeoutError("timed out")
                                break
                            continue
                    except OSError as exc:
                        failure = exc
                        break
                    if not k:
                        failure = ConnectionError(
                            f"connection closed with {self.remaining} bytes due"
                        )
                        break
                    if not n:
                        t0 = time.monotonic()
                    n += k
                    self.remaining -= k
                left_in_pipe = n
                try:
                    while left_in_pipe:
                        left_in_pipe -= os.splice(r, fd, left_in_pipe)
                except OSError as exc:
                    raise _SinkError(exc) from exc
                if n:
                    report(n)
                if failure is not None:
                    raise failure
        finally:
            os.close(r)
            os.close(w)

    def shutdown(self) -> None:
        """Make a receive blocked in another thread return."""
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shutdown()
            self.resp.close()
            self.conn.close()


class Fetcher:
    """Opens upstream URLs. Create inside a running loop; :meth:`close` when done."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        retries: int = 3,
        retry_backoff: float = 0.5,
        chunk_size: int = 1 << 20,
        observe: Observer = _noop,
        on_bytes: Callable[[int], None] | None = None,
        part_size: int = 0,
        parallel: int = 1,
        http_parts: bool = False,
        s3: S3Upstream | None = None,
        threaded: bool = True,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.chunk_size = chunk_size
        self.observe = observe
        self.on_bytes = on_bytes
        # Parallel ranged parts: 0 or parallel 1 means one stream per object.
        # For http(s) only with http_parts: one stream keeps upstream bytes at 1x the shard
        # and memory low; parts pay off where an origin limits each connection.
        self.part_size = part_size
        self.parallel = parallel
        self.http_parts = http_parts
        # One stream per http(s) object is received by a worker thread (blocking sockets,
        # written to the partial file there), which frees the event loop and lets a second
        # core work; aiohttp keeps parallel parts and what the thread does not handle.
        self.threaded = threaded
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ssl: ssl.SSLContext | None = None
        self._s3 = (
            None
            if s3 is None
            else S3Fetcher(
                s3,
                part_size=part_size,
                parallel=parallel,
                retries=retries,
                retry_backoff=retry_backoff,
                chunk_size=chunk_size,
                observe=observe,
                on_bytes=on_bytes,
            )
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
                ),
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                headers={"User-Agent": f"shardcache/{__version__}", "Accept-Encoding": "identity"},
                read_bufsize=1 << 18,
            )
        return self._session

    async def close(self) -> None:
        """Close the upstream connection pools."""
        if self._s3 is not None:
            await self._s3.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def open(self, url: str) -> UpstreamBody:
        """Request ``url`` and return once its headers are in. Raises ProxyError subclasses."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "file":
            return await self._open_file(url)
        if scheme in ("http", "https"):
            return await self._open_http(url)
        if scheme == "s3":
            if self._s3 is None:
                raise UpstreamError(f"{url}: no S3 client configured for s3:// upstreams")
            return await self._s3.open(url)
        raise UpstreamError(f"{url}: unsupported upstream scheme {scheme!r}")

    # -- http ------------------------------------------------------------------------------

    async def _request(
        self, url: str, start: int = 0, etag: str | None = None, last_modified: str | None = None
    ) -> aiohttp.ClientResponse:
        headers: dict[str, str] = {}
        if start:
            headers["Range"] = f"bytes={start}-"
            if etag:
                headers["If-Match"] = etag
            elif last_modified:
                headers["If-Unmodified-Since"] = last_modified
        try:
            # a redirect is the client's to follow, not something to cache under this URL
            resp = await self.session.get(url, headers=headers, allow_redirects=False)
        except asyncio.TimeoutError as exc:
            self.observe("timeout")
            raise UpstreamTimeout(f"upstream {url} timed out") from exc
        except aiohttp.ClientConnectorError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url} unreachable: {exc.os_error or exc}") from exc
        except aiohttp.ClientError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url} failed: {exc or type(exc).__name__}") from exc
        status = resp.status
        if status == 200 and not start or status == 206 and start:
            return resp
        resp.release()
        if not start and status in REDIRECTS and resp.headers.get("Location"):
            self.observe("ok")
            raise UpstreamRedirect(url, status, resp.headers["Location"])
        self._refuse(url, status, resp.reason, start)

    def _refuse(self, url: str, status: int, reason_text: str | None, start: int) -> NoReturn:
        """Raise the error for an upstream answer other than 200 (206 when resuming)."""
        reason = f"{status} {reason_text or ''}".strip()
        if status in (404, 410):
            self.observe("not_found")
            raise NotFound(f"upstream {url} answered {reason}")
        if start and status in (200, 412, 416):
            self.observe("error")
            raise UpstreamError(f"upstream {url} cannot resume at byte {start}: {reason}")
        self.observe("error")
        if 400 <= status < 500 and status not in (408, 429):
            raise ProxyError(f"upstream {url} answered {reason}", status_hint=status)
        raise UpstreamError(f"upstream {url} answered {reason}")

    async def _open_http(self, url: str) -> UpstreamBody:
        if self.threaded and not (self.http_parts and self.parallel > 1 and self.part_size > 0):
            body = await self._open_threaded(url)
            if body is not None:
                return body
        resp = await self._request(url)
        self.observe("ok")
        h = resp.headers
        size = resp.content_length if "Content-Length" in h else None
        if "Content-Encoding" in h and h["Content-Encoding"].lower() != "identity":
            # Bytes are stored exactly as sent; a compressed representation is not a shard.
            log.warning("upstream %s sent Content-Encoding %s", url, h["Content-Encoding"])
        body = UpstreamBody(
            url=url,
            size=size,
            etag=h.get("ETag"),
            last_modified=h.get("Last-Modified"),
            content_type=h.get("Content-Type"),
            md5=_md5_from_headers(h),
            cache_control=h.get("Cache-Control"),
        )
        state = {"resp": resp}

        def close() -> None:
            state["resp"].close()

        body._close = close
        info = info_from_headers(h)
        if (
            self.http_parts
            and self.parallel > 1
            and self.part_size > 0
            and can_fetch_in_parts(info, self.part_size)
        ):
            body._iter = self._parts(body, info, resp)
        else:
            body._iter = self._http_chunks(body, state)
        return body

    async def _parts(
        self, body: UpstreamBody, info: ObjectInfo, resp: aiohttp.ClientResponse
    ) -> AsyncIterator[bytes]:
        """The body as parallel ranged parts; the first GET's response serves part one."""
        stream = parts_stream(
            HTTPRangedSource(self.session, body.url, chunk_size=self.chunk_size),
            info,
            part_size=self.part_size,
            parallel=self.parallel,
            retries=self.retries,
            backoff=self.retry_backoff,
            initial=response_chunks(resp, self.chunk_size),
            on_bytes=self.on_bytes,
        )
        pos = 0
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    pos += len(chunk)
                    yield chunk
        except (ProxyError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.observe("aborted")
            log.warning("upstream %s: ranged fetch failed at byte %d: %s", body.url, pos, exc)
            raise IncompleteDownloadError(body.url, pos, body.size) from exc

    async def _http_chunks(self, body: UpstreamBody, state: dict) -> AsyncIterator[bytes]:
        pos = 0
        attempt = 0
        while True:
            resp: aiohttp.ClientResponse = state["resp"]
            content = resp.content
            try:
                while True:
                    data = await content.readany()
                    if not data:
                        break
                    if len(data) < self.chunk_size:
                        more = content.read_nowait(self.chunk_size - len(data))
                        if more:
                            data += more
                    pos += len(data)
                    if self.on_bytes is not None:
                        self.on_bytes(len(data))
                    yield data
                if body.size is not None and pos != body.size:
                    raise aiohttp.ClientPayloadError(f"body ended at {pos} of {body.size} bytes")
                resp.release()
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                resp.close()
                attempt += 1
                state["resp"] = await self._resume(
                    body, pos, attempt, exc, self._request, lambda r: r.headers
                )

    async def _resume(
        self,
        body: UpstreamBody,
        pos: int,
        attempt: int,
        exc: BaseException,
        request: Callable[..., Awaitable[Any]],
        headers_of: Callable[[Any], Mapping[str, str]],
    ) -> Any:
        """Resume ``body`` at ``pos`` after ``exc`` (try ``attempt``) with ``request``
        (``Range`` + ``If-Match``); the new response, or IncompleteDownloadError when the
        retries are spent, the request fails, or the answer does not continue the body
        (``request`` returns None for a redirect where a 206 was due)."""
        await self._before_resume(body, pos, attempt, exc)
        try:
            new = await request(body.url, pos, body.etag, body.last_modified)
        except ProxyError as exc2:
            log.warning("upstream %s: resume failed: %s", body.url, exc2)
            self.observe("aborted")
            raise IncompleteDownloadError(body.url, pos, body.size) from exc2
        if new is None or not _resumes_at(body, pos, headers_of(new)):
            if new is not None:
                new.close()
            self.observe("aborted")
            raise IncompleteDownloadError(body.url, pos, body.size) from exc
        self.observe("resumed")
        return new

    async def _before_resume(
        self, body: UpstreamBody, pos: int, attempt: int, exc: BaseException
    ) -> None:
        """After a body failed at ``pos``: give up (IncompleteDownloadError) when retries
        are spent or nothing pins the object's version, else wait the backoff for try
        ``attempt``."""
        cause = str(exc) or type(exc).__name__
        resumable = body.etag is not None or body.last_modified is not None
        if attempt > self.retries or not resumable:
            self.observe("aborted")
            log.warning("upstream %s failed at byte %d, giving up: %s", body.url, pos, cause)
            raise IncompleteDownloadError(body.url, pos, body.size) from exc
        delay = self.retry_backoff * 2 ** (attempt - 1)
        log.info(
            "upstream %s failed at byte %d (%s); resume %d/%d in %.2fs",
            body.url,
            pos,
            cause,
            attempt,
            self.retries,
            delay,
        )
        await asyncio.sleep(delay)

    # -- http(s) in a worker thread --------------------------------------------------------

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            # Its own pool: a thread blocked on a slow upstream must not starve the store's
            # and the readers' to_thread calls on the default executor.
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=64, thread_name_prefix="upstream"
            )
        return self._pool

    async def _in_thread(self, tr: _ThreadedResponse, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the upstream pool. If cancelled, shut the socket down so a blocked
        receive returns, and wait until the thread has let go (it may be writing to a
        descriptor the caller is about to close)."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor(), fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            tr.shutdown()
            with contextlib.suppress(BaseException):
                await fut
            raise

    async def _run_to_sink(
        self, tr: _ThreadedResponse, sink: tuple[int, Any]
    ) -> AsyncIterator[int]:
        """Let a worker thread receive and write the whole body without stopping, and
        yield the bytes written since the last step (one wake-up per batch at most);
        raise what the thread raised once every byte it wrote is counted."""
        loop = asyncio.get_running_loop()
        pending = 0
        wake = asyncio.Event()

        def progress(n: int) -> None:
            nonlocal pending
            pending += n
            wake.set()

        def report(n: int) -> None:  # in the worker thread
            loop.call_soon_threadsafe(progress, n)

        fut = loop.run_in_executor(self._executor(), tr.run, sink, report)
        fut.add_done_callback(lambda _: wake.set())
        try:
            while True:
                await wake.wait()
                wake.clear()
                if pending:
                    n, pending = pending, 0
                    yield n
                if fut.done() and not pending:
                    # progress callbacks were queued before the future completed
                    fut.result()
                    return
        except (asyncio.CancelledError, GeneratorExit):
            tr.shutdown()
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
            raise

    def _blocking_get(self, url: str, headers: dict[str, str]) -> _ThreadedResponse:
        """Connect (within connect_timeout), send the GET, read the status and headers
        (within read_timeout). Runs in a worker thread; raises OSError/HTTPException."""
        u = urlsplit(url)
        host = u.hostname or ""
        if u.scheme.lower() == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, u.port, timeout=self.connect_timeout, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(host, u.port, timeout=self.connect_timeout)
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise _ConnectError(exc) from exc
            conn.sock.settimeout(self.read_timeout)
            target = (u.path or "/") + (f"?{u.query}" if u.query else "")
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        return _ThreadedResponse(conn, resp)

    async def _thread_request(
        self, url: str, start: int = 0, etag: str | None = None, last_modified: str | None = None
    ) -> _ThreadedResponse | None:
        """Like :meth:`_request` over a blocking connection (a redirect is passed on as
        UpstreamRedirect, not followed)."""
        headers = {"User-Agent": f"shardcache/{__version__}", "Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
            if etag:
                headers["If-Match"] = etag
            elif last_modified:
                headers["If-Unmodified-Since"] = last_modified
        loop = asyncio.get_running_loop()
        try:
            tr = await loop.run_in_executor(self._executor(), self._blocking_get, url, headers)
        except _ConnectError as exc:
            cause = exc.__cause__
            if isinstance(cause, TimeoutError):
                self.observe("timeout")
                raise UpstreamTimeout(f"upstream {url} timed out") from exc
            self.observe("error")
            raise UpstreamError(f"upstream {url} unreachable: {cause}") from exc
        except TimeoutError as exc:
            self.observe("timeout")
            raise UpstreamTimeout(f"upstream {url} timed out") from exc
        except (OSError, http.client.HTTPException) as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url} failed: {exc or type(exc).__name__}") from exc
        status = tr.resp.status
        if status == 200 and not start or status == 206 and start:
            return tr
        location = tr.resp.headers.get("Location")
        tr.close()
        if status in REDIRECTS and not start and location:
            self.observe("ok")
            raise UpstreamRedirect(url, status, location)
        self._refuse(url, status, tr.resp.reason, start)

    async def _open_threaded(self, url: str) -> UpstreamBody | None:
        u = urlsplit(url)
        if u.username or u.password:
            return None  # credentials in the URL: aiohttp turns them into Basic auth
        tr = await self._thread_request(url)
        if tr is None:
            return None
        self.observe("ok")
        h = tr.resp.headers
        size = (
            tr.resp.length if h.get("Content-Length") is not None and not tr.resp.chunked else None
        )
        if h.get("Content-Encoding", "identity").lower() != "identity":
            log.warning("upstream %s sent Content-Encoding %s", url, h["Content-Encoding"])
        body = UpstreamBody(
            url=url,
            size=size,
            etag=h.get("ETag"),
            last_modified=h.get("Last-Modified"),
            content_type=h.get("Content-Type"),
            md5=_md5_from_headers(h),  # type: ignore[arg-type]
            cache_control=h.get("Cache-Control"),
        )
        state: dict[str, Any] = {"tr": tr}

        def close() -> None:
            state["tr"].close()

        body._close = close
        body._iter = self._threaded_body(body, state, None)
        body._pump = lambda fd, hasher: self._threaded_body(body, state, (fd, hasher))
        return body

    async def _threaded_body(
        self, body: UpstreamBody, state: dict[str, Any], sink: tuple[int, Any] | None
    ) -> AsyncIterator[Any]:
        """Receive the body in a worker thread, one batch per hand-over. With ``sink``
        (fd, hasher) the thread writes each batch there and this yields its size; without,
        it yields the bytes. Resumes like :meth:`_http_chunks`."""
        pos = 0
        attempt = 0
        while True:
            tr: _ThreadedResponse = state["tr"]
            try:
                if sink is not None:
                    async for n in self._run_to_sink(tr, sink):
                        pos += n
                        if self.on_bytes is not None:
                            self.on_bytes(n)
                        yield n
                while sink is None:
                    n, data = await self._in_thread(tr, lambda tr=tr: tr.batch(None))
                    if not n:
                        break
                    pos += n
                    if self.on_bytes is not None:
                        self.on_bytes(n)
                    yield data
                if body.size is not None and pos != body.size:
                    raise ConnectionError(f"body ended at {pos} of {body.size} bytes")
                tr.close()
                return
            except _SinkError as exc:
                tr.close()
                raise exc.__cause__ from None  # type: ignore[misc]
            except (OSError, http.client.HTTPException) as exc:
                tr.close()
                attempt += 1
                state["tr"] = await self._resume(
                    body, pos, attempt, exc, self._thread_request, lambda t: t.resp.headers
                )

    # -- verified ranges and revalidation --------------------------------------------------

    async def read_range(
        self,
        url: str,
        start: int,
        end: int | None,
        *,
        size: int | None,
        etag: str | None,
        last_modified: str | None,
    ) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` (to the object's end when ``end`` is None) of the version
        of ``url`` named by its validators, verified before a byte is yielded: status,
        ``Content-Range`` exactly as asked, total size and validators equal to the first
        response's. Without a strong ETag or a Last-Modified, only a request from byte 0
        can be answered. Raises ProxyError (ObjectChanged when the object changed) or
        IncompleteDownloadError when fewer bytes arrive than asked for; never yields a
        byte of another version."""
        if end is None and size is not None:
            end = size
        want = None if end is None else end - start
        got = 0
        async for chunk in self._verified_range(url, start, end, size, etag, last_modified):
            got += len(chunk)
            if want is not None and got > want:
                raise UpstreamError(f"upstream {url}: more bytes than the range asked for")
            yield chunk
        if want is not None and got != want:
            raise IncompleteDownloadError(url, start + got, end)

    async def _verified_range(
        self,
        url: str,
        start: int,
        end: int | None,
        size: int | None,
        etag: str | None,
        last_modified: str | None,
    ) -> AsyncIterator[bytes]:
        scheme = urlsplit(url).scheme.lower()
        strong = etag if is_strong_etag(etag) else None
        if start and not strong and not last_modified:
            raise UpstreamError(
                f"upstream {url}: no validator (strong ETag or Last-Modified) to continue "
                f"at byte {start} with the same version"
            )
        if scheme == "file":
            body = await self._open_file(url)
            try:
                if (body.etag, body.size) != (etag, size):
                    raise ObjectChanged(f"{url}: the file changed")
                pos = 0
                async for chunk in body.chunks():
                    a, b = pos, pos + len(chunk)
                    pos = b
                    lo, hi = max(a, start), b if end is None else min(b, end)
                    if hi > lo:
                        yield chunk[lo - a : hi - a]
                    if end is not None and pos >= end:
                        break
            finally:
                body.close()
            return
        if scheme == "s3":
            if self._s3 is None or end is None or not strong:
                raise UpstreamError(f"upstream {url}: cannot continue without size and ETag")
            await self._s3.s3.ensure_started()
            source = S3RangedSource(self._s3.s3, url, self.chunk_size, quoted=True)
            async for chunk in source.read_range(start, end, strong):
                yield chunk
            return
        headers: dict[str, str] = {}
        if start or (end is not None and end != size):
            # open-ended when the range runs to the object's end: every origin knows that form
            tail = "" if end is None or end == size else str(end - 1)
            headers["Range"] = f"bytes={start}-{tail}"
        if strong:
            headers["If-Match"] = strong
        elif last_modified:
            headers["If-Unmodified-Since"] = last_modified
        try:
            async with self.session.get(url, headers=headers, allow_redirects=False) as resp:
                h = resp.headers
                whole = resp.status == 200 and start == 0
                if resp.status == 412:
                    raise ObjectChanged(f"{url}: object changed at the upstream (412)")
                if resp.status != 206 and not whole:
                    self._refuse(url, resp.status, resp.reason, start or 1)
                if strong and h.get("ETag") != strong:
                    raise ObjectChanged(f"{url}: ETag is now {h.get('ETag')}, was {strong}")
                if not strong and last_modified and h.get("Last-Modified") != last_modified:
                    raise ObjectChanged(f"{url}: Last-Modified is now {h.get('Last-Modified')}")
                if resp.status == 206:
                    try:
                        first, last, total = parse_content_range(h.get("Content-Range", ""))
                    except ValueError as exc:
                        raise UpstreamError(f"upstream {url}: {exc}") from None
                    if first != start or (end is not None and last != end - 1):
                        raise UpstreamError(
                            f"upstream {url}: asked bytes {start}-{'' if end is None else end - 1}"
                            f", got {first}-{last}"
                        )
                    if size is not None and total is not None and total != size:
                        raise ObjectChanged(f"{url}: size is now {total}, was {size}")
                elif size is not None and resp.content_length not in (None, size):
                    raise ObjectChanged(f"{url}: size is now {resp.content_length}, was {size}")
                async for chunk in resp.content.iter_chunked(self.chunk_size):
                    if self.on_bytes is not None:
                        self.on_bytes(len(chunk))
                    yield chunk
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"upstream {url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream {url} failed: {exc or type(exc).__name__}") from exc

    async def revalidate(
        self, url: str, *, etag: str | None, last_modified: str | None, size: int
    ) -> str:
        """Ask the upstream whether the cached version of ``url`` is still current:
        ``"fresh"`` (304, or the same validators), ``"changed"`` or ``"gone"`` (404/410).
        Raises ProxyError when the upstream cannot tell (5xx, unreachable, timeout)."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "file":
            try:
                body = await self._open_file(url)
            except NotFound:
                return "gone"
            body.close()
            return "fresh" if (body.etag, body.size) == (etag, size) else "changed"
        if scheme == "s3":
            if self._s3 is None:
                raise UpstreamError(f"{url}: no S3 client configured for s3:// upstreams")
            await self._s3.s3.ensure_started()
            try:
                info = await self._s3.s3.head(url, quoted=True)
            except NotFound:
                return "gone"
            same = (info.etag, info.size) == (etag, size) if etag else False
            return "fresh" if same else "changed"
        headers: dict[str, str] = {}
        if etag:
            headers["If-None-Match"] = etag
        if last_modified:
            headers["If-Modified-Since"] = last_modified
        if not headers:
            return "changed"  # nothing to compare: fetch it again
        try:
            async with self.session.get(url, headers=headers, allow_redirects=False) as resp:
                status, h = resp.status, resp.headers
        except asyncio.TimeoutError as exc:
            self.observe("timeout")
            raise UpstreamTimeout(f"upstream {url} timed out") from exc
        except aiohttp.ClientError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url} failed: {exc or type(exc).__name__}") from exc
        if status == 304:
            self.observe("not_modified")
            return "fresh"
        if status in (404, 410):
            self.observe("not_found")
            return "gone"
        if status == 200:
            self.observe("ok")
            same = (
                h.get("ETag") == etag
                if etag
                else h.get("Last-Modified") == last_modified and resp.content_length == size
            )
            return "fresh" if same else "changed"
        if status in REDIRECTS:
            return "changed"  # the next GET passes the redirect on
        self._refuse(url, status, resp.reason, 0)

    # -- file ------------------------------------------------------------------------------

    async def _open_file(self, url: str) -> UpstreamBody:
        path = unquote(urlsplit(url).path)

        def _open() -> tuple[int, os.stat_result]:
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise IsADirectoryError(path)
            except BaseException:
                os.close(fd)
                raise
            return fd, st

        try:
            fd, st = await asyncio.wait_for(asyncio.to_thread(_open), self.read_timeout)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            self.observe("not_found")
            raise NotFound(f"upstream {url}: no such file") from exc
        except PermissionError as exc:
            self.observe("error")
            raise Forbidden(f"upstream {url}: permission denied") from exc
        except asyncio.TimeoutError as exc:
            self.observe("timeout")
            raise UpstreamTimeout(f"upstream {url} timed out opening the file") from exc
        except OSError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url}: {exc.strerror or exc}") from exc
        self.observe("ok")
        etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        body = UpstreamBody(
            url=url,
            size=st.st_size,
            etag=etag,
            last_modified=email.utils.formatdate(st.st_mtime, usegmt=True),
            content_type="application/x-tar" if path.endswith(".tar") else None,
        )
        state = {"fd": fd}

        def close() -> None:
            if state["fd"] is not None:
                fd_, state["fd"] = state["fd"], None
                os.close(fd_)

        body._close = close
        body._iter = self._file_chunks(body, path, st, state)
        return body

    async def _file_chunks(
        self, body: UpstreamBody, path: str, st: os.stat_result, state: dict
    ) -> AsyncIterator[bytes]:
        pos = 0
        attempt = 0
        size = st.st_size
        while pos < size:
            try:
                if state["fd"] is None:
                    raise OSError("file closed")
                n = min(self.chunk_size, size - pos)
                data = await asyncio.wait_for(
                    asyncio.to_thread(os.pread, state["fd"], n, pos), self.read_timeout
                )
                if not data:
                    raise OSError(f"file ended at byte {pos} of {size}")
            except (OSError, asyncio.TimeoutError) as exc:
                if attempt >= self.retries:
                    self.observe("aborted")
                    raise IncompleteDownloadError(body.url, pos, size) from exc
                attempt += 1
                await asyncio.sleep(self.retry_backoff * 2 ** (attempt - 1))
                try:
                    fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
                    st2 = os.fstat(fd)
                except OSError:
                    continue
                if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    os.close(fd)
                    self.observe("aborted")
                    raise IncompleteDownloadError(body.url, pos, size) from exc
                old, state["fd"] = state["fd"], fd
                if old is not None:
                    os.close(old)
                self.observe("resumed")
                continue
            pos += len(data)
            if self.on_bytes is not None:
                self.on_bytes(len(data))
            yield data
        body.close()
