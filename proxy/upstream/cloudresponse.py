"""What GCS and Azure say through obstore, in the terms of an HTTP origin's answer: an
object's metadata as :class:`~shardcache.meta.ObjectMeta` (stored header fields, user
metadata, the GCS generation), a ``Range`` header as obstore's range, an object key as
obstore reads it, and :class:`CloudResponse`, an answer whose body is obstore's stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any

from proxy.upstream.cloudurl import CloudLocation
from proxy.upstream.errors import cloud_error
from proxy.upstream.options import DEFAULT_OPTIONS as DEFAULTS
from proxy.upstream.s3 import S3Response
from shardcache.errors import BadRequest, ProxyError, UpstreamCut
from shardcache.meta import ObjectMeta

__all__ = ["CloudResponse"]

# obstore attribute names that are HTTP header fields of the object as stored
_STANDARD = ("Content-Encoding", "Content-Language", "Content-Disposition", "Cache-Control")
_META_PREFIX = {"gs": "x-goog-meta-", "az": "x-ms-meta-"}


def _http_date(value: Any) -> str | None:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return format_datetime(value.astimezone(timezone.utc), usegmt=True)
    return None


def _quoted(etag: str | None) -> str | None:
    if not etag:
        return None
    return etag if etag.startswith(('"', 'W/"')) else f'"{etag}"'


def _object_meta(scheme: str, meta: Mapping[str, Any], attributes: Mapping[str, str]) -> ObjectMeta:
    """An :class:`ObjectMeta` from obstore's object metadata and attributes: the stored
    header fields and user metadata (``x-goog-meta-*`` / ``x-ms-meta-*``) kept as fields
    that travel with the bytes, the GCS generation as ``x-goog-generation``."""
    fields: list[tuple[str, str]] = []
    content_type = None
    for name, value in attributes.items():
        if name == "Content-Type":
            content_type = value
        elif name in _STANDARD:
            fields.append((name, value))
        elif name != "Storage-Class":
            fields.append((_META_PREFIX[scheme] + name, value))
    if scheme == "gs" and meta.get("version"):
        fields.append(("x-goog-generation", str(meta["version"])))
    return ObjectMeta(
        size=int(meta["size"]),
        etag=_quoted(meta.get("e_tag")),
        last_modified=_http_date(meta.get("last_modified")),
        content_type=content_type,
        accept_ranges=True,
        fields=tuple(fields),
    )


def _range(header: str | None) -> tuple[int, int | None] | int | None:
    """``(first, last_inclusive_or_None)`` of a single ``bytes=`` range, ``-n`` (an int,
    negative) for a suffix, None for no range or one obstore cannot send (several
    ranges: the whole object answers, as an HTTP origin may)."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    try:
        if not dash:
            return None
        if not first:
            return -int(last)
        return int(first), (int(last) if last else None)
    except ValueError:
        return None


def _object_key(url: str, loc: CloudLocation) -> str:
    """``loc``'s key as obstore reads it. obstore's paths have no empty, ``.`` or ``..``
    segments and drop a leading or trailing ``/``: such a key would name another object
    (``dir/`` would read ``dir``), so it is refused rather than served."""
    key = loc.key
    segments = key.split("/")
    if not key or any(s in ("", ".", "..") for s in segments):
        raise BadRequest(
            f"{url}: object names with empty, '.' or '..' segments (or a leading or "
            f"trailing '/') cannot be read from {loc.scheme}:// upstreams"
        )
    return key


class CloudResponse(S3Response):
    """An answer of GCS or Azure as an HTTP origin would send it (headers as
    :class:`S3Response` builds them); its body is obstore's stream."""

    def __init__(
        self,
        url: str,
        scheme: str,
        status: int,
        meta: ObjectMeta,
        start: int,
        length: int,
        body: Any = None,
    ) -> None:
        super().__init__(url, status, meta, start, length, body)
        self.scheme = scheme

    async def chunks(self, chunk_size: int = DEFAULTS.chunk_size) -> AsyncIterator[bytes]:
        got = 0
        if self._body is None:
            return
        try:
            async for chunk in self._body.stream(min_chunk_size=chunk_size):
                got += len(chunk)
                yield chunk
        except ProxyError:
            raise
        except Exception as exc:
            raise cloud_error(self.url, self.scheme, exc, body=True) from exc
        finally:
            if got != self.length:
                self._body = None  # abandoned: obstore drops the connection with it
        if got != self.length:
            raise UpstreamCut(f"{self.url}: body ended after {got} of {self.length} bytes")

    iter_chunks = chunks

    def close(self) -> None:
        self._body = None
