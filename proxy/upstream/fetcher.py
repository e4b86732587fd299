"""The upstream layer's face: :class:`Fetcher` turns "bytes X..Y of object U, of this
version" into a body stream, for every backend.

Backends (one :class:`~proxy.upstream.transport.Transport` each): ``http(s)://`` in
worker threads (:mod:`.threaded`) or on the event loop (:mod:`.aio`), ``file://``
(:mod:`.file`), ``s3://`` (:mod:`.s3`), ``gs://`` and ``az://`` (:mod:`.cloud`); large
objects optionally in parallel ranged parts (:mod:`.parts`). Verification and resuming are the same for all (:mod:`.stream`,
:mod:`.resume`); so are the errors (:mod:`.errors`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from proxy.credentials import Credentials
from proxy.policy import parse_range
from proxy.upstream.aio import AioTransport
from proxy.upstream.answers import RangeAnswer, Revalidation, _passable
from proxy.upstream.cloud import CloudTransport, CloudUpstream
from proxy.upstream.errors import (
    REDIRECTS,
    UpstreamRedirect,
    status_error,
)
from proxy.upstream.file import FileTransport
from proxy.upstream.options import DEFAULT_OPTIONS as DEFAULTS
from proxy.upstream.parts import PartsOrder, can_fetch_in_parts, parts_pump, parts_stream
from proxy.upstream.redirects import RedirectingTransport, RedirectPolicy, Target
from proxy.upstream.resume import can_resume, check_framing
from proxy.upstream.s3 import S3Transport, S3Upstream
from proxy.upstream.stream import Policy, UpstreamBody, ask, read, retrying
from proxy.upstream.threaded import ThreadTransport, threadable
from proxy.upstream.transport import Response, Transport, pump_chunks
from shardcache.digests import content_md5, declared_digests
from shardcache.errors import (
    NotFound,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)
from shardcache.meta import ObjectMeta, origin_headers, parse_content_range

__all__ = ["Fetcher", "RangeAnswer", "Revalidation", "origin_of"]

log = logging.getLogger(__name__)

Observer = Callable[[str], None]

PROC_FD = os.path.isdir("/proc/self/fd")  # parts written at their offsets need it


def _noop(outcome: str) -> None:
    pass


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of ``url``, lowercased: the origin its bytes come from."""
    parts = urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


class Fetcher:
    """Opens upstream URLs. Create inside a running loop; :meth:`close` when done."""

    def __init__(
        self,
        *,
        connect_timeout: float = DEFAULTS.connect_timeout,
        read_timeout: float = DEFAULTS.read_timeout,
        retries: int = DEFAULTS.retries,
        retry_backoff: float = DEFAULTS.retry_backoff,
        chunk_size: int = DEFAULTS.chunk_size,
        observe: Observer = _noop,
        on_bytes: Callable[[int], None] | None = None,
        part_size: int = DEFAULTS.part_size,
        parallel: int = DEFAULTS.parallel,
        http_parts: bool = DEFAULTS.http_parts,
        s3: S3Upstream | None = None,
        cloud: CloudUpstream | None = None,
        threaded: bool = DEFAULTS.http_transport == "threads",
        redirects: RedirectPolicy | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.observe = observe
        self.policy = Policy(retries, retry_backoff, observe, on_bytes)
        # Parallel ranged parts: for s3://, gs://, az:// always, for http(s) only with http_parts (one
        # stream keeps upstream bytes at 1x the shard; parts pay where an origin limits
        # each connection). part_size 0 or parallel 1: one stream per object.
        self.part_size = part_size
        self.parallel = parallel
        self.http_parts = http_parts
        self.threaded = threaded
        self._aio = AioTransport(
            connect_timeout=connect_timeout, read_timeout=read_timeout, chunk_size=chunk_size
        )
        self._threads = ThreadTransport(connect_timeout=connect_timeout, read_timeout=read_timeout)
        self._file = FileTransport(read_timeout=read_timeout, chunk_size=chunk_size)
        self._s3 = (
            S3Transport(s3, threads=self._threads if threaded else None) if s3 is not None else None
        )
        self._cloud = (
            CloudTransport(cloud, threads=self._threads if threaded else None)
            if cloud is not None
            else None
        )
        self.redirects = redirects if redirects is not None else RedirectPolicy()
        self.credentials = credentials if credentials is not None else Credentials()
        self._targets: OrderedDict[str, Target] = OrderedDict()
        # http(s) origins (scheme://host) that answered a first part in a way parts
        # cannot build on: a reader's urgent download goes there in one stream
        self._no_parts: set[str] = set()

    async def close(self) -> None:
        """Close the upstream connection pools."""
        for t in (self._aio, self._threads, self._file, self._s3, self._cloud):
            if t is not None:
                await t.close()

    # -- routing ---------------------------------------------------------------------------

    def in_parts(self, url: str) -> bool:
        """Whether a large object at ``url`` is downloaded in parallel ranged parts."""
        return self._parts_for(urlsplit(url).scheme.lower())

    def _parts_for(self, scheme: str, urgent: bool = False) -> bool:
        wanted = scheme in ("s3", "gs", "az") or (
            scheme in ("http", "https") and (self.http_parts or urgent)
        )
        return wanted and self.parallel > 1 and self.part_size > 0

    def _urgent_parts(self, url: str) -> bool:
        """Whether an object a reader waits for now may come in parts although
        ``http_parts`` is off: an http(s) origin not yet seen to refuse them (no ranges,
        no strong ETag). One that did is asked with plain GETs from then on, so the
        bytes of a part request it cannot serve are lost at most once."""
        origin = origin_of(url)
        return origin.startswith(("http://", "https://")) and origin not in self._no_parts

    def _refused_parts(self, url: str) -> None:
        if len(self._no_parts) < 10_000:
            self._no_parts.add(origin_of(url))

    def transport(self, url: str, *, stream: bool = False) -> Transport:
        """The transport for ``url``; ``stream``: for one whole-object stream (the
        threaded transport when allowed), else for short or parallel requests."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "file":
            return self._file
        if scheme in ("http", "https"):

            def pick(hop: str) -> Transport:
                return self._threads if stream and self.threaded and threadable(hop) else self._aio

            try:
                creds = self.credentials.headers_for(url) if self.credentials else None
            except ValueError as exc:  # names the source (variable, file), never a value
                raise UpstreamError(f"credentials for {url} cannot be read: {exc}") from None
            return RedirectingTransport(pick, self.redirects, self._targets, creds)
        if scheme == "s3":
            if self._s3 is None:
                raise UpstreamError(f"{url}: no S3 client configured for s3:// upstreams")
            return self._s3
        if scheme in ("gs", "az"):
            if self._cloud is None:
                raise UpstreamError(f"{url}: no client configured for {scheme}:// upstreams")
            return self._cloud
        raise UpstreamError(f"{url}: unsupported upstream scheme {scheme!r}")

    async def _request(
        self, method: str, url: str, headers: dict[str, str], ok: tuple[int, ...], *, stream: bool
    ) -> Response:
        """One request, retried while throttled; an answer outside ``ok`` raises
        (redirects are followed by the transport; one it could not follow, e.g. of a
        method other than GET and HEAD, as UpstreamRedirect). Counted in ``observe``."""
        transport = self.transport(url, stream=stream)

        async def once() -> Response:
            resp = await transport.request(method, url, headers)
            if resp.status in ok:
                return resp
            location = resp.headers.get("Location")
            if resp.status in REDIRECTS and location:
                resp.close()
                raise UpstreamRedirect(url, resp.status, location)
            answer = await _passable(resp, method)
            resp.close()
            raise status_error(url, resp.status, resp.reason, answer)

        try:
            resp = await retrying(once, url, self.policy)
        except UpstreamRedirect:
            self.observe("ok")
            raise
        except NotFound:
            self.observe("not_found")
            raise
        except UpstreamTimeout:
            self.observe("timeout")
            raise
        except ProxyError:
            self.observe("error")
            raise
        self.observe("not_modified" if resp.status == 304 else "ok")
        return resp

    # -- whole objects ---------------------------------------------------------------------

    async def open(
        self,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        at: int | None = None,
        urgent: bool = False,
        one_stream: bool = False,
    ) -> UpstreamBody:
        """Request ``url`` and return once its headers are in. Raises ProxyError.
        ``headers``: the end-to-end fields of the client that asked (see
        :func:`proxy.policy.forwarded_fields`), sent with the first request.

        Fetched in parts (``s3://``, and ``http(s)://`` with ``http_parts``), the first
        request asks for part 0 only (``Range: bytes=0-…``): a plain GET closed after its
        first part would leave the rest of the object in flight, sent by the origin (and
        billed) but never used. Its 206 tells the size and version the other parts are
        pinned to, and the digests that are about the whole object (an S3 ETag,
        x-goog-hash). S3 sends its full-object checksums only on whole-object answers:
        for ``s3://`` a HEAD asks for them beside the first part (no added latency).
        ``at``: a byte a reader waits for (a cold Range): the first request asks for the
        part holding it instead, so that range is answered first; RangeNotSatisfiable
        (with the size) when the object ends before it.
        ``urgent``: a reader waits for this object now (a read plan's next shard): an
        ``http(s)://`` object comes in parts too when ``http_parts`` is off, if its origin
        serves ranges pinned by a strong ETag (up to ``parallel`` requests, the bytes
        once). A reader held up by one connection's rate gets the origin's.
        ``one_stream``: an ``http(s)://`` object in one stream even with ``http_parts``
        (a background download beside an urgent one leaves it the connections).
        """
        scheme = urlsplit(url).scheme.lower()
        extra = dict(headers or {})
        urgent = urgent and not self.http_parts and self._urgent_parts(url)
        one_stream = one_stream and scheme in ("http", "https")
        if self._parts_for(scheme, urgent) and not one_stream:
            index = at // self.part_size if at is not None and at > 0 else 0
            head = asyncio.ensure_future(self._head_digests(url)) if scheme == "s3" else None
            try:
                try:
                    body = await self._open_first_part(url, extra, index, urgent)
                except (NotFound, RangeNotSatisfiable, UpstreamThrottled):
                    raise
                except ProxyError as exc:
                    if not urgent or exc.answer is None:
                        raise  # no answer (unreachable, timed out): not about ranges
                    # parts were this proxy's choice, not asked for: an origin that
                    # answers a ranged GET with an error is asked the plain way, now and
                    # from now on
                    log.info("%s: a first part failed (%s); one stream from now on", url, exc)
                    self._refused_parts(url)
                    body = index = None
                if body is None and index:
                    body = await self._open_first_part(url, extra, 0, urgent)
            except BaseException:
                if head is not None:
                    head.cancel()
                raise
            if head is not None:
                try:
                    etag, declared = await head
                except BaseException:  # cancelled: the opened body must not leak
                    if body is not None:
                        body.close()
                    raise
                if body is not None and declared and etag == body.meta.etag:
                    merged = body.meta.digests + tuple(
                        d for d in declared if d not in body.meta.digests
                    )
                    body.meta = replace(body.meta, digests=merged)
            if body is not None:
                return body
        resp = await self._request("GET", url, extra, (200,), stream=True)
        meta = ObjectMeta.from_headers(resp.headers, 200)
        return self._body(url, resp, meta, in_parts=not one_stream)

    async def _head_digests(self, url: str) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        """The ETag of ``url`` and the whole-object digests a HEAD declares; nothing when
        it fails (the download goes on with what its GET declared)."""
        try:
            resp = await self.transport(url).request("HEAD", url, {})
            resp.close()
        except Exception as exc:  # never fails the download
            log.debug("HEAD %s for its checksums failed: %s", url, exc)
            return None, ()
        if resp.status != 200:
            return None, ()
        return resp.headers.get("ETag"), declared_digests(resp.headers, 200, s3=True)

    async def _open_first_part(
        self, url: str, extra: dict[str, str], index: int = 0, urgent: bool = False
    ) -> UpstreamBody | None:
        """``url`` opened with a ranged GET of its part ``index`` (0: its first), or
        None when a plain GET (or part 0) must follow (an empty object, or an answer the
        parts cannot build on)."""
        first_byte = index * self.part_size
        header = f"bytes={first_byte}-{first_byte + self.part_size - 1}"
        resp = await self._request(
            "GET", url, {**extra, "Range": header}, (200, 206, 416), stream=True
        )
        if resp.status == 416 and index:
            resp.close()
            try:
                _, _, total = parse_content_range(
                    (resp.headers.get("Content-Range") or "").replace("*", "0-0", 1)
                )
            except ValueError:
                total = None
            if total is None or total > first_byte:
                return None  # no size told, or a sloppy 416: from part 0
            raise RangeNotSatisfiable(f"{url}: {total} bytes, none at {first_byte}", size=total)
        if resp.status == 200:
            # Range ignored (whatever Accept-Ranges claims): the whole object in one
            # stream, no part asked of an origin that answers every range with all of it
            meta = replace(ObjectMeta.from_headers(resp.headers, 200), accept_ranges=False)
            if urgent:
                self._refused_parts(url)
            return self._body(url, resp, meta)
        usable = False
        meta = ObjectMeta(size=None)
        framed = True
        if resp.status == 206:
            try:
                check_framing(url, 206, resp.headers)
            except UpstreamError as exc:
                log.warning("%s", exc)
                framed = False
        if resp.status == 206 and framed:
            meta = ObjectMeta.from_headers(resp.headers, 206)
            try:
                first, last, total = parse_content_range(resp.headers.get("Content-Range"))
            except ValueError:
                first, last, total = -1, -1, None
            if total is not None and first == first_byte:
                meta = replace(meta, accept_ranges=True)
                whole = not index and last + 1 == total  # no larger than one part
                usable = whole or can_fetch_in_parts(meta, self.part_size)
        if not usable:
            # 416 (an empty object), or a 206 the parts cannot be pinned to (no strong
            # ETag, no total, framing that disagrees with itself): the object again
            # with a plain GET
            log.debug("upstream %s answered %s to %s: plain GET", url, resp.status, header)
            resp.close()
            if urgent and resp.status != 416:
                self._refused_parts(url)
            return None
        return self._body(url, resp, meta, index, urgent)

    def _body(
        self,
        url: str,
        resp: Response,
        meta: ObjectMeta,
        index: int = 0,
        urgent: bool = False,
        *,
        in_parts: bool = True,
    ) -> UpstreamBody:
        """The body of ``resp``, an open answer from byte 0 of version ``meta`` (or of
        its part ``index``): in parallel parts when they are wanted and possible (and
        ``in_parts``), else one resumable stream."""
        encoding = resp.headers.get("Content-Encoding")
        if encoding and encoding.lower() != "identity":
            # bytes are stored exactly as sent; a compressed representation is not a shard
            log.warning("upstream %s sent Content-Encoding %s", url, encoding)
        scheme = urlsplit(url).scheme.lower()
        meta, prefix_md5 = self._declared(scheme, resp, meta)
        transport = self.transport(url, stream=True)
        if (
            in_parts
            and self._parts_for(scheme, urgent)
            and can_fetch_in_parts(meta, self.part_size)
        ):
            order = PartsOrder()

            def parts(sink: Any) -> Any:
                kw = {"part_size": self.part_size, "parallel": self.parallel}
                if sink is not None and PROC_FD:
                    # straight into the file at each part's offset, nothing in memory
                    # (a hasher follows the contiguous prefix, read back from the page cache)
                    return parts_pump(
                        transport,
                        url,
                        meta,
                        sink[0],
                        policy=self.policy,
                        initial=resp,
                        initial_index=index,
                        order=order,
                        hasher=sink[1],
                        **kw,
                    )
                first = resp
                if index:
                    resp.close()  # in order through memory: part 0 is asked first
                    first = None
                chunks = parts_stream(transport, url, meta, policy=self.policy, initial=first, **kw)
                return chunks if sink is None else pump_chunks(chunks, *sink)

            body = UpstreamBody(url, meta, parts, resp.close, prefix_md5=prefix_md5)
            body.order = order
            return body

        def whole(sink: Any) -> Any:
            return read(transport, url, meta, 0, None, self.policy, first=resp, sink=sink)

        return UpstreamBody(url, meta, whole, resp.close, prefix_md5=prefix_md5)

    @staticmethod
    def _declared(
        scheme: str, resp: Response, meta: ObjectMeta
    ) -> tuple[ObjectMeta, tuple[int, str] | None]:
        """``meta`` with the whole-object digests ``resp`` declares, and the Content-MD5
        of a 206 from byte 0 (the part's digest or the object's: see
        :class:`~shardcache.digests.Digester`)."""
        declared = declared_digests(resp.headers, resp.status, s3=scheme == "s3")
        prefix_md5 = None
        if resp.status == 206:
            value = content_md5(resp.headers)
            if value is not None and ("md5", value) not in declared:
                first, last, _ = parse_content_range(resp.headers.get("Content-Range"))
                if first == 0:
                    prefix_md5 = (last + 1, value)
        if declared:
            meta = replace(meta, digests=declared)
        return meta, prefix_md5

    async def head(self, url: str, headers: Mapping[str, str] | None = None) -> ObjectMeta:
        """The object's size, validators and type from a HEAD, without its body."""
        resp = await self._request("HEAD", url, dict(headers or {}), (200,), stream=False)
        resp.close()
        return ObjectMeta.from_headers(resp.headers, 200)

    # -- ranges ----------------------------------------------------------------------------

    async def read_range(self, url: str, start: int, end: int | None, *, meta: ObjectMeta) -> Any:
        """Bytes ``[start, end)`` (to the end when ``end`` is None) of version ``meta``,
        verified before a byte is yielded and resumed like any body. Without a strong ETag
        or a Last-Modified only a read from byte 0 can be answered. Raises ProxyError
        (ObjectChanged when the object changed) or IncompleteDownloadError."""
        if start and not can_resume(meta):
            raise UpstreamError(
                f"upstream {url}: no validator (strong ETag or Last-Modified) to continue "
                f"at byte {start} with the same version"
            )
        transport = self.transport(url)
        async for chunk in read(transport, url, meta, start, end, self.policy):
            yield chunk

    async def open_range(self, url: str, header: str) -> RangeAnswer:
        """Answer a client's single-range ``Range`` header straight from the upstream
        (for an object not cached): the upstream's ranged answer, checked against what
        the header asks of the size it reports. RangeNotSatisfiable (with ``size``) when
        the range lies outside the object."""
        resp = await self._request("GET", url, {"Range": header}, (200, 206, 416), stream=False)
        try:
            if resp.status == 416:
                try:
                    _, _, total = parse_content_range(
                        (resp.headers.get("Content-Range") or "").replace("*", "0-0", 1)
                    )
                except ValueError:
                    total = None
                if total is None:
                    total = (await self.head(url)).size
                raise RangeNotSatisfiable(
                    f"range {header!r} not satisfiable for {total} bytes", size=total
                )
            check_framing(url, resp.status, resp.headers)
            meta = ObjectMeta.from_headers(resp.headers, resp.status)
            if meta.size is None:
                raise UpstreamError(f"upstream {url}: answered a range without the object's size")
            try:
                wanted = parse_range(header, meta.size)
            except RangeNotSatisfiable as exc:  # an origin answering 200 to what it cannot serve
                raise RangeNotSatisfiable(str(exc), size=meta.size) from None
            if wanted is None:
                raise UpstreamError(f"upstream {url}: {header!r} is not a single byte range")
            if resp.status == 200:
                brange = None
                start, end = 0, meta.size
            else:
                try:
                    first, last, _ = parse_content_range(resp.headers.get("Content-Range"))
                except ValueError as exc:
                    raise UpstreamError(f"upstream {url}: {exc}") from None
                if (first, last) != (wanted.start, wanted.end):
                    raise UpstreamError(
                        f"upstream {url}: asked {header!r}, got bytes {first}-{last}"
                    )
                brange, start, end = wanted, wanted.start, wanted.end + 1
        except BaseException:
            resp.close()
            raise
        transport = self.transport(url)

        def body(sink: Any) -> Any:
            return read(transport, url, meta, start, end, self.policy, first=resp, sink=sink)

        return RangeAnswer(meta, brange, wanted, UpstreamBody(url, meta, body, resp.close))

    async def probe_end(self, url: str, meta: ObjectMeta, n: int) -> tuple[int | None, bytes]:
        """Ask for byte ``n - 1`` of version ``meta`` (pinned by its strong ETag or
        Last-Modified): the object's total size as that version's 206 states it, and the
        byte. Confirms where a close-delimited body of ``n`` bytes ended. Raises
        ProxyError when the upstream cannot say (no validator, Range ignored, another
        version)."""
        if not can_resume(meta):
            raise UpstreamError(f"upstream {url}: no validator to pin a probe of its end")
        resp, got = await ask(self.transport(url), url, meta, n - 1, n, self.policy)
        try:
            data = b""
            async for chunk in resp.chunks():
                data += chunk
                if len(data) > 1:
                    raise UpstreamError(f"upstream {url}: more bytes than asked")
        finally:
            resp.close()
        return got.size, data

    # -- revalidation ----------------------------------------------------------------------

    async def revalidate(
        self, url: str, meta: ObjectMeta, fields: Mapping[str, str] | None = None
    ) -> Revalidation:
        """Ask the upstream whether version ``meta`` of ``url`` is still current, with a
        conditional GET: ``fresh`` (304, or the same validators; ``fields`` are the
        answer's end-to-end header fields, which update the stored ones), ``changed``
        (``body``: the new version's answer, open, to be streamed into the new entry
        instead of asking again) or ``gone`` (404/410). Raises ProxyError when the
        upstream cannot tell (5xx, unreachable, timeout). ``fields``: the client's
        end-to-end request fields (:func:`proxy.policy.forwarded_fields`), sent along as
        with a miss."""
        headers: dict[str, str] = dict(fields or {})
        if meta.etag:
            headers["If-None-Match"] = meta.etag
        if meta.last_modified:
            headers["If-Modified-Since"] = meta.last_modified
        if not (meta.etag or meta.last_modified):
            return Revalidation("changed")  # nothing to compare: fetch it again
        try:
            resp = await self._request("GET", url, headers, (200, 304), stream=True)
        except NotFound:
            return Revalidation("gone")
        except UpstreamRedirect:
            return Revalidation("changed")
        if resp.status == 304:
            resp.close()
            return Revalidation("fresh", origin_headers(resp.headers))
        got = ObjectMeta.from_headers(resp.headers, 200)
        if meta.etag:
            same = got.etag == meta.etag
        else:
            same = got.last_modified == meta.last_modified and got.size == meta.size
        if same:
            resp.close()
            return Revalidation("fresh", got.fields)
        # the new version in one stream: this answer is a whole 200, not a first part
        one_stream = replace(got, accept_ranges=False)
        return Revalidation("changed", got.fields, self._body(url, resp, one_stream))
