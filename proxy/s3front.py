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

Pure policy (request classification, list parameters, XML rendering) is in I/O-free
functions, tested directly.
"""

from __future__ import annotations

import datetime as dt
import hmac
import logging
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote
from xml.etree import ElementTree as ET

from aiohttp import web
from yarl import URL

from proxy.upstream.cloud import CloudUpstream
from proxy.upstream.cloudurl import parse_cloud_url
from proxy.upstream.errors import PassedAnswer, botocore_error
from proxy.upstream.s3 import S3Upstream
from proxy.upstream.s3url import join_key, parse_s3_url
from shardcache.errors import ProxyError, error_answer, s3_code_for_status
from shardcache.meta import parse_decimal

log = logging.getLogger(__name__)

__all__ = [
    "S3Error",
    "S3Front",
    "classify_request",
    "list_params",
    "render_error",
    "render_list_v2",
    "store_error",
    "verify_sigv4",
]

S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
REQUEST_ID = web.RequestKey("s3_request_id", str)
# set on requests the front answers itself (listings, bucket and service calls): the
# metrics count them apart from object reads
S3_SERVICE_ROUTE = web.RequestKey("s3_service_route", str)
# the response-* overrides of a GetObject/HeadObject, applied when its answer is prepared
S3_OVERRIDES = web.RequestKey("s3_overrides", dict)
# set on an S3 object read that did not ask for checksums (x-amz-checksum-mode: ENABLED):
# S3 sends the stored x-amz-checksum-* fields only to those that ask
S3_NO_CHECKSUMS = web.RequestKey("s3_no_checksums", bool)
_BUCKET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
LIST_PARAMS = frozenset(
    {
        "list-type",
        "prefix",
        "delimiter",
        "marker",
        "max-keys",
        "encoding-type",
        "continuation-token",
        "start-after",
        "fetch-owner",
        "x-id",
        "allow-unordered",
    }
)
MAX_SKEW = dt.timedelta(minutes=15)
MAX_PRESIGN_EXPIRES = 7 * 24 * 3600
# GetObject/HeadObject query parameters that set a field of a successful answer
RESPONSE_OVERRIDES = {
    "response-content-type": "Content-Type",
    "response-content-disposition": "Content-Disposition",
    "response-content-encoding": "Content-Encoding",
    "response-content-language": "Content-Language",
    "response-cache-control": "Cache-Control",
    "response-expires": "Expires",
}
# Query parameters of GetObject/HeadObject that do not change the bytes served.
IGNORABLE_OBJECT_PARAMS = frozenset({"x-id", *RESPONSE_OVERRIDES})
# what S3 says of a failed If-Match / If-Unmodified-Since
PRECONDITION_MESSAGE = "At least one of the pre-conditions you specified did not hold"
EPOCH = "1970-01-01T00:00:00.000Z"  # the creation date of a bucket the store cannot date
OWNER = "shardcache"  # the owner named when the store names none (or is not S3)
PRESIGN_PARAMS = frozenset(
    {
        "X-Amz-Algorithm",
        "X-Amz-Credential",
        "X-Amz-Date",
        "X-Amz-Expires",
        "X-Amz-SignedHeaders",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
    }
)


class S3Error(Exception):
    """An S3 error to answer with: HTTP status, S3 code and a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class FrontRequest:
    """What an incoming request asks of the front."""

    kind: str  # "service", "bucket", "object" or "other"
    bucket: str = ""
    key: str = ""  # still percent-encoded as sent


def classify_request(
    raw_path: str,
    buckets: Iterable[str],
    host: str | None = None,
    domains: Sequence[str] = (),
) -> FrontRequest:
    """Classify a raw request path (no query) against the front's bucket names.

    With ``host`` under one of ``domains`` (``BUCKET.DOMAIN[:PORT]``, virtual-hosted
    style) the bucket comes from the Host and the whole path is the key; a bucket the
    front does not have is kind ``"nobucket"``. Otherwise the first path segment names
    the bucket (path style)."""
    path = raw_path.partition("?")[0]
    vbucket = virtual_bucket(host, domains)
    if vbucket is not None:
        if vbucket not in set(buckets):
            return FrontRequest("nobucket", vbucket)
        key = path[1:]
        return FrontRequest("object", vbucket, key) if key else FrontRequest("bucket", vbucket)
    if path == "/":
        return FrontRequest("service")
    bucket, slash, key = path[1:].partition("/")
    if bucket not in set(buckets):
        return FrontRequest("other", bucket)
    if not key:
        return FrontRequest("bucket", bucket)
    return FrontRequest("object", bucket, key)


def virtual_bucket(host: str | None, domains: Sequence[str]) -> str | None:
    """The bucket a virtual-hosted ``Host`` names (``BUCKET.DOMAIN[:PORT]``), or None."""
    if not host or not domains:
        return None
    name = host.strip().lower()
    if name.startswith("["):
        return None  # an IPv6 literal
    name = name.rpartition(":")[0] if ":" in name else name
    name = name.rstrip(".")
    for domain in domains:
        if name.endswith("." + domain) and len(name) > len(domain) + 1:
            return name[: -len(domain) - 1]
    return None


# User-Agent markers of S3 clients that may send requests with no S3 header at all
# (anonymous CRT-based readers such as s3torchconnector, rclone, obstore)
_S3_AGENTS = (
    "aws-",
    "boto",
    "crts3",
    "s3torchconnector",
    "mountpoint-s3",
    "s5cmd",
    "rclone",
    "object_store",
    "obstore",
    "s3fs",
    "minio",
)


def is_s3_request(headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
    """Whether the request comes from an S3 SDK (and so wants S3 XML errors)."""
    auth = headers.get("Authorization", "")
    if auth.startswith(("AWS4-HMAC-SHA256", "AWS ")) or "X-Amz-Algorithm" in query:
        return True
    if any(k.lower().startswith(("x-amz-", "amz-sdk-")) for k in headers):
        return True
    agent = headers.get("User-Agent", "").lower()
    return any(marker in agent for marker in _S3_AGENTS)


def _int_param(query: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    value = parse_decimal(raw)
    if value is None:
        raise S3Error(400, "InvalidArgument", f"{name} must be a non-negative integer")
    return max(lo, min(hi, value))


# past every key that starts with a common prefix: where a V1 listing resumes after one
_AFTER_PREFIX = "\U0010ffff"


def list_params(query: Mapping[str, str], base_prefix: str, v1: bool = False) -> dict[str, Any]:
    """botocore ListObjectsV2 parameters for a front listing (V2, or V1 when ``v1``) of a
    bucket mapped to ``base_prefix`` (``""`` or ``"data/"``) in the upstream bucket."""
    encoding = query.get("encoding-type")
    if encoding not in (None, "", "url"):
        raise S3Error(400, "InvalidArgument", f"invalid encoding-type {encoding!r}")
    params: dict[str, Any] = {
        "Prefix": base_prefix + query.get("prefix", ""),
        "MaxKeys": _int_param(query, "max-keys", 1000, 0, 1000),
    }
    delimiter = query.get("delimiter")
    if delimiter:
        params["Delimiter"] = delimiter
    if v1 or query.get("fetch-owner") == "true":
        params["FetchOwner"] = True  # the owner as the store names it
    if v1:
        marker = query.get("marker")
        if marker:
            # a marker that is a common prefix stands for every key under it
            after = marker + _AFTER_PREFIX if delimiter and marker.endswith(delimiter) else marker
            params["StartAfter"] = base_prefix + after
        return params
    if query.get("continuation-token"):
        params["ContinuationToken"] = query["continuation-token"]
    if query.get("start-after"):
        params["StartAfter"] = base_prefix + query["start-after"]
    return params


def _strip(base: str, key: str) -> str:
    return key[len(base) :] if base and key.startswith(base) else key


def _s3_time(value: Any) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc)
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    return str(value)


def _xml(root: ET.Element) -> bytes:
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8")


def _sub(parent: ET.Element, tag: str, text: Any) -> ET.Element:
    el = ET.SubElement(parent, tag)
    el.text = str(text)
    return el


def render_list(
    bucket: str,
    query: Mapping[str, str],
    result: Mapping[str, Any],
    base_prefix: str,
    v1: bool = False,
) -> bytes:
    """ListBucketResult XML (ListObjectsV2, or V1 when ``v1``) for the front bucket from
    a botocore ListObjectsV2 result, with keys and common prefixes made relative to
    ``base_prefix``."""
    url_enc = query.get("encoding-type") == "url"

    def enc(s: str) -> str:
        return quote(s, safe="/") if url_enc else s

    contents = result.get("Contents", []) or []
    prefixes = result.get("CommonPrefixes", []) or []
    truncated = bool(result.get("IsTruncated"))
    root = ET.Element("ListBucketResult", xmlns=S3_NS)
    _sub(root, "Name", bucket)
    _sub(root, "Prefix", enc(query.get("prefix", "")))
    if v1:
        _sub(root, "Marker", enc(query.get("marker", "")))
        if truncated:
            # the last key or common prefix listed: where the next page starts
            last = [_strip(base_prefix, o["Key"]) for o in contents[-1:]]
            last += [_strip(base_prefix, p["Prefix"]) for p in prefixes[-1:]]
            if last:
                _sub(root, "NextMarker", enc(max(last)))
    if query.get("delimiter"):
        _sub(root, "Delimiter", enc(query["delimiter"]))
    if not v1 and query.get("start-after"):
        _sub(root, "StartAfter", enc(query["start-after"]))
    if not v1:
        _sub(root, "KeyCount", len(contents) + len(prefixes))
    _sub(root, "MaxKeys", list_params(query, "")["MaxKeys"])
    if url_enc:
        _sub(root, "EncodingType", "url")
    _sub(root, "IsTruncated", "true" if truncated else "false")
    if not v1 and "continuation-token" in query:
        _sub(root, "ContinuationToken", query["continuation-token"])  # even empty, as S3
    if not v1 and result.get("NextContinuationToken"):
        _sub(root, "NextContinuationToken", result["NextContinuationToken"])
    owner = v1 or query.get("fetch-owner") == "true"
    for obj in contents:
        c = ET.SubElement(root, "Contents")
        _sub(c, "Key", enc(_strip(base_prefix, obj["Key"])))
        _sub(c, "LastModified", _s3_time(obj.get("LastModified", "")))
        _sub(c, "ETag", obj.get("ETag", ""))
        _sub(c, "Size", obj.get("Size", 0))
        _sub(c, "StorageClass", obj.get("StorageClass", "STANDARD"))
        if owner:
            o = ET.SubElement(c, "Owner")
            theirs = obj.get("Owner") or {}
            _sub(o, "ID", theirs.get("ID", OWNER))
            _sub(o, "DisplayName", theirs.get("DisplayName", theirs.get("ID", OWNER)))
    for p in prefixes:
        cp = ET.SubElement(root, "CommonPrefixes")
        _sub(cp, "Prefix", enc(_strip(base_prefix, p["Prefix"])))
    return _xml(root)


def render_list_v2(
    bucket: str, query: Mapping[str, str], result: Mapping[str, Any], base_prefix: str
) -> bytes:
    """:func:`render_list` for ListObjectsV2."""
    return render_list(bucket, query, result, base_prefix)


def render_error(
    code: str,
    message: str,
    resource: str,
    request_id: str,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """An S3 ``<Error>`` body (``extra``: further elements, e.g. ActualObjectSize)."""
    root = ET.Element("Error")
    _sub(root, "Code", code)
    _sub(root, "Message", " ".join(message.split()))
    for tag, value in (extra or {}).items():
        _sub(root, tag, value)
    _sub(root, "Resource", resource)
    _sub(root, "RequestId", request_id)
    return _xml(root)


_CODE_RE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
_MESSAGE_RE = re.compile(rb"<Message>([^<]{0,1024})</Message>")


def store_error(body: bytes) -> tuple[str | None, str | None]:
    """The code and message of an S3 ``<Error>`` document (an upstream store's answer),
    or None for each when ``body`` is not one."""
    head = body[:65536]
    if b"<Error>" not in head:
        return None, None
    code, message = _CODE_RE.search(head), _MESSAGE_RE.search(head)
    return (
        code.group(1).decode() if code else None,
        message.group(1).decode("utf-8", "replace") if message else None,
    )


_AUTH_RE = re.compile(
    r"^AWS4-HMAC-SHA256\s+Credential=([^,\s]+)\s*,\s*SignedHeaders=([^,\s]+)\s*,"
    r"\s*Signature=([0-9a-fA-F]+)\s*$"
)


def _parse_amz_date(value: str) -> dt.datetime:
    try:
        return dt.datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    except (TypeError, ValueError):
        raise S3Error(403, "AccessDenied", "missing or malformed X-Amz-Date") from None


def _skew(when: dt.datetime, now: dt.datetime) -> str:
    return (
        f"the request was signed at {when:%Y-%m-%dT%H:%M:%SZ} and this proxy's clock says "
        f"{now:%Y-%m-%dT%H:%M:%SZ}: more than {int(MAX_SKEW.total_seconds() // 60)} minutes "
        "apart; fix the client's (or this host's) clock"
    )


def verify_sigv4(
    method: str,
    raw_path: str,
    query: Sequence[tuple[str, str]],
    headers: Mapping[str, str] | Any,
    access_key: str,
    secret_key: str,
    now: dt.datetime,
) -> None:
    """Check a SigV4-signed request (Authorization header or presigned query) against the
    key pair, recomputing the signature with botocore's S3 signer. Raises S3Error.

    ``raw_path`` is the path as sent (percent-encoded, no query); ``query`` the decoded
    query pairs; ``headers`` supports ``get`` and ``getall`` (aiohttp's CIMultiDict) or is
    a plain mapping.
    """
    from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    qd = dict(query)
    presigned = "X-Amz-Algorithm" in qd
    if presigned:
        if qd.get("X-Amz-Algorithm") != "AWS4-HMAC-SHA256":
            raise S3Error(400, "AuthorizationQueryParametersError", "unsupported algorithm")
        credential = qd.get("X-Amz-Credential", "")
        signed = qd.get("X-Amz-SignedHeaders", "")
        signature = qd.get("X-Amz-Signature", "")
        amz_date = qd.get("X-Amz-Date", "")
    else:
        m = _AUTH_RE.match(headers.get("Authorization", ""))
        if not m:
            raise S3Error(400, "AuthorizationHeaderMalformed", "malformed Authorization header")
        credential, signed, signature = m.groups()
        amz_date = headers.get("X-Amz-Date", "")
    parts = credential.split("/")
    if len(parts) != 5 or parts[3] != "s3" or parts[4] != "aws4_request":
        raise S3Error(400, "AuthorizationHeaderMalformed", "malformed credential scope")
    key_id, day, region = parts[0], parts[1], parts[2]
    if not hmac.compare_digest(key_id.encode(), access_key.encode()):
        raise S3Error(403, "InvalidAccessKeyId", "the access key ID is not known to this proxy")
    when = _parse_amz_date(amz_date)
    if day != amz_date[:8]:
        raise S3Error(403, "SignatureDoesNotMatch", "credential date does not match X-Amz-Date")
    if presigned:
        expires = qd.get("X-Amz-Expires", "")
        seconds = parse_decimal(expires)
        if seconds is None or seconds > MAX_PRESIGN_EXPIRES:
            raise S3Error(403, "AuthorizationQueryParametersError", "bad X-Amz-Expires")
        if now > when + dt.timedelta(seconds=seconds):
            raise S3Error(
                403,
                "AccessDenied",
                f"request has expired: signed {when:%Y-%m-%dT%H:%M:%SZ} for {expires} s, "
                f"now {now:%Y-%m-%dT%H:%M:%SZ}",
            )
        if when - now > MAX_SKEW:
            raise S3Error(403, "RequestTimeTooSkewed", _skew(when, now))
    elif abs(now - when) > MAX_SKEW:
        raise S3Error(403, "RequestTimeTooSkewed", _skew(when, now))

    signed_names = [h for h in signed.lower().split(";") if h]
    if "host" not in signed_names:
        raise S3Error(403, "AccessDenied", "the Host header must be signed")
    req_headers: dict[str, str] = {}
    for name in signed_names:
        if hasattr(headers, "getall"):
            values = headers.getall(name, [])
        else:
            values = [v for k, v in headers.items() if k.lower() == name]
        if not values:
            raise S3Error(403, "SignatureDoesNotMatch", f"signed header {name} is missing")
        req_headers[name] = ",".join(values)
    host = req_headers["host"]
    params = [(k, v) for k, v in query if k != "X-Amz-Signature"]
    request = AWSRequest(method=method.upper(), url=f"http://{host}{raw_path}", headers=req_headers)
    request.params = params  # the canonical query string is built from the decoded pairs
    request.context["timestamp"] = amz_date
    creds = Credentials(key_id, secret_key)
    signer_cls = S3SigV4QueryAuth if presigned else S3SigV4Auth
    signer = signer_cls(creds, "s3", region)
    if not params:
        request.params = {}
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if not hmac.compare_digest(expected.encode(), signature.lower().encode()):
        log.debug("SigV4 mismatch; canonical request was:\n%s", canonical)
        raise S3Error(
            403,
            "SignatureDoesNotMatch",
            "the request signature we calculated does not match the signature you provided; "
            "check the key pair given with --s3-front-access-key/--s3-front-secret-key",
        )


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
        target = classify_request(request.raw_path, self.buckets, host, self.domains)
        virtual = virtual_bucket(host, self.domains) is not None
        s3ish = virtual or is_s3_request(request.headers, request.query)
        if target.kind == "other":
            if not s3ish or self.catch_all or not _BUCKET_NAME_RE.match(target.bucket):
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
                raise S3Error(
                    404,
                    "NoSuchBucket",
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
        except S3Error as exc:
            return self._error(request, exc.status, exc.code, exc.message, resource, request_id)
        except ProxyError as exc:
            if not s3ish:
                raise
            answer = exc.answer
            if isinstance(answer, PassedAnswer):
                if answer.status < 400:
                    raise  # a success that is not the object: passed on as it was
                # the upstream's own error answer: its status, and its code when it is an
                # S3 error document (an S3 store behind an http(s) upstream)
                status = 403 if answer.status == 401 else answer.status
                code, message = store_error(answer.body)
                code = code or s3_code_for_status(status)
                message = message or str(exc)
                return self._error(request, status, code, message, resource, request_id)
            status, code = error_answer(exc)
            return self._error(request, status, code, str(exc), resource, request_id, exc)
        except web.HTTPException as exc:
            if not s3ish or exc.status < 400:
                raise
            code = s3_code_for_status(exc.status)
            msg = exc.text or exc.reason
            return self._error(request, exc.status, code, msg, resource, request_id)

    def _proxys_own(self, request: web.Request) -> bool:
        """True for a request the checks below would hand straight to the proxy (kind
        ``other``: no front bucket in its Host or first path segment, and no S3 client's
        request for a bucket the front lacks), told from its path and Host alone: with a
        catch-all upstream every such path is the proxy's, and without one a first segment
        that cannot name a bucket (``/-/...``) is. False: the full classification decides.
        A data request of a sidecar pays this test instead of classifying the request
        and scanning its headers for an S3 client (measured: see BENCHMARKS.md)."""
        path = request.raw_path.partition("?")[0]
        if path == "/":
            return False
        first = path[1:].partition("/")[0]
        if first in self.buckets:
            return False
        if not self.catch_all and _BUCKET_NAME_RE.match(first):
            return False
        if not self.domains:
            return True
        host = request.headers.get("Host")
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
        self,
        request: web.Request,
        status: int,
        code: str,
        message: str,
        resource: str,
        rid: str,
        exc: BaseException | None = None,
    ) -> web.Response:
        headers = {"x-amz-request-id": rid}
        extra: dict[str, Any] = {}
        content_range = (getattr(exc, "headers", None) or {}).get("Content-Range", "")
        if status == 416 and content_range.startswith("bytes */"):
            # what S3 says of a range past the end; the CRT (s3torchconnector) reads an
            # empty object's size from it
            headers["Content-Range"] = content_range
            extra["ActualObjectSize"] = content_range[len("bytes */") :]
        body = render_error(code, message, resource, rid, extra)
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        return web.Response(
            status=status, body=body, content_type="application/xml", headers=headers
        )

    # -- authentication

    def authenticate(self, request: web.Request) -> None:
        """Accept or reject the request (raises S3Error 403/400)."""
        signed = request.headers.get("Authorization", "").startswith("AWS") or any(
            k in request.query for k in ("X-Amz-Algorithm", "AWSAccessKeyId")
        )
        if not self.access_key:
            return
        if not signed:
            if self.allow_anonymous:
                return
            raise S3Error(403, "AccessDenied", "anonymous access is not allowed; sign requests")
        if request.headers.get("Authorization", "").startswith("AWS ") or (
            "AWSAccessKeyId" in request.query
        ):
            raise S3Error(400, "InvalidRequest", "SigV2 is not supported; use SigV4 (s3v4)")
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

    async def _store_buckets(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The upstream store's ListBuckets: creation date by bucket name, and its owner
        (``{}`` for either when there is no s3:// bucket or the store refuses: the proxy's
        credentials may read objects without being allowed to list buckets)."""
        if self.s3 is None or not any(b.startswith("s3://") for b in self.buckets.values()):
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
            raise S3Error(405, "MethodNotAllowed", "read-only cache: buckets can be listed only")
        dates, store_owner = await self._store_buckets()
        root = ET.Element("ListAllMyBucketsResult", xmlns=S3_NS)
        owner = ET.SubElement(root, "Owner")
        _sub(owner, "ID", store_owner.get("ID", OWNER))
        _sub(owner, "DisplayName", store_owner.get("DisplayName", store_owner.get("ID", OWNER)))
        bl = ET.SubElement(root, "Buckets")
        for name in sorted(self.buckets):
            base = self.buckets[name]
            created = dates.get(parse_s3_url(base).bucket) if base.startswith("s3://") else None
            b = ET.SubElement(bl, "Bucket")
            _sub(b, "Name", name)
            _sub(b, "CreationDate", _s3_time(created) if created else EPOCH)
        return web.Response(body=_xml(root), content_type="application/xml")

    async def _check_bucket(self, bucket: str) -> None:
        """Raise NoSuchBucket when the store says the upstream bucket of ``bucket`` does
        not exist (HeadBucket). Any other answer, a refusal included, leaves the bucket
        standing: credentials may read objects without being allowed HeadBucket."""
        base = self.buckets[bucket]
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
                raise S3Error(
                    404,
                    "NoSuchBucket",
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
            raise S3Error(405, "MethodNotAllowed", "read-only cache: buckets can be listed only")
        q = request.query
        if "location" in q:
            await self._check_bucket(bucket)
            root = ET.Element("LocationConstraint", xmlns=S3_NS)
            root.text = "" if self.region == "us-east-1" else self.region
            return web.Response(body=_xml(root), content_type="application/xml", headers=headers)
        if "versioning" in q:
            return await self._versioning(bucket, headers)
        other = [k for k in q if k not in LIST_PARAMS and k not in PRESIGN_PARAMS]
        if other:
            raise S3Error(501, "NotImplemented", f"bucket operation {other[0]!r} is not supported")
        if "list-type" in q and q["list-type"] != "2":
            raise S3Error(400, "InvalidArgument", f"invalid list-type {q['list-type']!r}")
        return await self._list(bucket, q, headers, v1="list-type" not in q)

    async def _versioning(self, bucket: str, headers: dict[str, str]) -> web.Response:
        """GetBucketVersioning as the store answers it (versionId reads go to the store);
        a bucket that is not S3 has never been versioned."""
        root = ET.Element("VersioningConfiguration", xmlns=S3_NS)
        base = self.buckets[bucket]
        if base.startswith("s3://") and self.s3 is not None:
            loc = parse_s3_url(base)
            await self.s3.ensure_started()
            try:
                result = await self.s3.client.get_bucket_versioning(Bucket=loc.bucket)
            except Exception as exc:
                raise botocore_error(f"s3://{loc.bucket}", exc, body=False) from exc
            for tag in ("Status", "MFADelete"):
                if result.get(tag):
                    _sub(root, tag, result[tag])
        return web.Response(body=_xml(root), content_type="application/xml", headers=headers)

    async def _list(
        self, bucket: str, query: Mapping[str, str], headers: dict[str, str], v1: bool
    ) -> web.Response:
        """ListObjects (V1) or ListObjectsV2 of a front bucket, from the upstream
        bucket's ListObjectsV2."""
        base = self.buckets[bucket]
        if base.startswith(("gs://", "az://")):
            return await self._list_cloud(bucket, base, query, headers, v1)
        if not base.startswith("s3://"):
            raise S3Error(501, "NotImplemented", f"bucket {bucket} is not backed by S3")
        if self.s3 is None:
            raise S3Error(503, "ServiceUnavailable", "the S3 client is not running")
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
            raise S3Error(503, "ServiceUnavailable", "the GCS/Azure client is not running")
        loc = parse_cloud_url(base)
        base_prefix = join_key(loc.key, "") if loc.key.strip("/") else ""
        params = list_params(query, base_prefix, v1)
        result = await self.cloud.list_objects_v2(loc.store_url, **params)
        body = render_list(bucket, query, result, base_prefix, v1)
        return web.Response(body=body, content_type="application/xml", headers=headers)

    # -- objects

    async def _object(self, request: web.Request, handler: Any, s3ish: bool) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise S3Error(
                405, "MethodNotAllowed", "read-only cache: objects can be read (GET, HEAD) only"
            )
        if s3ish and request.headers.get("x-amz-checksum-mode", "").upper() != "ENABLED":
            request[S3_NO_CHECKSUMS] = True
        if s3ish and request.query_string:
            keep = []
            version: str | None = None
            overrides: dict[str, str] = {}
            for k, v in request.query.items():
                if k in RESPONSE_OVERRIDES:
                    overrides[RESPONSE_OVERRIDES[k]] = v
                if k in IGNORABLE_OBJECT_PARAMS or k in PRESIGN_PARAMS:
                    continue
                if k == "partNumber" and v == "1":
                    continue  # an object uploaded in one piece is its own part 1
                if k == "partNumber":
                    raise S3Error(
                        416, "InvalidPartNumber", f"part {v} does not exist: objects are one part"
                    )
                if k == "versionId":
                    if not v:
                        raise S3Error(
                            400, "InvalidArgument", "Version id cannot be the empty string"
                        )
                    version = v
                    continue
                keep.append((k, v))
            if keep:
                raise S3Error(400, "InvalidArgument", f"unsupported query parameter {keep[0][0]!r}")
            if overrides:
                request[S3_OVERRIDES] = overrides
            # a version is an object of its own: its URL upstream and its cache key
            query = None if version is None else {"versionId": version}
            request = request.clone(rel_url=request.rel_url.with_query(query))
        resp = await handler(request)
        if s3ish and resp.status == 412 and not resp.prepared:
            # the proxy's own answer to a failed If-Match / If-Unmodified-Since
            raise S3Error(412, "PreconditionFailed", PRECONDITION_MESSAGE)
        return resp
