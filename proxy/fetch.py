"""Upstream clients: ``http(s)://`` through one aiohttp session, ``file://`` in threads.

:meth:`Fetcher.open` returns an :class:`UpstreamBody` once the upstream has answered with
its headers; iterating :meth:`UpstreamBody.chunks` yields the bytes. When the upstream
fails mid-body, the body resumes transparently with ``Range: bytes=N-`` and
``If-Match: <ETag>`` (bounded retries, exponential backoff). Errors are translated at this
boundary into the proxy's error tree, each carrying the status to answer with::

    upstream 404/410            -> NotFound (404), never cached
    upstream other 4xx          -> ProxyError with that status
    upstream 5xx, refused, DNS  -> UpstreamError (502)
    upstream timeout            -> UpstreamTimeout (504)
    mid-body failure, no resume -> IncompleteDownloadError (the caller aborts its clients)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import logging
import os
import re
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import aiohttp

from proxy.parts import (
    HTTPRangedSource,
    ObjectInfo,
    can_fetch_in_parts,
    info_from_headers,
    parts_stream,
    response_chunks,
)
from proxy.s3 import S3Fetcher, S3Upstream
from shardcache._version import __version__
from shardcache.errors import (
    Forbidden,
    IncompleteDownloadError,
    NotFound,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
)

__all__ = ["Fetcher", "UpstreamBody"]

log = logging.getLogger(__name__)

Observer = Callable[[str], None]
_CONTENT_RANGE_RE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def _noop(outcome: str) -> None:
    pass


@dataclass
class UpstreamBody:
    """An upstream answer: metadata known from the headers, and the bytes to come."""

    url: str
    size: int | None
    etag: str | None = None
    last_modified: str | None = None
    content_type: str | None = None
    md5: bytes | None = None  # Content-MD5 (or x-goog-hash md5) to verify, if sent
    _iter: AsyncIterator[bytes] | None = field(default=None, repr=False)
    _close: Callable[[], None] | None = field(default=None, repr=False)

    def chunks(self) -> AsyncIterator[bytes]:
        """The body, resumed across upstream failures; iterate once."""
        if self._iter is None:
            raise RuntimeError("body already consumed")
        it, self._iter = self._iter, None
        return it

    def close(self) -> None:
        """Release the upstream connection (idempotent)."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


def _md5_from_headers(headers: aiohttp.typedefs.LooseHeaders) -> bytes | None:
    value = headers.get("Content-MD5")  # type: ignore[union-attr]
    if not value:
        for part in (headers.get("x-goog-hash") or "").split(","):  # type: ignore[union-attr]
            k, _, v = part.strip().partition("=")
            if k == "md5":
                value = v
    if not value:
        return None
    try:
        digest = base64.b64decode(value.strip(), validate=True)
    except ValueError:
        return None
    return digest if len(digest) == 16 else None


class Fetcher:
    """Opens upstream URLs. Create inside a running loop; :meth:`close` when done."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        retries: int = 3,
        retry_backoff: float = 0.5,
        chunk_size: int = 1 << 20,
        observe: Observer = _noop,
        on_bytes: Callable[[int], None] | None = None,
        part_size: int = 0,
        parallel: int = 1,
        http_parts: bool = False,
        s3: S3Upstream | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.chunk_size = chunk_size
        self.observe = observe
        self.on_bytes = on_bytes
        # Parallel ranged parts: 0 or parallel 1 means one stream per object.
        # For http(s) only with http_parts: one stream keeps upstream bytes at 1x the shard
        # and memory low; parts pay off where an origin limits each connection.
        self.part_size = part_size
        self.parallel = parallel
        self.http_parts = http_parts
        self._s3 = (
            None
            if s3 is None
            else S3Fetcher(
                s3,
                part_size=part_size,
                parallel=parallel,
                retries=retries,
                retry_backoff=retry_backoff,
                chunk_size=chunk_size,
                observe=observe,
                on_bytes=on_bytes,
            )
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
                ),
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                headers={"User-Agent": f"shardcache/{__version__}", "Accept-Encoding": "identity"},
                read_bufsize=1 << 18,
            )
        return self._session

    async def close(self) -> None:
        """Close the upstream connection pools."""
        if self._s3 is not None:
            await self._s3.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(self, url: str) -> UpstreamBody:
        """Request ``url`` and return once its headers are in. Raises ProxyError subclasses."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "file":
            return await self._open_file(url)
        if scheme in ("http", "https"):
            return await self._open_http(url)
        if scheme == "s3":
            if self._s3 is None:
                raise UpstreamError(f"{url}: no S3 client configured for s3:// upstreams")
            return await self._s3.open(url)
        raise UpstreamError(f"{url}: unsupported upstream scheme {scheme!r}")

    # -- http ------------------------------------------------------------------------------

    async def _request(
        self, url: str, start: int = 0, etag: str | None = None, last_modified: str | None = None
    ) -> aiohttp.ClientResponse:
        headers: dict[str, str] = {}
        if start:
            headers["Range"] = f"bytes={start}-"
            if etag:
                headers["If-Match"] = etag
            elif last_modified:
                headers["If-Unmodified-Since"] = last_modified
        try:
            resp = await self.session.get(url, headers=headers, allow_redirects=True)
        except asyncio.TimeoutError as exc:
            self.observe("timeout")
            raise UpstreamTimeout(f"upstream {url} timed out") from exc
        except aiohttp.ClientConnectorError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url} unreachable: {exc.os_error or exc}") from exc
        except aiohttp.ClientError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url} failed: {exc or type(exc).__name__}") from exc
        status = resp.status
        if status == 200 and not start or status == 206 and start:
            return resp
        resp.release()
        reason = f"{status} {resp.reason or ''}".strip()
        if status in (404, 410):
            self.observe("not_found")
            raise NotFound(f"upstream {url} answered {reason}")
        if start and status in (200, 412, 416):
            self.observe("error")
            raise UpstreamError(f"upstream {url} cannot resume at byte {start}: {reason}")
        self.observe("error")
        if 400 <= status < 500 and status not in (408, 429):
            raise ProxyError(f"upstream {url} answered {reason}", status_hint=status)
        raise UpstreamError(f"upstream {url} answered {reason}")

    async def _open_http(self, url: str) -> UpstreamBody:
        resp = await self._request(url)
        self.observe("ok")
        h = resp.headers
        size = resp.content_length if "Content-Length" in h else None
        if "Content-Encoding" in h and h["Content-Encoding"].lower() != "identity":
            # Bytes are stored exactly as sent; a compressed representation is not a shard.
            log.warning("upstream %s sent Content-Encoding %s", url, h["Content-Encoding"])
        body = UpstreamBody(
            url=url,
            size=size,
            etag=h.get("ETag"),
            last_modified=h.get("Last-Modified"),
            content_type=h.get("Content-Type"),
            md5=_md5_from_headers(h),
        )
        state = {"resp": resp}

        def close() -> None:
            state["resp"].close()

        body._close = close
        info = info_from_headers(h)
        if (
            self.http_parts
            and self.parallel > 1
            and self.part_size > 0
            and can_fetch_in_parts(info, self.part_size)
        ):
            body._iter = self._parts(body, info, resp)
        else:
            body._iter = self._http_chunks(body, state)
        return body

    async def _parts(
        self, body: UpstreamBody, info: ObjectInfo, resp: aiohttp.ClientResponse
    ) -> AsyncIterator[bytes]:
        """The body as parallel ranged parts; the first GET's response serves part one."""
        stream = parts_stream(
            HTTPRangedSource(self.session, body.url, chunk_size=self.chunk_size),
            info,
            part_size=self.part_size,
            parallel=self.parallel,
            retries=self.retries,
            backoff=self.retry_backoff,
            initial=response_chunks(resp, self.chunk_size),
            on_bytes=self.on_bytes,
        )
        pos = 0
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    pos += len(chunk)
                    yield chunk
        except (ProxyError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.observe("aborted")
            log.warning("upstream %s: ranged fetch failed at byte %d: %s", body.url, pos, exc)
            raise IncompleteDownloadError(body.url, pos, body.size) from exc

    async def _http_chunks(self, body: UpstreamBody, state: dict) -> AsyncIterator[bytes]:
        pos = 0
        attempt = 0
        while True:
            resp: aiohttp.ClientResponse = state["resp"]
            content = resp.content
            try:
                while True:
                    data = await content.readany()
                    if not data:
                        break
                    if len(data) < self.chunk_size:
                        more = content.read_nowait(self.chunk_size - len(data))
                        if more:
                            data += more
                    pos += len(data)
                    if self.on_bytes is not None:
                        self.on_bytes(len(data))
                    yield data
                if body.size is not None and pos != body.size:
                    raise aiohttp.ClientPayloadError(f"body ended at {pos} of {body.size} bytes")
                resp.release()
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                resp.close()
                cause = str(exc) or type(exc).__name__
                resumable = body.etag is not None or body.last_modified is not None
                if attempt >= self.retries or not resumable:
                    self.observe("aborted")
                    log.warning(
                        "upstream %s failed at byte %d, giving up: %s", body.url, pos, cause
                    )
                    raise IncompleteDownloadError(body.url, pos, body.size) from exc
                attempt += 1
                delay = self.retry_backoff * 2 ** (attempt - 1)
                log.info(
                    "upstream %s failed at byte %d (%s); resume %d/%d in %.2fs",
                    body.url,
                    pos,
                    cause,
                    attempt,
                    self.retries,
                    delay,
                )
                await asyncio.sleep(delay)
                try:
                    new = await self._request(body.url, pos, body.etag, body.last_modified)
                except ProxyError as exc2:
                    log.warning("upstream %s: resume failed: %s", body.url, exc2)
                    self.observe("aborted")
                    raise IncompleteDownloadError(body.url, pos, body.size) from exc2
                m = _CONTENT_RANGE_RE.match(new.headers.get("Content-Range", ""))
                same = m and int(m.group(1)) == pos
                if same and body.size is not None and m.group(3) != "*":
                    same = int(m.group(3)) == body.size
                if not same or (body.etag and new.headers.get("ETag") not in (None, body.etag)):
                    new.close()
                    self.observe("aborted")
                    raise IncompleteDownloadError(body.url, pos, body.size) from exc
                self.observe("resumed")
                state["resp"] = new

    # -- file ------------------------------------------------------------------------------

    async def _open_file(self, url: str) -> UpstreamBody:
        path = unquote(urlsplit(url).path)

        def _open() -> tuple[int, os.stat_result]:
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise IsADirectoryError(path)
            except BaseException:
                os.close(fd)
                raise
            return fd, st

        try:
            fd, st = await asyncio.wait_for(asyncio.to_thread(_open), self.read_timeout)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            self.observe("not_found")
            raise NotFound(f"upstream {url}: no such file") from exc
        except PermissionError as exc:
            self.observe("error")
            raise Forbidden(f"upstream {url}: permission denied") from exc
        except asyncio.TimeoutError as exc:
            self.observe("timeout")
            raise UpstreamTimeout(f"upstream {url} timed out opening the file") from exc
        except OSError as exc:
            self.observe("error")
            raise UpstreamError(f"upstream {url}: {exc.strerror or exc}") from exc
        self.observe("ok")
        etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        body = UpstreamBody(
            url=url,
            size=st.st_size,
            etag=etag,
            last_modified=email.utils.formatdate(st.st_mtime, usegmt=True),
            content_type="application/x-tar" if path.endswith(".tar") else None,
        )
        state = {"fd": fd}

        def close() -> None:
            if state["fd"] is not None:
                fd_, state["fd"] = state["fd"], None
                os.close(fd_)

        body._close = close
        body._iter = self._file_chunks(body, path, st, state)
        return body

    async def _file_chunks(
        self, body: UpstreamBody, path: str, st: os.stat_result, state: dict
    ) -> AsyncIterator[bytes]:
        pos = 0
        attempt = 0
        size = st.st_size
        while pos < size:
            try:
                if state["fd"] is None:
                    raise OSError("file closed")
                n = min(self.chunk_size, size - pos)
                data = await asyncio.wait_for(
                    asyncio.to_thread(os.pread, state["fd"], n, pos), self.read_timeout
                )
                if not data:
                    raise OSError(f"file ended at byte {pos} of {size}")
            except (OSError, asyncio.TimeoutError) as exc:
                if attempt >= self.retries:
                    self.observe("aborted")
                    raise IncompleteDownloadError(body.url, pos, size) from exc
                attempt += 1
                await asyncio.sleep(self.retry_backoff * 2 ** (attempt - 1))
                try:
                    fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
                    st2 = os.fstat(fd)
                except OSError:
                    continue
                if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    os.close(fd)
                    self.observe("aborted")
                    raise IncompleteDownloadError(body.url, pos, size) from exc
                old, state["fd"] = state["fd"], fd
                if old is not None:
                    os.close(old)
                self.observe("resumed")
                continue
            pos += len(data)
            if self.on_bytes is not None:
                self.on_bytes(len(data))
            yield data
        body.close()
