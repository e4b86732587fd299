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

__all__ = ["send_file"]

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
