"""The ``file://`` transport: a local (or mounted) file answered like an HTTP origin
would, with an ETag and Last-Modified from its stat, ``Range`` and the conditional
headers, so that every rule above the transports treats it like any other upstream."""

from __future__ import annotations

import asyncio
import email.utils
import os
import stat
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from multidict import CIMultiDict

from proxy.policy import parse_range
from proxy.upstream.errors import file_error
from proxy.upstream.transport import pump_chunks
from shardcache.errors import RangeNotSatisfiable

__all__ = ["FileTransport"]


class FileResponse:
    """A synthetic answer for one file."""

    def __init__(
        self,
        url: str,
        status: int,
        headers: CIMultiDict[str],
        fd: int | None,
        start: int,
        end: int,
        chunk_size: int,
        read_timeout: float,
    ) -> None:
        self.url = url
        self.status = status
        self.reason = ""
        self.headers: Mapping[str, str] = headers
        self._fd = fd
        self._pos, self._end = start, end
        self._chunk = chunk_size
        self._timeout = read_timeout

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while self._pos < self._end:
                if self._fd is None:
                    raise OSError("file closed")
                n = min(self._chunk, self._end - self._pos)
                data = await asyncio.wait_for(
                    asyncio.to_thread(os.pread, self._fd, n, self._pos), self._timeout
                )
                if not data:
                    raise OSError(f"file ended at byte {self._pos} of {self._end}")
                self._pos += len(data)
                yield data
        except (OSError, asyncio.TimeoutError) as exc:
            self.close()
            raise file_error(self.url, exc, body=True) from exc
        self.close()

    def pump(self, fd: int, hasher: Any, limit: int | None = None) -> AsyncIterator[int]:
        return pump_chunks(self.chunks(), fd, hasher, limit)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _open(path: str) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class FileTransport:
    """Reads ``file://`` URLs in threads."""

    def __init__(self, *, read_timeout: float, chunk_size: int) -> None:
        self.read_timeout = read_timeout
        self.chunk_size = chunk_size

    async def request(self, method: str, url: str, headers: Mapping[str, str]) -> FileResponse:
        path = unquote(urlsplit(url).path)
        try:
            fd, st = await asyncio.wait_for(asyncio.to_thread(_open, path), self.read_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise file_error(url, exc, body=False) from exc
        size = st.st_size
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        h: CIMultiDict[str] = CIMultiDict(
            {
                "ETag": etag,
                "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
                "Accept-Ranges": "bytes",
            }
        )
        if path.endswith(".tar"):
            h["Content-Type"] = "application/x-tar"
        status, start, end = 200, 0, size
        if_match = headers.get("If-Match")
        if_none = headers.get("If-None-Match")
        if if_match is not None and if_match != etag:
            status, end = 412, 0
        elif if_none is not None and if_none == etag:
            status, end = 304, 0
        elif headers.get("Range") and headers.get("If-Range") in (None, etag):
            try:
                rng = parse_range(headers["Range"], size)
            except RangeNotSatisfiable:
                status, end = 416, 0
                h["Content-Range"] = f"bytes */{size}"
            else:
                if rng is not None:
                    status, start, end = 206, rng.start, rng.end + 1
                    h["Content-Range"] = rng.content_range
        h["Content-Length"] = str(end - start)
        if method == "HEAD" or status not in (200, 206):
            os.close(fd)
            return FileResponse(url, status, h, None, 0, 0, self.chunk_size, self.read_timeout)
        return FileResponse(url, status, h, fd, start, end, self.chunk_size, self.read_timeout)

    async def close(self) -> None:
        pass
