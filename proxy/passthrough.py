"""Paths of an upstream that are an API, not objects: forwarded as they are, never cached.

The Hugging Face Hub answers its API under ``/api/`` (repository info at a revision, tree
listings, ``paths-info``): JSON that changes whenever a branch moves. Kept as an entry it
would freeze a repository's file list and commit forever, so ``HfFileSystem`` and
``datasets`` streaming through a proxy set as ``HF_ENDPOINT`` would never see a new
commit. Paths matching ``--uncached-path`` (default ``api/*``, relative to the upstream
they map to) are therefore forwarded for every request, with GET, HEAD and POST (a
request body of at most :data:`MAX_BODY` bytes: ``paths-info`` sends a form), and answered
with the upstream's status, fields and body as they were (``X-Cache: BYPASS``).

The rules of every upstream request hold here too: the client's end-to-end fields go on
but not its credentials; the proxy's own credentials for the upstream go to the
upstream's host only; redirects are followed inside the proxy to safe targets only
(:func:`proxy.upstream.redirects.check_target`); a body cut short by the upstream breaks
the client's connection instead of ending cleanly. A body the upstream ends by closing
its connection (no Content-Length, not chunked) is passed on the same way, ended by
closing the client's connection (an orderly close for an orderly close, a reset for a
reset): the proxy cannot tell such a body's end from a cut, so it claims no more than
the upstream did.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from proxy.config import Settings
from proxy.context import FETCHER, SETTINGS, T_BYTES, T_RESP, _abort_client
from proxy.decide import XCache
from proxy.policy import Upstream, confine, end_to_end_headers, forwarded_fields, map_request
from proxy.upstream.aio import USER_AGENT, ConnectionEnd, framed_by_close, watching_connector
from proxy.upstream.redirects import check_target
from shardcache.compat import delimit_by_close
from shardcache.errors import MethodNotAllowed, ProxyError, UpstreamError

__all__ = ["MAX_BODY", "mapped", "on_paths", "METHODS", "is_uncached", "pass_through"]

METHODS = ("GET", "HEAD", "POST")
MAX_BODY = 1 << 20
_REDIRECTS = (301, 302, 303, 307, 308)
# framing and the fields aiohttp writes itself; the rest of the answer goes on as it was
_NOT_PASSED = {"content-length", "transfer-encoding", "www-authenticate"}


def upstream_path(url: str, upstreams: Sequence[Upstream]) -> str | None:
    """``url``'s path relative to the upstream base it lies under (no query), or None."""
    path = url.partition("?")[0].partition("#")[0]
    best: str | None = None
    for u in upstreams:
        if path.startswith(u.root) and (best is None or len(u.root) > len(best)):
            best = u.root
    return None if best is None else path[len(best) :]


def on_paths(url: str, upstreams: Sequence[Upstream], patterns: Sequence[str]) -> bool:
    """Whether ``url``'s path relative to its upstream matches one of ``patterns``."""
    rel = upstream_path(url, upstreams)
    return rel is not None and any(fnmatch.fnmatchcase(rel, p) for p in patterns)


def is_uncached(url: str, upstreams: Sequence[Upstream], patterns: Sequence[str]) -> bool:
    """Whether ``url`` (a mapped upstream URL) lies on a path ``patterns`` name: shell
    patterns matched against the path relative to its upstream (``*`` crosses ``/``).
    Only an http(s) upstream has an API: under an ``s3://``, ``gs://``, ``az://`` or
    ``file://`` upstream, ``api/...`` is a key like any other, an object to cache."""
    if not patterns or not url.lower().startswith(("http://", "https://")):
        return False
    return on_paths(url, upstreams, patterns)


async def pass_through(request: web.Request, url: str) -> web.StreamResponse:
    """Forward ``request`` to ``url`` and answer with what the upstream said."""
    if request.method not in METHODS:
        raise MethodNotAllowed(
            f"method {request.method} not allowed on an uncached path; use " + ", ".join(METHODS),
            allow=", ".join(METHODS),
        )
    s = request.app[SETTINGS]
    if request.method == "POST" and not on_paths(url, s.upstreams, s.uncached_post_paths):
        # a POST goes upstream with the proxy's credentials: only where the operator lets
        # it (by default the Hub's read-only paths-info), never to any API path a client
        # (or a web page the operator visits, through a loopback proxy) would name
        raise MethodNotAllowed(
            "POST is not forwarded to this path (see --uncached-post-path); use GET or HEAD",
            allow="GET, HEAD",
        )
    body = b""
    if request.method == "POST":
        if request.content_length is not None and request.content_length > MAX_BODY:
            raise ProxyError(f"request body over {MAX_BODY} bytes", 413)
        body = await _read_body(request)
    fetcher = request.app[FETCHER]
    origin_host = (urlsplit(url).hostname or "").lower()
    fields = forwarded_fields(request.headers)
    fields.pop("Content-Length", None)
    method, target = request.method, url
    timeout = aiohttp.ClientTimeout(sock_connect=s.connect_timeout, sock_read=s.read_timeout)
    async with aiohttp.ClientSession(
        timeout=timeout, auto_decompress=False, connector=watching_connector()
    ) as session:
        for _hop in range(fetcher.redirects.max_hops + 1):
            try:
                creds = fetcher.credentials.headers_for(target) if fetcher.credentials else {}
            except (OSError, ValueError) as exc:
                raise UpstreamError(f"credentials for {url} cannot be read: {exc}") from None
            headers = {
                **fields,
                "User-Agent": USER_AGENT,
                "Accept-Encoding": "identity",
                **creds,
            }
            try:
                resp = await session.request(
                    method,
                    target,
                    headers=headers,
                    data=body if method == "POST" else None,
                    allow_redirects=False,
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise UpstreamError(f"upstream {_shown(target)}: {_reason(exc)}") from None
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECTS or not location:
                break
            resp.release()
            target = check_target(target, location, origin_host, fetcher.redirects)
            if resp.status == 303 or (resp.status in (301, 302) and method == "POST"):
                method, body = ("HEAD" if method == "HEAD" else "GET"), b""
        else:
            raise UpstreamError(
                f"upstream {_shown(url)}: more than {fetcher.redirects.max_hops} redirects"
            )
        async with resp:
            return await _answer(request, resp)


async def _answer(request: web.Request, resp: aiohttp.ClientResponse) -> web.StreamResponse:
    status = 403 if resp.status == 401 else resp.status  # the proxy's credentials, refused
    out = web.StreamResponse(status=status, reason=None if status != resp.status else resp.reason)
    for k, v in end_to_end_headers(resp.headers.items()):
        if k.lower() not in _NOT_PASSED:
            out.headers.add(k, v)
    out.headers["X-Cache"] = XCache.BYPASS
    confine(out.headers)  # the upstream's bytes never run as a page of the proxy's origin
    request[T_RESP] = out  # a cut at shutdown aborts the connection once it is prepared
    if status != resp.status:
        out.headers["X-Shardcache-Error"] = "the upstream refused the proxy's credentials (401)"
    length = resp.headers.get("Content-Length")
    if request.method == "HEAD" or status in (204, 304):
        if length is not None and length.isdigit():
            out.content_length = int(length)
        await out.prepare(request)
        await out.write_eof()
        return out
    by_close = framed_by_close(resp.headers)
    if length is not None and length.isdigit():
        out.content_length = int(length)
    elif by_close:
        # ended by the upstream's close, which cannot tell a cut from the end: so is
        # this answer (a chunked end would vouch for it); an upstream reset resets it
        delimit_by_close(out)
    ended = ConnectionEnd(resp)
    await out.prepare(request)
    try:
        async for chunk in resp.content.iter_chunked(1 << 16):
            await out.write(chunk)
            request[T_BYTES] += len(chunk)
    except (aiohttp.ClientError, TimeoutError):
        _abort_client(request)  # a body cut short never ends cleanly
        return out
    if by_close and ended.error is not None:
        # aiohttp reads a reset at the end of a close-delimited body as its end
        _abort_client(request)
        return out
    await out.write_eof()
    return out


async def _read_body(request: web.Request) -> bytes:
    """The whole request body (at most :data:`MAX_BODY` bytes; 413 beyond). One
    ``read(n)`` returns what has arrived so far, not the body: a body that comes in
    several segments would be forwarded cut, as a well-formed shorter request."""
    pieces: list[bytes] = []
    got = 0
    while True:
        piece = await request.content.read(MAX_BODY + 1 - got)
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
        if got > MAX_BODY:
            raise ProxyError(f"request body over {MAX_BODY} bytes", 413)
    return b"".join(pieces)


def _shown(url: str) -> str:
    """``url`` without its query (signatures live there)."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc.rpartition('@')[2]}{p.path}"


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def mapped(raw: str, s: Settings) -> tuple[str, bool]:
    """(The upstream URL of the raw target ``raw``, whether it lies on an uncached path),
    kept for the last targets asked: readers ask for the same shards again and again."""
    try:
        return _mapped_kept(raw, s.upstreams, s.allow_hosts, s.max_path_length, s.uncached_paths)
    except TypeError:  # settings made with lists (unhashable): not kept
        url = map_request(raw, s.upstreams, s.allow_hosts, s.max_path_length)
        return url, is_uncached(url, s.upstreams, s.uncached_paths)


@functools.lru_cache(maxsize=1024)
def _mapped_kept(
    raw: str,
    upstreams: tuple[Upstream, ...],
    allow_hosts: tuple[str, ...],
    max_length: int,
    uncached_paths: tuple[str, ...],
) -> tuple[str, bool]:
    url = map_request(raw, upstreams, allow_hosts, max_length)
    return url, is_uncached(url, upstreams, uncached_paths)
