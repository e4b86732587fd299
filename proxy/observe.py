"""The middleware around every request: the proxy's errors answered in one line (or an
upstream's answer passed on as it was), the access log, and the request metrics (data
requests apart from the proxy's own routes, clients' wait, read plans' progress)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.context import (
    ADMIN_ROUTES,
    METRICS,
    RUNTIME,
    T_ABORTED,
    T_BYTES,
    T_PLANS,
    T_READY,
    T_RESP,
    T_START,
    T_WAIT,
    UPSTREAM_HEALTH,
    _abort_client,
    _error_response,
    _forwarded,
)
from proxy.decide import XCache
from proxy.errormap import error_answer
from proxy.logs import AccessLines, clip
from proxy.policy import confine
from proxy.s3front import S3_SERVICE_ROUTE
from proxy.upstream.errors import PassedAnswer
from shardcache.errors import ProxyError

log = logging.getLogger(__name__)


access_log = logging.getLogger("shardcache.access")


def _redacting(request: web.Request) -> Any:
    """What redacts the configured secrets from a message shown to a client (an upstream
    may echo what it was sent into an error the proxy words)."""
    return request.app[UPSTREAM_HEALTH].redacting


def _passed(
    exc: ProxyError, answer: PassedAnswer, method: str, redacting: Any = None
) -> web.Response:
    """The upstream's answer as it was (status, end-to-end fields, body), uncached, with
    the proxy's one-line account in ``X-Shardcache-Error``. A 401 becomes 403: the
    upstream refused the proxy's own credentials, and the client must not be asked for
    its own (they are not forwarded).

    ``redacting`` (a :class:`proxy.logs.SecretsRedactor`): the configured secrets are
    redacted from the account, and a field or a body that holds one (an origin echoing
    the proxy's credentials) is withheld, a reason phrase that holds one replaced."""
    status = 403 if answer.status == 401 else answer.status
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v)
        for k, v in answer.fields
        if k.lower() != "www-authenticate"
        and (redacting is None or not redacting.names_secret(v.encode("utf-8", "replace")))
    )
    account = " ".join(str(exc).split())
    body = answer.body
    reason = answer.reason or None
    if redacting is not None:
        if reason and redacting.names_secret(reason.encode("utf-8", "replace")):
            reason = None  # the status's own phrase instead
        account = redacting(account)
        if body and redacting.names_secret(body):
            body = b""
            account += " (its body named a configured secret and is withheld)"
            for name in ("Content-Length", "Content-MD5", "Content-Encoding", "ETag", "Digest"):
                headers.popall(name, None)
    headers["X-Shardcache-Error"] = account[:512]
    if status < 400:
        headers["X-Cache"] = XCache.BYPASS  # a success that is not the object: passed, uncached
    confine(headers)  # the upstream's body never runs as a page of the proxy's origin
    sent = None if method == "HEAD" or status in (204, 304) else body
    resp = web.Response(status=status, reason=reason, body=sent, headers=headers)
    if method == "HEAD" and body:
        resp.headers["Content-Length"] = str(len(body))
    return resp


@web.middleware
async def _observe(request: web.Request, handler: Any) -> web.StreamResponse:
    start = time.monotonic()
    request[T_START] = start
    request[T_BYTES] = 0
    resp: web.StreamResponse | None = None
    note = ""
    cut = False
    task = asyncio.current_task()
    handlers = request.app[RUNTIME].handlers
    if task is not None:
        handlers.add(task)  # cancelled if still running when the grace period ends
    try:
        try:
            resp = await handler(request)
        except (ProxyError, web.HTTPException) as exc:
            if isinstance(exc, ProxyError) and isinstance(exc.answer, PassedAnswer):
                resp = _passed(exc, exc.answer, request.method, _redacting(request))
            else:
                told = error_answer(exc)
                resp = _error_response(
                    told.status, _redacting(request)(told.message), dict(told.headers) or None
                )
        except ConnectionError:
            note = " client-gone"
            resp = request.get(T_RESP)
            if resp is None:
                raise
        except asyncio.CancelledError:
            # cut off at shutdown: the status already sent, or 499 when none was
            cut, note = True, " cut-off"
            resp = request.get(T_RESP)
            if resp is not None and resp.prepared:
                _abort_client(request)  # a body begun must not seem to end at the close
            raise
        if request.get(T_ABORTED):
            note = " aborted"
        return resp
    finally:
        handlers.discard(task)  # type: ignore[arg-type]
        status = resp.status if resp is not None else (CUT_OFF if cut else 500)
        cache = (resp.headers.get("X-Cache") if resp is not None else None) or "NONE"
        nbytes = request[T_BYTES]
        if resp is not None and not resp.prepared and isinstance(resp, web.Response):
            nbytes = 0 if request.method == "HEAD" else len(resp.body or b"")
        duration = time.monotonic() - start
        route = _service_route(request)
        if _forwarded(request):
            note += " for-worker"  # counted by the worker that received it
        elif route is not None:
            request.app[METRICS].observe_service(route, status)
        else:
            request.app[METRICS].observe_request(cache, status, nbytes)
            _account_wait(request, nbytes)
        level = logging.DEBUG if route in PROBES and status < 400 else logging.INFO
        log_access(
            level, request.remote, request.method, request.raw_path, status, cache, nbytes,
            duration, note,
        )  # fmt: skip


def log_access(
    level: int,
    remote: str | None,
    method: str,
    raw_path: str,
    status: int,
    cache: str,
    nbytes: int,
    duration: float,
    note: str = "",
) -> None:
    """The access-log line of one request (the middleware's, and the fast path's for the
    hits it answers itself: :mod:`proxy.fastpath`)."""
    if access_log.isEnabledFor(level):
        # Logger.log would walk the stack for the caller's file and line, which no
        # access-log line shows, and LogRecord would work out again what is the same for
        # every line; with the daemon's own handler the line is written without a record
        # (proxy.logs.AccessLines)
        _lines.log(level, (remote, method, clip(raw_path), status, cache, nbytes, duration, note))


ACCESS_FORMAT = '%s "%s %s" %d %s %d %.3fs%s'
_lines = AccessLines(access_log, ACCESS_FORMAT, __file__)


CUT_OFF = 499  # logged for a request cut off before its status was sent (as nginx does)
PROBES = frozenset({"healthz", "readyz", "metrics"})  # logged at DEBUG when they pass


def _account_wait(request: web.Request, nbytes: int) -> None:
    """At the end of a data request: its stall and its read plans' progress."""
    m = request.app[METRICS]
    wait = request.get(T_WAIT, 0.0)
    if wait:
        m.client_wait.inc(wait)
    plans = request.get(T_PLANS)
    if not plans:
        return
    ready = request.get(T_READY, "miss")
    m.plan_requests.labels(ready=ready).inc()
    now = time.monotonic()
    for plan in plans:
        plan.wait_seconds += wait
        plan.note_read(nbytes, now, hit=ready == "hit")


def _service_route(request: web.Request) -> str | None:
    """The proxy's own route a request went to (metrics, health, admin, S3 listings),
    counted apart from data requests so that hit ratios count shard reads only; None for
    a data request."""
    path = request.path
    if path == "/metrics":
        return "metrics"
    if path.startswith("/-/"):
        name = path[3:].partition("/")[0]
        if f"/-/{name}" not in ADMIN_ROUTES:
            return "other"
        return name or "status"  # /-/ is the status page
    return request.get(S3_SERVICE_ROUTE)
