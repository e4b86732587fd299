"""``sendfile`` to a client from worker threads.

asyncio's ``loop.sendfile`` runs every ``sendfile(2)`` call on the event loop, and on
loopback or a fast NIC that call is the copy itself: with many clients (16 followers of
one download, many hits at once) one core does all the copying while the other idles.
Here each call runs on a worker thread instead, non-blocking: a thread sends what the
socket takes and returns, and the event loop waits for the socket to take more. A slow
client thus never holds a thread.

The socket belongs to an aiohttp transport; while bytes go around it, the transport's
write buffer is empty (waited for first) and its reading is paused, as asyncio's own
``sendfile`` does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Any

from shardcache.compat import (
    add_writer,
    remove_writer,
    reset_empty_waiter,
    threaded_sendfile_hooks,
    wait_empty,
)

__all__ = ["send_file", "send_now", "send_rest"]

_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, (os.cpu_count() or 1) * 4), thread_name_prefix="sendfile"
        )
    return _POOL


def _send_some(sockfd: int, fd: int, offset: int, count: int) -> tuple[int, bool]:
    """Send up to ``count`` bytes until the socket would block: (sent, file ended)."""
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(sockfd, fd, offset + sent, count - sent)
        except BlockingIOError:
            return sent, False
        except InterruptedError:
            continue
        if n == 0:
            return sent, True
        sent += n
    return sent, False


async def _writable(loop: Any, sockfd: int) -> None:
    """Wait until the socket takes bytes again. The transport owns the descriptor, so
    the public ``add_writer`` refuses it; asyncio's own ``sock_sendfile`` on a paused,
    drained transport registers it the same way (:func:`shardcache.compat.add_writer`)."""
    fut = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    add_writer(loop, sockfd, ready)
    try:
        await fut
    finally:
        remove_writer(loop, sockfd)


async def send_file(transport: Any, fobj: Any, offset: int, count: int) -> int | None:
    """Send ``count`` bytes of ``fobj`` from ``offset`` to ``transport``'s socket from
    worker threads; the bytes sent (fewer only when the file ended early), or None when
    this transport cannot be sent to this way (the caller falls back)."""
    sock = transport.get_extra_info("socket")
    loop = asyncio.get_running_loop()
    if (
        sock is None
        or not threaded_sendfile_hooks(loop, transport)
        or transport.get_extra_info("sslcontext") is not None
    ):
        return None
    if transport.is_closing():
        raise ConnectionResetError("client gone")
    sockfd, fd = sock.fileno(), fobj.fileno()
    reading = transport.is_reading()
    transport.pause_reading()
    try:
        await wait_empty(transport)  # the headers and anything written before are on the wire
        sent = 0
        while sent < count:
            if transport.is_closing():
                raise ConnectionResetError("client gone")
            n, ended = await loop.run_in_executor(
                _pool(), _send_some, sockfd, fd, offset + sent, count - sent
            )
            sent += n
            if ended:
                break
            if sent < count:
                await _writable(loop, sockfd)
        return sent
    except (RuntimeError, ValueError) as exc:
        # never let the caller fall back to another way of sending after bytes went out
        raise ConnectionResetError(f"sendfile failed: {exc}") from exc
    finally:
        reset_empty_waiter(transport)
        if reading and not transport.is_closing():
            transport.resume_reading()


def send_now(transport: Any, fobj: Any, offset: int, count: int) -> tuple[int, bool] | None:
    """Send on the event loop, at once, what ``transport``'s socket takes of ``count``
    bytes of ``fobj`` from ``offset``: (bytes sent, whether the file ended first); None
    when this transport cannot be sent to this way (TLS, bytes waiting in its buffer, an
    asyncio without the hooks), nothing sent. A hit of a few MiB usually goes out whole
    in this one call, without the task, futures and writer registrations of asyncio's
    ``loop.sendfile``; :func:`send_rest` sends what is left. ``ConnectionError`` when the
    client is gone. The caller writes nothing to the transport until the bytes are out."""
    if (
        transport.is_closing()
        or transport.get_write_buffer_size()
        or transport.get_extra_info("sslcontext") is not None
        or not threaded_sendfile_hooks(asyncio.get_running_loop(), transport)
    ):
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        return _send_some(sock.fileno(), fobj.fileno(), offset, count)
    except OSError as exc:
        if isinstance(exc, ConnectionError):
            raise
        raise ConnectionResetError(f"sendfile failed: {exc}") from exc


async def send_rest(
    transport: Any, fobj: Any, offset: int, count: int, *, pause: bool = False
) -> int:
    """After :func:`send_now` sent part: send the other ``count`` bytes on the event loop
    as the socket takes them; the bytes sent (fewer only when the file ended early).
    ``ConnectionError`` when the client is gone. ``pause``: the transport's reading is
    paused meanwhile, as asyncio's ``sendfile`` does (for a protocol that could write
    when bytes arrive; the fast path holds what arrives itself)."""
    loop = asyncio.get_running_loop()
    sock = transport.get_extra_info("socket")
    if sock is None:
        raise ConnectionResetError("client gone")
    sockfd, fd = sock.fileno(), fobj.fileno()
    reading = pause and transport.is_reading()
    if reading:
        transport.pause_reading()
    try:
        return await _send_rest(loop, transport, sockfd, fd, offset, count)
    finally:
        if reading and not transport.is_closing():
            transport.resume_reading()


async def _send_rest(
    loop: Any, transport: Any, sockfd: int, fd: int, offset: int, count: int
) -> int:
    sent = 0
    while sent < count:
        if transport.is_closing():
            raise ConnectionResetError("client gone")
        await _writable(loop, sockfd)
        if transport.is_closing():
            raise ConnectionResetError("client gone")
        try:
            n, ended = _send_some(sockfd, fd, offset + sent, count - sent)
        except OSError as exc:
            if isinstance(exc, ConnectionError):
                raise
            raise ConnectionResetError(f"sendfile failed: {exc}") from exc
        sent += n
        if ended:
            break
    return sent
