"""A download's shared state: where it is (:class:`State`) and :class:`Download`, the
object its producer (the download task, :mod:`proxy.inflight.registry`) moves from state
to state and its consumers (the clients) wait on, following the growing ``.part`` file.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.upstream import UpstreamBody
from shardcache.digests import Digester
from shardcache.errors import (
    CacheError,
    DigestMismatch,
    DownloadFailed,
    IncompleteDownloadError,
    ProxyError,
)
from shardcache.meta import ObjectMeta
from shardcache.store import Entry

__all__ = ["Download", "State"]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
WHOLE_TAIL = 64 << 10  # an unverified final span up to this long is sent whole, once verified


class State(enum.Enum):
    """Where a download is: OPENING -> STREAMING -> DONE | FAILED | PASSTHROUGH, or
    OPENING -> BYPASS (not cached: its body goes to one client) | FAILED."""

    OPENING = "opening"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    BYPASS = "bypass"
    PASSTHROUGH = "passthrough"


_FINISHED = frozenset({State.DONE, State.FAILED, State.BYPASS, State.PASSTHROUGH})


class Download:
    """The shared state of one upstream download. Created by :class:`Inflight`, whose
    task is its producer (the methods under "producer"); clients are its consumers
    (:meth:`acquire`, the ``wait_*`` methods, :meth:`stream`, :meth:`release`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.state = State.OPENING
        self.meta = ObjectMeta(size=None)
        self.written = 0
        self.verified = False  # all bytes in, length and checksum checked
        self.cached = False  # will become an entry if it completes
        self.entry: Entry | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._changed = asyncio.Event()
        self._read_fd: int | None = None
        self._refs = 1  # the download task itself
        self._bypass_body: UpstreamBody | None = None
        self.bypass_reason = ""
        self.claimed = False  # holds the store's cross-process claim (--workers)
        self.reason = "demand"  # or what started it in the background: plan, prefetch
        # a read plan's reader waits for it now (or is about to): fetched in parts where
        # the upstream allows; while a client follows it, no other background download
        # of its origin starts (:class:`proxy.plans.Scheduler`)
        self.urgent = False
        # started beside an urgent download of the same origin: one stream, never parts,
        # so the urgent one keeps most of the origin's connections
        self.one_stream = False
        self.task: asyncio.Task | None = None
        self.opening: UpstreamBody | None = None  # an answer already open to start from
        self.headers: dict[str, str] = {}  # the first client's end-to-end request fields
        # passthrough: reads bytes [start, end) of this version from the upstream
        self._upstream_range: Callable[[int, int | None], Any] | None = None
        # parallel parts written at their offsets: which to fetch first, how far each is
        self._order: Any = None
        self._preferred: list[int] = []
        # the digests of the bytes written so far: a passthrough client reading to the end
        # completes them with the rest it reads from the upstream
        self.digester: Digester | None = None

    # -- producer ------------------------------------------------------------------------

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def opened(self, meta: ObjectMeta, upstream_range: Callable[[int, int | None], Any]) -> None:
        """The upstream answered with version ``meta``; ``upstream_range(start, end)``
        reads bytes of that version from the upstream (for passthrough)."""
        self.meta = meta
        self._upstream_range = upstream_range

    def attach(self, body: UpstreamBody) -> None:
        """The body about to be written: when it is parallel parts written at their
        offsets, readers may have parts fetched first and read them ahead of the prefix."""
        self._order = body.order
        if self._order is not None:
            self._order.notify = self._notify
            for pos in self._preferred:
                self._order.prefer(pos)

    def to_bypass(self, body: UpstreamBody, reason: str) -> None:
        """Not cached: ``body`` goes to the first client that asks for it."""
        self._bypass_body = body
        self.bypass_reason = reason
        self.state = State.BYPASS
        self._notify()

    def to_streaming(self, read_fd: int) -> None:
        """Bytes start arriving in the partial file, readable through ``read_fd``."""
        self._read_fd = read_fd
        self.state = State.STREAMING
        self._notify()

    def wrote(self, n: int) -> None:
        self.written += n
        self._notify()

    def all_verified(self) -> None:
        """Every byte is in the file, its count (and digest) checked."""
        self.verified = True
        self._notify()

    def to_passthrough(self, error: BaseException) -> None:
        """The store gave up mid-download: clients continue from the upstream."""
        self.cached = False
        self.error = error
        self.state = State.PASSTHROUGH
        self._notify()

    def to_done(self, entry: Entry | None) -> None:
        self.entry = entry
        self.state = State.DONE
        self._notify()

    def hold_claim(self) -> None:
        """This download also holds the store's cross-process claim on its URL (taken by
        a request that found it started meanwhile); released when it ends."""
        self.claimed = True

    def ended(self) -> None:
        """The download task is done with this download (whatever its state)."""
        self._notify()
        self.release()

    def to_failed(self, error: BaseException) -> None:
        """Only once the partial file is gone may clients see the failure."""
        self.error = error
        self.state = State.FAILED
        self._notify()

    # -- consumers -----------------------------------------------------------------------

    async def _wait(self) -> None:
        await self._changed.wait()

    def prefer(self, pos: int) -> None:
        """A reader needs byte ``pos`` (far ahead of the prefix, e.g. a cold Range):
        downloaded in parts, the part holding it is fetched next (said before the
        download opened, its first request asks for that part)."""
        if self._order is not None:
            self._order.prefer(pos)
        elif pos not in self._preferred and self.state is State.OPENING:
            self._preferred.append(pos)

    @property
    def first_preferred(self) -> int | None:
        """The first byte a reader asked to have first, before the download opened."""
        return self._preferred[0] if self._preferred else None

    @property
    def reads_ahead(self) -> bool:
        """Whether bytes far ahead of the prefix can come from this download soon (its
        parts are written at their offsets and :meth:`prefer` reorders them)."""
        return self._order is not None and self._order.active

    def available(self, pos: int) -> int:
        """How far the bytes on disk from ``pos`` reach: the written prefix, or beyond
        it a part fetched ahead (while streaming)."""
        if pos < self.written or self._order is None or self.state is not State.STREAMING:
            return self.written
        return max(self.written, pos + self._order.ready(pos))

    @property
    def known_size(self) -> int | None:
        """The object's size: from the upstream's headers, or once every byte is in (a
        close-delimited body's only once its size was confirmed and it was committed: an
        answer with a length would vouch for an end nobody confirmed)."""
        if self.meta.size is not None:
            return self.meta.size
        if not self.verified or (self.meta.close_delimited and self.entry is None):
            return None
        return self.written

    @property
    def finished(self) -> bool:
        return self.state in _FINISHED

    async def wait_headers(self) -> None:
        """Wait until the upstream answered; raise its error if it failed before any byte."""
        while self.state is State.OPENING:
            await self._wait()
        if self.state is State.FAILED and self.written == 0 and isinstance(self.error, ProxyError):
            raise self.error
        if self.state is State.FAILED:
            raise DownloadFailed(self.url, self.error)

    async def wait_beyond(self, pos: int) -> None:
        """Wait until byte ``pos`` is on disk, or the download ended either way."""
        if self.written < pos:
            self.prefer(pos)
        while self.available(pos) <= pos and self.state in (State.OPENING, State.STREAMING):
            await self._wait()

    async def wait_verified(self) -> None:
        """Wait until every byte is in and verified; DownloadFailed otherwise."""
        while not self.verified and self.state not in (
            State.FAILED,
            State.BYPASS,
            State.PASSTHROUGH,
        ):
            await self._wait()
        if not self.verified:
            raise DownloadFailed(self.url, self.error)

    async def wait_finished(self) -> None:
        while not self.finished:
            await self._wait()

    # -- readers -------------------------------------------------------------------------

    def acquire(self) -> None:
        """Register a client; the shared read descriptor stays open until all release."""
        self._refs += 1

    @property
    def holders(self) -> int:
        """How many clients (and the download task, while it runs) hold this download."""
        return self._refs

    def release(self) -> None:
        self._refs -= 1
        if self._refs == 0 and self._read_fd is not None:
            fd, self._read_fd = self._read_fd, None
            os.close(fd)

    def take_bypass_body(self) -> UpstreamBody | None:
        """The upstream body of a bypassed download, to the first client that asks."""
        body, self._bypass_body = self._bypass_body, None
        return body

    async def stream(
        self,
        write: Callable[[bytes], Awaitable[None]],
        start: int = 0,
        end: int | None = None,
        on_first_byte: Callable[[], None] | None = None,
        *,
        send: Callable[[Any, int, int], Awaitable[int]] | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> int:
        """Send bytes ``start..end-1`` (to the end when ``end`` is None) as they arrive.

        With ``send`` (``send(file, offset, count)`` returning the bytes it sent, e.g. a
        ``sendfile``), each pass hands it the whole written prefix not yet sent, straight
        from the ``.part`` file; the last byte of the object is held back until the
        download is verified and committed. Without it, ``pread`` reads 1 MiB at a time into ``write``.

        ``on_wait(since)`` is called after each wait for bytes not yet downloaded (or
        verified, or read from the upstream), with the ``time.monotonic()`` it began.

        Returns the number of bytes sent. Raises DownloadFailed if the download fails
        before the range is complete; the caller must then abort its connection.
        """
        loop = asyncio.get_running_loop()
        pos = start
        first = True
        fobj: Any = None
        try:
            while end is None or pos < end:
                if self.available(pos) <= pos and self.state in (State.OPENING, State.STREAMING):
                    since = time.monotonic()
                    try:
                        await self.wait_beyond(pos)
                    finally:
                        if on_wait is not None:
                            on_wait(since)
                if self.state is State.FAILED:
                    raise DownloadFailed(self.url, self.error)
                if self.state is State.PASSTHROUGH and pos >= self.written:
                    since = time.monotonic()
                    try:
                        pos += await self._from_upstream(write, pos, end)
                    finally:
                        if on_wait is not None:
                            on_wait(since)
                    break
                avail = self.available(pos)
                if avail <= pos:
                    # finished without more bytes: only a verified end of a whole object
                    # is clean
                    if end is None and self.verified:
                        break
                    raise DownloadFailed(
                        self.url, self.error or IncompleteDownloadError(self.url, avail, end)
                    )
                stop = avail if end is None else min(avail, end)
                n, last = _next_span(
                    pos,
                    stop,
                    end,
                    self.known_size,
                    self.written,
                    self.state is State.STREAMING,
                    self.verified,
                    READ_CHUNK if send is None else None,
                )
                if self.state is State.PASSTHROUGH:
                    last = False  # the end comes from the upstream, verified there
                if last and not self.verified:
                    # the final byte goes once every byte is on disk and verified; the
                    # commit (fsync, rename, index) follows on its own
                    since = time.monotonic()
                    try:
                        await self.wait_verified()
                    finally:
                        if on_wait is not None:
                            on_wait(since)
                fd = self._read_fd
                if fd is None:
                    raise DownloadFailed(self.url, RuntimeError("download file closed"))
                if first and on_first_byte is not None:
                    on_first_byte()
                    first = False
                if send is not None:
                    if fobj is None:
                        fobj = open(fd, "rb", buffering=0, closefd=False)  # noqa: SIM115
                    sent = await send(fobj, pos, n)
                    pos += sent
                    if sent < n:
                        raise DownloadFailed(self.url, IncompleteDownloadError(self.url, pos, end))
                else:
                    data = await loop.run_in_executor(None, os.pread, fd, n, pos)
                    if not data:
                        raise DownloadFailed(self.url, IncompleteDownloadError(self.url, pos, end))
                    await write(data)
                    pos += len(data)
                if end is None and self.verified and pos >= self.written:
                    break
        finally:
            if fobj is not None:
                fobj.close()  # closefd=False: the shared descriptor stays open
        return pos - start

    async def _from_upstream(
        self, write: Callable[[bytes], Awaitable[None]], pos: int, end: int | None
    ) -> int:
        """The rest of a client's range from the upstream, once the store gave up."""
        if self._upstream_range is None:
            raise DownloadFailed(self.url, self.error)
        stop = end if end is not None else self.meta.size
        if stop is not None and pos >= stop:
            return 0
        # to the object's end, after bytes [0, pos) all hashed: the declared digests are
        # checked, the last chunk held back until they match
        check = self.digester
        if check is None or not check.checks or check.size != pos or stop != self.meta.size:
            check = None
        else:
            check = check.copy()
        sent = 0
        held: bytes | None = None
        try:
            async for chunk in self._upstream_range(pos, end):
                if check is not None:
                    await asyncio.to_thread(check.update, chunk)
                    chunk, held = held, chunk
                    if chunk is None:
                        continue
                await write(chunk)
                sent += len(chunk)
        except (ProxyError, CacheError) as exc:
            raise DownloadFailed(self.url, exc) from exc
        if check is not None:
            bad = check.mismatches()
            if bad:
                log.warning("upstream %s: digest mismatch: %s", self.url, "; ".join(map(str, bad)))
                raise DownloadFailed(self.url, DigestMismatch("; ".join(map(str, bad))))
            if held is not None:
                await write(held)
                sent += len(held)
        return sent


def _next_span(
    pos: int,
    stop: int,
    end: int | None,
    known_size: int | None,
    written: int,
    streaming: bool,
    verified: bool,
    cap: int | None,
) -> tuple[int, bool]:
    """How many bytes from ``pos`` to send now (``stop`` is the written limit), and
    whether they include the object's final byte, which may go out only once verified.

    When ``cap`` is None (spans go out whole), an unverified final span of more than
    :data:`WHOLE_TAIL` bytes is split: all but its last byte now, the last byte after
    verification, so a slow verification never holds back the bulk of the bytes. A
    shorter one waits whole: for a small object, one send after the commit costs less
    than two (each a thread hop), and the bytes held back are few.
    """
    n = stop - pos if cap is None else min(cap, stop - pos)

    def is_last(k: int) -> bool:
        if end is not None:
            return pos + k == end and end == known_size
        return not streaming and pos + k == written

    last = is_last(n)
    if last and not verified and cap is None and n > WHOLE_TAIL:
        return n - 1, False
    return n, last
