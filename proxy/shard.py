"""Data requests: ``GET``/``HEAD`` of a shard. :func:`_shard` gathers what is known
about a request and asks :func:`proxy.decide.decide` what to do next, until the answer
is one that serves: a hit, a download to join or start, a cold shortcut, a bypass, or
another worker's answer. The carrying out (revalidation, cold answers, background
downloads) is here; the response itself is :mod:`proxy.answer`'s."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from proxy.answer import (
    DIRECT_RANGE_AHEAD,
    _answer,
    _ChunkBody,
    _counted,
    _DownloadBody,
    _EntryBody,
    _NoBody,
    hit_age,
)
from proxy.context import (
    ADMIN_ROUTES,
    FETCHER,
    HEALTH,
    HITS,
    INFLIGHT,
    METRICS,
    PLANS,
    RUNTIME,
    SETTINGS,
    STORE,
    T_PLANS,
    T_READY,
    _forwarded,
    _waited,
)
from proxy.decide import Claim, Facts, Step, XCache, decide
from proxy.inflight import Download, State
from proxy.passthrough import is_uncached, mapped, pass_through
from proxy.peers import (
    _forward,
)
from proxy.plans import PLAN_HEADER
from proxy.policy import (
    REVALIDATE_HTTP,
    carries_credentials,
    credentials_forwarded,
    forwarded_fields,
    is_fresh,
    map_request,
    must_revalidate_each_use,
    needs_revalidation,
    should_admit,
    stale_needs_upstream,
    stale_while_revalidate,
)
from proxy.policy import range_start as _range_start  # where a client's range begins
from proxy.upstream import ObjectMeta, UpstreamBody
from shardcache.errors import (
    CacheError,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    UpstreamError,
)
from shardcache.store import Entry

log = logging.getLogger(__name__)


async def _shard(request: web.Request) -> web.StreamResponse:
    s = request.app[SETTINGS]
    raw = request.raw_path
    path_only = raw.partition("?")[0]
    if path_only.startswith("/-/") or path_only == "/metrics":
        if path_only in ADMIN_ROUTES:
            raise MethodNotAllowed(
                f"method {request.method} not allowed on {path_only}",
                allow=ADMIN_ROUTES[path_only],
            )
        raise NotFound(f"no admin route {path_only}")
    if request.method not in ("GET", "HEAD"):
        try:
            url = map_request(raw, s.upstreams, s.allow_hosts, s.max_path_length)
        except ProxyError:
            url = ""
        if url and is_uncached(url, s.upstreams, s.uncached_paths):
            return await pass_through(request, url)  # an API, not objects
        raise MethodNotAllowed(f"method {request.method} not allowed; use GET or HEAD")
    url, uncached = mapped(raw, s)
    if uncached:  # an API, not objects
        return await pass_through(request, url)
    # the client's credentials go to the upstream only where the operator allows it, and
    # then the answer is this client's alone: never stored, never shared (RFC 9111 3.5)
    private = carries_credentials(request.headers) and credentials_forwarded(
        url, s.upstreams, s.forward_credentials
    )
    if path_only.endswith("/") and len(path_only) > 1:
        # a directory (listing), not a shard: forwarded with its slash, never cached
        base, sep, query = url.partition("?")
        return await _serve_bypass(
            request, (base if base.endswith("/") else base + "/") + sep + query, private=private
        )
    store = request.app[STORE]
    inflight = request.app[INFLIGHT]
    plans = request.app[PLANS]
    plan_id = request.headers.get(PLAN_HEADER)
    if plan_id and plans.shared and plan_id not in plans and not _forwarded(request):
        await plans.learn(plan_id)  # registered through another worker a moment ago
    if len(plans) and not _forwarded(request):  # counted by the worker it came to
        matched = plans.on_request(url, plan_id)
        if matched:
            request[T_PLANS] = matched
    health = request.app[HEALTH]
    shared = s.workers > 1 and not _forwarded(request)
    refreshed = False  # a revalidation found the object changed: this request's own miss
    for _ in range(3):  # a round: the download table and the index as they are now
        facts = Facts(shared=shared)
        dl = inflight.get(url)
        facts = facts.learn(downloading=dl is not None)
        entry: Entry | None = None
        claimed = False
        owner: int | None = None
        cache = XCache.COALESCED
        while dl is None:
            step = decide(facts)
            if step is Step.LOOKUP:
                if facts.looked_up:
                    break  # committed by another worker meanwhile: a new round finds it
                request[T_READY] = "hit"
                try:
                    entry = store.lookup(url)
                except CacheError as exc:  # the index cannot be read: answer from the upstream
                    log.error("cache lookup of %s failed, passing it through: %s", url, exc)
                    facts = facts.learn(looked_up=True, lookup_failed=True)
                    continue
                due, fresh, stale_ok = entry_state(s.revalidate, entry, time.time())
                facts = facts.learn(
                    looked_up=True,
                    entry=entry is not None,
                    revalidation_due=due,
                    fresh=fresh,
                    stale_ok=stale_ok,
                    writable=health.writable,
                    private=private,
                )
                if entry is None:
                    request[T_READY] = "miss"
            elif step is Step.REVALIDATE:
                assert entry is not None
                entry = await _revalidate(request, url, entry)
                refreshed = entry is None
                facts = facts.learn(revalidated=True, entry=entry is not None)
                if refreshed:
                    request[T_READY] = "miss"
                    # the revalidation's answer may already be this object's download
                    dl = inflight.get(url)
            elif step is Step.HIT:
                assert entry is not None
                if not facts.fresh and not facts.revalidated:
                    _revalidate_behind(request, url, entry)  # stale-while-revalidate
                resp = await _serve_hit(request, entry)
                if resp is not None:
                    return resp
                facts = facts.learn(entry_gone=True)
            elif step is Step.ENTRY_GONE:
                assert entry is not None
                # evicted (or replaced) by another process between lookup and open: drop
                # a row whose file is gone or has another size, then look again
                store.forget(entry.key)
                await asyncio.to_thread(store.get, url, touch=False)
                store.forget(entry.key)
                break
            elif step is Step.BYPASS:
                return await _serve_bypass(request, url, private=private)
            elif step is Step.COLD:
                resp = await _serve_cold(request, url)
                if resp is not None:
                    return resp
                facts = facts.learn(cold_tried=True)
            elif step is Step.CLAIM:
                # one download per object across the workers of this port
                try:
                    state, owner = await asyncio.to_thread(
                        store.claim, url, request.app[RUNTIME].internal_port
                    )
                    claim = Claim(state)
                except CacheError as exc:
                    log.warning("cannot claim %s, downloading it here: %s", url, exc)
                    claim = Claim.MINE
                if claim is Claim.OWNER and owner is None:
                    claim = Claim.MINE  # an owner that left no port: take it over here
                claimed = claim is Claim.MINE
                facts = facts.learn(claim=claim)
            elif step is Step.FORWARD:
                assert owner is not None
                resp = await _forward(request, owner)
                if resp is not None:
                    return resp
                break  # the owner is gone: its claim is taken over in a new round
            elif step is Step.START:
                dl = inflight.get(url)
                if dl is None:
                    dl = inflight.start(
                        url, claimed=claimed, headers=forwarded_fields(request.headers)
                    )
                    # a plan's reader waits for it: in parts, ahead of the plans' lookahead
                    dl.urgent = bool(request.get(T_PLANS))
                    cache = XCache.MISS
                elif claimed:
                    # started meanwhile by another request of this worker, under the same claim
                    dl.hold_claim()
            else:  # Step.JOIN needs a download, which ends this loop
                raise AssertionError(f"unexpected step {step}")
        if dl is None:
            continue
        if cache is XCache.COALESCED:
            request[T_READY] = "downloading"
            if refreshed:
                cache = XCache.MISS
        if dl.verified:
            cache = XCache.HIT  # every byte is local already; only the commit is pending
            request[T_READY] = "hit"
        try:
            return await _serve_download(request, dl, cache)
        finally:
            dl.release()
    raise UpstreamError(f"{url}: entry keeps disappearing; try again")


def entry_state(
    revalidate: object, entry: Entry | None, now: float, no_cache: bool | None = None
) -> tuple[bool, bool, bool]:
    """What ``--revalidate`` (``revalidate``) says of ``entry`` (None: none found) at
    ``now``: (revalidation due, fresh, stale but within its stale-while-revalidate
    window), the facts :func:`proxy.decide.decide` takes; ``no_cache``: what
    :func:`_no_cache` says of the entry, when the caller kept it. Shared by
    :func:`_shard` and the fast path (:mod:`proxy.fastpath`), which serves only what
    this calls fresh and not due."""
    if entry is None:
        return False, True, False
    if no_cache is None:
        no_cache = _no_cache(entry)
    due = needs_revalidation(revalidate, entry.validated, now) or no_cache
    fresh = revalidate != REVALIDATE_HTTP or is_fresh(
        entry.fields, entry.last_modified, entry.validated, now
    )
    stale_ok = not fresh and stale_while_revalidate(
        entry.fields, entry.last_modified, entry.validated, now
    )
    return due, fresh, stale_ok


def no_cache(entry: Entry) -> bool:
    """:func:`_no_cache`, for the fast path to keep with the entry's header block."""
    return _no_cache(entry)


def _no_cache(entry: Entry) -> bool:
    """Whether the entry's answer said ``no-cache`` (Cache-Control or CDN-Cache-Control):
    every reuse asks the upstream first, in every ``--revalidate`` mode."""
    return must_revalidate_each_use(entry.meta.cache_control) or must_revalidate_each_use(
        entry.meta.field("CDN-Cache-Control")
    )


def _must_not_serve_stale(app: web.Application, entry: Entry) -> bool:
    """With ``--revalidate http``: whether the entry may not be served when the upstream
    cannot be asked (RFC 9111 4.2.4): it is stale and says ``must-revalidate``,
    ``proxy-revalidate`` or ``s-maxage``, or it says ``no-cache``. The other modes serve
    the cached copy (shards are immutable unless the operator says otherwise)."""
    if app[SETTINGS].revalidate != REVALIDATE_HTTP:
        return False
    if _no_cache(entry):
        return True
    stale = not is_fresh(entry.fields, entry.last_modified, entry.validated, time.time())
    return stale and stale_needs_upstream(entry.fields)


async def _revalidate(request: web.Request, url: str, entry: Entry) -> Entry | None:
    """Ask the upstream whether an aged entry is current (one request however many
    clients ask at once). The entry when it is (a 304); None when it changed (it is
    removed, the caller fetches the new version like a miss); NotFound when it is gone.
    When the upstream cannot answer, the cached copy is served (and a warning logged)."""
    app = request.app
    pending: dict[str, asyncio.Task] = app[RUNTIME].revalidating
    task = pending.get(url)
    if task is None:
        fields = forwarded_fields(request.headers)
        task = asyncio.get_running_loop().create_task(_ask_upstream(app, url, entry, fields))
        pending[url] = task
        task.add_done_callback(lambda _: pending.pop(url, None))
    return await asyncio.shield(task)


def _revalidate_behind(request: web.Request, url: str, entry: Entry) -> None:
    """Ask the upstream about ``entry`` in the background (once however many clients
    ask), while it is served stale (``stale-while-revalidate``); what the upstream says
    takes effect as in :func:`_revalidate`."""
    pending: dict[str, asyncio.Task] = request.app[RUNTIME].revalidating
    if url in pending:
        return
    fields = forwarded_fields(request.headers)
    task = asyncio.get_running_loop().create_task(_ask_upstream(request.app, url, entry, fields))
    pending[url] = task

    def done(t: asyncio.Task) -> None:
        pending.pop(url, None)
        if not t.cancelled() and t.exception() is not None:
            log.info("background revalidation of %s: %s", url, t.exception())

    task.add_done_callback(done)


async def _ask_upstream(
    app: web.Application, url: str, entry: Entry, fields: dict[str, str]
) -> Entry | None:
    m, store = app[METRICS], app[STORE]
    try:
        answer = await app[FETCHER].revalidate(url, entry.meta, fields)
    except ProxyError as exc:
        m.revalidations.labels(result="error").inc()
        if _must_not_serve_stale(app, entry):
            log.warning("cannot revalidate %s (%s); its answer forbids serving it stale", url, exc)
            raise
        log.warning("cannot revalidate %s (%s); serving the cached copy", url, exc)
        return entry
    m.revalidations.labels(result=answer.result).inc()
    if answer.result == "fresh":
        entry = store.mark_validated(entry)
        if answer.fields:
            try:  # what the 304 says replaces what was stored (Cache-Control, Expires...)
                entry = await asyncio.to_thread(store.update_fields, entry, answer.fields)
            except CacheError as exc:
                log.warning("cannot store the new header fields of %s: %s", url, exc)
        return entry
    log.info("%s %s at the upstream; dropping the cached copy", url, answer.result)
    store.forget(entry.key)
    try:
        await asyncio.to_thread(store.remove, url)
    except CacheError as exc:
        err = app[HEALTH].classify("index", exc)
        if err is not None:
            app[HEALTH].failed(err)
    if answer.result == "gone":
        raise NotFound(f"upstream {url} is gone; removed from the cache")
    if answer.body is not None:
        # the new version is already on its way: it becomes the download (one GET)
        dl = await _background(app, url, "demand", body=answer.body)
        if dl is None:
            answer.body.close()
        else:
            dl.release()
    return None


async def _serve_hit(request: web.Request, entry: Entry) -> web.StreamResponse | None:
    """Serve a hit; None when the entry file turned out missing or replaced (the caller
    forgets the entry and looks again)."""
    body = _EntryBody(request.app[HITS], entry)
    if not body.open():
        return None
    age = {"Age": hit_age(entry, time.time())}
    return await _answer(request, body.meta, XCache.HIT, entry.size, body, age)


async def _await_headers(request: web.Request, dl: Download) -> None:
    """Wait (timed as the client's wait) until ``dl`` has its upstream's headers."""
    if dl.state is State.OPENING:
        since = time.monotonic()
        try:
            await dl.wait_headers()
        finally:
            _waited(request, since)


async def _serve_download(request: web.Request, dl: Download, cache: str) -> web.StreamResponse:
    await _await_headers(request, dl)
    if dl.state is State.BYPASS:
        return await _serve_bypass(request, dl.url, dl)
    return await _answer(request, dl.meta, cache, dl.known_size, _DownloadBody(dl))


async def _serve_bypass(
    request: web.Request, url: str, dl: Download | None = None, *, private: bool = False
) -> web.StreamResponse:
    """Stream ``url`` from the upstream to this client alone, uncached (X-Cache: BYPASS):
    the body a bypassed download already opened, or a request of its own (``private``:
    with the client's credentials)."""
    fetcher = request.app[FETCHER]
    body: UpstreamBody | None = None
    if request.method == "GET" or dl is None:
        body = dl.take_bypass_body() if dl is not None else None
        if body is None:
            since = time.monotonic()
            try:
                body = await fetcher.open(
                    url, forwarded_fields(request.headers, credentials=private)
                )
            finally:
                _waited(request, since)
    try:
        meta: ObjectMeta = body.meta if body is not None else dl.meta  # type: ignore[union-attr]
        source = _NoBody() if body is None else _ChunkBody(body.chunks())
        return await _answer(request, meta, XCache.BYPASS, meta.size, source)
    finally:
        if body is not None:
            body.close()


_CONDITIONALS = (
    "If-Range",
    "If-Match",
    "If-None-Match",
    "If-Modified-Since",
    "If-Unmodified-Since",
)


async def _serve_cold(request: web.Request, url: str) -> web.StreamResponse | None:
    """Answer a request for an object neither cached nor downloading without waiting
    for a download: HEAD from an upstream HEAD; a Range that starts past the first few
    MiB, with ``--cold-range fast`` over one stream, from a ranged upstream GET (a 416
    from the object's size, with no body fetched), the download of the whole object
    starting meanwhile (the range's bytes counted as fetched twice); in parts, or with
    ``once``, from the download it starts (parts: the one holding the range first).
    None: the caller starts (or joins) the download as usual — also when the ranged
    answer is unusable."""
    if request.method == "HEAD":
        since = time.monotonic()
        try:
            meta = await request.app[FETCHER].head(url, forwarded_fields(request.headers))
        except (UpstreamError, ProxyError) as exc:
            if exc.status_hint in (405, 501):
                return None  # an origin without HEAD: the download answers
            raise
        finally:
            _waited(request, since)
        return await _answer(request, meta, XCache.MISS, meta.size, _NoBody())
    header = request.headers.get("Range")
    if request.method != "GET" or header is None:
        return None
    if any(h in request.headers for h in _CONDITIONALS):
        return None
    start = _range_start(header)
    if start is None or 0 <= start < DIRECT_RANGE_AHEAD:
        return None
    app = request.app
    fetcher = app[FETCHER]
    if start > 0 and (fetcher.in_parts(url) or app[SETTINGS].cold_range == "once"):
        # every byte once: the range from the object's one download, which in parts
        # fetches the part holding it first (after part 0, which tells the version)
        dl = await _background(app, url, "demand", forwarded=_forwarded(request))
        if dl is None:
            return None  # running already, cached, or no writes: joined as usual
        try:
            dl.prefer(start)
            await _await_headers(request, dl)
            if dl.state is not State.BYPASS:
                return await _serve_download(request, dl, XCache.MISS)
            # not cached (too big, no-store...): nothing to fetch once for, and the
            # whole object for a range would cost more than the range alone
            body = dl.take_bypass_body()
            if body is not None:
                body.close()
        finally:
            dl.release()
    since = time.monotonic()
    try:
        answer = await fetcher.open_range(url, header)
    except UpstreamError as exc:
        # a ranged answer that is malformed or fails verification (a range past the
        # object's end answered with a sloppy 206...): the download serves the range,
        # or its 416, from the whole object instead
        log.info("%s: ranged answer unusable, serving %r from the download: %s", url, header, exc)
        return None
    finally:
        _waited(request, since)
    try:
        meta = answer.meta
        chunks = answer.body.chunks()
        if should_admit(meta.size, app[INFLIGHT].cache_size):
            await _start_background(request, url)
            # the download fetches these bytes as well
            chunks = _counted(chunks, app[METRICS].upstream_extra_bytes.labels(reason="cold_range"))
        # the upstream's answer starts at the range's first byte, or at 0 when it ignored Range
        first = 0 if answer.brange is None else answer.wanted.start
        return await _answer(request, meta, XCache.MISS, meta.size, _ChunkBody(chunks, first))
    finally:
        answer.body.close()


async def _start_background(request: web.Request, url: str) -> None:
    """Start downloading ``url`` for the cache (no client follows it), once per object
    across the workers of this port."""
    dl = await _background(request.app, url, "demand", forwarded=_forwarded(request))
    if dl is not None:
        dl.release()


async def _background(
    app: web.Application,
    url: str,
    reason: str,
    *,
    forwarded: bool = False,
    body: UpstreamBody | None = None,
    urgent: bool = False,
    one_stream: bool = False,
) -> Download | None:
    """Start downloading ``url`` for the cache, no client following it, once per object
    across the workers of this port; the download (acquired for the caller), or None
    when it runs already, is cached, or the store takes no writes. ``body``: the
    object's answer, already open (the download starts from it). ``urgent``: a plan's
    reader asks for it next (:attr:`Download.urgent`); ``one_stream``: never in parts
    (:attr:`Download.one_stream`)."""
    inflight = app[INFLIGHT]
    if inflight.running(url) or not app[HEALTH].writable:
        return None
    claimed = False
    if app[SETTINGS].workers > 1 and not forwarded:
        try:
            state, _ = await asyncio.to_thread(app[STORE].claim, url, app[RUNTIME].internal_port)
        except CacheError:
            return None
        if state != "mine":
            return None
        claimed = True
    if inflight.running(url):
        return None
    dl = inflight.start(url, claimed=claimed, body=body)
    dl.reason = reason
    dl.urgent = urgent
    dl.one_stream = one_stream
    return dl
