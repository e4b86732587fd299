"""Workers of one port (``serve --workers N``): a request for an object another worker
is downloading is passed to that worker over loopback and its answer streamed back."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from aiohttp import web
from multidict import CIMultiDict

from proxy.context import (
    FORWARDED,
    RUNTIME,
    T_BYTES,
    T_READY,
    T_RESP,
    _abort_client,
    _waited,
)
from proxy.decide import XCache
from proxy.upstream.aio import ConnectionEnd, framed_by_close, watching_connector
from shardcache.compat import delimit_by_close

log = logging.getLogger(__name__)


_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    }
)


async def _forward(request: web.Request, port: int) -> web.StreamResponse | None:
    """Let the worker that owns the download of this request's object answer it, and
    stream its answer. None when that worker cannot be reached (it died)."""
    import aiohttp

    session = request.app[RUNTIME].peers
    if session is None:
        session = request.app[RUNTIME].peers = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None),
            connector=watching_connector(limit=0),
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers[FORWARDED] = str(os.getpid())
    request[T_READY] = "downloading"  # another worker's download, followed from here
    since = time.monotonic()
    try:
        peer = await session.request(
            request.method,
            f"http://127.0.0.1:{port}{request.raw_path}",
            headers=headers,
            allow_redirects=False,
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log.info("worker on port %d unreachable (%s); taking over", port, exc)
        return None
    finally:
        _waited(request, since)
    async with peer:
        # a multidict: a field sent more than once (the origin's Content-Security-Policy
        # beside the proxy's own) goes on as often
        out = CIMultiDict((k, v) for k, v in peer.headers.items() if k.lower() not in _HOP_BY_HOP)
        if out.get("X-Cache") == XCache.MISS:
            out["X-Cache"] = XCache.COALESCED  # this client joined another's download
        resp = web.StreamResponse(status=peer.status, reason=peer.reason, headers=out)
        by_close = request.method != "HEAD" and framed_by_close(peer.headers)
        if "Content-Length" in peer.headers:
            resp.content_length = int(peer.headers["Content-Length"])
        elif by_close:
            delimit_by_close(resp)  # as the owner ends it: by closing, FIN or reset
        ended = ConnectionEnd(peer)
        request[T_RESP] = resp
        await resp.prepare(request)
        if request.method == "HEAD":
            await resp.write_eof()
            return resp
        try:
            chunks = aiter(peer.content.iter_chunked(1 << 20))
            while True:
                since = time.monotonic()
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                finally:
                    _waited(request, since)
                await resp.write(chunk)
                request[T_BYTES] += len(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # the owner aborted (its download failed) or died: never end cleanly
            log.warning(
                "aborting %s %s: worker answer cut: %s", request.method, request.raw_path, exc
            )
            _abort_client(request)
            return resp
        if by_close and ended.error is not None:
            # the owner reset a body framed by its close (aiohttp reads that as its end)
            log.warning("aborting %s %s: worker answer reset", request.method, request.raw_path)
            _abort_client(request)
            return resp
        await resp.write_eof()
        return resp
