"""The aiohttp transport: http(s) on the event loop, one pooled session.

A close-delimited body (no Content-Length, not chunked) ends where the connection ends,
and aiohttp reports a connection reset there as a clean end of the body; this transport
records how each connection ended (:class:`_Handler`) and raises UpstreamCut unless the
close was orderly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from proxy.upstream.errors import aiohttp_error
from proxy.upstream.transport import pump_chunks
from shardcache._version import __version__
from shardcache.compat import response_handler_class, response_payload, use_protocol
from shardcache.errors import UpstreamCut, UpstreamError

__all__ = ["AioTransport", "ConnectionEnd", "framed_by_close", "watching_connector"]

USER_AGENT = f"shardcache/{__version__}"


class _Handler(response_handler_class()):  # type: ignore[misc]
    """aiohttp's protocol, remembering the error a connection was lost with, and
    failing the body being read when the response cannot be parsed (aiohttp puts a
    framing error such as a bad chunk-size line only on the connection and stops the
    read timeout, which leaves a reader of the body waiting forever)."""

    lost_error: BaseException | None = None
    lost = False
    # bytes that are no answer after a complete body: that body's framing was wrong.
    # Recorded with the request they came during (``serial`` counts the requests sent
    # on this connection): a body whose connection went back to the pool at its end may
    # see the next request's failure here, which is not its own.
    serial = 0
    after_body: tuple[Any, int] | None = None

    def set_response_params(self, *args: Any, **kw: Any) -> None:
        self.serial += 1  # once per request sent on this connection
        super().set_response_params(*args, **kw)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.lost_error = exc
        super().connection_lost(exc)

    def set_exception(self, exc: BaseException, *args: Any) -> None:
        payload = response_payload(self)
        super().set_exception(exc, *args)
        if payload is not None and not payload.is_eof():
            payload.set_exception(aiohttp.ClientPayloadError(f"malformed response: {exc}"))
        elif isinstance(exc, HttpProcessingError) and payload is not None:
            self.after_body = (payload, self.serial)


class _Connector(aiohttp.TCPConnector):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        use_protocol(self, lambda loop: _Handler(loop=loop))


def watching_connector(**kw: Any) -> aiohttp.TCPConnector:
    """A connector whose connections remember how they ended (for :class:`ConnectionEnd`)."""
    return _Connector(**kw)


def framed_by_close(headers: Mapping[str, str]) -> bool:
    """Whether an answer with a body and these headers ends where its connection ends:
    no Content-Length and not chunked."""
    te = (headers.get("Transfer-Encoding") or "").lower()
    return "Content-Length" not in headers and "chunked" not in te


class ConnectionEnd:
    """How the connection under an aiohttp response (of a session made with
    :func:`watching_connector`) ended. aiohttp reports a reset at the end of a
    close-delimited body as a clean end; :attr:`error` tells it from an orderly close.
    Taken when the response's headers arrived: the connection is released at the body's
    end."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        conn = resp.connection
        self._proto = conn.protocol if conn is not None else None

    @property
    def error(self) -> BaseException | None:
        """The error the connection was lost with (None: open, closed in order, or not
        watched)."""
        proto = self._proto
        return proto.lost_error if isinstance(proto, _Handler) else None


class AioResponse:
    """An aiohttp response as a :class:`~proxy.upstream.transport.Response`."""

    def __init__(self, url: str, resp: aiohttp.ClientResponse, chunk_size: int) -> None:
        self.url = url
        self._resp = resp
        self.status = resp.status
        self.reason = resp.reason or ""
        self.headers: Mapping[str, str] = resp.headers
        self._chunk = chunk_size
        conn = resp.connection
        self._proto = conn.protocol if conn is not None else None
        self._serial = getattr(self._proto, "serial", 0)
        self._close_delimited = framed_by_close(resp.headers)

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    break
                if len(data) < self._chunk:
                    more = content.read_nowait(self._chunk - len(data))
                    if more:
                        data += more
                yield data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.close()
            raise aiohttp_error(self.url, exc, body=True) from exc
        proto = self._proto
        if isinstance(proto, _Handler) and proto.after_body == (self._resp.content, self._serial):
            # more bytes than the Content-Length declared (they failed to parse as the next
            # answer): the body received is not known to be the object's
            self.close()
            # (not the parser's message: it quotes the stray bytes)
            raise UpstreamError(f"upstream {self.url}: more bytes than its Content-Length declared")
        if self._close_delimited:
            if proto is not None and isinstance(proto, _Handler) and proto.lost_error is not None:
                self.close()
                raise UpstreamCut(
                    f"upstream {self.url}: connection ended with an error, not an orderly "
                    f"close ({proto.lost_error!r})"
                )
        self._resp.release()

    def pump(self, fd: int, hasher: Any, limit: int | None = None) -> AsyncIterator[int]:
        declared = (self.headers.get("Content-Length") or "").strip()
        if limit is not None and declared.isdigit() and limit >= int(declared):
            limit = None  # all of it: read to its end, where its framing is checked
        return pump_chunks(self.chunks(), fd, hasher, limit)

    def close(self) -> None:
        self._resp.close()


class AioTransport:
    """http(s) requests through one aiohttp session (created on first use, in the loop)."""

    def __init__(self, *, connect_timeout: float, read_timeout: float, chunk_size: int) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.chunk_size = chunk_size
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
                ),
                connector=_Connector(limit=0, ttl_dns_cache=300),
                headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
                read_bufsize=1 << 18,
            )
        return self._session

    async def request(self, method: str, url: str, headers: Mapping[str, str]) -> AioResponse:
        try:
            # a redirect is the client's to follow, not something to cache under this URL
            resp = await self.session.request(
                method, url, headers=dict(headers), allow_redirects=False
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise aiohttp_error(url, exc, body=False) from exc
        return AioResponse(url, resp, self.chunk_size)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
