"""The live status page (``/-/``, with ``/`` redirecting there) and the two read-only
JSON routes it needs besides ``/-/stats`` and ``/-/plans``: ``/-/downloads`` (this
process's downloads in flight, with their progress) and ``/-/entries`` (the largest and
the hottest entries).

The page is three files of package data (``proxy/static/``: HTML, CSS and a script), read
once and served from memory with a Content-Security-Policy that allows nothing but this
proxy (no inline script, no CDN: it works offline). The script reads the JSON routes and
refreshes itself; every text from them goes into the page as text, never as markup.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.context import INFLIGHT, STORE
from proxy.policy import unsigned_url
from proxy.s3front import S3_SERVICE_ROUTE
from shardcache.errors import BadRequest, NotFound
from shardcache.store import INDEX_NAME

__all__ = ["STATIC_FILES", "add_routes", "display_url", "static_file", "top_entries"]

# name -> Content-Type: everything the page is made of (package data in proxy/static/)
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
}
# Nothing from elsewhere: scripts, styles, images and fetches from this proxy only, no
# inline script or style, no frames, no plugins.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
TOP_DEFAULT = 10
TOP_MAX = 100
ENTRIES_MAX_AGE = 5.0  # seconds a ranking of the entries is reused (a scan of the index)


def static_file(name: str) -> bytes:
    """The bytes of one of the page's files, from the installed package."""
    if name not in STATIC_FILES:
        raise KeyError(name)
    return resources.files("proxy").joinpath("static", name).read_bytes()


def display_url(url: str) -> str:
    """``url`` as the page may show it to anyone who can reach the proxy: without
    ``user:password@`` and without the parameters that sign it."""
    head, sep, rest = url.partition("://")
    if sep:
        netloc, slash, path = rest.partition("/")
        url = f"{head}{sep}{netloc.rpartition('@')[2]}{slash}{path}"
    return unsigned_url(url)


# ---------------------------------------------------------------------------------------
# /-/entries: the largest and the hottest entries


def top_entries(cache_dir: Path, n: int) -> dict[str, list[dict[str, Any]]]:
    """The ``n`` largest and the ``n`` most read entries, from the index on disk (read
    only, its own connection: the store's lock is not held during the scan). Hits are
    those the index has recorded (accesses are written in batches)."""
    path = Path(cache_dir) / INDEX_NAME
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:

        def rows(order: str) -> list[dict[str, Any]]:
            cur = conn.execute(
                "SELECT url, size, hits, created, last_access FROM entries "
                f"ORDER BY {order} LIMIT ?",
                (n,),
            )
            return [
                {
                    "url": display_url(url),
                    "size": int(size),
                    "hits": int(hits),
                    "created": float(created),
                    "last_access": float(last_access),
                }
                for url, size, hits, created, last_access in cur.fetchall()
            ]

        return {
            "largest": rows("size DESC, key"),
            "hottest": rows("hits DESC, last_access DESC, key"),
        }
    finally:
        conn.close()


@dataclass
class _Ranking:
    """The last ranking of the entries and when it was made: a page open in several
    browsers costs one scan of the index per :data:`ENTRIES_MAX_AGE`, not one per poll."""

    at: float = -1e9
    n: int = 0
    body: dict[str, Any] | None = None
    lock: asyncio.Lock | None = None


RANKING = web.AppKey("status_ranking", _Ranking)


def _top(request: web.Request) -> int:
    raw = request.query.get("top", str(TOP_DEFAULT))
    try:
        n = int(raw)
    except ValueError:
        raise BadRequest(f"top={raw!r}: a whole number of entries expected") from None
    if not 1 <= n <= TOP_MAX:
        raise BadRequest(f"top={n}: between 1 and {TOP_MAX}")
    return n


async def _entries(request: web.Request) -> web.Response:
    n = _top(request)
    ranking = request.app[RANKING]
    if ranking.lock is None:
        ranking.lock = asyncio.Lock()
    async with ranking.lock:  # one scan at a time
        now = time.monotonic()
        if ranking.body is None or now - ranking.at > ENTRIES_MAX_AGE:
            # always the longest ranking, cut to each request's ``top``: a client
            # alternating top=10 and top=11 would otherwise have the index scanned (0.3 s
            # for 500,000 entries) for every request
            store = request.app[STORE]
            ranking.body = await asyncio.to_thread(top_entries, store.cache_dir, TOP_MAX)
            ranking.n, ranking.at = TOP_MAX, now
        top = ranking.body
    body = {"top": n, "max_age_seconds": ENTRIES_MAX_AGE, **{k: v[:n] for k, v in top.items()}}
    return web.json_response(body)


# ---------------------------------------------------------------------------------------
# /-/downloads: this process's downloads in flight


def _downloads_now(request: web.Request) -> list[dict[str, Any]]:
    inflight = request.app[INFLIGHT]
    now = time.monotonic()
    out = []
    # the table of downloads, read as it is (no public iterator on Inflight yet)
    for dl in inflight.in_progress():
        age = max(now - dl.started, 1e-6)
        size = dl.known_size
        out.append(
            {
                "url": display_url(dl.url),
                "state": dl.state.value,
                "reason": dl.reason,
                "written": dl.written,
                "size": size,
                "fraction": (dl.written / size) if size else None,
                "seconds": round(age, 3),
                "bytes_per_second": round(dl.written / age),
                "clients": max(0, dl.holders - 1),  # the download task holds one
                "cached": dl.cached,
            }
        )
    out.sort(key=lambda d: (-d["seconds"], d["url"]))
    return out


async def _downloads(request: web.Request) -> web.Response:
    return web.json_response({"downloads": _downloads_now(request)})


# ---------------------------------------------------------------------------------------
# the page


def _page_response(name: str, body: bytes) -> web.Response:
    # (aiohttp answers HEAD with the headers of this response, Content-Length included)
    resp = web.Response(body=body, headers=SECURITY_HEADERS)
    resp.headers["Content-Type"] = STATIC_FILES[name]
    return resp


async def _root(request: web.Request) -> web.StreamResponse:
    request[S3_SERVICE_ROUTE] = "status"  # counted with the proxy's own routes
    return web.Response(
        status=302,
        body=b"the status page is at /-/\n",
        headers={"Location": "/-/", "Content-Type": "text/plain; charset=utf-8"},
    )


def add_routes(app: web.Application) -> None:
    """Mount the page, its files and its JSON routes on ``app`` (files read now)."""
    files = {name: static_file(name) for name in STATIC_FILES}
    app[RANKING] = _Ranking()

    async def page(request: web.Request) -> web.Response:
        return _page_response("index.html", files["index.html"])

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in files or name == "index.html":
            raise NotFound(f"no such file of the status page: {name}")
        return _page_response(name, files[name])

    r = app.router
    r.add_get("/", _root)
    r.add_get("/-/", page)
    r.add_get("/-/static/{name}", static)
    r.add_get("/-/downloads", _downloads)
    r.add_get("/-/entries", _entries)
