"""One upstream download per shard, teed to a ``.part`` file that every client follows.

The first request for a URL that is not cached starts a :class:`Download` (a background
task); requests for the same URL while it runs join it. The task writes upstream bytes to
the store's ``.part`` file; every client — the first, later joiners, Range requests —
follows the growing file through one shared descriptor and is woken by an event each time
bytes arrive. A client sends the written prefix with ``sendfile`` when its connection
allows (else ``pread`` and write). No client waits for the whole shard, and a slow client
never slows the download.

Completeness: a response that reaches the end of the object sends its last bytes only
after the download has been verified and committed (byte count against Content-Length, MD5 when the
upstream sent one). On an unrecoverable failure every client of the download gets
:class:`DownloadFailed`, upon which the handler aborts the connection: a truncated body
never looks like a clean end. The partial file is deleted, never committed.

Admission: when the store refuses the shard (bigger than the cache, or ``keep`` and full,
or the upstream said ``Cache-Control: no-store``/``private``, or the store cannot write)
the download turns into *bypass*: its upstream body goes to one client, and every other
client fetches its own, uncached (``X-Cache: BYPASS``).

Store failures: when the disk or index refuses a write mid-download (ENOSPC, EIO, EROFS…)
the download turns into *passthrough*: the partial file is discarded (its reservation
released), and each client sends what it can from the bytes already written, then fetches
the rest of its range from the upstream, verified to be the same version
(:meth:`proxy.upstream.Fetcher.read_range`). An upstream that cannot prove that ends in an
aborted connection, never in a short body or a splice of two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from proxy.metrics import ProxyMetrics
from proxy.policy import cache_control_forbids, should_admit, vary_forbids
from proxy.storehealth import StoreHealth
from proxy.upstream import Fetcher, UpstreamBody
from shardcache.digests import Digester
from shardcache.errors import (
    CacheError,
    DigestMismatch,
    DownloadFailed,
    IncompleteDownloadError,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamError,
)
from shardcache.meta import MAX_STORED_HEADER_BYTES, ObjectMeta
from shardcache.sizes import format_size
from shardcache.store import Entry, Partial, Store

__all__ = ["Download", "DownloadFailed", "Inflight", "State"]

log = logging.getLogger(__name__)

GROW_STEP = 64 << 20  # reservation step for downloads of unknown size
READ_CHUNK = 1 << 20
BYPASS_CLAIM_SECONDS = 30.0


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
        """The object's size: from the upstream's headers, or once every byte is in."""
        if self.meta.size is not None:
            return self.meta.size
        return self.written if self.verified else None

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


WRITEBACK_STEP = 16 << 20  # bytes written between two starts of their writeback

try:
    import ctypes
    import ctypes.util

    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
except (AttributeError, OSError):  # not Linux: the commit's fsync does it all
    _sync_file_range = None
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, count: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + count)`` of ``fd`` to
    disk, without waiting for them (Linux ``sync_file_range``; elsewhere nothing)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, count, _SYNC_FILE_RANGE_WRITE)


def _open_pair(path: str) -> tuple[int, int]:
    """A write and a read descriptor on the partial file."""
    w = os.open(path, os.O_WRONLY)
    try:
        r = os.open(path, os.O_RDONLY)
    except BaseException:
        os.close(w)
        raise
    return w, r


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

    When ``cap`` is None (spans go out whole), an unverified final span is split: all but
    its last byte now, the last byte after verification, so a slow verification never
    holds back the bulk of the bytes.
    """
    n = stop - pos if cap is None else min(cap, stop - pos)

    def is_last(k: int) -> bool:
        if end is not None:
            return pos + k == end and end == known_size
        return not streaming and pos + k == written

    last = is_last(n)
    if last and not verified and cap is None and n > 1:
        return n - 1, False
    return n, last


class Inflight:
    """The downloads running in this proxy, keyed by canonical upstream URL."""

    def __init__(
        self,
        store: Store,
        fetcher: Fetcher,
        metrics: ProxyMetrics,
        *,
        cache_size: int,
        health: StoreHealth | None = None,
    ) -> None:
        self.store = store
        self.fetcher = fetcher
        self.metrics = metrics
        self.cache_size = cache_size
        self.health = health if health is not None else StoreHealth(store, metrics)
        self._downloads: dict[str, Download] = {}

    def __len__(self) -> int:
        return len(self._downloads)

    def running(self, url: str) -> bool:
        """Whether a download of ``url`` is under way here."""
        return self.store.key(url) in self._downloads

    def get(self, url: str) -> Download | None:
        """The running download of ``url``, already acquired for the caller, or None."""
        dl = self._downloads.get(self.store.key(url))
        if dl is not None:
            dl.acquire()
        return dl

    def start(
        self,
        url: str,
        *,
        claimed: bool = False,
        body: UpstreamBody | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Download:
        """Start downloading ``url`` (caller checked it is neither cached nor running);
        the returned download is acquired for the caller. ``claimed``: the caller holds
        the store's cross-process claim on ``url``, released when the download ends."""
        if self.store.key(url) in self._downloads:
            return self.get(url)  # type: ignore[return-value]
        dl = Download(url)
        dl.opening = body
        dl.headers = dict(headers or {})
        if claimed:
            dl.hold_claim()
        dl.acquire()
        self._downloads[self.store.key(url)] = dl
        dl.task = asyncio.get_running_loop().create_task(self._run(dl), name=f"download {url}")
        return dl

    async def stop(self, finish_within: float = 10.0) -> None:
        """Give downloads up to ``finish_within`` seconds to finish (a download whose
        clients already have every byte is still verifying and committing, and cutting it
        off would throw that fetch away), then cancel the rest (their partial files are
        deleted) and wait for them."""
        tasks = [dl.task for dl in self._downloads.values() if dl.task is not None]
        if tasks and finish_within > 0:
            _, pending = await asyncio.wait(tasks, timeout=finish_within)
            tasks = list(pending)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, dl: Download) -> None:
        m = self.metrics
        m.downloads_in_progress.inc()
        body: UpstreamBody | None = None
        partial: Partial | None = None
        wfd: int | None = None
        try:
            body, dl.opening = dl.opening, None
            if body is None:
                body = await self._open(dl)
            meta = body.meta
            dl.opened(
                meta, lambda start, end: self.fetcher.read_range(dl.url, start, end, meta=meta)
            )
            dl.attach(body)
            partial, reason = await self._admit(dl, meta)
            if partial is None:
                log.info("%s not cached (%s), streaming it through", dl.url, reason)
                dl.to_bypass(body, reason)
                body = None
                asyncio.get_running_loop().call_later(
                    BYPASS_CLAIM_SECONDS, self._close_unclaimed, dl
                )
                return
            dl.cached = True
            wfd, rfd = await asyncio.to_thread(_open_pair, partial.path)
            dl.to_streaming(rfd)
            try:
                await self._receive(dl, body, partial, wfd)
            except OSError as exc:
                err = self.health.classify("write", exc)
                if err is None:
                    raise
                # the disk refused: discard the partial, clients continue from the upstream
                self.health.failed(err)
                body.close()
                body = None
                os.close(wfd)
                wfd = None
                with contextlib.suppress(CacheError):
                    await asyncio.to_thread(self.store.abort, partial)
                partial = None
                dl.to_passthrough(err)
                log.warning(
                    "%s: store write failed after %d bytes; its clients continue from the upstream",
                    dl.url,
                    dl.written,
                )
                return
            os.close(wfd)
            wfd = None
            if dl.meta.close_delimited and not await self._confirmed(dl):
                # a close-delimited body cannot tell a cut from its end: served, not kept
                m.unconfirmed.inc()
                if dl.cached:
                    with contextlib.suppress(CacheError):
                        await asyncio.to_thread(self.store.abort, partial)
                    partial = None
                    dl.cached = False
            entry = None
            if dl.cached:
                # the rename and the index row before the last byte goes out: a client
                # that saw a clean end finds the entry, even after a kill -9 of the proxy
                entry = await self._commit(dl, partial)
                partial = None
            # from here a request finds the entry (and revalidates it when due) or starts
            # afresh; none joins this finished download
            self._forget(dl)
            dl.all_verified()
            dl.to_done(entry)
            log.info("downloaded %s (%d bytes)", dl.url, dl.written)
        except asyncio.CancelledError:
            await self._discard(wfd, body, partial)
            wfd = body = partial = None
            dl.to_failed(UpstreamError(f"{dl.url}: download cancelled (shutting down)"))
            raise
        except Exception as exc:
            await self._discard(wfd, body, partial)
            wfd = body = partial = None
            if dl.written or isinstance(exc, IncompleteDownloadError):
                m.failed_downloads.inc()
                log.warning("download of %s failed after %d bytes: %s", dl.url, dl.written, exc)
            elif not isinstance(exc, ProxyError):
                log.exception("download of %s failed", dl.url)
                exc = UpstreamError(f"{dl.url}: {exc}")
            # only now, with the partial file gone, may clients see the failure
            dl.to_failed(exc)
        finally:
            await self._discard(wfd, body, partial)
            self._forget(dl)
            if dl.claimed:
                # after the commit: a process asking from now on finds the entry
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.to_thread(self.store.release_claim, dl.url))
            m.downloads_in_progress.dec()
            dl.ended()

    def _forget(self, dl: Download) -> None:
        """Take ``dl`` out of the table: requests from now on do not join it."""
        key = self.store.key(dl.url)
        if self._downloads.get(key) is dl:
            del self._downloads[key]

    async def _confirmed(self, dl: Download) -> bool:
        """Whether the upstream confirms that a close-delimited body ended where the object
        does: its last byte asked again with a range pinned to the version (strong ETag or
        Last-Modified), answered 206 with the same total and the same byte. False when the
        upstream cannot say (no validator, Range ignored, another version): the body is
        served, not cached. IncompleteDownloadError when the same version states a larger
        size: the close cut the body, and no client may see a clean end."""
        n = dl.written
        if n == 0 or dl._read_fd is None:
            return False
        try:
            total, byte = await self.fetcher.probe_end(dl.url, dl.meta, n)
            mine = await asyncio.to_thread(os.pread, dl._read_fd, 1, n - 1)
        except (ProxyError, CacheError, OSError) as exc:
            log.info(
                "%s: close-delimited body of %d bytes unconfirmed (%s); not cached",
                dl.url,
                n,
                exc,
            )
            return False
        if total is not None and total > n:
            raise IncompleteDownloadError(dl.url, n, total)
        if total != n or byte != mine:
            log.info(
                "%s: close-delimited body of %d bytes unconfirmed (the upstream states %s "
                "bytes%s); not cached",
                dl.url,
                n,
                total,
                "" if byte == mine else ", another last byte",
            )
            return False
        return True

    async def _open(self, dl: Download) -> UpstreamBody:
        """The upstream body of ``dl``, starting (in parts) with the part its first
        reader waits for. When the object ends before that byte, the reader's answer is
        a 416 — unless other clients joined meanwhile: the object is theirs to have."""
        at = dl.first_preferred
        try:
            return await self.fetcher.open(dl.url, dl.headers, at=at)
        except RangeNotSatisfiable:
            if at is None or dl.holders <= 2:  # this task and the reader that asked
                raise
            return await self.fetcher.open(dl.url, dl.headers)

    async def _admit(self, dl: Download, meta: ObjectMeta) -> tuple[Partial | None, str]:
        """A partial file for the download, or None and why it is not cached."""
        health = self.health
        if cache_control_forbids(meta.cache_control):
            return None, f"upstream Cache-Control: {meta.cache_control}"
        cdn = meta.field("CDN-Cache-Control")  # RFC 9213: for caches such as this one
        if cache_control_forbids(cdn):
            return None, f"upstream CDN-Cache-Control: {cdn}"
        vary = ", ".join(v for k, v in meta.fields if k.lower() == "vary")  # every line
        if vary_forbids(vary, meta.content_encoding):
            return None, f"upstream Vary: {vary} (entries are keyed by URL)"
        size = sum(len(k) + len(v) + 4 for k, v in meta.fields)
        if size > MAX_STORED_HEADER_BYTES:
            return None, (
                f"its header fields take {size} bytes, more than the "
                f"{MAX_STORED_HEADER_BYTES} stored with an entry"
            )
        if not health.writable:
            return None, "the store is not writable"
        if not should_admit(meta.size, self.cache_size):
            return None, await asyncio.to_thread(self.store.why_no_room, meta.size)
        try:
            partial = await asyncio.to_thread(
                # a download started ahead of its reader must be kept for it
                functools.partial(
                    self.store.begin, dl.url, meta.size, streamed=dl.reason == "demand"
                )
            )
            if partial is None:
                return None, await asyncio.to_thread(self.store.why_no_room, meta.size)
            return partial, ""
        except CacheError as exc:
            err = health.classify("create", exc)
            if err is not None:
                health.failed(err)
            else:
                log.error("cannot cache %s, streaming it through: %s", dl.url, exc)
            return None, f"store error: {exc}"

    async def _receive(self, dl: Download, body: UpstreamBody, partial: Partial, wfd: int) -> None:
        """Write the whole body to the partial file, then check its length and every
        digest the upstream declared (:mod:`shardcache.digests`); the digests computed
        become the entry's. Batches of up to 1 MiB are written off the loop (by the
        thread that received them when the backend has one): the readers wake once per
        batch. The digests are computed as the bytes are written (in parts: as the
        contiguous prefix grows), never by a second read of the finished file."""
        meta = body.meta
        digester = dl.digester = Digester(meta.digests, prefix_md5=body.prefix_md5)
        flushed = 0
        async for n in body.pump(wfd, digester):
            dl.wrote(n)
            if dl.cached and meta.size is None and dl.written > partial.reserved:
                await self._grow(dl, partial)
            if dl.written - flushed >= WRITEBACK_STEP:
                # the commit's fsync comes before the last byte goes out: start writing
                # back what is in, so that fsync finds little left to do
                await asyncio.to_thread(start_writeback, wfd, flushed, dl.written - flushed)
                flushed = dl.written
        if meta.size is not None and dl.written != meta.size:
            raise IncompleteDownloadError(dl.url, dl.written, meta.size)
        bad = digester.mismatches()
        for m in bad:
            self.metrics.digest_mismatches.labels(m.algorithm).inc()
            log.warning("upstream %s: %s digest mismatch: %s", dl.url, m.algorithm, m)
        if bad:
            raise DigestMismatch(f"upstream {dl.url}: digest mismatch: " + "; ".join(map(str, bad)))
        for algorithm in digester.unchecked:
            log.info(
                "upstream %s: declared %s digest not checked (no implementation)", dl.url, algorithm
            )
        dl.meta = replace(dl.meta, digests=digester.computed())

    async def _commit(self, dl: Download, partial: Partial) -> Entry | None:
        """Turn the verified partial into an entry; None when only caching failed (the
        bytes the clients got were right)."""
        try:
            return await asyncio.to_thread(self.store.commit, partial, dl.written, meta=dl.meta)
        except IncompleteDownloadError:
            raise  # the file is not what was written: no client may see a clean end
        except CacheError as exc:
            err = self.health.classify("commit", exc)
            if err is not None:
                self.health.failed(err)
            else:
                log.error("could not commit %s: %s", dl.url, exc)
            return None

    async def _discard(
        self, wfd: int | None, body: UpstreamBody | None, partial: Partial | None
    ) -> None:
        if wfd is not None:
            os.close(wfd)
        if body is not None:
            body.close()
        if partial is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(self.store.abort, partial))

    async def _grow(self, dl: Download, partial: Partial) -> None:
        want = dl.written + GROW_STEP
        if dl.written <= self.cache_size:
            want = min(want, self.cache_size)  # a body of unknown size may fit a small cache
        why = ""
        try:
            ok = await asyncio.to_thread(self.store.grow, partial, want)
        except CacheError as exc:
            err = self.health.classify("index", exc)
            if err is None:
                raise
            self.health.failed(err)
            ok, why = False, f"store error: {exc}"
        if not ok:
            # Too big to keep: drop the reservation and the directory entry; the open
            # descriptors keep the bytes readable for the clients already following.
            if not why:
                try:
                    need = dl.written if dl.written > self.cache_size else want
                    why = await asyncio.to_thread(self.store.why_no_room, need)
                except CacheError as exc:
                    why = f"store error: {exc}"
            log.info(
                "%s outgrew the cache at %s (%s); finishing uncached",
                dl.url,
                format_size(dl.written),
                why,
            )
            with contextlib.suppress(CacheError):
                await asyncio.to_thread(self.store.abort, partial)
            dl.cached = False

    def _close_unclaimed(self, dl: Download) -> None:
        body = dl.take_bypass_body()
        if body is not None:
            body.close()
