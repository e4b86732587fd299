"""The S3 front's reading of a request, pure: which bucket and key it names (path or
virtual-hosted style), whether an S3 SDK sent it, and what the query of an object read
asks (a version, ``response-*`` overrides)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.errormap import InvalidArgument, InvalidPartNumber

__all__ = [
    "FrontRequest",
    "IGNORABLE_OBJECT_PARAMS",
    "LIST_PARAMS",
    "PRESIGN_PARAMS",
    "RESPONSE_OVERRIDES",
    "ObjectQuery",
    "classify_request",
    "is_bucket_name",
    "is_s3_request",
    "object_query",
    "virtual_bucket",
]

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
    store: bool = False,
) -> FrontRequest:
    """Classify a raw request path (no query) against the front's bucket names.

    With ``host`` under one of ``domains`` (``BUCKET.DOMAIN[:PORT]``, virtual-hosted
    style) the bucket comes from the Host and the whole path is the key; a bucket the
    front does not have is kind ``"nobucket"``. Otherwise the first path segment names
    the bucket (path style). With ``store`` (the whole S3 store behind the front) every
    name shaped like a bucket's is one: the store says whether it exists."""
    path = raw_path.partition("?")[0]
    names = set(buckets)
    vbucket = virtual_bucket(host, domains)
    if vbucket is not None:
        if vbucket not in names and not (store and is_bucket_name(vbucket)):
            return FrontRequest("nobucket", vbucket)
        key = path[1:]
        return FrontRequest("object", vbucket, key) if key else FrontRequest("bucket", vbucket)
    if path == "/":
        return FrontRequest("service")
    bucket, slash, key = path[1:].partition("/")
    if bucket not in names and not (store and is_bucket_name(bucket)):
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


def is_bucket_name(name: str) -> bool:
    """Whether ``name`` is shaped like an S3 bucket name (3-63 of a-z, 0-9, ``.``, ``-``)."""
    return bool(_BUCKET_NAME_RE.match(name))


@dataclass(frozen=True)
class ObjectQuery:
    """What the query of a GetObject/HeadObject asks: a version (None: the current one)
    and the ``response-*`` overrides of its answer's fields."""

    version: str | None
    overrides: Mapping[str, str]


def object_query(query: Iterable[tuple[str, str]]) -> ObjectQuery:
    """Read the query of a GetObject/HeadObject; an S3 error for a parameter the front
    does not take (an object is one part; a version id is never empty)."""
    keep = []
    version: str | None = None
    overrides: dict[str, str] = {}
    for k, v in query:
        if k in RESPONSE_OVERRIDES:
            overrides[RESPONSE_OVERRIDES[k]] = v
        if k in IGNORABLE_OBJECT_PARAMS or k in PRESIGN_PARAMS:
            continue
        if k == "partNumber" and v == "1":
            continue  # an object uploaded in one piece is its own part 1
        if k == "partNumber":
            raise InvalidPartNumber(f"part {v} does not exist: objects are one part")
        if k == "versionId":
            if not v:
                raise InvalidArgument("Version id cannot be the empty string")
            version = v
            continue
        keep.append((k, v))
    if keep:
        raise InvalidArgument(f"unsupported query parameter {keep[0][0]!r}")
    return ObjectQuery(version, overrides)
