"""The S3 front's XML: listing parameters read from a request's query, and the
answers written (ListObjects V1/V2, ListBuckets, bucket facts, ``<Error>``). Pure."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote
from xml.etree import ElementTree as ET

from proxy.errormap import InvalidArgument
from shardcache.meta import parse_decimal

__all__ = [
    "EPOCH",
    "OWNER",
    "S3_NS",
    "list_params",
    "render_buckets",
    "render_error",
    "render_list",
    "render_list_v2",
    "render_location",
    "render_versioning",
]

S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
EPOCH = "1970-01-01T00:00:00.000Z"  # the creation date of a bucket the store cannot date
OWNER = "shardcache"  # the owner named when the store names none (or is not S3)


def _int_param(query: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    value = parse_decimal(raw)
    if value is None:
        raise InvalidArgument(f"{name} must be a non-negative integer")
    return max(lo, min(hi, value))


# past every key that starts with a common prefix: where a V1 listing resumes after one
_AFTER_PREFIX = "\U0010ffff"


def list_params(query: Mapping[str, str], base_prefix: str, v1: bool = False) -> dict[str, Any]:
    """botocore ListObjectsV2 parameters for a front listing (V2, or V1 when ``v1``) of a
    bucket mapped to ``base_prefix`` (``""`` or ``"data/"``) in the upstream bucket."""
    encoding = query.get("encoding-type")
    if encoding not in (None, "", "url"):
        raise InvalidArgument(f"invalid encoding-type {encoding!r}")
    if query.get("allow-unordered") == "true" and query.get("delimiter"):
        # an unordered listing cannot group keys under a delimiter (the store says so)
        raise InvalidArgument("allow-unordered cannot be used with a delimiter")
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

    # the fields S3 url-encodes besides keys and common prefixes (and botocore decodes):
    # V1 its Delimiter, Marker and NextMarker, V2 its Delimiter, Prefix and StartAfter
    def prefix_enc(s: str) -> str:
        return s if v1 else enc(s)

    contents = result.get("Contents", []) or []
    prefixes = result.get("CommonPrefixes", []) or []
    truncated = bool(result.get("IsTruncated"))
    root = ET.Element("ListBucketResult", xmlns=S3_NS)
    _sub(root, "Name", bucket)
    _sub(root, "Prefix", prefix_enc(query.get("prefix", "")))
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


def render_buckets(owner: Mapping[str, str], buckets: Mapping[str, Any]) -> bytes:
    """A ListAllMyBucketsResult: the store's ``owner`` (``{}``: the front's own) and
    each front bucket's creation date (None: the front cannot date it)."""
    root = ET.Element("ListAllMyBucketsResult", xmlns=S3_NS)
    who = ET.SubElement(root, "Owner")
    _sub(who, "ID", owner.get("ID", OWNER))
    _sub(who, "DisplayName", owner.get("DisplayName", owner.get("ID", OWNER)))
    bl = ET.SubElement(root, "Buckets")
    for name in sorted(buckets):
        created = buckets[name]
        b = ET.SubElement(bl, "Bucket")
        _sub(b, "Name", name)
        _sub(b, "CreationDate", _s3_time(created) if created else EPOCH)
    return _xml(root)


def render_location(region: str) -> bytes:
    """A GetBucketLocation answer (us-east-1 is said as nothing, as S3 does)."""
    root = ET.Element("LocationConstraint", xmlns=S3_NS)
    root.text = "" if region == "us-east-1" else region
    return _xml(root)


def render_versioning(result: Mapping[str, Any]) -> bytes:
    """A GetBucketVersioning answer from the store's (``{}``: never versioned)."""
    root = ET.Element("VersioningConfiguration", xmlns=S3_NS)
    for tag in ("Status", "MFADelete"):
        if result.get(tag):
            _sub(root, tag, result[tag])
    return _xml(root)
