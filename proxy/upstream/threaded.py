"""The threaded transport: one http(s) stream received by a worker thread on a blocking
socket and written to the partial file there, off the event loop; on Linux, once the
parser's buffer is drained, the rest of a plain-http Content-Length body moves socket ->
pipe -> file with ``splice``, never copied through this process.

Connections are not pooled: each request has its own (a shard's body dwarfs a connect on
the networks this serves).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import http.client
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from proxy.upstream.aio import USER_AGENT
from proxy.upstream.errors import socket_error
from proxy.upstream.transport import write_all
from shardcache.compat import InterimSkippingResponse
from shardcache.errors import UpstreamError

__all__ = ["ThreadTransport", "threadable"]

BATCH_BYTES = 1 << 20  # a worker thread hands over upstream bytes in batches of this size
BATCH_SECONDS = 0.05  # ... or whatever arrived within this long, so slow upstreams still flow
# spliced bodies: the pipe between socket and file, and the batches reported (each batch
# wakes the download's readers, who send it on: fewer, larger batches cost the event loop
# and the readers' sendfile calls less per byte; measured in BENCHMARKS.md, "Cold path:
# CPU per GiB")
PIPE_BYTES = 1 << 20
SPLICE_BATCH_BYTES = 4 << 20

# Linux: move plain-http bodies socket -> pipe -> file without copying them through Python
SPLICE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")


def threadable(url: str) -> bool:
    """Whether this transport can fetch ``url``: http(s) without credentials in the URL
    (aiohttp turns those into Basic auth)."""
    u = urlsplit(url)
    return u.scheme.lower() in ("http", "https") and not (u.username or u.password)


class _SinkError(Exception):
    """Writing received bytes to the partial file failed (the OSError is the cause)."""


class _ConnectError(Exception):
    """Connecting to the upstream failed (the OSError is the cause)."""


class _ThreadedResponse:
    """A blocking ``http.client`` response whose body a worker thread receives into one
    reused buffer. Only :meth:`shutdown` and :meth:`close` may be called from another
    thread while :meth:`batch` runs."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.conn = conn
        self.resp = resp
        # bytes still due when the length is known and not chunked; else None (read1)
        self.remaining: int | None = None if resp.chunked else resp.length
        self.declared = self.remaining  # the Content-Length, when the body has one
        self._buf: bytearray | None = None
        self._closed = False
        self._error: BaseException | None = None  # raised by the next batch
        self._first = True  # the first batch is whatever the first read returns
        self.limited = False  # the caller stops before the declared end (bytes stay due)

    def batch(self, sink: tuple[int, Any] | None) -> tuple[int, bytes | None]:
        """Receive up to BATCH_BYTES (less if BATCH_SECONDS pass after the first bytes or
        the body ends), then write them to ``sink`` (fd, hasher) or return them. Returns
        (0, None) at the end of the body; raises OSError/HTTPException on a failure,
        ConnectionError if the connection ends before Content-Length."""
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        if self._buf is None:
            # no bigger than the body: a zeroed 1 MiB per 1 KiB object cost more than
            # receiving it (every later slice of a Content-Length body fits, as n +
            # remaining never exceeds what was due when the buffer was made)
            due = self.remaining
            self._buf = bytearray(BATCH_BYTES if due is None else max(1, min(BATCH_BYTES, due)))
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
            if self.remaining == 0 and not self.limited:
                self._check_declared_end()
            return 0, None
        if sink is None:
            return n, bytes(view[:n])
        try:
            write_all(sink[0], view[:n], sink[1])
        except OSError as exc:
            raise _SinkError(exc) from exc
        return n, None

    def _check_declared_end(self) -> None:
        """After the last byte of the declared Content-Length: raise UpstreamError when
        more bytes are already there (buffered, or waiting in the socket; never waits for
        any). An origin that sends more than it declared framed the body wrongly: the
        bytes received are not known to be the object's (nor its declared prefix)."""
        fp = self.resp.fp
        sock = self.conn.sock
        if fp is None or sock is None:
            return
        timeout = sock.gettimeout()
        try:
            sock.setblocking(False)
            extra = fp.peek(1)
        except (OSError, ValueError):
            return  # closed or reset after the body: nothing more was sent
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(timeout)
        if extra:
            raise UpstreamError(f"upstream sent more bytes than its Content-Length {self.declared}")

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
                # in the kernel, never copied through this process (a hasher reads each
                # batch back from the page cache)
                if sink[1] is None:
                    self._splice_rest(sink[0], report)
                else:
                    self._splice_hashed(sink[0], report, sink[1])

    def _can_splice(self, sink: tuple[int, Any]) -> bool:
        sock = self.conn.sock
        return (
            SPLICE
            and bool(self.remaining)
            and self._error is None
            and isinstance(sock, socket.socket)
            and not isinstance(sock, ssl.SSLSocket)
        )

    def _splice_hashed(self, fd: int, report: Callable[[int], None], hasher: Any) -> None:
        """:meth:`_splice_rest`, each batch also fed to ``hasher`` (read back from the
        file by a thread of its own); returns or raises once every batch is hashed."""
        rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            rehash = _Rehash(rfd, os.lseek(fd, 0, os.SEEK_CUR), hasher, report)
            try:
                self._splice_rest(fd, rehash)
            finally:
                rehash.finish()  # before the body counts as received, and rfd closes
        finally:
            os.close(rfd)

    def _splice_rest(self, fd: int, report: Callable[[int], None]) -> None:
        """Move the rest of a Content-Length body from the socket to ``fd`` with splice,
        through a pipe of PIPE_BYTES emptied into ``fd`` whenever it fills, reported in
        batches of one pipeful growing to SPLICE_BATCH_BYTES (or what arrived within
        BATCH_SECONDS). Raises
        TimeoutError after read_timeout without a byte, ConnectionError on an early end,
        _SinkError when writing to ``fd`` fails."""
        sock = self.conn.sock
        sfd = sock.fileno()
        timeout = sock.gettimeout()
        idle_ms = None if timeout is None else max(1, int(timeout * 1000))
        poller = select.poll()
        poller.register(sfd, select.POLLIN)
        r, w = os.pipe()

        def drain(k: int) -> None:  # the pipe's k bytes into the file
            try:
                while k:
                    k -= os.splice(r, fd, k)
            except OSError as exc:
                raise _SinkError(exc) from exc

        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
            # the first batches are one pipeful, then twice as large up to the limit: the
            # readers who joined at the start (each a sendfile call on a shared pool)
            # get their first bytes as soon as before
            limit = PIPE_BYTES
            while self.remaining:
                n = 0  # bytes of this batch, in the pipe or in the file
                piped = 0  # of which still in the pipe
                t0 = 0.0
                failure: BaseException | None = None
                while self.remaining and n < limit:
                    if piped >= PIPE_BYTES:
                        drain(piped)
                        piped = 0
                    want = min(PIPE_BYTES - piped, limit - n, self.remaining)
                    try:
                        k = os.splice(sfd, w, want, flags=flags)
                    except BlockingIOError:
                        if n:
                            left = BATCH_SECONDS - (time.monotonic() - t0)
                            # the pipe may be full, or the socket empty: flush if the
                            # socket stays empty, empty the pipe if it is full
                            if left <= 0 or not poller.poll(int(left * 1000)):
                                break
                            try:
                                k = os.splice(sfd, w, want, flags=flags)
                            except BlockingIOError:
                                if not piped:
                                    break
                                drain(piped)  # readable but the pipe is full
                                piped = 0
                                continue
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
                    piped += k
                    self.remaining -= k
                drain(piped)
                if n:
                    report(n)
                    limit = min(SPLICE_BATCH_BYTES, 2 * limit)
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


class _Rehash:
    """A ``report`` callback for spliced batches that also has them hashed: a thread of
    its own reads each batch back from the file through ``rfd`` (the page cache: no disk
    read) from ``pos`` on and feeds ``hasher``, so hashing overlaps receiving.
    :meth:`finish` waits until every batch is hashed."""

    def __init__(self, rfd: int, pos: int, hasher: Any, report: Callable[[int], None]) -> None:
        self.rfd = rfd
        self.pos = pos
        self.hasher = hasher
        self.report = report
        self.error: OSError | None = None
        self._batches: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="upstream-hash", daemon=True)
        self._thread.start()

    def __call__(self, n: int) -> None:
        if self.error is not None:
            raise _SinkError(self.error) from self.error
        self._batches.put(n)
        self.report(n)

    def _run(self) -> None:
        while (n := self._batches.get()) is not None:
            end = self.pos + n
            while self.error is None and self.pos < end:
                try:
                    data = os.pread(self.rfd, min(BATCH_BYTES, end - self.pos), self.pos)
                    if not data:
                        raise OSError(errno.EIO, f"file ended at byte {self.pos} while hashing")
                except OSError as exc:  # a local failure, like a failed write
                    self.error = exc
                    break
                self.hasher.update(data)
                self.pos += len(data)

    def finish(self) -> None:
        """Wait for the hashing thread; raise what it failed with."""
        self._batches.put(None)
        self._thread.join()
        if self.error is not None:
            raise _SinkError(self.error) from self.error


class ThreadResponse:
    """A blocking response as a :class:`~proxy.upstream.transport.Response`."""

    def __init__(self, url: str, tr: _ThreadedResponse, pool: concurrent.futures.Executor) -> None:
        self.url = url
        self._tr = tr
        self._pool = pool
        self.status = tr.resp.status
        self.reason = tr.resp.reason or ""
        self.headers: Mapping[str, str] = tr.resp.headers  # type: ignore[assignment]

    async def chunks(self) -> AsyncIterator[bytes]:
        tr = self._tr
        loop = asyncio.get_running_loop()
        while True:
            fut = loop.run_in_executor(self._pool, tr.batch, None)
            try:
                n, data = await asyncio.shield(fut)
            except asyncio.CancelledError:
                # make a blocked receive return before the caller closes the socket
                tr.shutdown()
                with contextlib.suppress(BaseException):
                    await fut
                raise
            except (OSError, http.client.HTTPException) as exc:
                tr.close()
                raise socket_error(self.url, exc, body=True) from exc
            if not n:
                tr.close()
                return
            yield data  # type: ignore[misc]

    async def pump(self, fd: int, hasher: Any, limit: int | None = None) -> AsyncIterator[int]:
        """Let a worker thread receive and write the whole body (its first ``limit``
        bytes) without stopping, and yield the bytes written since the last step (one
        wake-up per batch at most); raise what the thread raised once every byte it wrote
        is counted."""
        tr = self._tr
        if limit is not None and tr.remaining is not None and tr.remaining > limit:
            tr.remaining = limit  # a Content-Length body: stop after the part asked for
            tr.limited = True
        loop = asyncio.get_running_loop()
        pending = 0
        wake = asyncio.Event()

        def progress(n: int) -> None:
            nonlocal pending
            pending += n
            wake.set()

        def report(n: int) -> None:  # in the worker thread
            loop.call_soon_threadsafe(progress, n)

        fut = loop.run_in_executor(self._pool, tr.run, (fd, hasher), report)
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(wake.set))
        try:
            while True:
                await wake.wait()
                wake.clear()
                if pending:
                    n, pending = pending, 0
                    yield n
                if fut.done() and not pending:
                    # progress callbacks were queued before the future completed
                    try:
                        fut.result()
                    except _SinkError as exc:
                        tr.close()
                        raise exc.__cause__ from None  # type: ignore[misc]
                    except (OSError, http.client.HTTPException) as exc:
                        tr.close()
                        raise socket_error(self.url, exc, body=True) from exc
                    tr.close()
                    return
        except (asyncio.CancelledError, GeneratorExit):
            tr.shutdown()
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
            raise

    def close(self) -> None:
        self._tr.close()


class ThreadTransport:
    """http(s) requests over blocking connections, each served by a worker thread."""

    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ssl: ssl.SSLContext | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            # Its own pool: a thread blocked on a slow upstream must not starve the store's
            # and the readers' to_thread calls on the default executor.
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=128, thread_name_prefix="upstream"
            )
        return self._pool

    def _blocking_request(
        self, method: str, url: str, headers: dict[str, str]
    ) -> _ThreadedResponse:
        """Connect (within connect_timeout), send the request, read the status and headers
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
        conn.response_class = InterimSkippingResponse
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise _ConnectError(exc) from exc
            conn.sock.settimeout(self.read_timeout)
            target = (u.path or "/") + (f"?{u.query}" if u.query else "")
            conn.request(method, target, headers=headers)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        return _ThreadedResponse(conn, resp)

    async def request(
        self, method: str, url: str, headers: Mapping[str, str], *, label: str | None = None
    ) -> ThreadResponse:
        """``label``: the URL to name in errors (a presigned URL carries a signature)."""
        h = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **headers}
        name = label or url
        loop = asyncio.get_running_loop()
        pool = self._executor()
        fut = loop.run_in_executor(pool, self._blocking_request, method, url, h)
        try:
            tr = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_close_result)
            raise
        except _ConnectError as exc:
            raise socket_error(name, exc.__cause__, body=False, connecting=True) from exc  # type: ignore[arg-type]
        except (OSError, http.client.HTTPException) as exc:
            raise socket_error(name, exc, body=False) from exc
        return ThreadResponse(name, tr, pool)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _close_result(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()
