"""From a request to an upstream URL: mapping a request path (or an admin route's URL)
to the canonical upstream URL, the hosts an upstream may redirect to, and the cache key
of a signed URL. Pure: no I/O."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from shardcache.errors import BadRequest, Forbidden, NotFound

__all__ = [
    "DEFAULT_REDIRECT_HOSTS",
    "SIGNATURE_FAMILIES",
    "STORE_BASE",
    "Upstream",
    "map_request",
    "map_url",
    "unsigned_url",
]

# hosts an upstream may redirect to besides its own: the Hugging Face Hub's CDN and
# storage hosts, where its resolve URLs lead (see proxy.upstream.redirects)
DEFAULT_REDIRECT_HOSTS: tuple[str, ...] = ("*.hf.co", "*.huggingface.co", "huggingface.co")


# Query parameters that sign a URL or bound its validity, by the parameter whose presence
# says the URL is signed that way. Only a signed URL loses them (an ordinary query with an
# "st" or "expires" parameter keeps it): AWS SigV4 presigned URLs, SigV2 / CloudFront /
# GCS V2 signatures, GCS V4 signed URLs, Azure SAS tokens.
SIGNATURE_FAMILIES: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "x-amz-signature",
        frozenset(
            {
                "x-amz-algorithm",
                "x-amz-credential",
                "x-amz-date",
                "x-amz-expires",
                "x-amz-signedheaders",
                "x-amz-signature",
                "x-amz-security-token",
            }
        ),
    ),
    (
        "x-goog-signature",
        frozenset(
            {
                "x-goog-algorithm",
                "x-goog-credential",
                "x-goog-date",
                "x-goog-expires",
                "x-goog-signedheaders",
                "x-goog-signature",
            }
        ),
    ),
    (
        "signature",
        frozenset(
            {
                "signature",
                "expires",
                "awsaccesskeyid",
                "googleaccessid",
                "key-pair-id",
                "policy",
                "x-amz-security-token",
            }
        ),
    ),
    (
        "sig",
        frozenset(
            {
                "sig",
                "sv",
                "ss",
                "srt",
                "sp",
                "se",
                "st",
                "spr",
                "sr",
                "si",
                "sip",
                "skoid",
                "sktid",
                "skt",
                "ske",
                "sks",
                "skv",
                "saoid",
                "suoid",
                "scid",
                "sdd",
                "ses",
            }
        ),
    ),
)


def unsigned_url(url: str) -> str:
    """``url`` without the parameters that sign it or bound its validity (see
    :data:`SIGNATURE_FAMILIES`), the other parameters in their order; ``url`` itself,
    unchanged, when it is not signed. The cache key of a signed URL: the same object
    under a fresh signature is the same entry."""
    base, sep, query = url.partition("?")
    if not sep or not query:
        return url
    pairs = query.split("&")
    names = [unquote(p.partition("=")[0]).lower() for p in pairs]
    present = set(names)
    drop: set[str] = set()
    for marker, family in SIGNATURE_FAMILIES:
        if marker in present:
            drop |= family
    if not drop:
        return url
    kept = [p for p, n in zip(pairs, names, strict=True) if n not in drop]
    return base + ("?" + "&".join(kept) if kept else "")


@dataclass(frozen=True)
class Upstream:
    """An upstream base URL, optionally mounted under ``/<name>/``."""

    name: str | None
    base: str  # no trailing slash, but for ``s3://``: every bucket of the S3 store

    def __str__(self) -> str:
        return f"{self.name}={self.base}" if self.name else self.base

    @property
    def root(self) -> str:
        """What every URL under this upstream starts with: the base and a slash
        (``s3://``, the whole store, ends in one already)."""
        return self.base if self.base.endswith("/") else self.base + "/"

    @property
    def whole_store(self) -> bool:
        """Whether this upstream is every bucket of the S3 store (``s3://``): ``/BUCKET/KEY``
        maps to ``s3://BUCKET/KEY``."""
        return self.base == STORE_BASE


# the unnamed upstream that serves every bucket of the S3 store under its own name
STORE_BASE = "s3://"
_SEGMENT_SAFE = "!$&'()*+,;=:@~"
_ABSOLUTE_RE = re.compile(r"^/(https?):/{1,2}(.*)$", re.IGNORECASE | re.DOTALL)


def _clean_segments(raw_segments: Sequence[str], what: str) -> list[str]:
    """Percent-decode path segments and reject traversal; return re-quoted segments."""
    out: list[str] = []
    for raw in raw_segments:
        seg = unquote(raw, errors="strict") if "%" in raw else raw
        if seg in (".", ".."):
            raise BadRequest(f"path traversal not allowed in {what}")
        if "/" in seg or "\\" in seg:
            raise BadRequest(f"encoded slash or backslash not allowed in {what}")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in seg):
            raise BadRequest(f"control character not allowed in {what}")
        out.append(quote(seg, safe=_SEGMENT_SAFE))
    return out


def _host_allowed(netloc_host: str, port: int | None, allow_hosts: Iterable[str]) -> bool:
    for allowed in allow_hosts:
        allowed = allowed.strip().lower()
        if not allowed:
            continue
        if ":" in allowed and not allowed.startswith("["):
            host, _, p = allowed.rpartition(":")
            if host == netloc_host and p.isdigit() and port == int(p):
                return True
        elif allowed == netloc_host:
            return True
    return False


def map_request(
    raw_target: str,
    upstreams: Sequence[Upstream],
    allow_hosts: Sequence[str] = (),
    max_length: int = 1024,
) -> str:
    """Map the raw request target (path and query, still percent-encoded) to the
    canonical upstream URL that is both fetched and used as the cache key.

    ``/<path>`` goes to the unnamed upstream, ``/<name>/<path>`` to the upstream mounted as
    ``name``, and ``/http(s)://host/<path>`` to that host only if it is in ``allow_hosts``.
    Raises BadRequest (traversal, NUL or control characters, over-long, malformed),
    Forbidden (a host not allowed) or NotFound (no upstream serves the path).
    """
    if len(raw_target) > max_length:
        raise BadRequest(f"request path longer than {max_length} characters")
    if "\x00" in raw_target or "%00" in raw_target:
        raise BadRequest("NUL byte not allowed in path")
    if not raw_target.startswith("/"):
        raise BadRequest("request target must be an absolute path")
    path, _, query = raw_target.partition("?")
    path = path.partition("#")[0]
    try:
        m = _ABSOLUTE_RE.match(path)
        if m:
            return _map_absolute(m.group(1).lower(), m.group(2), query, allow_hosts)
        segments = path[1:].split("/")
        if segments and segments[-1] == "":
            segments = segments[:-1]
        clean = _clean_segments(segments, "path")
    except UnicodeDecodeError as exc:
        raise BadRequest("path is not valid percent-encoded UTF-8") from exc
    if not clean or any(s == "" for s in clean):
        raise NotFound("empty path segment or no shard path" if clean else "no shard path given")
    named = {u.name: u for u in upstreams if u.name}
    default = next((u for u in upstreams if not u.name), None)
    if clean[0] in named and len(clean) > 1:
        up, rest = named[clean[0]], clean[1:]
    elif default is not None:
        up, rest = default, clean
    else:
        raise NotFound(f"no upstream serves /{'/'.join(clean)}")
    url = up.root + "/".join(rest)
    return url + ("?" + query if query else "")


def _map_absolute(scheme: str, rest: str, query: str, allow_hosts: Sequence[str]) -> str:
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise BadRequest("credentials not allowed in an absolute URL")
    parts = urlsplit(f"{scheme}://{authority}")
    try:
        host, port = (parts.hostname or ""), parts.port
    except ValueError as exc:
        raise BadRequest(f"bad host in absolute URL: {authority!r}") from exc
    if not host:
        raise BadRequest("absolute URL without a host")
    if not _host_allowed(host, port, allow_hosts):
        raise Forbidden(f"host {host} is not allowed (see --allow-host)")
    segments = path.split("/") if slash else []
    if segments and segments[-1] == "":
        segments = segments[:-1]
    clean = _clean_segments(segments, "path")
    if not clean or any(s == "" for s in clean):
        raise NotFound("no shard path given in absolute URL")
    netloc = host if port is None else f"{host}:{port}"
    url = f"{scheme}://{netloc}/" + "/".join(clean)
    return url + ("?" + query if query else "")


def map_url(
    url: str, upstreams: Sequence[Upstream], allow_hosts: Sequence[str] = (), max_length: int = 1024
) -> str:
    """Canonicalise a URL or proxy path given to an admin route (prefetch, purge).

    A proxy path (``/shard.tar``) is mapped like a request; an absolute URL must lie under
    a configured upstream or on an allowed host, otherwise Forbidden (never an open proxy).
    """
    if url.startswith("/"):
        return map_request(url, upstreams, allow_hosts, max_length)
    for u in upstreams:
        if url.startswith(u.root):
            rest = "/" + url[len(u.root) :]
            prefix = f"/{u.name}" if u.name else ""
            return map_request(prefix + rest, upstreams, allow_hosts, max_length + len(prefix))
    if re.match(r"^https?://", url, re.IGNORECASE):
        return map_request("/" + url, upstreams, allow_hosts, max_length + 1)
    raise Forbidden(f"{url} is not under a configured upstream")
