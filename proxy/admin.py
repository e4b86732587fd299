"""The proxy's own routes: health and readiness, stats and gauges, where a URL goes,
prefetch and purge, and the admin-token rule for the mutating ones."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from braceexpand import braceexpand

from proxy.context import (
    HEALTH,
    HITS,
    INFLIGHT,
    METRICS,
    PLANS,
    RUNTIME,
    SCHEDULER,
    SETTINGS,
    STORE,
    UPSTREAM_HEALTH,
    _error_response,
)
from proxy.policy import (
    map_url,
)
from shardcache._version import __version__
from shardcache.errors import (
    BadRequest,
    Forbidden,
    ProxyError,
)

log = logging.getLogger(__name__)
MAX_PREFETCH = 100_000


async def _healthz(request: web.Request) -> web.Response:
    health = request.app.get(HEALTH)
    upstreams = _upstream_lines(request)
    if health is None or health.writable:
        return web.Response(text="ok\nstore: writable\n" + upstreams)
    return web.Response(
        text=f"ok\nstore: not writable ({health.error}); serving from the upstream uncached\n"
        + upstreams
    )


def _upstream_lines(request: web.Request) -> str:
    """A line for each upstream that is down. Neither probe fails for it: the cache
    still serves its hits (docs/deployment.md, "Probes")."""
    watch = request.app.get(UPSTREAM_HEALTH)
    return watch.lines() if watch is not None else ""


async def _readyz(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    if runtime.ready:
        return web.Response(text="ready\n" + _upstream_lines(request))
    why = runtime.not_ready or "starting: the store is being opened"
    return _error_response(503, f"not ready: {why}")


async def _refresh_gauges(app: web.Application) -> dict[str, Any]:
    st = await asyncio.to_thread(app[STORE].stats)
    m = app[METRICS]
    m.cache_size.set(st["bytes"])
    m.cache_entries.set(st["entries"])
    m.cache_limit.set(st["limit"])
    m.cache_effective_limit.set(st["effective_limit"])
    return st


async def _stats(request: web.Request) -> web.Response:
    st = await _refresh_gauges(request.app)
    m = request.app[METRICS]
    t = m.totals()
    total = t["hits"] + t["misses"]
    body = {
        "version": __version__,
        "entries": st["entries"],
        "bytes": st["bytes"],
        "limit": st["limit"],
        "reserved": st["reserved"],
        "policy": st["policy"],
        "in_flight": len(request.app[INFLIGHT]),
        "downloads_all_processes": st["downloads"],
        "hits": t["hits"],
        "misses": t["misses"],
        "hit_ratio": (t["hits"] / total) if total else 0.0,
        "upstream_bytes": t["upstream_bytes"],
        "served_bytes": t["served_bytes"],
        "evictions": t["evictions"],
        "evicted_bytes": t["evicted_bytes"],
        "evicted_before_reuse": t["evicted_unread"],
        "workers": request.app[SETTINGS].workers,
        # what the tools need to map an upstream URL to this proxy's path
        "upstreams": [_without_userinfo(str(u)) for u in request.app[SETTINGS].upstreams],
        "allow_hosts": list(request.app[SETTINGS].allow_hosts),
        # each upstream's state, failures by reason and last error (docs/deployment.md)
        "upstream_health": request.app[UPSTREAM_HEALTH].snapshot(),
        "pid": os.getpid(),
        "store": {
            **request.app[HEALTH].snapshot(),
            "free_bytes": st["free_bytes"],
            "min_free_bytes": st["min_free_bytes"],
            "filesystem_bytes": st["filesystem_bytes"],
            "effective_limit": st["effective_limit"],
            "pending_access_records": request.app[STORE].pending_access(),
            # the name pass a crash left owed, made while serving (None: none was owed)
            "names_pass": request.app[STORE].names_pass,
            "layout": request.app[STORE].layout,  # as the cache directory records it
        },
        "ram_tier": {"entries": len(request.app[HITS]), "bytes": request.app[HITS].bytes},
    }
    return web.json_response(body)


def _without_userinfo(upstream: str) -> str:
    """``NAME=URL`` as /-/stats may show it to anyone: no ``user:password@``."""
    head, sep, rest = upstream.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{head}{sep}{netloc.rpartition('@')[2]}{slash}{path}"


def loopback_only(host: str) -> bool:
    """Whether listening on ``host`` accepts connections from this machine only."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or "" / 0.0.0.0 / ::): reachable from the network


def _require_admin(request: web.Request) -> None:
    settings = request.app[SETTINGS]
    token = settings.admin_token
    if not token:
        if loopback_only(settings.host):
            return
        raise Forbidden(
            f"mutating admin routes are disabled: this proxy listens on {settings.host} "
            "without --admin-token; set --admin-token (env SHARDCACHE_ADMIN_TOKEN) and send "
            "Authorization: Bearer <token>"
        )
    auth = request.headers.get("Authorization")
    if not auth:
        raise ProxyError(
            "admin token required (Authorization: Bearer <token>)",
            status_hint=401,
            headers={"WWW-Authenticate": 'Bearer realm="shardcache"'},
        )
    scheme, _, given = auth.partition(" ")
    # the header's bytes that are not UTF-8 arrive as surrogates: compare them as sent
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), token.encode()
    ):
        raise Forbidden("wrong admin token")


def _canonical(request: web.Request, url: str) -> str:
    s = request.app[SETTINGS]
    if not isinstance(url, str) or not url:
        raise BadRequest("each URL must be a non-empty string")
    try:
        return map_url(url, s.upstreams, s.allow_hosts, s.max_path_length)
    except Forbidden:
        # a typo in the URL or the upstream is far likelier than a wish for an open proxy
        names = ", ".join(_without_userinfo(str(u)) for u in s.upstreams) or "none"
        raise Forbidden(
            f"{url}: under none of this proxy's upstreams ({names}); check both for a typo "
            "(a URL of another host is fetched only when --allow-host names the host)"
        ) from None
    except ProxyError as exc:
        raise type(exc)(f"{url}: {exc}") from None


def _expand(body: Any) -> Iterator[str]:
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object {"urls": [...]} or {"pattern": "..."}')
    if "urls" in body:
        urls = body["urls"]
        if not isinstance(urls, list):
            raise BadRequest('"urls" must be a list of strings')
        yield from urls
    elif "pattern" in body:
        pattern = body["pattern"]
        if not isinstance(pattern, str):
            raise BadRequest('"pattern" must be a string')
        yield from braceexpand(pattern)
    else:
        raise BadRequest('body needs "urls" or "pattern"')


async def _prefetch(request: web.Request) -> web.Response:
    _require_admin(request)
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    urls: list[str] = []
    for u in _expand(body):
        if len(urls) >= MAX_PREFETCH:
            raise BadRequest(f"more than {MAX_PREFETCH} URLs in one prefetch")
        urls.append(_plan_url(request, u))  # the URL forms a read plan takes
    app = request.app
    store = app[STORE]
    # What is cached when the request is answered is not fetched again, even if it is
    # purged before the prefetch task gets to it.
    todo = await asyncio.to_thread(
        lambda: [u for u in dict.fromkeys(urls) if store.get(u, touch=False) is None]
    )
    app[SCHEDULER].prefetch(todo)
    return web.json_response({"accepted": len(urls)}, status=202)


async def _purge(request: web.Request) -> web.Response:
    _require_admin(request)
    store = request.app[STORE]
    url = request.query.get("url")
    if url is not None:
        removed = int(await asyncio.to_thread(store.remove, _canonical(request, url)))
    else:
        removed = await asyncio.to_thread(store.clear)
    return web.json_response({"removed": removed})


def _plan_url(request: web.Request, url: Any) -> str:
    """The canonical upstream URL of a plan entry: a proxy path, a URL of this proxy, an
    upstream URL, or ``s3://BUCKET/KEY`` of a bucket of the S3 front."""
    try:
        return _canonical(request, _url_form(request, url)[1])
    except Forbidden as exc:
        raise BadRequest(str(exc)) from None


def _url_form(request: web.Request, url: Any) -> tuple[str, Any]:
    """Which form ``url`` has, and what :func:`_canonical` maps: ("proxy path", path),
    ("proxy URL", its path), ("S3 front bucket", /BUCKET/KEY) or ("absolute URL", url);
    the one rule of every route that takes URLs (plans, prefetch, where)."""
    if not isinstance(url, str) or url.startswith("/"):
        return "proxy path", url
    s = request.app[SETTINGS]
    if any(url.startswith(u.root) for u in s.upstreams):
        return "upstream URL", url
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if sep and scheme.lower() in ("http", "https") and _is_me(request, scheme, host):
        return "proxy URL", slash + path  # a URL of this proxy
    if sep and scheme.lower() == "s3" and any(u.name == host for u in s.upstreams):
        return "S3 front bucket", f"/{host}/{path}"  # a bucket of the S3 front
    return "absolute URL", url


async def _where(request: web.Request) -> web.Response:
    """``GET /-/where?url=URL``: what a URL in any form maps to on this proxy (the
    upstream, the upstream URL fetched, the proxy path, the cache key) and what the
    proxy holds of it (cached, downloading, in a read plan); without ``url``, the
    upstreams and allowed hosts, which is what a client needs to map URLs itself.
    Read-only: no admin token. A URL that maps nowhere is answered 200 with ``error``
    saying why."""
    s = request.app[SETTINGS]
    body: dict[str, Any] = {
        "upstreams": [_without_userinfo(str(u)) for u in s.upstreams],
        "allow_hosts": list(s.allow_hosts),
        # what a reader on this node needs to open committed entries straight from the
        # cache directory (shardcache.direct): whether an entry may be used without asking
        # the upstream ("never": immutable objects), and whether keys drop signatures
        "revalidate": (
            "never" if s.revalidate is None else "always" if s.revalidate == 0 else s.revalidate
        ),
        "strip_signatures": request.app[STORE].key_url is not None,
    }
    url = request.query.get("url")
    if url is None:
        return web.json_response(body)
    body["url"] = url
    form, target = _url_form(request, url)
    try:
        canonical = _canonical(request, target)
    except ProxyError as exc:
        body.update(form=form, error=str(exc))
        return web.json_response(body)
    under = [u for u in s.upstreams if canonical.startswith(u.root)]
    if under:
        up = max(under, key=lambda u: len(u.root))
        rest = "/" + canonical[len(up.root) :]
        path = (f"/{up.name}" if up.name else "") + rest
        upstream = _without_userinfo(str(up))
    else:  # a host of --allow-host, in the absolute-URL form
        path = "/" + canonical
        upstream = "allowed host " + (urlsplit(canonical).hostname or "?")
    if form == "absolute URL":
        form = "upstream URL" if under else "URL of an allowed host"
    store = request.app[STORE]
    entry = await asyncio.to_thread(store.get, canonical, touch=False)
    dl = request.app[INFLIGHT].get(canonical)

    def scan(plans: list[Any]) -> list[dict[str, Any]]:  # up to 64 x 100,000 URLs
        found = []
        for plan in plans:
            at = plan.position
            ahead = next((i for i, u in enumerate(plan.urls) if u == canonical and i >= at), None)
            if ahead is not None:
                found.append({"plan": plan.id, "name": plan.name, "index": ahead, "position": at})
        return found

    planned = await asyncio.to_thread(scan, list(request.app[PLANS]))
    state = "cached" if entry is not None else "downloading" if dl is not None else "not cached"
    body.update(
        form=form,
        upstream=upstream,
        upstream_url=_without_userinfo(canonical),
        proxy_path=path,
        proxy_url=f"{request.scheme}://{request.host}{path}",
        key=store.key(canonical),
        state=state,
        size=entry.size if entry is not None else (dl.meta.size if dl is not None else None),
        downloaded=dl.written if dl is not None and entry is None else None,
        planned=planned,
    )
    return web.json_response(body)


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def _is_me(request: web.Request, scheme: str, netloc: str) -> bool:
    """Whether ``scheme://netloc`` names this proxy: the Host the request came to, or a
    loopback name or this proxy's address on the port it listens on (default ports
    written or not)."""
    from urllib.parse import urlsplit

    default = 443 if scheme.lower() == "https" else 80
    try:
        there = urlsplit(f"{scheme}://{netloc}")
        port = there.port or default
        here = urlsplit(f"{request.scheme}://{request.host}")
        here_port = here.port or (443 if request.scheme == "https" else 80)
    except ValueError:
        return False
    name = (there.hostname or "").lower()
    if name == (here.hostname or "").lower() and port == here_port:
        return True
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    listen_port = sock[1] if sock else here_port
    mine = _LOOPBACK_NAMES | {request.app[SETTINGS].host.lower()}
    if sock:
        mine |= {str(sock[0]).lower()}
    return port == listen_port and name in mine
