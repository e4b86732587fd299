"""The downloads running in this proxy (:class:`Inflight`, one per shard) and the task
that carries each through its phases: open the upstream, admit it to the store
(``_admit``), receive and verify its bytes (``_receive``), commit the entry
(``_commit``), or discard the partial file (``_discard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import replace

from proxy.inflight.download import Download
from proxy.metrics import ProxyMetrics
from proxy.policy import cache_control_forbids, should_admit, vary_forbids
from proxy.storehealth import StoreHealth
from proxy.upstream import Fetcher, UpstreamBody
from shardcache.digests import Digester
from shardcache.errors import (
    CacheError,
    DigestMismatch,
    IncompleteDownloadError,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamError,
)
from shardcache.meta import MAX_STORED_HEADER_BYTES, ObjectMeta
from shardcache.sizes import format_size
from shardcache.store import Entry, Partial, Store

__all__ = ["Inflight"]

log = logging.getLogger(__name__)

GROW_STEP = 64 << 20  # reservation step for downloads of unknown size
BYPASS_CLAIM_SECONDS = 30.0

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


def _begin_open(
    store: Store, url: str, size: int | None, streamed: bool
) -> tuple[Partial, tuple[int, int]] | None:
    """:meth:`Store.begin` and :func:`_open_pair` on its file, in one trip to a thread (a
    small object's miss is a handful of such trips: each one counts)."""
    partial = store.begin(url, size, streamed=streamed)
    if partial is None:
        return None
    try:
        return partial, _open_pair(str(partial.path))
    except BaseException:
        with contextlib.suppress(CacheError):
            store.abort(partial)
        raise


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
        return bool(self._downloads) and self.store.key(url) in self._downloads

    def in_progress(self) -> list[Download]:
        """The downloads in progress now (a snapshot; none is acquired for the caller)."""
        return list(self._downloads.values())

    def get(self, url: str) -> Download | None:
        """The running download of ``url``, already acquired for the caller, or None."""
        if not self._downloads:
            return None  # every hit asks: no key to derive (a hash of the URL) when idle
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
            partial, fds, reason = await self._admit(dl, meta)
            if partial is None:
                log.info("%s not cached (%s), streaming it through", dl.url, reason)
                dl.to_bypass(body, reason)
                body = None
                asyncio.get_running_loop().call_later(
                    BYPASS_CLAIM_SECONDS, self._close_unclaimed, dl
                )
                return
            dl.cached = True
            wfd, rfd = fds
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
        a 416 — unless other clients joined meanwhile: the object is theirs to have.
        An urgent download (a plan's reader waits for it) comes in parts where it can."""
        at = dl.first_preferred
        try:
            return await self.fetcher.open(
                dl.url, dl.headers, at=at, urgent=dl.urgent, one_stream=dl.one_stream
            )
        except RangeNotSatisfiable:
            if at is None or dl.holders <= 2:  # this task and the reader that asked
                raise
            return await self.fetcher.open(
                dl.url, dl.headers, urgent=dl.urgent, one_stream=dl.one_stream
            )

    async def _admit(
        self, dl: Download, meta: ObjectMeta
    ) -> tuple[Partial | None, tuple[int, int], str]:
        """A partial file for the download with a write and a read descriptor on it, or
        None and why it is not cached."""
        health = self.health
        no = (-1, -1)
        if cache_control_forbids(meta.cache_control):
            return None, no, f"upstream Cache-Control: {meta.cache_control}"
        cdn = meta.field("CDN-Cache-Control")  # RFC 9213: for caches such as this one
        if cache_control_forbids(cdn):
            return None, no, f"upstream CDN-Cache-Control: {cdn}"
        vary = ", ".join(v for k, v in meta.fields if k.lower() == "vary")  # every line
        if vary_forbids(vary, meta.content_encoding):
            return None, no, f"upstream Vary: {vary} (entries are keyed by URL)"
        size = sum(len(k) + len(v) + 4 for k, v in meta.fields)
        if size > MAX_STORED_HEADER_BYTES:
            return (
                None,
                no,
                (
                    f"its header fields take {size} bytes, more than the "
                    f"{MAX_STORED_HEADER_BYTES} stored with an entry"
                ),
            )
        if not health.writable:
            return None, no, "the store is not writable"
        if not should_admit(meta.size, self.cache_size):
            return None, no, await asyncio.to_thread(self.store.why_no_room, meta.size)
        try:
            begin = asyncio.ensure_future(
                asyncio.to_thread(
                    # a download started ahead of its reader must be kept for it
                    functools.partial(
                        _begin_open, self.store, dl.url, meta.size, dl.reason == "demand"
                    )
                )
            )
            try:
                made = await asyncio.shield(begin)
            except asyncio.CancelledError:
                # cancelled (shutting down) while the store created the partial file:
                # it is this download's to remove, not a leftover for the next start
                with contextlib.suppress(Exception):
                    late = await begin
                    if late is not None:
                        for fd in late[1]:
                            os.close(fd)
                        await asyncio.to_thread(self.store.abort, late[0])
                raise
            if made is None:
                return None, no, await asyncio.to_thread(self.store.why_no_room, meta.size)
            return made[0], made[1], ""
        except CacheError as exc:
            err = health.classify("create", exc)
            if err is not None:
                health.failed(err)
            else:
                log.error("cannot cache %s, streaming it through: %s", dl.url, exc)
            return None, no, f"store error: {exc}"

    async def _receive(self, dl: Download, body: UpstreamBody, partial: Partial, wfd: int) -> None:
        """Write the whole body to the partial file, then check its length and every
        digest the upstream declared (:mod:`shardcache.digests`); the digests computed
        become the entry's. Batches (up to 1 MiB; up to 4 MiB spliced by the threaded
        transport) are written off the loop (by the thread that received them when the
        backend has one): the readers wake once per batch. The digests are computed as
        the bytes are written (in parts: as the contiguous prefix grows), never by a
        second read of the finished file."""
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
