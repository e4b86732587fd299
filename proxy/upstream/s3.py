"""The S3 backend: ``s3://bucket/key`` on AWS S3 or an S3-compatible store
(``endpoint_url``: SeaweedFS, MinIO, R2, AIStore) through aiobotocore.

:class:`S3Upstream` is the client (HEAD, ranged GET with If-Match, ListObjectsV2);
:class:`S3Transport` answers the upstream layer's requests with it, shaped like an HTTP
origin's answers, so resuming, verification and parts work as for any upstream.
Credentials come from the standard AWS chain (environment, shared config/credentials
files, ``profile``); with no credentials at all requests go unsigned (public buckets).
S3 failures are mapped by the S3 table of :mod:`proxy.upstream.errors`; throttling and 5xx
are retried with the one backoff (:func:`proxy.upstream.stream.retrying`): by the client's
own :class:`~proxy.upstream.options.RetryPolicy` when it is called directly, by the
upstream layer's loop (and never also here) when called through :class:`S3Transport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any

from multidict import CIMultiDict

from proxy.upstream.errors import botocore_error, s3_error
from proxy.upstream.options import DEFAULT_OPTIONS, NO_RETRY, RetryPolicy, UpstreamOptions
from proxy.upstream.s3url import S3Location, format_range, join_key, parse_s3_url
from proxy.upstream.stream import retrying
from proxy.upstream.transport import error_document, pump_chunks
from shardcache.errors import (
    S3_EXTRA_HINT,
    ConfigError,
    ObjectChanged,
    ProxyError,
    UpstreamCut,
    UpstreamError,
)
from shardcache.meta import ObjectMeta, origin_headers, parse_content_range

log = logging.getLogger(__name__)

__all__ = [
    "S3Location",
    "S3Response",
    "S3Transport",
    "S3Upstream",
    "format_range",
    "join_key",
    "parse_s3_url",
]


def _status(resp: dict) -> int:
    """The HTTP status of botocore's answer ``resp`` (or of its error answer)."""
    return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 200))


def _fields(resp: dict) -> tuple[tuple[str, str], ...]:
    """The end-to-end header fields of botocore's answer ``resp``, as an HTTP origin's."""
    return origin_headers(resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}))


def _http_date(resp: dict) -> str | None:
    """Last-Modified as the upstream sent it (an HTTP-date), else rebuilt from botocore's."""
    raw = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("last-modified")
    if raw:
        return raw
    value = resp.get("LastModified")
    if isinstance(value, datetime):
        return format_datetime(value.astimezone(timezone.utc), usegmt=True)
    return None


CHECKSUM_MODE = {"x-amz-checksum-mode": "ENABLED"}


def _ask_checksums(request: Any, **_: Any) -> None:
    """botocore's before-sign hook: ask S3 for the object's checksums."""
    for name, value in CHECKSUM_MODE.items():
        request.headers[name] = value


class S3Response:
    """An answer of S3 as an HTTP origin would send it: status, headers, streamed body.

    ``meta.size`` is the size of the whole object; ``start``/``length`` the bytes of this
    body (a range for 206). A body cut short raises UpstreamCut, never a clean end.
    """

    def __init__(
        self, url: str, status: int, meta: ObjectMeta, start: int, length: int, body: Any = None
    ) -> None:
        self.url = url
        self.status = status
        self.reason = ""
        self.meta = meta
        self.start = start
        self.length = length
        self._body = body
        h: CIMultiDict[str] = CIMultiDict({"Accept-Ranges": "bytes"})
        if status in (200, 206):
            h["Content-Length"] = str(length)
        if status == 206 and meta.size is not None:
            h["Content-Range"] = f"bytes {start}-{start + length - 1}/{meta.size}"
        if status == 416 and meta.size is not None:
            h["Content-Range"] = f"bytes */{meta.size}"
        h.update(meta.headers())
        for k, v in meta.fields:
            if k not in h:
                h.add(k, v)
        if meta.content_type:
            h["Content-Type"] = meta.content_type
        self.headers: Mapping[str, str] = h

    async def chunks(self, chunk_size: int = DEFAULT_OPTIONS.chunk_size) -> AsyncIterator[bytes]:
        got = 0
        if self._body is None:
            return
        try:
            async for chunk in self._body.iter_chunks(chunk_size):
                got += len(chunk)
                yield chunk
        except ProxyError:
            raise
        except Exception as exc:
            raise botocore_error(self.url, exc, body=True) from exc
        finally:
            if got != self.length:  # abandoned or failed: do not reuse the connection
                self._body.close()
        if got != self.length:
            raise UpstreamCut(f"{self.url}: body ended after {got} of {self.length} bytes")

    iter_chunks = chunks

    def pump(self, fd: int, hasher: Any, limit: int | None = None) -> AsyncIterator[int]:
        return pump_chunks(self.chunks(), fd, hasher, limit)

    def close(self) -> None:
        if self._body is not None:
            self._body.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> S3Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class S3Upstream:
    """Async S3 client for the proxy: HEAD, ranged GET with If-Match, ListObjectsV2.

    Use as ``async with S3Upstream(...) as s3:`` or call :meth:`start` / :meth:`close`.
    Credentials: ``credentials=(access_key, secret_key)`` if given, else the standard AWS
    chain (``profile`` selects a shared-config profile). ``anonymous=None`` signs when
    credentials are found and sends unsigned requests otherwise; True/False force it.
    Timeouts, retries and the connection pool's size come from ``options``; throttling
    and 5xx are retried as its :attr:`~proxy.upstream.options.UpstreamOptions.retry` says.
    """

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        credentials: tuple[str, str] | None = None,
        anonymous: bool | None = None,
        addressing_style: str | None = None,
        options: UpstreamOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.endpoint_url = endpoint_url
        self.region = region
        self.profile = profile
        self.credentials = credentials
        self.anonymous = anonymous
        self.addressing_style = addressing_style or ("path" if endpoint_url else "auto")
        self.options = options
        self.retry = options.retry
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._start_lock: asyncio.Lock | None = None
        self._presigned: dict[str, tuple[float, str]] = {}

    async def start(self) -> S3Upstream:
        """Resolve credentials and open the connection pool."""
        try:
            from aiobotocore.config import AioConfig
            from aiobotocore.session import AioSession
        except ImportError as exc:
            raise ConfigError(
                "--upstream", f"s3:// upstreams need aiobotocore: {S3_EXTRA_HINT}"
            ) from exc
        from botocore import UNSIGNED
        from botocore.exceptions import ProfileNotFound

        try:
            session = AioSession(profile=self.profile)
            anonymous = self.anonymous
            if anonymous is None:
                if self.credentials is not None:
                    anonymous = False
                else:
                    anonymous = (await session.get_credentials()) is None
                    if anonymous:
                        log.info("no AWS credentials found: S3 requests go unsigned")
        except ProfileNotFound as exc:
            raise ConfigError("--s3-profile", str(exc)) from exc
        config = AioConfig(
            s3={"addressing_style": self.addressing_style},
            retries={"total_max_attempts": 1},
            connect_timeout=self.options.connect_timeout,
            read_timeout=self.options.read_timeout,
            max_pool_connections=self.options.connections,
            signature_version=UNSIGNED if anonymous else None,
            response_checksum_validation="when_required",
        )
        kwargs: dict[str, Any] = {"config": config}
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.region:
            kwargs["region_name"] = self.region
        if self.credentials is not None and not anonymous:
            kwargs["aws_access_key_id"], kwargs["aws_secret_access_key"] = self.credentials
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(session.create_client("s3", **kwargs))
        except ValueError as exc:  # e.g. a malformed endpoint URL
            await stack.aclose()
            raise ConfigError("--s3-endpoint-url", str(exc)) from exc
        # S3 declares an object's full-object checksum (x-amz-checksum-*) only when asked;
        # the header is added before signing (a presigned GET signs it too), not as
        # botocore's ChecksumMode, whose own validation would hash every body a second
        # time: the proxy checks what S3 declares itself (shardcache.digests)
        for op in ("HeadObject", "GetObject"):
            self._client.meta.events.register(f"before-sign.s3.{op}", _ask_checksums)
        self._stack = stack
        return self

    async def ensure_started(self) -> S3Upstream:
        """Start on first use (safe to call concurrently)."""
        if self._client is None:
            if self._start_lock is None:
                self._start_lock = asyncio.Lock()
            async with self._start_lock:
                if self._client is None:
                    await self.start()
        return self

    async def close(self) -> None:
        """Close the connection pool."""
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None
            self._client = None

    async def __aenter__(self) -> S3Upstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def client(self) -> Any:
        """The aiobotocore S3 client (after :meth:`start`)."""
        if self._client is None:
            raise RuntimeError("S3Upstream not started")
        return self._client

    async def _call(
        self,
        url: str,
        op: str,
        retry: RetryPolicy | None,
        answers: tuple[int, ...] = (),
        **params: Any,
    ) -> dict:
        """``op`` on the client, retried by ``retry`` (None: this client's policy). S3's
        error answers with a status in ``answers`` are returned as answers (botocore's
        reading of them), not raised."""
        from botocore.exceptions import ClientError

        async def once() -> dict:
            try:
                return await getattr(self.client, op)(**params)
            except ClientError as exc:
                if answers and _status(exc.response) in answers:
                    return exc.response
                raise botocore_error(url, exc, body=False) from exc
            except Exception as exc:
                raise botocore_error(url, exc, body=False) from exc

        return await retrying(once, url, self.retry if retry is None else retry)

    async def head(
        self,
        url: str,
        *,
        if_match: str | None = None,
        quoted: bool = False,
        retry: RetryPolicy | None = None,
    ) -> ObjectMeta:
        """HEAD ``s3://bucket/key``: size, ETag, Last-Modified, Content-Type. ``retry``:
        how to retry throttling (None: this client's policy)."""
        loc = parse_s3_url(url, quoted=quoted)
        params: dict[str, Any] = loc.params()
        if if_match:
            params["IfMatch"] = if_match
        resp = await self._call(url, "head_object", retry, **params)
        return ObjectMeta(
            size=int(resp["ContentLength"]),
            etag=resp.get("ETag"),
            last_modified=_http_date(resp),
            content_type=resp.get("ContentType"),
            accept_ranges=True,
            fields=_fields(resp),
        )

    async def open(
        self,
        url: str,
        range: tuple[int, int | None] | str | None = None,  # noqa: A002 - HTTP's name
        if_match: str | None = None,
        *,
        quoted: bool = False,
        retry: RetryPolicy | None = None,
        answers: tuple[int, ...] = (),
    ) -> S3Response:
        """GET ``s3://bucket/key``, optionally a byte range and pinned to an ETag.

        ``range`` is ``(first, last_inclusive_or_None)`` or a Range header value;
        ``quoted`` as in :func:`parse_s3_url`; ``retry`` as for :meth:`head`. The returned
        response streams; close it when done. ``answers``: statuses among 412 and 416
        that S3 may answer with, as an HTTP origin would (no body; a 416 with the size
        from a HEAD); otherwise they raise ObjectChanged and RangeNotSatisfiable.
        """
        loc = parse_s3_url(url, quoted=quoted)
        params: dict[str, Any] = loc.params()
        header = format_range(range)
        if header:
            params["Range"] = header
        if if_match:
            params["IfMatch"] = if_match
        resp = await self._call(url, "get_object", retry, answers, **params)
        status = _status(resp)
        if status == 412:
            return S3Response(url, 412, ObjectMeta(size=None), 0, 0)
        if status == 416:
            meta = await self.head(url, if_match=if_match, quoted=quoted, retry=retry)
            return S3Response(url, 416, meta, 0, 0)
        length = int(resp["ContentLength"])
        if status == 206 and resp.get("ContentRange"):
            try:
                start, last, size = parse_content_range(resp["ContentRange"])
            except ValueError as exc:
                resp["Body"].close()
                raise UpstreamError(f"{url}: {exc}") from exc
            if last - start + 1 != length:
                # the answer passed on is rebuilt from these two: they must agree
                resp["Body"].close()
                raise UpstreamError(
                    f"{url}: ContentLength {length} disagrees with ContentRange "
                    f"{resp['ContentRange']}"
                )
        else:
            start, size = 0, length
        etag = resp.get("ETag")
        if if_match and etag and etag != if_match:
            resp["Body"].close()
            raise ObjectChanged(f"{url}: ETag changed from {if_match} to {etag}")
        meta = ObjectMeta(
            size=size,
            etag=etag,
            last_modified=_http_date(resp),
            content_type=resp.get("ContentType"),
            accept_ranges=True,
            fields=_fields(resp),
        )
        return S3Response(url, status, meta, start, length, resp["Body"])

    async def presign(self, url: str, *, quoted: bool = False) -> str:
        """A URL that GETs ``url`` without further signing (valid an hour; reused for
        half of that). Unsigned when the client sends unsigned requests."""
        now = time.monotonic()
        hit = self._presigned.get(url)
        if hit is not None and hit[0] > now:
            return hit[1]
        loc = parse_s3_url(url, quoted=quoted)
        signed = await self.client.generate_presigned_url(
            "get_object", Params=loc.params(), ExpiresIn=3600
        )
        if len(self._presigned) > 4096:
            self._presigned.clear()
        self._presigned[url] = (now + 1800, signed)
        return signed

    async def list_objects_v2(self, bucket: str, **params: Any) -> dict:
        """ListObjectsV2 on ``bucket`` with botocore's parameter names; keys come decoded."""
        params = {k: v for k, v in params.items() if v is not None}
        return await self._call(f"s3://{bucket}/", "list_objects_v2", None, Bucket=bucket, **params)


class S3Transport:
    """The upstream layer's requests answered by S3: HEAD, GET with ``Range`` and
    ``If-Match`` (S3 has no ``If-Range``: a validator there is sent as ``If-Match``, so a
    replaced object answers 412). URLs are the proxy's canonical ones (key segments
    percent-encoded).

    With ``threads``, GETs go to a presigned URL (signing is local) over the threaded
    transport: bodies are received by worker threads and spliced into the file, the
    event loop never touches their bytes (aiobotocore's reads cost a core at the speeds
    of a local S3). HEADs and listings stay with aiobotocore.

    Every request here is one try (:data:`~proxy.upstream.options.NO_RETRY`): the upstream
    layer retries it, with the daemon's one policy, so a throttled request is retried in
    one loop and ``--retries`` counts its tries."""

    def __init__(self, s3: S3Upstream, threads: Any = None) -> None:
        self.s3 = s3
        self.threads = threads

    async def _threaded_get(self, url: str, headers: Mapping[str, str]) -> Any:
        signed = await self.s3.presign(url, quoted=True)
        h = {k: v for k, v in headers.items() if k in ("Range", "If-Match")}
        h.update(CHECKSUM_MODE)  # signed into the presigned URL (_ask_checksums)
        resp = await self.threads.request("GET", signed, h, label=url)
        if resp.status < 400 or resp.status in (412, 416):
            return resp
        text = (await error_document(resp)).decode("utf-8", "replace")
        code = re.search(r"<Code>([^<]*)</Code>", text)
        message = re.search(r"<Message>([^<]*)</Message>", text)
        raise s3_error(
            url,
            code.group(1) if code else "",
            resp.status,
            message.group(1) if message else resp.reason,
        )

    async def request(self, method: str, url: str, headers: Mapping[str, str]) -> S3Response:
        await self.s3.ensure_started()
        if_match = headers.get("If-Match")
        if if_match is None and (headers.get("If-Range") or "").startswith('"'):
            if_match = headers["If-Range"]
        if method == "HEAD" or "If-None-Match" in headers:
            meta = await self.s3.head(url, if_match=if_match, quoted=True, retry=NO_RETRY)
            if headers.get("If-None-Match") in (meta.etag, "*"):
                return S3Response(url, 304, meta, 0, 0)
            return S3Response(url, 200, meta, 0, meta.size or 0)
        if self.threads is not None:
            return await self._threaded_get(
                url, {**headers, **({"If-Match": if_match} if if_match else {})}
            )
        return await self.s3.open(
            url, headers.get("Range"), if_match, quoted=True, retry=NO_RETRY, answers=(412, 416)
        )

    async def close(self) -> None:
        await self.s3.close()
