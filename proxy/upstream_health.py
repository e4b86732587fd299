"""What the proxy knows of each upstream's health: its failures by reason, its last error
and its last success, one WARNING line per upstream and interval, and a probe at
startup.

The upstream layer raises errors; this module only watches them go by. It is fed by
:class:`WatchedFetcher` (every request the application makes of an upstream: opening a
body, HEAD, a client's ranged read, a read of bytes beside a download (``read_range``),
a revalidation, a close-delimited body's end probe (``probe_end``)) and by
:class:`WatchedInflight` (every download's end, which sees the failures that happen after
the body opened: a cut past the retries, a digest mismatch). An error seen by both is
counted once.

Reasons are a small fixed set (:data:`REASONS`) and the upstream label is one of the
configured upstreams (or ``scheme://host`` of an ``--allow-host`` URL, at most
:data:`MAX_HOSTS` of them), so ``shardcache_upstream_failures_total{upstream,reason}``
has bounded label values. A client's 404 or a version that changed is no failure of the
upstream; nor is a download cancelled at shutdown.

Readiness does not depend on it: a proxy whose upstream is down still serves its hits,
and every proxy of a tier shares the upstream, so failing readiness would take away the
hits as well (see docs/deployment.md). ``/-/healthz``, ``/-/readyz``, ``/-/stats`` and
``shardcache stats`` say which upstream is down and why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from proxy.inflight import Download, Inflight, State
from proxy.logs import Redactor, url_secrets
from proxy.upstream import Fetcher, ObjectMeta
from proxy.upstream.resume import can_resume
from shardcache.errors import (
    CacheError,
    DigestMismatch,
    DownloadFailed,
    Forbidden,
    IncompleteDownloadError,
    NotFound,
    ObjectChanged,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamCut,
    UpstreamThrottled,
    UpstreamTimeout,
)

__all__ = [
    "REASONS",
    "UpstreamHealth",
    "WatchedFetcher",
    "WatchedInflight",
    "classify",
    "probe_upstreams",
]

log = logging.getLogger("shardcache.upstream")

REASONS = (
    "refused",  # nothing listens there (connection refused)
    "dns",  # the name does not resolve
    "tls",  # TLS handshake or certificate refused
    "timeout",  # connect or read timed out (or the upstream answered 504)
    "reset",  # the connection was reset
    "cut",  # the body broke off (past the retries) or ended short
    "digest",  # the bytes did not match a digest the upstream declared
    "throttled",  # 429, 503, SlowDown and the like
    "http_5xx",  # another 5xx answer
    "http_4xx",  # a 4xx answer other than not found / range / precondition (401, 403...)
    "unreachable",  # could not connect, for another reason
    "other",
)
WARN_INTERVAL = 10.0  # seconds between WARNING lines about one upstream
MAX_HOSTS = 32  # --allow-host hosts given their own label; the rest are "other"
MAX_MESSAGE = 300  # characters of an error message kept for /-/stats

# not the upstream failing: the object is missing, the range past its end, another version
_NOT_FAILURES = (NotFound, RangeNotSatisfiable, ObjectChanged)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes (``raise ... from``, then the implicit context), and the
    ``os_error`` aiohttp's connector errors carry; at most 8 deep."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 8:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "os_error", None), e.__cause__, e.__context__]
        if isinstance(e, DownloadFailed):
            todo.insert(0, e.cause)


_STATUS_RE = re.compile(r"\banswered (\d{3})\b")


def classify(exc: BaseException) -> str | None:
    """The reason (one of :data:`REASONS`) that ``exc`` counts as a failure of the
    upstream, or None when it is none (a 404, a cancelled download, a store error)."""
    if isinstance(exc, DownloadFailed) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, (asyncio.CancelledError, *_NOT_FAILURES)):
        return None
    if isinstance(exc, CacheError) and not isinstance(exc, IncompleteDownloadError):
        return None  # the store's trouble, not the upstream's
    if not isinstance(exc, (ProxyError, IncompleteDownloadError, OSError)):
        return None
    if isinstance(exc, DigestMismatch):
        return "digest"
    answer = getattr(exc, "answer", None)
    status = getattr(answer, "status", None)
    for e in _chain(exc):
        if isinstance(e, ConnectionRefusedError):
            return "refused"
        if isinstance(e, socket.gaierror):
            return "dns"
        if isinstance(e, ssl.SSLError) or type(e).__name__.startswith(
            ("ClientSSLError", "ClientConnectorCertificateError", "ClientConnectorSSLError")
        ):
            return "tls"
        if isinstance(e, (ConnectionResetError, BrokenPipeError)):
            return "reset"
        if isinstance(e, (TimeoutError, asyncio.TimeoutError, UpstreamTimeout)):
            return "timeout"
    if isinstance(exc, UpstreamThrottled):
        return "throttled"
    if isinstance(exc, (UpstreamCut, IncompleteDownloadError)):
        return "cut"
    text = str(exc)
    if status is None:
        m = _STATUS_RE.search(text)
        status = int(m.group(1)) if m else None
    if isinstance(status, int) and status >= 400:
        if status in (404, 410, 412, 416):
            return None
        return "http_5xx" if status >= 500 else "http_4xx"
    if isinstance(exc, Forbidden):
        return "http_4xx"
    lower = re.sub(r"\S+://\S*", "", text).lower()  # the words, not the URLs
    for words, reason in (
        (("connection refused",), "refused"),
        (("name or service not known", "temporary failure in name resolution",
          "nodename nor servname", "no address associated"), "dns"),
        (("certificate", "ssl", "tls"), "tls"),
        (("timed out", "timeout"), "timeout"),
        (("reset by peer", "connection reset"), "reset"),
        (("unreachable", "cannot connect"), "unreachable"),
    ):  # fmt: skip
        if any(w in lower for w in words):
            return reason
    if isinstance(exc, ProxyError) and 400 <= exc.status_hint < 500:
        return "http_4xx"
    return "other"


def display(upstream: str) -> str:
    """An upstream as /-/stats and the metrics show it: no ``user:password@``."""
    head, sep, rest = upstream.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{head}{sep}{netloc.rpartition('@')[2]}{slash}{path}"


# redacts a message: its text, and the values (the URL's own secrets) to redact wherever
# they appear beside the configured secrets
Redacting = Callable[[str, Sequence[str]], str]


def _shapes(text: str, extra: Sequence[str]) -> str:
    """Redaction without the configured secrets: ``extra`` by value, then by shape."""
    return Redactor(extra)(text)


def _message(exc: BaseException, url: str = "", redacting: Redacting = _shapes) -> str:
    """One line about ``exc`` (a failure of ``url``) fit for anyone to read: every
    configured secret and every credential value of ``url`` (a presigned signature,
    a password) redacted by value wherever it appears, credentials of a known shape
    redacted, userinfo dropped, clipped."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = re.sub(r"://[^/\s@'\"]*@", "://", redacting(text, url_secrets(url)))
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass
class _Upstream:
    """The record of one upstream."""

    label: str
    failures: dict[str, int] = field(default_factory=dict)
    last_error: dict[str, Any] | None = None
    last_ok: float | None = None  # wall clock
    events: int = 0  # failures and successes seen, in order
    error_event: int = 0  # the number of the last failure among them
    ok_event: int = 0  # ... and of the last success
    warned_at: float = float("-inf")  # monotonic time of the last WARNING line
    unwarned: int = 0  # failures since that line

    @property
    def state(self) -> str:
        if self.last_error is None and self.last_ok is None:
            return "unknown"
        if self.last_error is not None and self.error_event > self.ok_event:
            return "down"
        return "up"

    def snapshot(self) -> dict[str, Any]:
        return {
            "upstream": self.label,
            "state": self.state,
            "last_error": self.last_error,
            "last_ok": _iso(self.last_ok),
            "failures": dict(sorted(self.failures.items())),
        }


class UpstreamHealth:
    """Failures and successes of each upstream: a counter, the last error, and rate
    limited WARNING lines."""

    def __init__(
        self,
        upstreams: Sequence[Any],
        counter: Any = None,
        *,
        interval: float = WARN_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        redacting: Redacting | None = None,
    ) -> None:
        # (base URL, label) longest base first: a URL belongs to the longest base it is under
        self._bases = sorted(
            ((str(getattr(u, "base", u)).rstrip("/"), display(str(u))) for u in upstreams),
            key=lambda b: len(b[0]),
            reverse=True,
        )
        self.counter = counter  # shardcache_upstream_failures_total{upstream,reason}
        self.interval = interval
        self.clock = clock
        # how a kept message is redacted: the daemon's secrets by value
        # (:class:`proxy.logs.SecretsRedactor`), else by shape and the URL's own values
        self.redacting: Redacting = redacting or _shapes
        self._records: dict[str, _Upstream] = {label: _Upstream(label) for _, label in self._bases}
        self._seen: weakref.WeakSet[BaseException] = weakref.WeakSet()

    def label(self, url: str) -> str:
        """The configured upstream ``url`` is under; ``scheme://host`` of an
        ``--allow-host`` URL (``other`` past :data:`MAX_HOSTS` of them)."""
        for base, label in self._bases:
            if url == base or url.startswith(base + "/") or url.startswith(base + "?"):
                return label
        try:
            parts = urlsplit(url)
            host = f"{parts.scheme}://{(parts.hostname or '')}" + (
                f":{parts.port}" if parts.port else ""
            )
        except ValueError:
            return "other"
        if host in self._records:
            return host
        hosts = len(self._records) - len(self._bases)
        return host if hosts < MAX_HOSTS else "other"

    def _record(self, url: str) -> _Upstream:
        label = self.label(url)
        rec = self._records.get(label)
        if rec is None:
            rec = self._records[label] = _Upstream(label)
        return rec

    def failed(self, url: str, exc: BaseException) -> str | None:
        """Count ``exc`` against the upstream of ``url`` when it is a failure of the
        upstream (once per exception); the reason, or None."""
        try:
            if exc in self._seen:
                return None
            self._seen.add(exc)
        except TypeError:  # an exception that cannot be weakly referenced
            pass
        reason = classify(exc)
        if reason is None:
            if isinstance(exc, _NOT_FAILURES):
                self.succeeded(url)  # an answer about the object: the upstream is there
            return None
        rec = self._record(url)
        rec.failures[reason] = rec.failures.get(reason, 0) + 1
        message = _message(exc, url, self.redacting)
        now = self.clock()
        rec.last_error = {"reason": reason, "message": message, "at": _iso(time.time())}
        rec.events += 1
        rec.error_event = rec.events
        if self.counter is not None:
            self.counter.labels(upstream=rec.label, reason=reason).inc()
        if now - rec.warned_at >= self.interval:
            more = (
                f" ({rec.unwarned} more failures in the last {now - rec.warned_at:.0f}s not logged)"
                if rec.unwarned
                else ""
            )
            log.warning("upstream %s failing: %s: %s%s", rec.label, reason, message, more)
            rec.warned_at, rec.unwarned = now, 0
        else:
            rec.unwarned += 1
        return reason

    def succeeded(self, url: str) -> None:
        """An answer from the upstream of ``url`` (the object, a 304, a 404...)."""
        rec = self._record(url)
        down = rec.state == "down"
        rec.last_ok = time.time()
        rec.events += 1
        rec.ok_event = rec.events
        if down:
            log.info("upstream %s answers again (last error: %s)", rec.label,
                     (rec.last_error or {}).get("reason"))  # fmt: skip
            rec.warned_at, rec.unwarned = float("-inf"), 0

    def snapshot(self) -> list[dict[str, Any]]:
        """The ``upstream_health`` list of /-/stats (shape in docs/deployment.md)."""
        return [r.snapshot() for r in self._records.values()]

    def down(self) -> list[dict[str, Any]]:
        """The snapshots of the upstreams whose last event was a failure."""
        return [s for s in self.snapshot() if s["state"] == "down"]

    def lines(self) -> str:
        """What /-/healthz and /-/readyz add: one line per upstream that is down."""
        out = []
        for s in self.down():
            e = s["last_error"] or {}
            n = sum(s["failures"].values())
            out.append(
                f"upstream {s['upstream']}: down since {e.get('at')} ({e.get('reason')}: "
                f"{e.get('message')}); {n} failures; hits are still served\n"
            )
        return "".join(out)


class WatchedFetcher(Fetcher):
    """The :class:`Fetcher` with every request's outcome reported to an
    :class:`UpstreamHealth`."""

    watch: UpstreamHealth | None = None

    def _failed(self, url: str, exc: BaseException) -> None:
        if self.watch is not None:
            self.watch.failed(url, exc)

    def _ok(self, url: str) -> None:
        if self.watch is not None:
            self.watch.succeeded(url)

    async def open(self, url: str, *args: Any, **kwargs: Any) -> Any:
        try:
            out = await super().open(url, *args, **kwargs)
        except BaseException as exc:
            self._failed(url, exc)
            raise
        self._ok(url)
        return out

    async def head(self, url: str, *args: Any, **kwargs: Any) -> Any:
        try:
            out = await super().head(url, *args, **kwargs)
        except BaseException as exc:
            self._failed(url, exc)
            raise
        self._ok(url)
        return out

    async def open_range(self, url: str, *args: Any, **kwargs: Any) -> Any:
        try:
            out = await super().open_range(url, *args, **kwargs)
        except BaseException as exc:
            self._failed(url, exc)
            raise
        self._ok(url)
        return out

    async def revalidate(self, url: str, *args: Any, **kwargs: Any) -> Any:
        try:
            out = await super().revalidate(url, *args, **kwargs)
        except BaseException as exc:
            self._failed(url, exc)
            raise
        self._ok(url)
        return out

    async def read_range(
        self, url: str, start: int, end: int | None, *, meta: ObjectMeta
    ) -> AsyncIterator[bytes]:
        """Bytes of a version read from the upstream beside its download (a range far
        ahead of it, the rest of a client's range once the store gave up): counted when
        the read fails, however far it got; an answer when it ends. Not counted: a read
        the upstream was never asked for (no validator to continue with) and a reader
        that stopped early."""
        if start and not can_resume(meta):
            async for chunk in super().read_range(url, start, end, meta=meta):
                yield chunk  # it raises before asking: nothing about the upstream
            return
        try:
            async for chunk in super().read_range(url, start, end, meta=meta):
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException as exc:
            self._failed(url, exc)
            raise
        self._ok(url)

    async def probe_end(self, url: str, meta: ObjectMeta, n: int) -> tuple[int | None, bytes]:
        """The ranged probe of a close-delimited body's end: a failure to answer
        (refused, reset, timed out, an error status, a cut) counts like any other. An
        upstream that answered but cannot confirm (no validator to pin the probe, Range
        ignored, another version) is no failure: it answered."""
        if not can_resume(meta):
            return await super().probe_end(url, meta, n)  # raises before asking
        try:
            out = await super().probe_end(url, meta, n)
        except BaseException as exc:
            reason = classify(exc)
            if reason is None or (reason == "other" and isinstance(exc, ProxyError)):
                if isinstance(exc, ProxyError):
                    self._ok(url)  # an answer, only not one that confirms
                raise
            self._failed(url, exc)
            raise
        self._ok(url)
        return out


class WatchedInflight(Inflight):
    """The :class:`Inflight` table with each download's end reported to an
    :class:`UpstreamHealth`: a failure after the body opened (cut past the retries,
    digest mismatch), or a success."""

    watch: UpstreamHealth | None = None  # (``health`` is the store's)

    def start(self, url: str, **kwargs: Any) -> Download:
        running = self.running(url)
        dl = super().start(url, **kwargs)
        if not running and dl.task is not None and self.watch is not None:
            watch = self.watch
            dl.task.add_done_callback(lambda task: _ended(watch, dl, task))
        return dl


def _ended(health: UpstreamHealth, dl: Download, task: asyncio.Task) -> None:
    if task.cancelled():
        return  # shutting down
    if dl.state is State.FAILED and dl.error is not None:
        health.failed(dl.url, dl.error)
    elif dl.state is State.DONE:
        health.succeeded(dl.url)


async def _resolve(host: str, port: int, timeout: float) -> str:
    """The first address of ``host``, looked up in a thread of its own: a resolver that
    hangs must hold neither the event loop nor, at exit, the default executor."""
    loop = asyncio.get_running_loop()
    found: asyncio.Future[str] = loop.create_future()

    def settle(address: str | None, exc: BaseException | None) -> None:
        if found.done():
            return
        if exc is not None:
            found.set_exception(exc)
        else:
            found.set_result(address or host)

    def work() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            result: tuple[str | None, BaseException | None] = (str(infos[0][4][0]), None)
        except OSError as exc:
            result = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=work, name="upstream probe resolver", daemon=True).start()
    return await asyncio.wait_for(found, timeout)


async def probe_upstreams(
    upstreams: Sequence[Any],
    health: UpstreamHealth,
    *,
    timeout: float,
    endpoints: dict[str, str | None] | None = None,
) -> None:
    """At startup: connect to each ``http(s)://`` upstream's host and port (and to the
    ``s3://``/``gs://``/``az://`` endpoint when one is configured), look for a
    ``file://`` upstream's directory; a WARNING (and a counted failure) for each that
    cannot be reached. Nothing is requested: the probe says whether the upstream can be
    reached, not whether an object is there."""

    async def one(u: Any) -> None:
        base = str(getattr(u, "base", u))
        scheme = base.partition("://")[0].lower()
        target = base
        if scheme in ("s3", "gs", "az"):
            target = (endpoints or {}).get(scheme) or ""
            if not target:
                return  # the provider's own endpoint: nothing local to check
            scheme = target.partition("://")[0].lower()
        if scheme == "file":
            path = urlsplit(base).path
            if not await asyncio.to_thread(os.path.isdir, path):
                exc = ProxyError(f"upstream {display(base)} unreachable: no directory {path}", 502)
                health.failed(base, exc)
            return
        if scheme not in ("http", "https"):
            return
        try:
            parts = urlsplit(target)
            host, port = parts.hostname or "", parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            return
        try:
            try:
                ip = await _resolve(host, port, timeout)
                _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
            except (OSError, asyncio.TimeoutError) as exc:
                raise ProxyError(
                    f"upstream {display(base)} cannot be reached at startup: "
                    f"{host}:{port}: {exc or type(exc).__name__}",
                    502,
                ) from exc
        except ProxyError as error:
            health.failed(base, error)
            return
        health.succeeded(base)
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass

    await asyncio.gather(*(one(u) for u in upstreams), return_exceptions=True)
