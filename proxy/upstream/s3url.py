"""``s3://`` URLs: parsing, joining keys, Range values. Pure, no client."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from shardcache.errors import BadRequest, RangeNotSatisfiable

__all__ = ["S3Location", "format_range", "join_key", "parse_s3_url"]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$", re.IGNORECASE)


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key (or key prefix)."""

    bucket: str
    key: str
    version_id: str | None = None  # one version of the key (``?versionId=``), else the latest

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def params(self) -> dict[str, str]:
        """botocore's object parameters: Bucket, Key and VersionId when one is named."""
        out = {"Bucket": self.bucket, "Key": self.key}
        if self.version_id is not None:
            out["VersionId"] = self.version_id
        return out


def parse_s3_url(url: str, *, quoted: bool = False) -> S3Location:
    """Split ``s3://bucket/key`` (the key may be empty or a prefix) into an S3Location.

    ``quoted=True`` percent-decodes the key (the proxy's canonical URLs quote each path
    segment) and reads ``versionId`` from the query, so that a version of an object is a
    URL (and a cache entry) of its own. Raises BadRequest naming the URL when it is not a
    valid s3 URL.
    """
    if not url.startswith("s3://"):
        raise BadRequest(f"{url!r}: not an s3:// URL")
    rest, query = url[len("s3://") :], ""
    if quoted:
        rest, _, query = rest.partition("?")
    version = dict(parse_qsl(query, keep_blank_values=True)).get("versionId")
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
    return S3Location(bucket, key, version)


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
