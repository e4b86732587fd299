"""Bodies that survive upstream failures, the same way for every backend.

:func:`read` asks a transport for bytes ``[start, end)`` of one version of an object
(:func:`proxy.upstream.resume.range_headers`), checks the answer before a byte of it is
used (:func:`proxy.upstream.resume.verify`) and, when the body breaks off, asks again
from the byte where it stopped, as :func:`proxy.upstream.resume.next_try` decides. A
download's whole body, each parallel part, and a client's range read from the upstream
are all this one loop. :func:`retrying` is the one loop for requests refused as
overloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from proxy.upstream.errors import status_error
from proxy.upstream.options import RetryPolicy
from proxy.upstream.resume import next_try, range_headers, verify
from proxy.upstream.transport import Response, Transport
from shardcache.digests import Digester
from shardcache.errors import (
    DigestMismatch,
    IncompleteDownloadError,
    ProxyError,
    UpstreamCut,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)
from shardcache.meta import ObjectMeta

__all__ = ["Policy", "UpstreamBody", "ask", "read", "retrying"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _noop(outcome: str) -> None:
    pass


@dataclass(frozen=True)
class Policy(RetryPolicy):
    """How hard to try (the daemon's one :class:`RetryPolicy`), and whom to tell."""

    observe: Callable[[str], None] = _noop  # "resumed", "aborted", ...
    on_bytes: Callable[[int], None] | None = None


async def retrying(call: Callable[[], Awaitable[T]], url: str, policy: RetryPolicy) -> T:
    """``call()``, again after the one backoff while the upstream says it is overloaded
    (UpstreamThrottled), up to ``policy.retries`` more times."""
    retries, backoff = policy.retries, policy.backoff
    attempt = 0
    first: UpstreamThrottled | None = None
    while True:
        try:
            return await call()
        except UpstreamThrottled as exc:
            first = first or exc
            attempt += 1
            delay = next_try(None, 0, attempt, retries, backoff, random.random())
            if delay is None:
                raise
            log.warning("%s: %s; retry %d/%d in %.2fs", url, exc, attempt, retries, delay)
            await asyncio.sleep(delay)
        except ProxyError as exc:
            if first is None:
                raise
            # a retry answered something else: the client is told the first failure,
            # never an answer meant for a request it did not make
            raise first from exc


async def ask(
    transport: Transport,
    url: str,
    meta: ObjectMeta | None,
    start: int,
    end: int | None,
    policy: Policy,
) -> tuple[Response, ObjectMeta]:
    """Request bytes ``[start, end)`` of version ``meta`` (any version when None) and
    verify the answer; the open response and the version it carries."""
    headers = range_headers(meta, start, end)

    async def once() -> Response:
        resp = await transport.request("GET", url, headers)
        if resp.status not in (200, 206, 412):
            resp.close()
            raise status_error(url, resp.status, resp.reason)
        return resp

    resp = await retrying(once, url, policy)
    try:
        got = verify(url, meta, start, end, resp.status, resp.headers)
    except BaseException:
        resp.close()
        raise
    return resp, got


async def read(
    transport: Transport,
    url: str,
    meta: ObjectMeta,
    start: int,
    end: int | None,
    policy: Policy,
    *,
    first: Response | None = None,
    sink: tuple[int, Any] | None = None,
) -> AsyncIterator[Any]:
    """Bytes ``[start, end)`` (to the end when ``end`` is None) of version ``meta``,
    resumed across failures: chunks, or with ``sink`` (fd, hasher) the size of each batch
    written there. ``first``: an open, verified answer for ``start`` to begin with (it
    may run past ``end``: the excess is dropped). Raises IncompleteDownloadError when
    the rule gives up, the upstream's error when a request is refused, ObjectChanged
    when another version answers; never yields a byte of another version."""
    if end is None and meta.size is not None:
        end = meta.size
    pos = start
    attempt = 0
    resp = first
    try:
        while True:
            try:
                if resp is None:
                    resp, _ = await ask(transport, url, meta, pos, end, policy)
                    if attempt:
                        policy.observe("resumed")
                if sink is not None:
                    it = resp.pump(*sink, None if end is None else end - pos)
                else:
                    it = resp.chunks()
                async with contextlib.aclosing(it):  # type: ignore[type-var]
                    async for item in it:
                        n = item if sink is not None else len(item)
                        trimmed = False
                        if end is not None and pos + n > end:
                            if sink is not None or first is None:
                                raise UpstreamError(f"upstream {url}: more bytes than asked")
                            item, n, trimmed = item[: end - pos], end - pos, True
                        if n:
                            pos += n
                            if policy.on_bytes is not None:
                                policy.on_bytes(n)
                            yield item
                        if trimmed:
                            break
                        # at ``end`` the body is read on to its own end: the transport
                        # checks there that no byte follows what its framing declared
                if end is not None and pos != end:
                    raise UpstreamCut(f"upstream {url}: body ended at byte {pos} of {end}")
                return
            except (UpstreamCut, UpstreamTimeout) as exc:
                attempt += 1
                delay = next_try(
                    meta, pos - start, attempt, policy.retries, policy.backoff, random.random()
                )
                if delay is None:
                    policy.observe("aborted")
                    log.warning("upstream %s failed at byte %d, giving up: %s", url, pos, exc)
                    raise IncompleteDownloadError(url, pos, end) from exc
                log.info(
                    "upstream %s failed at byte %d (%s); resume %d/%d in %.2fs",
                    url,
                    pos,
                    exc,
                    attempt,
                    policy.retries,
                    delay,
                )
                if resp is not None:
                    resp.close()
                    resp = None
                await asyncio.sleep(delay)
            except ProxyError as exc:
                if pos == start or isinstance(exc, IncompleteDownloadError):
                    raise
                policy.observe("aborted")
                log.warning("upstream %s: cannot continue at byte %d: %s", url, pos, exc)
                raise IncompleteDownloadError(url, pos, end) from exc
    finally:
        if resp is not None:
            resp.close()


class UpstreamBody:
    """An upstream answer whose headers are in: the version (``meta``) and its bytes to
    come, through :meth:`chunks` or :meth:`pump` (iterate one of them, once). ``order``:
    a :class:`proxy.upstream.parts.PartsOrder` when :meth:`pump` writes parallel parts
    at their offsets (readers may ask for a part first, and read it before the prefix
    reaches it); else None."""

    order: Any = None

    def __init__(
        self,
        url: str,
        meta: ObjectMeta,
        stream: Callable[[tuple[int, Any] | None], AsyncIterator[Any]],
        close: Callable[[], None],
        *,
        prefix_md5: tuple[int, str] | None = None,
    ) -> None:
        self.url = url
        self.meta = meta  # meta.digests: what the upstream declared of the whole object
        # (length, hex) of a Content-MD5 sent with a 206 for the first bytes (see
        # shardcache.digests.Digester)
        self.prefix_md5 = prefix_md5
        self._stream: Callable[[tuple[int, Any] | None], AsyncIterator[Any]] | None = stream
        self._close: Callable[[], None] | None = close

    def _take(self) -> Callable[[tuple[int, Any] | None], AsyncIterator[Any]]:
        if self._stream is None:
            raise RuntimeError("body already consumed")
        stream, self._stream = self._stream, None
        return stream

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, resumed across upstream failures. When the upstream declared
        digests of the whole object, the last chunk is held back until they are checked:
        a mismatch raises DigestMismatch instead of ending cleanly."""
        chunks = self._take()(None)
        if not self.meta.digests and self.prefix_md5 is None:
            return chunks
        return _checked(
            self.url, chunks, Digester(self.meta.digests, record=(), prefix_md5=self.prefix_md5)
        )

    def pump(self, fd: int, hasher: Any = None) -> AsyncIterator[int]:
        """Write the body to ``fd`` (and feed ``hasher``), yielding the count of each batch
        once written; a backend that receives in a worker thread writes there."""
        return self._take()((fd, hasher))

    def close(self) -> None:
        """Release the upstream connection (idempotent)."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


async def _checked(
    url: str, chunks: AsyncIterator[bytes], digester: Digester
) -> AsyncIterator[bytes]:
    """``chunks``, each fed to ``digester`` (off the loop) and passed on one chunk late,
    the last only once every declared digest matched."""
    held: bytes | None = None
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            await asyncio.to_thread(digester.update, chunk)
            if held is not None:
                yield held
            held = chunk
    bad = digester.mismatches()
    if bad:
        for m in bad:
            log.warning("upstream %s: %s digest mismatch: %s", url, m.algorithm, m)
        raise DigestMismatch(f"upstream {url}: digest mismatch: " + "; ".join(map(str, bad)))
    if held is not None:
        yield held
