"""An S3-compatible front for the proxy, so S3 clients can read through the cache.

Each named upstream is a bucket: with ``--upstream shards=s3://bucket/prefix``, S3 clients
pointed at the proxy (``endpoint_url``, path-style) see bucket ``shards``. The front is an
aiohttp middleware (:meth:`S3Front.middleware`) placed inside the proxy's own:

- ``GET|HEAD /{bucket}/{key}`` is authenticated, stripped of S3-only query parameters
  (``x-id``, ``response-*``; ``versionId`` stays, a version being an object of its own)
  and handed on to the proxy's normal shard handler (cache, Range, 206 clipping,
  conditionals); the ``response-*`` overrides are applied to its answer, and its errors
  (a failed precondition, the upstream's own error answers) come back as S3 XML error
  bodies with the store's code for S3 clients.
- ``HEAD /{bucket}``, ``GET /{bucket}?location``, ``GET /`` (ListBuckets) and
  ``GET /{bucket}?list-type=2&...`` (ListObjectsV2, passed through to the upstream S3 and
  re-rendered with keys relative to the front's bucket) are answered here, asking the
  store (for ``s3://`` buckets) whether the bucket exists and when it was created.
- Requests may be anonymous, or signed with SigV4 (header or presigned query) using the
  configured key pair; signatures are recomputed with botocore's ``S3SigV4Auth`` and
  compared in constant time. With no key pair configured every request is accepted.

Pure policy is in I/O-free modules, tested directly: :mod:`proxy.s3request` (request
classification, an object read's query), :mod:`proxy.s3auth` (SigV4),
:mod:`proxy.s3xml` (list parameters, XML answers); the front's errors are S3Errors of
:mod:`proxy.errormap`, whose :func:`~proxy.errormap.error_answer` says what each error
tells an S3 client.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from yarl import URL

from proxy.errormap import (
    AccessDenied,
    ErrorAnswer,
    InvalidArgument,
    InvalidRequest,
    NoSuchBucket,
    PreconditionFailed,
    S3Error,
    S3MethodNotAllowed,
    S3NotImplemented,
    S3Unavailable,
    error_answer,
)
from proxy.s3auth import verify_sigv4
from proxy.s3request import (
    _BUCKET_NAME_RE,
    LIST_PARAMS,
    PRESIGN_PARAMS,
    classify_request,
    is_bucket_name,
    is_s3_request,
    object_query,
    virtual_bucket,
)
from proxy.s3xml import (
    list_params,
    render_buckets,
    render_error,
    render_list,
    render_list_v2,
    render_location,
    render_versioning,
)
from proxy.upstream.cloud import CloudUpstream
from proxy.upstream.cloudurl import parse_cloud_url
from proxy.upstream.errors import PassedAnswer, botocore_error, store_error
from proxy.upstream.s3 import S3Upstream
from proxy.upstream.s3url import join_key, parse_s3_url
from shardcache.errors import ProxyError

log = logging.getLogger(__name__)

__all__ = [
    "S3Error",
    "S3Front",
    "classify_request",
    "list_params",
    "render_error",
    "render_list",
    "render_list_v2",
    "store_error",
    "verify_sigv4",
]

REQUEST_ID = web.RequestKey("s3_request_id", str)
# set on requests the front answers itself (listings, bucket and service calls): the
# metrics count them apart from object reads
S3_SERVICE_ROUTE = web.RequestKey("s3_service_route", str)
# the response-* overrides of a GetObject/HeadObject, applied when its answer is prepared
S3_OVERRIDES = web.RequestKey("s3_overrides", dict)
# set on an S3 object read that did not ask for checksums (x-amz-checksum-mode: ENABLED):
# S3 sends the stored x-amz-checksum-* fields only to those that ask
S3_NO_CHECKSUMS = web.RequestKey("s3_no_checksums", bool)
PRECONDITION_MESSAGE = "At least one of the pre-conditions you specified did not hold"


# --------------------------------------------------------------------------- middleware


@dataclass
class S3Front:
    """The S3 front: ``buckets`` maps front bucket names to upstream base URLs.

    ``s3`` is the upstream S3 client used for listings (assign it once started). With
    ``access_key``/``secret_key`` set, requests must be signed with them unless
    ``allow_anonymous``; with neither set, every request is accepted.
    """

    buckets: Mapping[str, str]
    s3: S3Upstream | None = None
    cloud: CloudUpstream | None = None  # lists gs:// and az:// buckets
    domains: Sequence[str] = ("localhost",)  # virtual-hosted style: BUCKET.DOMAIN
    catch_all: bool = False  # an unnamed upstream maps every other path
    # the unnamed upstream is the whole S3 store (``--upstream s3://``): every name shaped
    # like a bucket's is the store's bucket of that name, unless a named upstream has it
    store: bool = False
    access_key: str | None = None
    secret_key: str | None = None
    allow_anonymous: bool | None = None
    region: str = "us-east-1"
    clock: Any = field(default=lambda: dt.datetime.now(dt.timezone.utc))
    # the bucket each Host seen names virtual-hosted (None: none), for the fast test
    _virtual_hosts: dict[str, str | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if bool(self.access_key) != bool(self.secret_key):
            from shardcache.errors import ConfigError

            raise ConfigError(
                "--s3-front-access-key",
                "give both --s3-front-access-key and --s3-front-secret-key, or neither",
            )
        if self.allow_anonymous is None:
            self.allow_anonymous = not self.access_key

    # -- entry point

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp middleware: S3 routes, authentication and XML errors for front buckets."""
        if self._proxys_own(request):
            return await handler(request)  # the common case, decided without the rest
        host = request.headers.get("Host")
        target = classify_request(request.raw_path, self.buckets, host, self.domains, self.store)
        virtual = virtual_bucket(host, self.domains) is not None
        s3ish = virtual or is_s3_request(request.headers, request.query)
        if not s3ish and target.kind == "object" and target.bucket not in self.buckets:
            return await handler(request)  # a plain client's read of the store's object
        if target.kind == "other":
            if not s3ish or self.catch_all or not is_bucket_name(target.bucket):
                return await handler(request)  # the proxy's own paths
        elif target.kind == "service" and not s3ish and not self.buckets:
            return await handler(request)  # no bucket to list: the proxy's own 404
        elif (
            target.kind == "bucket"
            and not s3ish
            and request.method == "GET"
            and not request.query_string
        ):
            return await handler(request)  # a plain client's GET /NAME: the proxy's own 404
        request_id = uuid.uuid4().hex[:16].upper()
        request[REQUEST_ID] = request_id
        if target.kind != "object":
            request[S3_SERVICE_ROUTE] = "s3-listing" if target.kind == "bucket" else "s3-service"
        resource = request.path
        try:
            self.authenticate(request)
            if target.kind in ("other", "nobucket"):
                names = ", ".join(sorted(self.buckets)) or "none"
                raise NoSuchBucket(
                    f"The specified bucket does not exist: no bucket {target.bucket!r} here "
                    f"(the buckets of this front: {names})",
                )
            if target.kind == "service":
                return await self._list_buckets(request)
            if target.kind == "bucket":
                return await self._bucket(request, target.bucket)
            if virtual:
                # the proxy's routes are path style: /BUCKET/KEY
                path = f"/{target.bucket}/{target.key}"
                qs = request.rel_url.raw_query_string
                request = request.clone(rel_url=URL(path + (f"?{qs}" if qs else ""), encoded=True))
            return await self._object(request, handler, s3ish)
        except (ProxyError, web.HTTPException) as exc:
            if not isinstance(exc, S3Error) and not s3ish:
                raise  # a plain client's error: the proxy's own one-line answer
            if isinstance(exc, web.HTTPException) and exc.status < 400:
                raise
            answer = exc.answer if isinstance(exc, ProxyError) else None
            if isinstance(answer, PassedAnswer) and answer.status < 400:
                raise  # a success that is not the object: passed on as it was
            # the upstream's own error answer keeps its status, and its code when it is an
            # S3 error document (an S3 store behind an http(s) upstream)
            return self._error(request, error_answer(exc), resource, request_id)

    def _proxys_own(self, request: web.Request) -> bool:
        """True for a request the checks below would hand straight to the proxy (kind
        ``other``: no front bucket in its Host or first path segment, and no S3 client's
        request for a bucket the front lacks), told from its path and Host alone: with a
        catch-all upstream every such path is the proxy's, and without one a first segment
        that cannot name a bucket (``/-/...``) is. False: the full classification decides.
        A data request of a sidecar pays this test instead of classifying the request
        and scanning its headers for an S3 client (measured: see BENCHMARKS.md)."""
        return self.proxys_own(request.raw_path, request.headers.get("Host"))

    def proxys_own(self, raw_path: str, host: str | None) -> bool:
        """:meth:`_proxys_own` of a request for ``raw_path`` (the target as sent) with
        ``host`` (its Host field, None without one); the fast path for hits
        (:mod:`proxy.fastpath`) asks it of the requests it answers itself."""
        path = raw_path.partition("?")[0]
        if path == "/":
            return False
        first = path[1:].partition("/")[0]
        if first in self.buckets:
            return False
        if (self.store or not self.catch_all) and _BUCKET_NAME_RE.match(first):
            return False
        if not self.domains:
            return True
        if not host:
            return True
        virtual = self._virtual_hosts.get(host, False)
        if virtual is False:
            virtual = virtual_bucket(host, self.domains)
            if len(self._virtual_hosts) >= 256:  # the Host is the client's: bounded
                self._virtual_hosts.clear()
            self._virtual_hosts[host] = virtual
        return virtual is None

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """aiohttp ``on_response_prepare``: every answer of the front, errors and object
        bodies alike, names its request id as S3 does."""
        rid = request.get(REQUEST_ID)
        if rid is not None:
            response.headers.setdefault("x-amz-request-id", rid)
        if request.get(S3_NO_CHECKSUMS):
            for name in [k for k in response.headers if k.lower().startswith("x-amz-checksum-")]:
                response.headers.popall(name, None)
        overrides = request.get(S3_OVERRIDES)
        if overrides and response.status in (200, 206):
            # what the request asked the answer to say, over what the object says
            for name, value in overrides.items():
                response.headers[name] = value

    def _error(
        self, request: web.Request, told: ErrorAnswer, resource: str, rid: str
    ) -> web.Response:
        """An S3 error answer: the XML body (none to a HEAD), the request id, and of the
        answer's fields the one S3 sends (Content-Range of a range past the end)."""
        headers = {"x-amz-request-id": rid}
        if "Content-Range" in told.headers:
            headers["Content-Range"] = told.headers["Content-Range"]
        if request.method == "HEAD":
            return web.Response(status=told.status, headers=headers)
        body = render_error(told.code, told.message, resource, rid, told.details)
        return web.Response(
            status=told.status, body=body, content_type="application/xml", headers=headers
        )

    # -- authentication

    def authenticate(self, request: web.Request) -> None:
        """Accept or reject the request (raises an S3Error: AccessDenied, InvalidRequest,
        or the SigV4 check's)."""
        signed = request.headers.get("Authorization", "").startswith("AWS") or any(
            k in request.query for k in ("X-Amz-Algorithm", "AWSAccessKeyId")
        )
        if not self.access_key:
            return
        if not signed:
            if self.allow_anonymous:
                return
            raise AccessDenied("anonymous access is not allowed; sign requests")
        if request.headers.get("Authorization", "").startswith("AWS ") or (
            "AWSAccessKeyId" in request.query
        ):
            raise InvalidRequest("SigV2 is not supported; use SigV4 (s3v4)")
        verify_sigv4(
            request.method,
            request.raw_path.partition("?")[0],
            list(request.query.items()),
            request.headers,
            self.access_key,
            self.secret_key or "",
            self.clock(),
        )

    # -- service and bucket level

    def _base(self, bucket: str) -> str:
        """The upstream base URL of a front bucket: a named upstream's, else (the whole
        store behind the front) the store's bucket of that name."""
        base = self.buckets.get(bucket)
        if base is None:
            if not self.store:
                raise NoSuchBucket(f"The specified bucket does not exist: no bucket {bucket!r}")
            return f"s3://{bucket}"
        return base

    async def _store_buckets(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The upstream store's ListBuckets: creation date by bucket name, and its owner
        (``{}`` for either when there is no s3:// bucket or the store refuses: the proxy's
        credentials may read objects without being allowed to list buckets)."""
        if self.s3 is None or not (
            self.store or any(b.startswith("s3://") for b in self.buckets.values())
        ):
            return {}, {}
        try:
            await self.s3.ensure_started()
            result = await self.s3.client.list_buckets()
        except Exception as exc:  # noqa: BLE001 - any failure: the front's own dates
            log.info("the S3 upstream would not list its buckets (%s): dates unknown", exc)
            return {}, {}
        dates = {b["Name"]: b.get("CreationDate") for b in result.get("Buckets", [])}
        return dates, dict(result.get("Owner") or {})

    async def _list_buckets(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            raise S3MethodNotAllowed("read-only cache: buckets can be listed only")
        dates, store_owner = await self._store_buckets()
        # the whole store: each of its buckets under its own name, a named one over it
        created = dict(dates) if self.store else {}
        created.update(
            {
                name: dates.get(parse_s3_url(base).bucket) if base.startswith("s3://") else None
                for name, base in self.buckets.items()
            }
        )
        return web.Response(
            body=render_buckets(store_owner, created), content_type="application/xml"
        )

    async def _check_bucket(self, bucket: str) -> None:
        """Raise NoSuchBucket when the store says the upstream bucket of ``bucket`` does
        not exist (HeadBucket). Any other answer, a refusal included, leaves the bucket
        standing: credentials may read objects without being allowed HeadBucket."""
        base = self._base(bucket)
        if not base.startswith("s3://") or self.s3 is None:
            return
        from botocore.exceptions import ClientError

        loc = parse_s3_url(base)
        try:
            await self.s3.ensure_started()
            await self.s3.client.head_bucket(Bucket=loc.bucket)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                raise NoSuchBucket(
                    f"The specified bucket does not exist: the store has no bucket "
                    f"{loc.bucket!r} (upstream of {bucket!r})",
                ) from None
            log.debug("HeadBucket %s: %s; taken as existing", loc.bucket, exc)
        except Exception as exc:  # noqa: BLE001 - unreachable store: the bucket stands
            log.debug("HeadBucket %s failed: %s; taken as existing", loc.bucket, exc)

    async def _bucket(self, request: web.Request, bucket: str) -> web.StreamResponse:
        headers = {"x-amz-bucket-region": self.region}
        if request.method == "HEAD":
            await self._check_bucket(bucket)
            return web.Response(status=200, headers=headers)
        if request.method != "GET":
            raise S3MethodNotAllowed("read-only cache: buckets can be listed only")
        q = request.query
        if "location" in q:
            await self._check_bucket(bucket)
            body = render_location(self.region)
            return web.Response(body=body, content_type="application/xml", headers=headers)
        if "versioning" in q:
            return await self._versioning(bucket, headers)
        other = [k for k in q if k not in LIST_PARAMS and k not in PRESIGN_PARAMS]
        if other:
            raise S3NotImplemented(f"bucket operation {other[0]!r} is not supported")
        if "list-type" in q and q["list-type"] != "2":
            raise InvalidArgument(f"invalid list-type {q['list-type']!r}")
        return await self._list(bucket, q, headers, v1="list-type" not in q)

    async def _versioning(self, bucket: str, headers: dict[str, str]) -> web.Response:
        """GetBucketVersioning as the store answers it (versionId reads go to the store);
        a bucket that is not S3 has never been versioned."""
        base = self._base(bucket)
        result: Mapping[str, Any] = {}
        if base.startswith("s3://") and self.s3 is not None:
            loc = parse_s3_url(base)
            await self.s3.ensure_started()
            try:
                result = await self.s3.client.get_bucket_versioning(Bucket=loc.bucket)
            except Exception as exc:
                raise botocore_error(f"s3://{loc.bucket}", exc, body=False) from exc
        body = render_versioning(result)
        return web.Response(body=body, content_type="application/xml", headers=headers)

    async def _list(
        self, bucket: str, query: Mapping[str, str], headers: dict[str, str], v1: bool
    ) -> web.Response:
        """ListObjects (V1) or ListObjectsV2 of a front bucket, from the upstream
        bucket's ListObjectsV2."""
        base = self._base(bucket)
        if base.startswith(("gs://", "az://")):
            return await self._list_cloud(bucket, base, query, headers, v1)
        if not base.startswith("s3://"):
            raise S3NotImplemented(f"bucket {bucket} is not backed by S3")
        if self.s3 is None:
            raise S3Unavailable("the S3 client is not running")
        loc = parse_s3_url(base)
        base_prefix = join_key(loc.key, "") if loc.key.strip("/") else ""
        params = list_params(query, base_prefix, v1)
        await self.s3.ensure_started()
        result = await self.s3.list_objects_v2(loc.bucket, **params)
        body = render_list(bucket, query, result, base_prefix, v1)
        return web.Response(body=body, content_type="application/xml", headers=headers)

    async def _list_cloud(
        self, bucket: str, base: str, query: Mapping[str, str], headers: dict[str, str], v1: bool
    ) -> web.Response:
        """:meth:`_list` of a front bucket backed by a GCS bucket or an Azure container."""
        if self.cloud is None:
            raise S3Unavailable("the GCS/Azure client is not running")
        loc = parse_cloud_url(base)
        base_prefix = join_key(loc.key, "") if loc.key.strip("/") else ""
        params = list_params(query, base_prefix, v1)
        result = await self.cloud.list_objects_v2(loc.store_url, **params)
        body = render_list(bucket, query, result, base_prefix, v1)
        return web.Response(body=body, content_type="application/xml", headers=headers)

    # -- objects

    async def _object(self, request: web.Request, handler: Any, s3ish: bool) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise S3MethodNotAllowed("read-only cache: objects can be read (GET, HEAD) only")
        if s3ish and request.headers.get("x-amz-checksum-mode", "").upper() != "ENABLED":
            request[S3_NO_CHECKSUMS] = True
        if s3ish and request.query_string:
            asked = object_query(request.query.items())
            if asked.overrides:
                request[S3_OVERRIDES] = dict(asked.overrides)
            # a version is an object of its own: its URL upstream and its cache key
            query = None if asked.version is None else {"versionId": asked.version}
            request = request.clone(rel_url=request.rel_url.with_query(query))
        resp = await handler(request)
        if s3ish and resp.status == 412 and not resp.prepared:
            # the proxy's own answer to a failed If-Match / If-Unmodified-Since
            raise PreconditionFailed(PRECONDITION_MESSAGE)
        return resp
