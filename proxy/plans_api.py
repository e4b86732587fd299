"""The read plans' routes (``/-/plans``): register, list, inspect and delete plans; plan
entries given as proxy paths, URLs of this proxy, upstream URLs or ``s3://`` buckets of
the S3 front are mapped to canonical upstream URLs."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from proxy.admin import (
    _canonical,
    _expand,
    _require_admin,
)
from proxy.context import (
    PLANS,
    SETTINGS,
)
from proxy.plans import Plans
from shardcache.errors import (
    BadRequest,
    Forbidden,
)

log = logging.getLogger(__name__)


async def _plans_here(request: web.Request) -> Plans:
    """The plans, up to date with the other workers' progress."""
    plans = request.app[PLANS]
    await plans.sync(force=True)
    return plans


async def _plans_list(request: web.Request) -> web.Response:
    plans = await _plans_here(request)
    now = time.monotonic()
    return web.json_response({"plans": [p.status(now) for p in plans]})


async def _plans_get(request: web.Request) -> web.Response:
    plan = (await _plans_here(request)).get(request.match_info["id"])
    return web.json_response(plan.status(time.monotonic()))


async def _plans_add(request: web.Request) -> web.Response:
    _require_admin(request)
    plans = request.app[PLANS]
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    replace = body.get("replace", False) if isinstance(body, dict) else False
    if not isinstance(replace, bool):
        raise BadRequest(f'"replace" must be true or false, not {replace!r}')
    # before any work on the URLs (a replacing plan takes the room of those it replaces)
    plans.check_room(len(plans.named(body.get("name"))) if replace else 0)
    limit = plans.max_shards

    def canonical() -> list[str]:  # a large plan maps its URLs off the event loop
        urls: list[str] = []
        for u in _expand(body):
            if len(urls) >= limit:
                raise BadRequest(
                    f"plan has more than {limit} shards (--max-plan-shards)", status_hint=413
                )
            urls.append(_plan_url(request, u))
        return urls

    urls = await asyncio.to_thread(canonical)
    plan = await plans.register(urls, body.get("name"), body.get("lookahead"), replace=replace)
    status = plan.status(time.monotonic())
    return web.json_response(
        {
            "id": plan.id,
            "name": plan.name,
            "shards": len(plan.urls),
            "lookahead": {
                "shards": status["lookahead_shards"],
                "bytes": status["lookahead_bytes"],
            },
            "plan": status,
        },
        status=201,
    )


def _plan_url(request: web.Request, url: Any) -> str:
    """The canonical upstream URL of a plan entry: a proxy path, a URL of this proxy, an
    upstream URL, or ``s3://BUCKET/KEY`` of a bucket of the S3 front."""
    if isinstance(url, str) and not url.startswith("/"):
        s = request.app[SETTINGS]
        under = any(url.startswith(u.base + "/") for u in s.upstreams)
        if not under:
            scheme, sep, rest = url.partition("://")
            host, slash, path = rest.partition("/")
            if sep and scheme.lower() in ("http", "https") and _is_me(request, scheme, host):
                url = slash + path  # a URL of this proxy
            elif sep and scheme.lower() == "s3" and any(u.name == host for u in s.upstreams):
                url = f"/{host}/{path}"  # a bucket of the S3 front
    try:
        return _canonical(request, url)
    except Forbidden as exc:
        raise BadRequest(str(exc)) from None


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


async def _plans_delete(request: web.Request) -> web.Response:
    _require_admin(request)
    await request.app[PLANS].unregister(request.match_info["id"])
    return web.json_response({"removed": True})
