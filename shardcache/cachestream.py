"""Tee a shard stream to disk while it is read, and serve later reads from the copy.

:class:`CacheStream` proves completeness before anything becomes a cache entry: the
source must really end (a read returned ``b""``; a short read is *not* the end) and the
byte count must equal what the source promised (Content-Length, the file size, or
``expected_size``). A source that ends early raises :class:`IncompleteDownloadError` to
the reader and leaves no entry, so a consumer never mistakes a truncated shard for a
complete one.

:func:`cache_shards` is the iterator form used by datasets: it yields
``dict(url=..., stream=...)`` per shard, from the store on a hit and through a
CacheStream on a miss.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from shardcache.errors import CacheError, IncompleteDownloadError
from shardcache.store import DEFAULT_CACHE_SIZE, DEFAULT_POLICY, NoRoomError, Partial, Store
from shardcache.urls import expand_urls, guess_shard

__all__ = ["CacheStream", "cache_shards", "open_cached", "stream_length"]

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # read size used when draining a source to its end
GROW_STEP = 16 << 20  # reservation increment for downloads of unknown size


def stream_length(stream: Any) -> int | None:
    """The total number of bytes ``stream`` promises, or None when it does not say.

    Understands HTTP responses (``Content-Length`` in ``headers``, unless the body is
    content-encoded), objects with an integer ``length`` or ``size`` attribute, and
    regular files (their size from ``fstat`` minus the current position).
    """
    raw = getattr(stream, "raw", None)  # io.BufferedReader over an HTTP stream
    if raw is not None and raw is not stream and not hasattr(stream, "headers"):
        n = stream_length(raw)
        if n is not None:
            return n
    headers = getattr(stream, "headers", None)
    if headers is not None and hasattr(headers, "get"):
        value = headers.get("Content-Length")
        encoding = headers.get("Content-Encoding")
        if value is not None and (encoding in (None, "", "identity")):
            try:
                n = int(str(value).strip())
            except ValueError:
                n = -1
            if n >= 0:
                return n
    for attr in ("content_length", "length", "size"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    import stat

    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        pos = stream.tell()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pos = 0
    return max(st.st_size - pos, 0)


class CacheStream(io.RawIOBase):
    """A readable stream that copies everything read from ``stream`` into a cache file.

    Two ways to use it:

    * standalone: ``CacheStream(fname, stream)`` writes to a unique ``fname.*.part`` next to
      ``fname`` and renames it to ``fname`` when complete;
    * over a :class:`~shardcache.store.Store`: ``CacheStream(name, stream, store=store,
      partial=store.begin(url, size))`` writes to the partial's file and commits it to the
      store when complete (``fname`` is then only used in messages).

    ``fname=None`` (and no store) only verifies the byte count, caching nothing.

    Complete means: a read of the source returned ``b""`` *and* the byte count equals
    ``expected_size`` (default: what the stream itself announces, see
    :func:`stream_length`). Ending early raises :class:`IncompleteDownloadError` from
    ``read``; the cache file is discarded in every incomplete case.

    ``close(complete=True)`` finishes the download first (reads the rest of the source,
    e.g. the padding a tar reader leaves unread) and keeps it if it is complete;
    ``close()`` of an unfinished stream discards the partial file.
    """

    def __init__(
        self,
        fname: str | os.PathLike | None,
        stream: BinaryIO,
        verbose: bool = False,
        *,
        expected_size: int | None = None,
        store: Store | None = None,
        partial: Partial | None = None,
    ) -> None:
        super().__init__()
        if (store is None) != (partial is None):
            raise ValueError("CacheStream: pass store and partial together")
        self.stream = stream
        self.verbose = verbose
        self.store = store
        self.partial = partial
        self.name = str(partial.url if partial is not None else fname)
        if expected_size is None and partial is not None:
            expected_size = partial.expected_size
        if expected_size is None:
            expected_size = stream_length(stream)
        if expected_size is not None and expected_size < 0:
            raise ValueError(f"{self.name}: expected_size must be >= 0, got {expected_size}")
        self.expected_size = expected_size
        self.bytes_read = 0
        self.entry = None  # the store Entry once committed
        self._done = False  # finished: committed, discarded, or failed
        self._error: BaseException | None = None
        self._fname = Path(fname) if fname is not None and partial is None else None
        self._part: Path | None = None
        self._file: BinaryIO | None = None
        if partial is not None:
            self._part = partial.path
        elif self._fname is not None:
            self._fname.parent.mkdir(parents=True, exist_ok=True)
            self._part = self._fname.with_name(
                f"{self._fname.name}.{os.getpid()}.{secrets.token_hex(6)}.part"
            )
        if self._part is not None:
            try:
                self._file = open(self._part, "wb")  # noqa: SIM115 - closed in _finish
            except OSError as exc:
                self._release()
                raise CacheError(f"{self._part}: cannot write cache file: {exc}") from exc

    # -- io.RawIOBase --------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    @property
    def caching(self) -> bool:
        """True while the bytes read are still being written to a cache file."""
        return self._file is not None

    def read(self, n: int | None = -1) -> bytes:
        """Read up to ``n`` bytes (all remaining bytes for ``n`` None or negative)."""
        if self.closed:
            raise ValueError("read from a closed CacheStream")
        if self._error is not None:
            raise self._error
        if n is None or n < 0:
            return self.readall()
        if n == 0 or self._done:
            return b""
        try:
            data = self.stream.read(n)
        except BaseException as exc:
            self._fail(f"reading the source failed: {exc!r}")
            raise
        if not data:
            self._at_eof()
            return b""
        self._write(data)
        return data

    def readall(self) -> bytes:
        chunks = []
        while True:
            data = self.read(CHUNK)
            if not data:
                return b"".join(chunks)
            chunks.append(data)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data = self.read(len(view))
        n = len(data)
        view[:n] = data
        return n

    def close(self, complete: bool = False) -> None:
        """Close the source; keep the cache file only if the download is complete.

        ``complete=True`` reads the rest of the source first (bounded by the source's
        length) so that a consumer that stopped at the tar end-of-archive marker still
        leaves a complete entry; if the source turns out short the file is discarded and
        :class:`IncompleteDownloadError` raised.
        """
        if self.closed:
            return
        try:
            if complete and not self._done and self._error is None:
                while self.read(CHUNK):
                    pass
            if not self._done:
                self._discard(f"closed after {self.bytes_read} bytes, before the end")
        finally:
            try:
                self.stream.close()
            finally:
                super().close()

    # -- internals -----------------------------------------------------------------------

    def _log(self, msg: str, *args: object) -> None:
        log.log(logging.INFO if self.verbose else logging.DEBUG, msg, *args)

    def _write(self, data: bytes) -> None:
        self.bytes_read += len(data)
        if self.expected_size is not None and self.bytes_read > self.expected_size:
            err = IncompleteDownloadError(self.name, self.bytes_read, self.expected_size)
            self._fail(f"source sent more than the promised {self.expected_size} bytes")
            self._error = err
            raise err
        if self._file is None:
            return
        if (
            self.partial is not None
            and self.bytes_read > self.partial.reserved
            and self.store is not None
        ):
            # Reserve ahead (double, at most GROW_STEP more) to keep grow calls rare,
            # but never more than the cache holds nor less than what arrived.
            reserved = self.partial.reserved
            ahead = min(2 * reserved, reserved + GROW_STEP)
            want = max(self.bytes_read, min(ahead, self.store.cache_size))
            if want < self.bytes_read or not self.store.grow(self.partial, want):
                self._log("%s: too big for the cache, streaming through", self.name)
                self._discard("does not fit in the cache")
                return
        try:
            self._file.write(data)
        except OSError as exc:
            log.warning(
                "%s: cannot write cache file %s (%s); not caching", self.name, self._part, exc
            )
            self._discard("cache write failed")

    def _at_eof(self) -> None:
        if self._done:
            return
        if self.expected_size is not None and self.bytes_read != self.expected_size:
            err = IncompleteDownloadError(self.name, self.bytes_read, self.expected_size)
            self._fail(str(err))
            self._error = err
            raise err
        self._done = True
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            file.close()
        except OSError as exc:
            self._discard_file()
            log.warning("%s: cannot finish cache file (%s); not caching", self.name, exc)
            return
        if self.store is not None and self.partial is not None:
            try:
                self.entry = self.store.commit(self.partial, self.bytes_read)
            except NoRoomError:
                self._log("%s: no room to keep %d bytes", self.name, self.bytes_read)
                return
            except IncompleteDownloadError as exc:  # the file on disk disagrees
                self._error = exc
                raise
            self._log("%s: cached %d bytes as %s", self.name, self.bytes_read, self.entry.path)
        elif self._part is not None and self._fname is not None:
            try:
                os.replace(self._part, self._fname)
            except OSError as exc:
                self._discard_file()
                log.warning("%s: cannot rename cache file into place: %s", self.name, exc)
                return
            self._log("%s: cached %d bytes as %s", self.name, self.bytes_read, self._fname)

    def _fail(self, why: str) -> None:
        self._discard(why)
        self._done = True

    def _discard(self, why: str) -> None:
        """Stop caching: delete the partial file and release its reservation."""
        if self._file is None and self._part is None:
            return
        self._log("%s: discarding cache file (%s)", self.name, why)
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass
        self._discard_file()

    def _discard_file(self) -> None:
        part, self._part = self._part, None
        if self.store is not None and self.partial is not None:
            self.store.abort(self.partial)
        elif part is not None:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove partial file %s: %s", part, exc)

    def _release(self) -> None:
        if self.store is not None and self.partial is not None:
            self.store.abort(self.partial)
        self._part = None


# --------------------------------------------------------------------------------------


def _expand(urls: str | Iterable[str | dict]) -> Iterator[dict]:
    if isinstance(urls, (str, os.PathLike)):
        for url in expand_urls(os.fspath(urls)):
            yield {"url": url}
        return
    for item in urls:
        if isinstance(item, dict):
            if "url" not in item:
                raise ValueError(f"cache_shards: a dict item has no 'url' key: {item!r}")
            yield dict(item)
        elif isinstance(item, (str, os.PathLike)):
            yield {"url": os.fspath(item)}
        else:
            raise TypeError(f"cache_shards: expected URL strings or dicts, got {item!r}")


def cache_shards(
    urls: str | Iterable[str | dict],
    cache_dir: str | os.PathLike | None = "./data",
    cache_size: float = DEFAULT_CACHE_SIZE,
    cache_name: Callable[[str], str] = guess_shard,
    verbose: bool = False,
    *,
    handler: Callable[[BaseException], bool] | None = None,
    store: Store | None = None,
    policy: str = DEFAULT_POLICY,
    **gopen_kw: Any,
) -> Iterator[dict]:
    """Yield ``dict(url=..., stream=...)`` per shard, caching shards in ``cache_dir``.

    ``urls`` is a brace pattern, or an iterable of URLs or of webdataset-style dicts with a
    ``url`` key (other keys are passed through). A hit is served from disk; a miss is
    read from the source (:func:`shardcache.gopen.gopen`) through a :class:`CacheStream`
    that becomes an entry only if complete. ``cache_size`` bounds the directory (entries
    plus downloads in progress, LRU eviction, shared with other processes using the same
    ``cache_dir``); a shard bigger than ``cache_size`` is streamed through uncached.
    ``cache_dir=None`` opens every URL directly.

    Entries are named by ``shard_uuid`` of the full URL, so two URLs with the same base
    name never collide; ``cache_name`` (default ``guess_shard``) only gives the readable
    name used in log messages.

    When the consumer asks for the next shard, the previous stream is finished (the few
    bytes a tar reader leaves unread are read, so the entry is complete) and closed.
    ``handler`` decides what happens when a shard cannot be opened (default: raise).
    """
    name_of = cache_name or guess_shard
    own_store = False
    if cache_dir is not None and store is None:
        store = Store(cache_dir, int(cache_size), policy=policy)  # type: ignore[arg-type]
        own_store = True
    from shardcache.gopen import gopen

    def opener(url: str) -> BinaryIO:
        return gopen(url, **gopen_kw)

    try:
        for item in _expand(urls):
            url = item["url"]
            try:
                if store is None:
                    stream = gopen(url, **gopen_kw)
                else:
                    stream = open_cached(store, url, opener, name=name_of(url), verbose=verbose)
            except Exception as exc:
                if handler is not None and handler(exc):
                    continue
                raise
            item["stream"] = stream
            # If the consumer abandons us here, the stream stays with the consumer; an
            # unfinished download is discarded when the stream is closed or collected.
            yield item
            _finish(stream, url)
    finally:
        if own_store and store is not None:
            store.close()


def open_cached(
    store: Store,
    url: str,
    opener: Callable[[str], BinaryIO],
    *,
    name: str | None = None,
    verbose: bool = False,
) -> BinaryIO:
    """Open ``url`` through ``store``: the entry file on a hit, else ``opener(url)`` teed
    to the store by a :class:`CacheStream` (or only verified, when it cannot be admitted).

    A hit writes nothing (:meth:`~shardcache.store.Store.open_hit`): its access counts for
    LRU from the store's next access batch, written by the next miss, before any eviction
    decision, by a hit once the batch is a second old, and when the store is closed
    (``cache_shards`` closes the store it opened).
    """
    say = log.info if verbose else log.debug
    label = name or url
    hit = store.open_hit(url)  # writes nothing: the access is recorded in memory
    if hit is not None:
        entry, stream = hit
        say("cache hit %s (%s)", label, entry.key)
        return stream
    if store.pending_access():
        # a miss writes to the index anyway: the hits before it go first, so processes
        # sharing the directory evict by them too
        with contextlib.suppress(CacheError):
            store.flush_access()
    source = opener(url)
    try:
        size = stream_length(source)
        partial = store.begin(url, size)
    except BaseException:
        source.close()
        raise
    if partial is None:
        say("cache bypass %s (%s bytes do not fit)", label, size)
        return CacheStream(None, source, verbose, expected_size=size)
    say("cache miss %s -> %s", label, partial.path.name)
    try:
        return CacheStream(label, source, verbose, store=store, partial=partial)
    except BaseException:
        source.close()
        raise


def _finish(stream: Any, url: str) -> None:
    """Close a stream the consumer is done with, completing its cache entry if possible."""
    try:
        if isinstance(stream, CacheStream):
            stream.close(complete=True)
        else:
            stream.close()
    except Exception as exc:  # the consumer already has what it read; do not kill it
        log.warning("%s: not cached: %s", url, exc)
