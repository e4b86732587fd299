"""Each backend's failures mapped onto the project's error tree, one table per backend.

What a client is then told (HTTP status, S3 code) is decided in one place,
:func:`proxy.errormap.error_answer`. Failures *during* a body are :class:`UpstreamCut`
(or :class:`UpstreamTimeout`), which a download may resume after; failures before an
answer are final for that request.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin

import aiohttp

from shardcache.errors import (
    Forbidden,
    NotFound,
    ObjectChanged,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamCut,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)

__all__ = [
    "CREDENTIALS_HINT",
    "PASS_LIMIT",
    "PassedAnswer",
    "REDIRECTS",
    "UpstreamRedirect",
    "botocore_error",
    "aiohttp_error",
    "cloud_error",
    "cloud_status_error",
    "file_error",
    "s3_error",
    "socket_error",
    "status_error",
    "store_error",
]

CREDENTIALS_HINT = (
    "check the AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "~/.aws/credentials) and that they may read this bucket"
)

# -- HTTP statuses (every http(s) transport; S3 errors without a code) --------------------

_STATUS: dict[int, type[ProxyError]] = {
    401: Forbidden,  # the upstream refused the proxy's credentials, not the client's
    403: Forbidden,
    404: NotFound,
    410: NotFound,
    412: ObjectChanged,
    416: RangeNotSatisfiable,
    408: UpstreamThrottled,
    429: UpstreamThrottled,
    503: UpstreamThrottled,
    504: UpstreamTimeout,
}


@dataclass(frozen=True)
class PassedAnswer:
    """An upstream's answer that is passed to the client as it was: its status and
    reason, end-to-end header fields and body (small: error pages, empty successes)."""

    status: int
    reason: str
    fields: tuple[tuple[str, str], ...]
    body: bytes


PASS_LIMIT = 1 << 20  # an answer body larger than this is not passed on (nor held in memory)


def status_error(
    url: str, status: int, reason: str | None = "", answer: PassedAnswer | None = None
) -> ProxyError:
    """The error for an upstream answer with ``status`` where the bytes were due, carrying
    the ``answer`` to pass on when there is one. The class says what it means to the
    proxy (NotFound, throttled...); without an answer, other 4xx keep their status and
    other statuses become 502."""
    text = f"upstream {url} answered {status} {reason or ''}".rstrip()
    cls = _STATUS.get(status)
    if cls is Forbidden:
        return Forbidden(f"{text}: the upstream refused the proxy's own credentials", answer=answer)
    if cls is not None:
        return cls(text, answer=answer)
    if 400 <= status < 500:
        return ProxyError(text, status_hint=status, answer=answer)
    return UpstreamError(text, answer=answer)


# -- transports: exceptions raised while connecting or reading ---------------------------


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def aiohttp_error(url: str, exc: BaseException, *, body: bool) -> ProxyError:
    """An aiohttp failure: before the answer (``body=False``) or while reading it."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamTimeout(f"upstream {url} timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(f"upstream {url} unreachable: {exc.os_error or exc}")
    if isinstance(exc, aiohttp.ClientResponseError) and not body:
        # an answer that does not parse (bytes left over from a previous answer whose
        # length lied, a bad status line): asked again like a body that broke off. Its
        # message quotes the stray bytes: only the start of its first line is kept.
        first = _describe(exc).splitlines()[0].split("\\n")[0][:120]
        return UpstreamCut(f"upstream {url}: malformed answer: {first}")
    if body:
        return UpstreamCut(f"upstream {url}: body broke off: {_describe(exc)}")
    return UpstreamError(f"upstream {url} failed: {_describe(exc)}")


def socket_error(
    url: str, exc: BaseException, *, body: bool, connecting: bool = False
) -> ProxyError:
    """A blocking-socket (``http.client``) failure."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return UpstreamTimeout(f"upstream {url} timed out")
    if connecting:
        return UpstreamError(f"upstream {url} unreachable: {_describe(exc)}")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return UpstreamError(f"upstream {url}: TLS certificate refused: {exc}")
    if body and isinstance(exc, (OSError, http.client.HTTPException)):
        return UpstreamCut(f"upstream {url}: body broke off: {_describe(exc)}")
    return UpstreamError(f"upstream {url} failed: {_describe(exc)}")


def file_error(url: str, exc: BaseException, *, body: bool) -> ProxyError:
    """A ``file://`` upstream's OSError."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return NotFound(f"upstream {url}: no such file")
    if isinstance(exc, PermissionError):
        return Forbidden(f"upstream {url}: permission denied")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return UpstreamTimeout(f"upstream {url} timed out reading the file")
    if body:
        return UpstreamCut(f"upstream {url}: {_describe(exc)}")
    return UpstreamError(f"upstream {url}: {getattr(exc, 'strerror', None) or exc}")


# -- S3: error codes and botocore exceptions ---------------------------------------------

_S3_CODES: dict[str, type[ProxyError]] = {
    **dict.fromkeys(("NoSuchKey", "NoSuchBucket", "NotFound", "404"), NotFound),
    **dict.fromkeys(
        (
            "AccessDenied",
            "Forbidden",
            "403",
            "401",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "TokenRefreshRequired",
            "AllAccessDisabled",
            "AccountProblem",
        ),
        Forbidden,
    ),
    **dict.fromkeys(("PreconditionFailed", "412"), ObjectChanged),
    **dict.fromkeys(("InvalidRange", "416"), RangeNotSatisfiable),
    **dict.fromkeys(
        (
            "SlowDown",
            "Throttling",
            "ThrottlingException",
            "ThrottledException",
            "RequestThrottled",
            "RequestLimitExceeded",
            "TooManyRequestsException",
            "ServiceUnavailable",
            "503",
            "InternalError",
            "500",
        ),
        UpstreamThrottled,
    ),
    **dict.fromkeys(("RequestTimeout",), UpstreamTimeout),
}


def s3_error(url: str, code: str, status: int, message: str = "") -> ProxyError:
    """The error for an S3 error response (``code`` as S3 names it, may be empty). A
    client refusal that keeps its status (NoSuchBucket, AccessDenied...) keeps the
    store's code too, for the S3 front's clients."""
    cls, text = _s3_error(url, code, status, message)
    keep = code and not code.isdigit() and 400 <= status < 500 and status == cls.status_hint
    return cls(text, s3_code=code if keep else None)


def _s3_error(url: str, code: str, status: int, message: str) -> tuple[type[ProxyError], str]:
    detail = f"{code or status}" + (f": {message}" if message and message != code else "")
    cls = _S3_CODES.get(code) or _S3_CODES.get(str(status))
    if cls is Forbidden:
        return Forbidden, f"{url}: S3 denied access ({detail}); {CREDENTIALS_HINT}"
    if cls is NotFound:
        return NotFound, f"{url}: not found in S3 ({detail})"
    if cls is UpstreamThrottled:
        return UpstreamThrottled, f"{url}: S3 is throttling or unavailable ({detail})"
    if cls is not None:
        return cls, f"{url}: S3 answered {detail}"
    if code in ("PermanentRedirect", "AuthorizationHeaderMalformed") or status == 301:
        return UpstreamError, (
            f"{url}: S3 says the bucket is in another region or endpoint ({detail}); "
            "set --s3-region/--s3-endpoint-url"
        )
    return UpstreamError, f"{url}: S3 error ({detail})"


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


def botocore_error(url: str, exc: BaseException, *, body: bool) -> ProxyError:
    """A botocore/aiobotocore failure (an S3 error response or a transport failure)."""
    from botocore import exceptions as bx

    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError, asyncio.TimeoutError)):
        return UpstreamTimeout(f"{url}: S3 timed out ({exc})")
    if isinstance(exc, bx.NoCredentialsError):
        return Forbidden(f"{url}: no AWS credentials found; {CREDENTIALS_HINT}")
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return s3_error(url, str(err.get("Code", "")), status, str(err.get("Message", "")))
    if isinstance(exc, (bx.BotoCoreError, aiohttp.ClientError, OSError)):
        if body:
            return UpstreamCut(f"{url}: S3 body broke off: {_describe(exc)}")
        return UpstreamError(f"{url}: cannot reach S3: {_describe(exc)}")
    raise exc


# -- GCS and Azure Blob (obstore) ------------------------------------------------------

CLOUD_CREDENTIALS_HINT = {
    "gs": "check the Google credentials (GOOGLE_APPLICATION_CREDENTIALS, the gcloud "
    "application-default credentials, the metadata server / workload identity; "
    "GOOGLE_SKIP_SIGNATURE=true for public buckets) and that they may read this bucket",
    "az": "check the Azure credentials (AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, "
    "AZURE_STORAGE_CONNECTION_STRING, AZURE_CLIENT_ID/AZURE_TENANT_ID with "
    "AZURE_FEDERATED_TOKEN_FILE or AZURE_CLIENT_SECRET, managed identity) and that they "
    "may read this container",
}
_CLOUD_NAMES = {"gs": "GCS", "az": "Azure Blob"}

# obstore's exception classes by name (its module is imported only with a gs:// or az://
# upstream), then the HTTP status its generic errors quote
_CLOUD_CLASSES: dict[str, type[ProxyError]] = {
    "NotFoundError": NotFound,
    "FileNotFoundError": NotFound,
    "PermissionDeniedError": Forbidden,
    "UnauthenticatedError": Forbidden,
    "PreconditionError": ObjectChanged,
}
_CLOUD_STATUS: dict[int, type[ProxyError]] = {
    **_STATUS,
    500: UpstreamThrottled,  # both providers ask clients to retry their 500s
}
_STATUS_IN_TEXT = re.compile(r"status code: (\d{3})")
_QUERY_IN_TEXT = re.compile(r"\?[^\s\"']*")


_CODE_IN_TEXT = re.compile(r"<Code>([^<]{1,100})</Code>")


def _cloud_text(exc: BaseException) -> str:
    """obstore's message, first line only, and the service's error code; with every URL
    query removed: a SAS token travels in the query and must never reach a log or a
    client (obstore writes REDACTED for such URLs itself; this holds if it did not)."""
    full = str(exc) or type(exc).__name__
    text = full.strip().split("\n", 1)[0]
    if text.endswith("?>"):  # an XML error document follows: keep its code
        text = text[: text.rfind("<?xml")].rstrip(": ")
    code = _CODE_IN_TEXT.search(full)
    if code:
        text += f" ({code.group(1)})"
    return _QUERY_IN_TEXT.sub("?…", text)[:500]


def cloud_error(url: str, scheme: str, exc: BaseException, *, body: bool) -> ProxyError:
    """An obstore failure of a ``gs://`` (``scheme`` "gs") or ``az://`` upstream: an
    error answer of the service, or a transport failure before or during a body."""
    if isinstance(exc, ProxyError):
        return exc
    name = _CLOUD_NAMES.get(scheme, scheme)
    text = _cloud_text(exc)
    cls = next((_CLOUD_CLASSES[c.__name__] for c in type(exc).__mro__ if c.__name__ in
                _CLOUD_CLASSES), None)  # fmt: skip
    status = _STATUS_IN_TEXT.search(text)
    if cls is None and status is not None:
        cls = _CLOUD_STATUS.get(int(status.group(1)))
        if cls is None and int(status.group(1)) >= 500:
            return UpstreamError(f"{url}: {name} error ({text})")
    timed_out = isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or "timed out" in text
    if cls is None and timed_out:
        cls = UpstreamTimeout
    if cls is Forbidden:
        return Forbidden(f"{url}: {name} denied access ({text}); {CLOUD_CREDENTIALS_HINT[scheme]}")
    if cls is NotFound:
        return NotFound(f"{url}: not found in {name}")
    if cls is UpstreamThrottled:
        return UpstreamThrottled(f"{url}: {name} is throttling or unavailable ({text})")
    if cls is not None:
        return cls(f"{url}: {name} answered {text}")
    if "credential" in text.lower() or "token" in text.lower():
        # no credentials could be had (no metadata server, an unreadable key file)
        return Forbidden(f"{url}: no {name} credentials ({text}); {CLOUD_CREDENTIALS_HINT[scheme]}")
    if body:
        return UpstreamCut(f"{url}: {name} body broke off: {text}")
    return UpstreamError(f"{url}: cannot reach {name}: {text}")


def cloud_status_error(url: str, scheme: str, status: int, code: str = "") -> ProxyError:
    """An error answer of GCS or Azure to a presigned GET (``code``: the error
    document's, may be empty), mapped by the same table as obstore's errors."""
    text = f"status code: {status}" + (f" ({code})" if code else "")
    return cloud_error(url, scheme, _CloudStatus(text), body=False)


class _CloudStatus(Exception):
    """An error answer, described as obstore describes one."""


REDIRECTS = frozenset({301, 302, 303, 307, 308})


class UpstreamRedirect(ProxyError):
    """The upstream redirected: the client gets the same status and Location, and
    nothing is cached under the requested URL."""

    def __init__(self, url: str, status: int, location: str) -> None:
        # absolute, so that the client follows it to the upstream's target, not to a path
        # of the proxy that maps somewhere else
        location = urljoin(url, location)
        super().__init__(
            f"upstream {url} redirects to {location}",
            status_hint=status,
            headers={"Location": location, "X-Cache": "BYPASS"},
        )
