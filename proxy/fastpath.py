"""The fast path for hits: plain ``GET``/``HEAD`` hits on the public port answered by a
lean asyncio protocol with the httptools parser (the one uvicorn uses), in front of the
aiohttp application; every other request, and the rest of its connection, handed to the
application unchanged.

A connection starts here (:class:`FastConnection`). Each request head is parsed; one
that is certainly a plain hit is answered here with the answer the application gives
it (the entry's kept header block, ``Age``, ``Content-Length``, ``Date``, ``Server``,
``Connection``; the bytes from the RAM tier in one write or from the entry file with
``sendfile``), with the same side effects (the access recorded, the request metrics,
the access-log line). Which requests those are:

- HTTP/1.1, ``GET`` or ``HEAD``, no body, no upgrade, a ``Host`` field, each field
  once, a head of at most :data:`MAX_HEAD` bytes with no control bytes, bare CR/LF or
  folded lines, ``Connection`` absent, ``keep-alive`` or ``close``;
- no ``Range``, ``If-Range`` or conditional field, no read-plan field and no read plan
  registered (the plans count every request), not forwarded by another worker;
- a target in origin form for a data path (not ``/``, ``/-/...``, ``/metrics``, a
  directory, a dot segment, raw or percent-encoded) that the S3 front leaves to the
  proxy (:meth:`proxy.s3front.S3Front.proxys_own`) and that maps to an upstream URL
  off the uncached paths (:func:`proxy.passthrough.mapped`);
- no download of the object in this process; a committed entry the store finds, fresh
  and due no revalidation (:func:`proxy.shard.entry_state`), whose bytes
  :class:`proxy.answer._EntryBody` finds as it does for the application. (Credentials
  change nothing here: :func:`proxy.decide.decide` serves a found entry whatever they
  are; they matter to a miss, which is the application's.)

Anything else — a parse error, an oversized head, a field it does not know how to
treat — goes to the application: a fresh ``RequestHandler`` of the runner's server takes
the transport and every byte from the start of that request on, and the connection is
the application's from then on. A hand-over waits until the answer being sent (a
``sendfile``) has ended and the transport takes writes again.

What a target's first hit finds the whole way (the checks above, the mapped URL, the
entry, its answer head) is kept per (target, ``Host``) as a :class:`_Hit`, with the
identity token of the store's row it came from (:meth:`Access.row_token`): later hits on
the target answer from it while the row is that same object, and find it again once the
row changed (a new version, a 304, an eviction, the memo's bound). The entry file is
still checked on every hit, kept or not.

aiohttp's parser reads all it is given at once and answers only its 400 when anything
in it is malformed: when more than one request is held, they are parsed through before
any is answered, and an error anywhere hands them all over.

Pipelined requests are answered in order; none is started while a ``sendfile`` runs or
while the transport's buffer is above its high-water mark, and reading stops once
:data:`READ_LIMIT` unanswered bytes are held. An entry file that ends early aborts the
connection (never a clean short body). Idle connections close after
:data:`KEEPALIVE_SECONDS`, like the application's; at shutdown idle connections close at
once and a ``sendfile`` in flight is cut at the grace period's end like the
application's responses (its task is in ``Runtime.handlers``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from proxy.answer import _EntryBody, age_base
from proxy.context import (
    FORWARDED,
    HITS,
    INFLIGHT,
    METRICS,
    PLANS,
    RUNTIME,
    S3_FRONT,
    SETTINGS,
    STORE,
    abort_transport,
)
from proxy.decide import XCache
from proxy.hits import MAX_KEPT
from proxy.observe import log_access
from proxy.passthrough import mapped
from proxy.plans import PLAN_HEADER
from proxy.shard import entry_state, no_cache
from shardcache.compat import (
    PROBES,
    CompatError,
    attach_listener,
    date_function,
    serialize_headers,
)
from shardcache.errors import CacheError, ProxyError

__all__ = ["KEEPALIVE_SECONDS", "FastConnection", "FastHits", "FastSite", "unusable"]

log = logging.getLogger(__name__)

MAX_HEAD = 8190  # aiohttp's longest line: a head this long never trips its limits
MAX_FIELDS = 100  # aiohttp takes 128
READ_LIMIT = 256 << 10  # unanswered request bytes held before reading stops
KEEPALIVE_SECONDS = 75.0  # an idle connection is closed after this (the application's too)

# request fields that change what a hit's answer is (conditionals, Range), what the
# request is (a body, an upgrade, an expectation) or who counts it (a read plan, another
# worker): such a request goes to the application
_HANDED = frozenset(
    name.lower().encode()
    for name in (
        "Content-Length",
        "Transfer-Encoding",
        "Upgrade",
        "Expect",
        "Range",
        "If-Range",
        "If-Match",
        "If-None-Match",
        "If-Modified-Since",
        "If-Unmodified-Since",
        "Sec-WebSocket-Key1",
        PLAN_HEADER,
        FORWARDED,
    )
)
# what makes a head unusual: control bytes, a CR or LF alone, a folded line
_ODD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n|\n[ \t]")
# fields whose presence in a kept header block changes how the application frames the
# answer: such an entry's hits go to the application
_FRAMING = frozenset({"age", "content-length", "connection", "transfer-encoding"})
_SCRATCH = object()  # a parser with no callbacks: it only checks
_STATUS = "HTTP/1.1 200 OK"
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()
_CLOSE = b"Connection: close\r\n"
_HIT = str(XCache.HIT)


def _data_path(path: str) -> bool:
    """Whether ``path`` (no query) can only reach the data handler, however the
    application's router decodes it."""
    if path == "/" or path.endswith("/") or path.startswith("/-/") or path == "/metrics":
        return False
    if "/." in path:
        return False
    if "%" in path:
        return _data_path(unquote(path).replace("%", ""))
    return True


def unusable() -> str | None:
    """Why the fast path cannot run with the installed aiohttp, or None when it can."""
    try:
        PROBES[_PROBE]()
    except CompatError as exc:
        return str(exc)
    return None


_PROBE = "aiohttp answer heads and sites"


class _Block:
    """What a hit derives from an entry's stored description, made once with its kept
    header block: the answer head as bytes (the status line and the stored fields),
    whether the application adds its own ``Date`` and ``Server`` after them, whether
    the entry said ``no-cache``, and the base of its ``Age`` for the ``validated`` time
    it was computed for."""

    __slots__ = ("source", "head", "date", "server", "no_cache", "validated", "age")

    def __init__(self, source: Any, head: bytes, date: bool, server: bool, entry: Any) -> None:
        self.source = source
        self.head = head
        self.date = date
        self.server = server
        self.no_cache = no_cache(entry)
        self.validated = entry.validated
        self.age = age_base(entry)

    def age_base(self, entry: Any) -> float:
        if entry.validated != self.validated:  # validated again (a 304): its age anew
            self.validated = entry.validated
            self.age = age_base(entry)
        return self.age


class _Hit:
    """What a hit on one request target (with one ``Host``) is answered from, kept while
    the store's row of its entry is the same object (:meth:`Access.row_token`): the
    target's decisions (a data path the S3 front leaves to the proxy, its upstream URL
    off the uncached paths), the entry's key, file, size and whether the RAM tier takes
    it, and its answer head but for ``Age``, ``Date`` and ``Connection``. Nothing here
    vouches for the bytes: each hit still finds the entry file as it is on disk (a
    ``stat`` against the RAM copy's stamp, or an ``open`` and ``fstat``)."""

    __slots__ = (
        "raw",
        "url",
        "key",
        "path",
        "token",
        "size",
        "small",
        "head",
        "length",
        "date",
        "server",
        "age",
        "validated",
        "max_age",
        "now",
        "cost",
    )

    def __init__(
        self,
        hits: FastHits,
        raw: str,
        url: str,
        entry: Any,
        token: object | None,
        block: _Block,
        small: bool,
        revalidate: object,
        now: float,
    ) -> None:
        self.raw = raw
        self.url = url
        self.key = entry.key
        self.path = os.fspath(entry.path)
        self.token = token
        self.size = entry.size
        self.small = small
        self.head = block.head
        self.length = b"\r\nContent-Length: %d\r\n" % entry.size
        self.date = block.date
        self.server = block.server
        self.age = block.age_base(entry)
        self.validated = entry.validated
        # --revalidate AGE: due once this old (never: None; http: not kept)
        self.max_age = revalidate if isinstance(revalidate, (int, float)) else None
        self.now = now  # when it was found (the first hit's clock)
        self.cost = (
            HIT_OVERHEAD + len(self.head) + 2 * len(raw) + len(url) + len(self.key) + len(self.path)
        )


# bytes of memory a kept hit takes beyond its texts (the object, its dict slot and key
# tuple, the small objects it holds), for the bound
HIT_OVERHEAD = 480
KEPT_BYTES = 32 << 20  # what the kept hits of one process may take


class FastHits:
    """The fast path of one listening socket: its connections, and the application's
    parts it answers from. ``handler_factory`` makes the application's protocol for a
    connection handed over (``runner.server``)."""

    def __init__(self, app: web.Application, handler_factory: Callable[[], Any]) -> None:
        self.app = app
        self.handler_factory = handler_factory
        self.loop = asyncio.get_running_loop()
        self.settings = app[SETTINGS]
        self.store = app[STORE]
        self.tier = app[HITS]
        self.inflight = app[INFLIGHT]
        self.plans = app[PLANS]
        self.metrics = app[METRICS]
        self.runtime = app[RUNTIME]
        self.front: Any = app[S3_FRONT]
        self.date = date_function()  # aiohttp's Date value for now
        self.connections: set[FastConnection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.closing = False
        self._blocks: dict[str, _Block | None] = {}
        # (target, Host) -> what its hits are answered from, at most max_kept_bytes
        self.kept: dict[tuple[bytes, bytes], _Hit] = {}
        self.kept_bytes = 0
        self.max_kept_bytes = KEPT_BYTES
        # the metrics every hit counts in, resolved at the first hit (a series appears
        # once counted, as the application's)
        self.requests: Any = None
        self.served: Any = None
        self.ttfb: Any = None
        self.fast_count: Any = None

    def __call__(self) -> FastConnection:
        return FastConnection(self)

    def block(self, entry: Any, headers: Any) -> _Block | None:
        """What a hit derives from ``entry`` with its kept header block ``headers``;
        None for a block the application frames otherwise (or cannot send)."""
        key = entry.key
        item = self._blocks.get(key)
        if item is not None and item.source is headers:
            return item if item.head else None
        made: _Block | None = None
        if headers is not None and not any(k.lower() in _FRAMING for k in headers):
            try:
                head = serialize_headers(_STATUS, headers)[:-2]
            except ValueError:  # CR or LF in a field: the application's error to give
                head = b""
            if head:
                made = _Block(headers, head, "Date" not in headers, "Server" not in headers, entry)
        if item is None and len(self._blocks) >= MAX_KEPT:
            del self._blocks[next(iter(self._blocks))]
        self._blocks[key] = made if made is not None else _Block(headers, b"", False, False, entry)
        return made

    def resolve(self) -> None:
        """Resolve the metrics hits count in (before the first is counted)."""
        metrics = self.metrics
        self.requests = metrics.requests.labels(cache=_HIT, code="200")
        self.served = metrics.response_bytes.labels(cache=_HIT)
        self.ttfb = metrics.ttfb.labels(cache=_HIT)
        self.fast_count = metrics.fast_hits

    def keep(self, memo: tuple[bytes, bytes], hit: _Hit) -> None:
        """Keep ``hit`` for the next hits on ``memo`` (the oldest kept dropped first)."""
        self.forget(memo)
        if hit.cost > self.max_kept_bytes:
            return
        kept = self.kept
        while self.kept_bytes + hit.cost > self.max_kept_bytes and kept:
            self.kept_bytes -= kept.pop(next(iter(kept))).cost
        kept[memo] = hit
        self.kept_bytes += hit.cost

    def forget(self, memo: tuple[bytes, bytes]) -> None:
        old = self.kept.pop(memo, None)
        if old is not None:
            self.kept_bytes -= old.cost

    def pre_shutdown(self) -> None:
        """Stop answering: idle connections close now, the others once their answer
        is sent."""
        self.closing = True
        for conn in list(self.connections):
            conn.shut()

    async def drain(self) -> None:
        """Wait for the answers being sent (cut at the grace period's end)."""
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


class FastConnection(asyncio.Protocol):
    """One client connection while the fast path has it."""

    def __init__(self, hits: FastHits) -> None:
        self.hits = hits
        self.loop = hits.loop
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.remote: str | None = None
        self.buf = bytearray()
        self.fed = 0  # bytes of the current request head given to the parser
        self.parser = httptools.HttpRequestParser(self)
        self.busy = False  # an answer is being sent with sendfile
        self.write_paused = False
        self.read_paused = False
        self.close_after = False  # close once the answer being sent ends
        self.eof = False
        self.gone = False
        self.idle_since = self.loop.time()
        self.keepalive: asyncio.TimerHandle | None = None
        self.checked = True  # the bytes held have been parsed through (see _process)
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.fields: dict[bytes, bytes] = {}
        self.odd = False
        self.done = False

    # -- the parser's callbacks

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key in self.fields or key in _HANDED or len(self.fields) >= MAX_FIELDS:
            self.odd = True
        self.fields[key] = value

    def on_message_complete(self) -> None:
        self.done = True

    # -- the transport's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: Any = transport
        sock = tr.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # as the application's protocol does
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        self.transport = tr
        # the socket's descriptor for writev (None on a transport without one)
        self.fd = sock.fileno() if sock is not None else -1
        peer = tr.get_extra_info("peername")
        if isinstance(peer, (list, tuple)):
            self.remote = str(peer[0])
        elif peer is not None:
            self.remote = str(peer)
        self.hits.connections.add(self)
        self.keepalive = self.loop.call_at(self.idle_since + KEEPALIVE_SECONDS, self._idle)
        if self.hits.closing:
            tr.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.hits.connections.discard(self)
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._process()

    def eof_received(self) -> bool | None:
        if self.busy:
            self.eof = True  # closed once the answer being sent ends
            return True
        return None  # the transport closes, as it does for the application

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.checked = False
        if self.busy or self.write_paused:
            if len(self.buf) > READ_LIMIT and not self.read_paused and self.transport:
                self.read_paused = True
                self.transport.pause_reading()
            return
        self._process()

    # -- requests

    def _process(self) -> None:
        buf = self.buf
        while not (self.busy or self.write_paused or self.gone):
            if self.close_after or self.eof or self.hits.closing:
                self._close()
                return
            if not buf:
                break
            end = buf.find(b"\r\n\r\n")
            if not self.checked and 0 <= end < len(buf) - 4:
                # more than one request's head held: the application's parser reads all
                # it is given at once, and a parse error anywhere in it (a malformed
                # request, bytes after a `close`) is its one answer, for the requests
                # before the error too; so the bytes held are parsed through first, and
                # any such error is the application's (one head alone, or part of one,
                # is checked as it is fed below)
                try:
                    httptools.HttpRequestParser(_SCRATCH).feed_data(bytes(buf))
                except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                    self._hand_over()
                    return
                self.checked = True
            if end < 0:
                # an incomplete head: what came so far goes to the parser, so that an
                # error the application answers at once is found now
                if len(buf) > MAX_HEAD or _ODD.search(buf) or not self._feed(len(buf)):
                    self._hand_over()
                elif self.done:
                    self._hand_over()
                return
            end += 4
            if end > MAX_HEAD or _ODD.search(buf, 0, end) or not self._feed(end):
                self._hand_over()
                return
            if not (self.done and self._answer(end)):
                self._hand_over()
                return
        if self.read_paused and not (self.busy or self.write_paused) and self.transport:
            if len(self.buf) < READ_LIMIT:
                self.read_paused = False
                self.transport.resume_reading()

    def _feed(self, end: int) -> bool:
        """Give the parser the head's bytes up to ``end``; False on a parse error (or a
        protocol switch)."""
        if end > self.fed:
            try:
                self.parser.feed_data(bytes(self.buf[self.fed : end]))
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                return False
            self.fed = end
        return True

    def _answer(self, end: int) -> bool:
        """Answer the parsed request whose head ends at ``end`` if it is a plain hit;
        False (nothing done) when it is not, for the application to answer."""
        start = time.monotonic()
        hits = self.hits
        fields = self.fields
        parser = self.parser
        if self.odd or parser.get_http_version() != "1.1":
            return False
        method = parser.get_method()
        if method != b"GET" and method != b"HEAD":
            return False
        host = fields.get(b"host")
        if host is None:
            return False
        close = False
        conn = fields.get(b"connection")
        if conn is not None:
            conn = conn.strip().lower()
            if conn == b"close":
                # bytes after it are the parser's error to answer (aiohttp's 400)
                if len(self.buf) > end:
                    return False
                close = True
            elif conn != b"keep-alive":
                return False
        if len(hits.plans):
            return False  # every request counts in the plans' progress: the application's
        target = self.url
        memo = (target, host)
        hit = hits.kept.get(memo)
        if hit is not None and hits.store.row_token(hit.key) is not hit.token:
            hits.forget(memo)  # the entry changed, went or was dropped from memory
            hit = None
        if hit is None:
            hit = self._look(target, host)
            if hit is None:
                return False
            if hit.token is not None:
                hits.keep(memo, hit)
            now = hit.now
        else:
            now = time.time()
            if hit.max_age is not None and now - hit.validated >= hit.max_age:
                return False  # revalidation due: the application asks the upstream
        if hits.inflight.get(hit.url) is not None:
            return False
        key = hit.key
        size = hit.size
        data = fobj = None
        if hit.small:
            data = hits.tier.small_key(key, size)
            if data is None:
                data = hits.tier.read(key, hit.path, size)
            found = data is not None
        else:
            if not hits.runtime.sendfile:
                return False
            fobj = hits.tier.open_key(key, hit.path, size)
            found = fobj is not None
        if not found:
            hits.forget(memo)
            return False  # gone or replaced: the application forgets it, looks again
        hits.store.touch_key(key, now)
        if hits.requests is None:
            hits.resolve()
        # answered here from now on
        del self.buf[:end]
        self.fed = 0
        self._reset()
        parts = [
            hit.head,
            b"Age: ",
            str(int(hit.age + max(0.0, now - hit.validated))).encode(),
            hit.length,
        ]
        if hit.date:
            parts += (b"Date: ", hits.date().encode(), b"\r\n")
        if hit.server:
            parts.append(_SERVER)
        if close:
            parts.append(_CLOSE)
            self.close_after = True
        parts.append(b"\r\n")
        head = b"".join(parts)
        transport = self.transport
        assert transport is not None
        raw = hit.raw
        if method == b"GET":
            verb = "GET"
        else:
            verb, data = "HEAD", b"" if data is not None else None
        if data is not None:
            self._write(transport, head, data)
            done = time.monotonic()
            hits.ttfb.observe(done - start)
            self._account(verb, raw, len(data), start, "", done)
            self.idle_since = done
            return True
        assert fobj is not None
        transport.write(head)
        if verb == "HEAD" or size == 0:
            fobj.close()
            done = time.monotonic()
            self._account(verb, raw, 0, start, "", done)
            self.idle_since = done
            return True
        hits.ttfb.observe(time.monotonic() - start)
        sent = self._sendfile_now(transport, fobj, size)
        if sent == size:
            fobj.close()
            done = time.monotonic()
            self._account(verb, raw, size, start, "", done)
            self.idle_since = done
            return True
        self.busy = True
        task = self.loop.create_task(self._send(fobj, verb, raw, size, start, sent))
        hits.tasks.add(task)
        hits.runtime.handlers.add(task)  # cut off if still sending when the grace period ends
        task.add_done_callback(self._sent)
        return True

    def _look(self, target: bytes, host: bytes) -> _Hit | None:
        """What a hit on ``target`` with ``host`` is answered from, found the whole way
        (the target mapped, the entry looked up, its header block derived, its state
        decided); None when the request is not a plain hit."""
        hits = self.hits
        if target[:1] != b"/" or not target.isascii() or b"#" in target:
            return None
        raw = target.decode("ascii")
        if not _data_path(raw.partition("?")[0]):
            return None
        if not hits.front.proxys_own(raw, host.decode("utf-8", "surrogateescape")):
            return None
        try:
            url, uncached = mapped(raw, hits.settings)
        except ProxyError:
            return None
        if uncached:
            return None
        store = hits.store
        try:
            # the row the entry comes from, taken first: what is derived here is kept
            # while the row is that same object (a row that changes under the lookup
            # makes it no longer the same: derived again on the next hit)
            key = store.key(url)
            token = store.row_token(key)
            entry = store.lookup(url, key)
        except CacheError:
            return None
        if entry is None:
            return None
        body = _EntryBody(hits.tier, entry)
        block = hits.block(entry, body.headers)
        if block is None:
            return None
        now = time.time()
        revalidate = hits.settings.revalidate
        due, fresh, _ = entry_state(revalidate, entry, now, block.no_cache)
        if due or not fresh:
            return None
        if isinstance(revalidate, str):
            token = None  # freshness by the upstream's fields: decided anew on each hit
        return _Hit(
            hits, raw, url, entry, token, block, hits.tier.cacheable(entry), revalidate, now
        )

    def _write(self, transport: asyncio.Transport, head: bytes, data: bytes) -> None:
        """Write ``head`` then ``data``: with one ``writev`` on the socket when nothing
        is waiting in the transport's buffer (as its own ``write`` would send at once),
        without joining them (a copy of the body); what the socket does not take goes
        to the transport."""
        fd = self.fd
        if fd < 0 or not data or transport.is_closing() or transport.get_write_buffer_size():
            transport.write(head + data if data else head)
            return
        try:
            sent = os.writev(fd, (head, data))
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the transport's own write meets it and closes as it does
            transport.write(head + data)
            return
        if sent < len(head):
            transport.write(head[sent:] + data)
        elif sent < len(head) + len(data):
            transport.write(memoryview(data)[sent - len(head) :])

    def _sendfile_now(self, transport: asyncio.Transport, fobj: Any, size: int) -> int:
        """Send what the socket takes of the entry file now, with one ``sendfile`` (as
        nginx does): most answers go out whole, without a task, an await and the loop's
        writer registered and removed. Nothing when the transport still holds bytes to
        send (they go first); the bytes sent, the rest for :meth:`_send` (which finds a
        file that ended early, or an error, again)."""
        fd = self.fd
        if fd < 0 or transport.is_closing() or transport.get_write_buffer_size():
            return 0
        try:
            return os.sendfile(fd, fobj.fileno(), 0, size)
        except OSError:  # would block, or an error the loop's sendfile meets as well
            return 0

    async def _send(
        self, fobj: Any, verb: str, raw: str, size: int, start: float, sent: int = 0
    ) -> None:
        """Send the entry file's bytes from ``sent`` on with sendfile; a file that ends
        early (or a cut at shutdown) aborts the connection."""
        transport = self.transport
        assert transport is not None
        nbytes, note = sent, ""
        try:
            cut = None
            try:
                nbytes += await self.loop.sendfile(
                    transport, fobj, sent, size - sent, fallback=False
                )
            except RuntimeError as exc:
                if transport.is_closing():
                    note = " client-gone"
                else:  # no sendfile after all: the head is out, so no clean end
                    cut = f"cannot send the entry file: {exc}"
            else:
                if nbytes < size:
                    cut = f"entry file ended at byte {nbytes}"
            if cut is not None:
                log.warning("aborting %s %s: %s", verb, raw, cut)
                abort_transport(transport)
                note = " aborted"
        except ConnectionError:
            note = " client-gone"
        except asyncio.CancelledError:
            note = " cut-off"  # at shutdown: a body begun must not seem to end at the close
            abort_transport(transport)
            raise
        finally:
            fobj.close()
            self._account(verb, raw, nbytes, start, note, time.monotonic())
            if note:
                self.gone = True
                if not transport.is_closing():
                    abort_transport(transport)

    def _sent(self, task: asyncio.Task) -> None:
        self.hits.tasks.discard(task)
        self.hits.runtime.handlers.discard(task)
        self.busy = False
        if not task.cancelled():
            task.exception()  # retrieved: its account is in the log already
        self._ended()

    def _account(
        self, verb: str, raw: str, nbytes: int, start: float, note: str, done: float
    ) -> None:
        """The request's metrics and access-log line, as the application's middleware
        makes them (:mod:`proxy.observe`); ``done``: when it ended (monotonic)."""
        hits = self.hits
        hits.requests.inc()
        if nbytes:
            hits.served.inc(nbytes)
        hits.fast_count.inc()
        log_access(logging.INFO, self.remote, verb, raw, 200, _HIT, nbytes, done - start, note)

    def _ended(self) -> None:
        """An answer was sent: close when asked to, else go on with what came since."""
        self.idle_since = self.loop.time()
        if not self.gone:
            self._process()

    def _close(self) -> None:
        self.gone = True
        if self.transport is not None:
            self.transport.close()

    def shut(self) -> None:
        """At shutdown: close now when idle, else once the answer being sent ends."""
        if self.busy:
            self.close_after = True
        else:
            self._close()

    def _idle(self) -> None:
        self.keepalive = None
        if self.gone:
            return
        due = self.idle_since + KEEPALIVE_SECONDS
        if not self.busy and self.loop.time() >= due:
            self._close()
            return
        when = max(due, self.loop.time() + 1.0)
        self.keepalive = self.loop.call_at(when, self._idle)

    def _hand_over(self) -> None:
        """Give the connection, with every byte from the start of the current request
        on, to the application."""
        transport = self.transport
        if transport is None or self.gone:
            return
        if self.hits.closing:
            self._close()
            return
        self.gone = True  # this protocol's part is over
        self.hits.connections.discard(self)
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None
        handler = self.hits.handler_factory()
        handler.connection_made(transport)
        transport.set_protocol(handler)
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        data = bytes(self.buf)
        self.buf.clear()
        if data:
            handler.data_received(data)


class FastSite(web.BaseSite):
    """A TCP site whose connections start on the fast path (``fast``); with TLS the
    application's own site serves (see :func:`proxy.server.run_server`)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        fast: FastHits,
        host: str,
        port: int,
        *,
        backlog: int = 128,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self.fast = fast
        self.host = host
        self.port = port
        self.listen_backlog = backlog
        self.reuse_port = reuse_port

    @property
    def name(self) -> str:
        return f"http://{self.host or '0.0.0.0'}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = await asyncio.get_running_loop().create_server(
            self.fast,
            self.host,
            self.port,
            backlog=self.listen_backlog,
            reuse_port=self.reuse_port,
        )
        attach_listener(self, server)
        if server.sockets:
            self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await super().stop()
        self.fast.pre_shutdown()
