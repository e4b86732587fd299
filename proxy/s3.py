"""S3 upstream client on aiobotocore.

``S3Upstream`` reads ``s3://bucket/key`` objects from AWS S3 or an S3-compatible store
(``endpoint_url``: SeaweedFS, MinIO, R2, AIStore). Credentials come from the standard AWS
chain (environment, shared config/credentials files, ``profile``); with no credentials
at all requests go unsigned (public buckets).

Every S3 failure is translated at this boundary into the shardcache error tree, with the
HTTP status the proxy should answer (see :func:`classify_s3_error`):

=====================================================  =======================================
NoSuchKey, NoSuchBucket, 404                            NotFound (404)
AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch Forbidden (403) with a credentials hint
PreconditionFailed, 412 (If-Match)                      ObjectChanged (502)
InvalidRange, 416                                       RangeNotSatisfiable (416)
SlowDown, 503, RequestLimitExceeded, InternalError      retried with backoff, then
                                                        UpstreamError(status_hint=503)
connection errors                                       UpstreamError (502)
timeouts                                                UpstreamTimeout (504)
=====================================================  =======================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any
from urllib.parse import unquote

import aiohttp

from proxy.parts import (
    DEFAULT_PARALLEL,
    DEFAULT_PART_SIZE,
    ObjectChanged,
    ObjectInfo,
    backoff_delay,
    can_fetch_in_parts,
    parts_stream,
)
from shardcache.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    IncompleteDownloadError,
    NotFound,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamError,
    UpstreamTimeout,
)

log = logging.getLogger(__name__)

__all__ = [
    "S3Fetcher",
    "S3Location",
    "S3RangedSource",
    "S3Response",
    "S3Upstream",
    "classify_s3_error",
    "format_range",
    "join_key",
    "parse_s3_url",
]

CREDENTIALS_HINT = (
    "check the AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "~/.aws/credentials) and that they may read this bucket"
)

THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ServiceUnavailable",
        "503",
    }
)
RETRY_CODES = THROTTLE_CODES | {"InternalError", "500", "RequestTimeout"}
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
FORBIDDEN_CODES = frozenset(
    {
        "AccessDenied",
        "Forbidden",
        "403",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "401",
    }
)
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412"})
RANGE_CODES = frozenset({"InvalidRange", "416"})

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$", re.IGNORECASE)


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key (or key prefix)."""

    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3_url(url: str, *, quoted: bool = False) -> S3Location:
    """Split ``s3://bucket/key`` (the key may be empty or a prefix) into an S3Location.

    ``quoted=True`` percent-decodes the key (the proxy's canonical URLs quote each path
    segment). Raises BadRequest naming the URL when it is not a valid s3 URL.
    """
    if not url.startswith("s3://"):
        raise BadRequest(f"{url!r}: not an s3:// URL")
    rest = url[len("s3://") :].partition("?")[0] if quoted else url[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if quoted:
        try:
            key = unquote(key, errors="strict")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"{url!r}: key is not valid percent-encoded UTF-8") from exc
    if not _BUCKET_RE.match(bucket):
        raise BadRequest(f"{url!r}: bad bucket name {bucket!r}")
    if "\x00" in key:
        raise BadRequest(f"{url!r}: NUL in key")
    return S3Location(bucket, key)


def join_key(prefix: str, path: str) -> str:
    """The key of ``path`` under ``prefix`` (``"data"`` + ``"a.tar"`` → ``"data/a.tar"``)."""
    prefix = prefix.strip("/")
    path = path.lstrip("/")
    if not prefix:
        return path
    return f"{prefix}/{path}" if path else f"{prefix}/"


def format_range(range_: tuple[int, int | None] | str | None) -> str | None:
    """A Range header value from ``(first, last_inclusive_or_None)`` or a header string."""
    if range_ is None or isinstance(range_, str):
        return range_
    first, last = range_
    if first < 0 or (last is not None and last < first):
        raise RangeNotSatisfiable(f"bad range {range_!r}")
    return f"bytes={first}-" if last is None else f"bytes={first}-{last}"


def classify_s3_error(code: str, status: int) -> str:
    """The kind of an S3 error: not_found, forbidden, changed, range, retry or other."""
    if code in NOT_FOUND_CODES or (not code and status == 404):
        return "not_found"
    if code in FORBIDDEN_CODES or status in (401, 403):
        return "forbidden"
    if code in PRECONDITION_CODES or status == 412:
        return "changed"
    if code in RANGE_CODES or status == 416:
        return "range"
    if code in RETRY_CODES or status in (500, 503):
        return "retry"
    return "other"


def s3_error_to_proxy(url: str, code: str, status: int, message: str) -> ProxyError:
    """The shardcache error for an S3 error response (``code`` as S3 names it)."""
    kind = classify_s3_error(code, status)
    detail = f"{code or status}" + (f": {message}" if message and message != code else "")
    if kind == "not_found":
        return NotFound(f"{url}: not found in S3 ({detail})")
    if kind == "forbidden":
        return Forbidden(f"{url}: S3 denied access ({detail}); {CREDENTIALS_HINT}")
    if kind == "changed":
        return ObjectChanged(f"{url}: object changed (ETag no longer matches, {detail})")
    if kind == "range":
        return RangeNotSatisfiable(f"{url}: range not satisfiable ({detail})")
    if kind == "retry":
        return UpstreamError(f"{url}: S3 is throttling or unavailable ({detail})", status_hint=503)
    if code in ("PermanentRedirect", "AuthorizationHeaderMalformed") or status == 301:
        return UpstreamError(
            f"{url}: S3 says the bucket is in another region or endpoint ({detail}); "
            "set --s3-region/--s3-endpoint-url"
        )
    return UpstreamError(f"{url}: S3 error ({detail})")


def _http_date(resp: dict) -> str | None:
    """Last-Modified as the upstream sent it (an HTTP-date), else rebuilt from botocore's."""
    raw = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("last-modified")
    if raw:
        return raw
    value = resp.get("LastModified")
    if isinstance(value, datetime):
        return format_datetime(value.astimezone(timezone.utc), usegmt=True)
    return None


# --------------------------------------------------------------------------- client


@dataclass
class S3Response:
    """An open GET of an S3 object: status, object metadata and a streamed body.

    ``info.size`` is the size of the whole object; ``start``/``length`` the bytes of this
    body (a range for 206). Iterate the body with :meth:`iter_chunks`; close with
    :meth:`aclose` (or use ``async with``).
    """

    url: str
    status: int
    info: ObjectInfo
    start: int
    length: int
    _body: Any = None

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers describing this response, as a plain HTTP upstream would send."""
        h = {"Content-Length": str(self.length), "Accept-Ranges": "bytes"}
        if self.status == 206 and self.info.size is not None:
            h["Content-Range"] = (
                f"bytes {self.start}-{self.start + self.length - 1}/{self.info.size}"
            )
        if self.info.etag:
            h["ETag"] = self.info.etag
        if self.info.last_modified:
            h["Last-Modified"] = self.info.last_modified
        if self.info.content_type:
            h["Content-Type"] = self.info.content_type
        return h

    async def iter_chunks(self, chunk_size: int = 256 * 1024) -> AsyncIterator[bytes]:
        """The body in chunks; a body cut short raises UpstreamError, never a clean end."""
        got = 0
        try:
            async for chunk in self._body.iter_chunks(chunk_size):
                got += len(chunk)
                yield chunk
        except ProxyError:
            raise
        except Exception as exc:
            raise _translate_transport(self.url, exc) from exc
        finally:
            if got != self.length:  # abandoned or failed: do not reuse the connection
                self._body.close()
        if got != self.length:
            raise UpstreamError(f"{self.url}: body ended after {got} of {self.length} bytes")

    async def aclose(self) -> None:
        """Release the connection."""
        if self._body is not None:
            self._body.close()

    async def __aenter__(self) -> S3Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _translate_transport(url: str, exc: BaseException) -> ProxyError:
    """Map a transport-level failure (not an S3 error response) to a ProxyError."""
    from botocore import exceptions as bx

    if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError, asyncio.TimeoutError)):
        return UpstreamTimeout(f"{url}: S3 timed out ({exc})")
    if isinstance(exc, bx.NoCredentialsError):
        return Forbidden(f"{url}: no AWS credentials found; {CREDENTIALS_HINT}")
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return s3_error_to_proxy(url, str(err.get("Code", "")), status, str(err.get("Message", "")))
    if isinstance(
        exc,
        (
            bx.EndpointConnectionError,
            bx.ConnectionClosedError,
            bx.HTTPClientError,
            bx.ResponseStreamingError,
            bx.IncompleteReadError,
            bx.FlexibleChecksumError,
            aiohttp.ClientError,
            ConnectionError,
        ),
    ):
        return UpstreamError(f"{url}: cannot read from S3 ({exc})")
    if isinstance(exc, bx.BotoCoreError):
        return UpstreamError(f"{url}: S3 client error ({exc})")
    raise exc


class S3Upstream:
    """Async S3 client for the proxy: HEAD, ranged GET with If-Match, ListObjectsV2.

    Use as ``async with S3Upstream(...) as s3:`` or call :meth:`start` / :meth:`close`.
    Credentials: ``credentials=(access_key, secret_key)`` if given, else the standard AWS
    chain (``profile`` selects a shared-config profile). ``anonymous=None`` signs when
    credentials are found and sends unsigned requests otherwise; True/False force it.
    Throttling and 5xx are retried ``retries`` times with exponential backoff.
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
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_connections: int = 64,
        retries: int = 4,
        backoff: float = 0.2,
    ) -> None:
        self.endpoint_url = endpoint_url
        self.region = region
        self.profile = profile
        self.credentials = credentials
        self.anonymous = anonymous
        self.addressing_style = addressing_style or ("path" if endpoint_url else "auto")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.retries = retries
        self.backoff = backoff
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._start_lock: asyncio.Lock | None = None

    async def start(self) -> S3Upstream:
        """Resolve credentials and open the connection pool."""
        try:
            from aiobotocore.config import AioConfig
            from aiobotocore.session import AioSession
        except ImportError as exc:
            raise ConfigError(
                "--upstream", "s3:// upstreams need aiobotocore: pip install 'shardcache[s3]'"
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
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            max_pool_connections=self.max_connections,
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

    async def _call(self, url: str, op: str, **params: Any) -> dict:
        attempt = 0
        while True:
            try:
                return await getattr(self.client, op)(**params)
            except Exception as exc:
                err = _translate_transport(url, exc)
                if err.status_hint == 503 and attempt < self.retries:
                    delay = backoff_delay(attempt, self.backoff, rand=random.random())
                    log.warning(
                        "%s: %s; retry %d/%d in %.2fs", url, err, attempt + 1, self.retries, delay
                    )
                    attempt += 1
                    await asyncio.sleep(delay)
                    continue
                raise err from exc

    async def head(
        self, url: str, *, if_match: str | None = None, quoted: bool = False
    ) -> ObjectInfo:
        """HEAD ``s3://bucket/key``: size, ETag, Last-Modified, Content-Type."""
        loc = parse_s3_url(url, quoted=quoted)
        params: dict[str, Any] = {"Bucket": loc.bucket, "Key": loc.key}
        if if_match:
            params["IfMatch"] = if_match
        resp = await self._call(url, "head_object", **params)
        return ObjectInfo(
            size=int(resp["ContentLength"]),
            etag=resp.get("ETag"),
            last_modified=_http_date(resp),
            content_type=resp.get("ContentType"),
            accept_ranges=True,
        )

    async def open(
        self,
        url: str,
        range: tuple[int, int | None] | str | None = None,  # noqa: A002 - HTTP's name
        if_match: str | None = None,
        *,
        quoted: bool = False,
    ) -> S3Response:
        """GET ``s3://bucket/key``, optionally a byte range and pinned to an ETag.

        ``range`` is ``(first, last_inclusive_or_None)`` or a Range header value;
        ``quoted`` as in :func:`parse_s3_url`. The returned response streams; close it
        when done.
        """
        loc = parse_s3_url(url, quoted=quoted)
        params: dict[str, Any] = {"Bucket": loc.bucket, "Key": loc.key}
        header = format_range(range)
        if header:
            params["Range"] = header
        if if_match:
            params["IfMatch"] = if_match
        resp = await self._call(url, "get_object", **params)
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 200)
        length = int(resp["ContentLength"])
        if status == 206 and resp.get("ContentRange"):
            from proxy.parts import parse_content_range

            try:
                start, _, size = parse_content_range(resp["ContentRange"])
            except ValueError as exc:
                resp["Body"].close()
                raise UpstreamError(f"{url}: {exc}") from exc
        else:
            start, size = 0, length
        etag = resp.get("ETag")
        if if_match and etag and etag != if_match:
            resp["Body"].close()
            raise ObjectChanged(f"{url}: ETag changed from {if_match} to {etag}")
        info = ObjectInfo(
            size=size,
            etag=etag,
            last_modified=_http_date(resp),
            content_type=resp.get("ContentType"),
            accept_ranges=True,
        )
        return S3Response(
            url=url, status=status, info=info, start=start, length=length, _body=resp["Body"]
        )

    async def list_objects_v2(self, bucket: str, **params: Any) -> dict:
        """ListObjectsV2 on ``bucket`` with botocore's parameter names; keys come decoded."""
        params = {k: v for k, v in params.items() if v is not None}
        return await self._call(f"s3://{bucket}/", "list_objects_v2", Bucket=bucket, **params)


class S3RangedSource:
    """One S3 object as a :class:`proxy.parts.RangedSource` for parallel part fetches."""

    def __init__(
        self, s3: S3Upstream, url: str, chunk_size: int = 256 * 1024, *, quoted: bool = False
    ) -> None:
        self.s3 = s3
        self.url = url
        self.chunk_size = chunk_size
        self.quoted = quoted

    async def stat(self) -> ObjectInfo:
        """HEAD the object."""
        return await self.s3.head(self.url, quoted=self.quoted)

    async def read_range(self, start: int, end: int, etag: str | None) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` with ``If-Match: etag``."""
        resp = await self.s3.open(
            self.url, range=(start, end - 1), if_match=etag, quoted=self.quoted
        )
        async with resp:
            if resp.start != start or resp.length != end - start:
                raise UpstreamError(
                    f"{self.url}: asked bytes {start}-{end - 1}, got {resp.start}+{resp.length}"
                )
            async for chunk in resp.iter_chunks(self.chunk_size):
                yield chunk


class S3Fetcher:
    """Opens ``s3://`` URLs for the proxy's download loop, shaped like ``proxy.fetch.Fetcher``.

    :meth:`open` returns a ``proxy.fetch.UpstreamBody`` once S3 has answered. Objects
    larger than ``part_size`` are fetched as ``parallel`` ranged parts pinned to the
    ETag, delivered in order; smaller ones stream from the first GET, resumed with
    ``Range`` + ``If-Match`` after a mid-body failure (``retries`` times). URLs are the
    proxy's canonical ones: each key segment percent-encoded.
    """

    def __init__(
        self,
        s3: S3Upstream,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        parallel: int = DEFAULT_PARALLEL,
        retries: int = 3,
        retry_backoff: float = 0.5,
        chunk_size: int = 1 << 20,
        observe: Callable[[str], None] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.s3 = s3
        self.part_size = part_size
        self.parallel = parallel
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.chunk_size = chunk_size
        self.observe = observe or (lambda outcome: None)
        self.on_bytes = on_bytes

    async def start(self) -> S3Fetcher:
        """Start the underlying S3 client."""
        await self.s3.start()
        return self

    async def close(self) -> None:
        """Close the underlying S3 client."""
        await self.s3.close()

    async def open(self, url: str):  # -> proxy.fetch.UpstreamBody
        """GET ``url``; return its metadata and a body iterator. Raises ProxyError."""
        from proxy.fetch import UpstreamBody

        try:
            await self.s3.ensure_started()
            resp = await self.s3.open(url, quoted=True)
        except UpstreamTimeout:
            self.observe("timeout")
            raise
        except NotFound:
            self.observe("not_found")
            raise
        except ProxyError:
            self.observe("error")
            raise
        self.observe("ok")
        info = resp.info
        body = UpstreamBody(
            url=url,
            size=info.size,
            etag=info.etag,
            last_modified=info.last_modified,
            content_type=info.content_type,
        )
        first = resp.iter_chunks(self.chunk_size)
        if self.parallel > 1 and self.part_size > 0 and can_fetch_in_parts(info, self.part_size):
            source = S3RangedSource(self.s3, url, self.chunk_size, quoted=True)
            stream = parts_stream(
                source,
                info,
                part_size=self.part_size,
                parallel=self.parallel,
                retries=self.retries,
                backoff=self.retry_backoff,
                initial=first,
                on_bytes=self.on_bytes,
            )
            body._iter = self._in_parts(url, info, stream)
        else:
            body._iter = self._resuming(url, info, first)
        state = {"closed": False}

        def close() -> None:
            if not state["closed"]:
                state["closed"] = True
                resp._body.close()

        body._close = close
        return body

    async def _in_parts(
        self, url: str, info: ObjectInfo, stream: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """Chunks of a parallel ranged fetch; a failure becomes IncompleteDownloadError."""
        pos = 0
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for chunk in stream:
                    pos += len(chunk)
                    yield chunk
        except (ProxyError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.observe("aborted")
            log.warning("%s: ranged fetch failed at byte %d: %s", url, pos, exc)
            raise IncompleteDownloadError(url, pos, info.size) from exc

    async def _resuming(
        self, url: str, info: ObjectInfo, first: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        pos = 0
        attempt = 0
        stream = first
        size = info.size or 0
        while True:
            try:
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    async for chunk in stream:
                        pos += len(chunk)
                        if self.on_bytes is not None:
                            self.on_bytes(len(chunk))
                        yield chunk
                return
            except (UpstreamError, NotFound, Forbidden) as exc:
                if isinstance(exc, (ObjectChanged, NotFound, Forbidden)) or attempt >= self.retries:
                    self.observe("aborted")
                    raise IncompleteDownloadError(url, pos, info.size) from exc
                attempt += 1
                delay = backoff_delay(attempt - 1, self.retry_backoff, rand=random.random())
                log.info(
                    "%s failed at byte %d (%s); resume %d in %.2fs", url, pos, exc, attempt, delay
                )
                await asyncio.sleep(delay)
                try:
                    resp = await self.s3.open(
                        url, range=(pos, size - 1), if_match=info.etag, quoted=True
                    )
                except ProxyError as exc2:
                    self.observe("aborted")
                    raise IncompleteDownloadError(url, pos, info.size) from exc2
                if resp.start != pos:
                    await resp.aclose()
                    self.observe("aborted")
                    raise IncompleteDownloadError(url, pos, info.size) from exc
                self.observe("resumed")
                stream = resp.iter_chunks(self.chunk_size)
