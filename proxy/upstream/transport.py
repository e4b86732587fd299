"""What every backend provides: :class:`Transport` sends one request and returns a
:class:`Response` once the status and headers are in; the response streams its body.

A transport never interprets statuses (that is :mod:`proxy.upstream.resume` and
:mod:`proxy.upstream.errors`) and never resumes (:mod:`proxy.upstream.stream` does, the
same way for every backend). It raises errors of the project's tree, mapped by its own
table in :mod:`proxy.upstream.errors`: before the answer an UpstreamError/Timeout, during
the body :class:`~shardcache.errors.UpstreamCut` or UpstreamTimeout. A body ends cleanly
only when the backend saw its orderly end.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

__all__ = ["Response", "Transport", "write_all"]


def write_all(fd: int, data: Any, hasher: Any) -> None:
    """Write every byte of ``data`` to ``fd`` (and feed ``hasher``); OSError on failure."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    if hasher is not None:
        hasher.update(data)


class Response(Protocol):
    """One upstream answer."""

    status: int
    reason: str
    headers: Mapping[str, str]  # case-insensitive

    def chunks(self) -> AsyncIterator[bytes]:
        """The body; iterate once (this or :meth:`pump`)."""
        ...

    def pump(self, fd: int, hasher: Any, limit: int | None = None) -> AsyncIterator[int]:
        """Write the body (its first ``limit`` bytes, when given) to ``fd`` at its
        position, feeding ``hasher``; yield each batch's size once written. A failed
        write raises OSError (a local failure, never resumed)."""
        ...

    def close(self) -> None:
        """Release the connection (idempotent; safe before the body is read)."""
        ...


class Transport(Protocol):
    """Sends requests to one kind of upstream."""

    async def request(self, method: str, url: str, headers: Mapping[str, str]) -> Response:
        """Send ``method url`` and return once the answer's headers are in."""
        ...

    async def close(self) -> None: ...


async def pump_chunks(
    chunks: AsyncIterator[bytes], fd: int, hasher: Any, limit: int | None = None
) -> AsyncIterator[int]:
    """:meth:`Response.pump` for a body that only yields chunks: each written off the
    event loop."""
    loop = asyncio.get_running_loop()
    left = limit
    async for chunk in chunks:
        if left is not None:
            chunk = chunk[:left]
            left -= len(chunk)
        await loop.run_in_executor(None, write_all, fd, chunk, hasher)
        yield len(chunk)
        if left == 0:
            break
