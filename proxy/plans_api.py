"""The read plans' routes (``/-/plans``): register, list, inspect and delete plans; plan
entries given as proxy paths, URLs of this proxy, upstream URLs or ``s3://`` buckets of
the S3 front are mapped to canonical upstream URLs."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from proxy.admin import (
    _expand,
    _plan_url,
    _require_admin,
)
from proxy.context import (
    PLANS,
)
from proxy.plans import Plans
from shardcache.errors import (
    BadRequest,
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


async def _plans_delete(request: web.Request) -> web.Response:
    _require_admin(request)
    await request.app[PLANS].unregister(request.match_info["id"])
    return web.json_response({"removed": True})
