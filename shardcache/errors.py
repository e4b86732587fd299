"""The exceptions shardcache raises.

Every error is a :class:`ShardcacheError`; third-party errors are translated at the
boundary (``raise GopenError(...) from exc``) so callers catch one family::

    ShardcacheError
    ├── GopenError (also OSError; alias GopenException)  -- opening/reading a URL failed
    │   └── HTTPStatusError                               -- an HTTP server answered >= 400
    ├── ShardFormatError (also ValueError)                -- a tar shard is truncated or corrupt
    ├── ProxyURLError (also ValueError)                   -- a URL cannot be rewritten for a proxy
    ├── CacheError (also OSError)                         -- the on-disk store failed
    │   ├── IncompleteDownloadError                       -- a source ended before its promised size
    │   ├── NoRoomError                                   -- a download no longer fits cache_size
    │   ├── StoreWriteError                               -- the disk or index refused a write
    │   └── StoreUnusable                                 -- the store cannot be opened for writing
    ├── dbcache.DBCacheError                              -- a DBCache file cannot be used
    ├── ConfigError (also ValueError)                     -- a bad setting; names the flag
    └── ProxyError                                        -- carries a status hint to answer with
        ├── BadRequest (400) / Forbidden (403) / NotFound (404)
        ├── MethodNotAllowed (405) / RangeNotSatisfiable (416)
        └── UpstreamError (502)                           -- the upstream failed us
            ├── UpstreamTimeout (504)
            ├── UpstreamThrottled (503)                   -- overloaded; retried with backoff
            ├── UpstreamCut (502)                         -- a body broke off mid-way
            ├── ObjectChanged (502)                       -- another version answered
            ├── DigestMismatch (502)                      -- bytes unlike the declared digest
            └── DownloadFailed (502)                      -- the download a client followed

Errors that the proxy turns into responses carry, from construction on, what a client
must be told of them: a ``status_hint`` (after h11's ``ProtocolError``), and where they
know more, a code (``s3_code``: an S3 store's own name for the failure), header fields,
the size of the object a range missed, the methods allowed, or the upstream's answer to
pass on. The library raises; the daemon maps (``proxy.errormap.error_answer``, the one
place that turns an error into an HTTP or S3 answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "ShardcacheError",
    "GopenError",
    "GopenException",
    "HTTPStatusError",
    "ShardFormatError",
    "ProxyURLError",
    "CacheError",
    "IncompleteDownloadError",
    "NoRoomError",
    "StoreWriteError",
    "StoreUnusable",
    "ConfigError",
    "ProxyError",
    "BadRequest",
    "Forbidden",
    "NotFound",
    "MethodNotAllowed",
    "RangeNotSatisfiable",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamThrottled",
    "UpstreamCut",
    "ObjectChanged",
    "DigestMismatch",
    "DownloadFailed",
]


# how to get the s3 extra (aiobotocore, boto3): the package is installed from a checkout or
# from git, not from a package index
S3_EXTRA_HINT = (
    "install the s3 extra: pip install '.[s3]' in a checkout of shardcache "
    "(or into this environment: pip install aiobotocore boto3)"
)


class ShardcacheError(Exception):
    """Base class of every error raised by shardcache."""


class GopenError(ShardcacheError, OSError):
    """Opening or reading a URL failed. The message names the URL and the cause."""

    def __init__(self, url: str, cause: str) -> None:
        self.url = url
        self.cause = cause
        super().__init__(f"{url}: {cause}")

    def __str__(self) -> str:
        return f"{self.url}: {self.cause}"

    def __reduce__(self):  # picklable across DataLoader worker processes
        return (type(self), (self.url, self.cause))


GopenException = GopenError


class HTTPStatusError(GopenError):
    """An HTTP server answered with an error status."""

    def __init__(self, url: str, status: int, reason: str = "") -> None:
        self.status = status
        self.reason = reason
        super().__init__(url, f"HTTP {status} {reason}".rstrip())

    def __reduce__(self):
        return (type(self), (self.url, self.status, self.reason))


class ShardFormatError(ShardcacheError, ValueError):
    """A tar shard is truncated or corrupt. The message names the URL."""


class ProxyURLError(ShardcacheError, ValueError):
    """A URL, upstream spec or proxy address cannot be rewritten to go through a proxy."""


class CacheError(ShardcacheError, OSError):
    """The on-disk cache store failed."""


class IncompleteDownloadError(CacheError):
    """A source ended before delivering the number of bytes it promised."""

    def __init__(self, name: str, received: int, expected: int | None) -> None:
        self.name = name
        self.received = received
        self.expected = expected
        want = "an unknown size" if expected is None else f"{expected} bytes"
        super().__init__(f"{name}: incomplete download, got {received} bytes of {want}")

    def __reduce__(self):
        return (type(self), (self.name, self.received, self.expected))


class NoRoomError(CacheError):
    """A download of unknown size outgrew the room ``cache_size`` leaves; it was discarded."""

    def __init__(self, url: str, size: int, limit: int) -> None:
        self.url = url
        self.size = size
        self.limit = limit
        super().__init__(f"{url}: {size} bytes do not fit in a cache of {limit} bytes")

    def __reduce__(self):
        return (type(self), (self.url, self.size, self.limit))


class StoreWriteError(CacheError):
    """The store could not write: disk full (ENOSPC), quota (EDQUOT), I/O error (EIO),
    read-only filesystem or index (EROFS), file too large (EFBIG).

    ``op`` names what failed (``write``, ``create``, ``commit``, ``index``); ``errno`` is
    the errno number (None when unknown) and ``errno_name`` its symbol. Callers stop
    caching and pass bytes through; the store is no worse than before the write.
    """

    def __init__(self, op: str, path: str, errno_: int | None, detail: str) -> None:
        super().__init__(f"{path}: cannot {op}: {detail}")
        self.op = op
        self.path = path
        self.errno = errno_
        self.detail = detail

    @property
    def errno_name(self) -> str:
        import errno as _errno

        return _errno.errorcode.get(self.errno or 0, "EUNKNOWN")

    def __reduce__(self):
        return (type(self), (self.op, self.path, self.errno, self.detail))


class StoreUnusable(CacheError):
    """The cache directory or its index cannot be used at all (not creatable, not
    writable, from a newer format). The message names the path, the uid and what to do."""


class ConfigError(ShardcacheError, ValueError):
    """A bad configuration value. ``flag`` names the option (e.g. ``--cache-size``)."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(f"{flag}: {message}")

    def __reduce__(self):
        return (type(self), (self.flag, str(self).split(": ", 1)[-1]))


class ProxyError(ShardcacheError):
    """An error the proxy answers with ``status_hint`` and a one-line message.

    Everything else a client is told is given at construction and never changed after:
    ``s3_code`` (an S3 store's own code for the failure, kept for the S3 front; None:
    the daemon's code for the class or status), ``headers`` (fields of the answer, e.g.
    a redirect's Location) and ``answer`` (the upstream's own answer, passed on as it
    was)."""

    status_hint: int = 500
    s3_code: str | None = None
    headers: Mapping[str, str] = MappingProxyType({})
    # what the upstream answered, to be passed on to the client as it was (its status,
    # end-to-end fields and a small body), when the error comes from such an answer
    answer: object | None = None

    def __init__(
        self,
        message: str,
        status_hint: int | None = None,
        *,
        answer: object | None = None,
        s3_code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        if status_hint is not None:
            self.status_hint = status_hint
        if answer is not None:
            self.answer = answer
        if s3_code is not None:
            self.s3_code = s3_code
        if headers:
            self.headers = MappingProxyType(dict(headers))


class BadRequest(ProxyError):
    status_hint = 400


class Forbidden(ProxyError):
    """Access refused; also an upstream's 401/403, which refused the proxy's own
    credentials (not the client's), so the client is never asked to authenticate."""

    status_hint = 403


class NotFound(ProxyError):
    status_hint = 404


class MethodNotAllowed(ProxyError):
    """A method the route does not take; ``allow`` names the ones it does."""

    status_hint = 405

    def __init__(self, message: str, *, allow: str = "GET, HEAD", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.allow = allow


class RangeNotSatisfiable(ProxyError):
    """A byte range the object does not have; ``size``: the object's size, when known
    (its answer then says ``Content-Range: bytes */size``)."""

    status_hint = 416

    def __init__(self, message: str, *, size: int | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.size = size


class UpstreamError(ProxyError):
    status_hint = 502


class UpstreamTimeout(UpstreamError):
    status_hint = 504


class UpstreamThrottled(UpstreamError):
    """The upstream is overloaded (429, 503, S3 SlowDown): retried with backoff, then
    answered 503 so the client backs off too."""

    status_hint = 503


class UpstreamCut(UpstreamError):
    """An upstream body broke off (reset, timeout, bad framing, fewer bytes than
    promised). A download resumes after it when the version can be pinned."""


class ObjectChanged(UpstreamError):
    """Another version of the object answered (412, or a different ETag, Last-Modified or
    size): bytes of two versions are never joined."""


class DigestMismatch(UpstreamError):
    """The bytes received do not have a digest the upstream declared for them (Content-MD5,
    x-goog-hash, an S3 ETag or checksum, the Hub's sha256): never committed nor served
    as a clean end."""


class DownloadFailed(UpstreamError):
    """The download a client was following failed; a response already started must be
    aborted, never ended cleanly."""

    def __init__(self, url: str, cause: BaseException | None) -> None:
        self.url = url
        self.cause = cause
        super().__init__(f"{url}: download failed: {cause}")

    def __reduce__(self):
        return (type(self), (self.url, self.cause))
