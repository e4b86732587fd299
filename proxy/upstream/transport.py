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

from shardcache.errors import ProxyError

__all__ = ["Response", "Transport", "error_document", "write_all"]

ERROR_DOCUMENT_MAX = 65536  # bytes of an error answer read for its code


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


async def error_document(resp: Response) -> bytes:
    """The start of an error answer's body (an S3 or GCS XML error document, whose
    ``<Code>`` names the failure better than the status): about
    :data:`ERROR_DOCUMENT_MAX` bytes at most, what arrived if the body breaks; ``resp``
    is closed."""
    body = b""
    try:
        async for chunk in resp.chunks():
            body += chunk
            if len(body) > ERROR_DOCUMENT_MAX:
                break
    except ProxyError:
        pass
    finally:
        resp.close()
    return body
