"""What a client is told about an error: :func:`error_answer`, the one place that turns
any error into the proxy's HTTP answer or the S3 front's.

The library raises, the daemon maps. Errors carry from construction on what only their
raiser knows (:class:`shardcache.errors.ProxyError`: a status hint, a store's S3 code,
header fields, a range's object size, the methods allowed, the upstream's answer to pass
on); the codes S3 clients expect for each class and status are this module's. The S3
front's own errors join the same tree, each class with its status and code::

    ProxyError (shardcache.errors)
    └── S3Error                                   -- an S3 error of the front's own
        ├── InvalidArgument / InvalidRequest (400)
        ├── AuthorizationHeaderMalformed / AuthorizationQueryParametersError (400)
        ├── AccessDenied / InvalidAccessKeyId (403)
        ├── SignatureDoesNotMatch / RequestTimeTooSkewed (403)
        ├── NoSuchBucket (404)
        ├── S3MethodNotAllowed (405)
        ├── PreconditionFailed (412)
        ├── InvalidPartNumber (416)
        ├── S3NotImplemented (501)
        └── S3Unavailable (503, ServiceUnavailable)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.upstream.errors import PassedAnswer, store_error
from shardcache.errors import (
    BadRequest,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)

__all__ = [
    "AccessDenied",
    "AuthorizationHeaderMalformed",
    "AuthorizationQueryParametersError",
    "ErrorAnswer",
    "InvalidAccessKeyId",
    "InvalidArgument",
    "InvalidPartNumber",
    "InvalidRequest",
    "NoSuchBucket",
    "PreconditionFailed",
    "RequestTimeTooSkewed",
    "S3Error",
    "S3MethodNotAllowed",
    "S3NotImplemented",
    "S3Unavailable",
    "SignatureDoesNotMatch",
    "error_answer",
    "s3_code_for_status",
]


# --------------------------------------------------------------------------- the S3 front's


class S3Error(ProxyError):
    """An S3 error of the front's own. Each subclass names its status and S3 code
    (``class NoSuchBucket(S3Error, status=404)``; the code is the class's name unless
    given); ``status_hint`` may be given where S3 answers one code with two statuses."""

    status_hint = 400
    s3_code: str = "InvalidRequest"

    def __init_subclass__(cls, status: int = 400, code: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.status_hint = status
        cls.s3_code = code or cls.__name__

    def __init__(self, message: str, status_hint: int | None = None) -> None:
        super().__init__(f"{self.s3_code}: {message}", status_hint)
        self.message = message

    @property
    def status(self) -> int:
        return self.status_hint

    @property
    def code(self) -> str:
        return self.s3_code


class InvalidArgument(S3Error): ...


class InvalidRequest(S3Error): ...


class AuthorizationHeaderMalformed(S3Error): ...


class AuthorizationQueryParametersError(S3Error): ...


class AccessDenied(S3Error, status=403): ...


class InvalidAccessKeyId(S3Error, status=403): ...


class SignatureDoesNotMatch(S3Error, status=403): ...


class RequestTimeTooSkewed(S3Error, status=403): ...


class NoSuchBucket(S3Error, status=404): ...


class S3MethodNotAllowed(S3Error, status=405, code="MethodNotAllowed"): ...


class PreconditionFailed(S3Error, status=412): ...


class InvalidPartNumber(S3Error, status=416): ...


class S3NotImplemented(S3Error, status=501, code="NotImplemented"): ...


class S3Unavailable(S3Error, status=503, code="ServiceUnavailable"): ...


# --------------------------------------------------------------------------- the mapping

# the S3 code of each class of the library's tree, when its status is the class's own
# (a subclass takes the nearest: UpstreamCut is an UpstreamError, InternalError)
_CLASS_CODES: dict[type[ProxyError], str] = {
    BadRequest: "InvalidRequest",
    Forbidden: "AccessDenied",
    NotFound: "NoSuchKey",
    MethodNotAllowed: "MethodNotAllowed",
    RangeNotSatisfiable: "InvalidRange",
    UpstreamError: "InternalError",  # S3 clients retry it, as they should a bad gateway
    UpstreamTimeout: "RequestTimeout",
    UpstreamThrottled: "SlowDown",
}

_STATUS_CODES = {
    400: "InvalidRequest",
    401: "AccessDenied",
    403: "AccessDenied",
    404: "NoSuchKey",
    405: "MethodNotAllowed",
    412: "PreconditionFailed",
    416: "InvalidRange",
    501: "NotImplemented",
    503: "ServiceUnavailable",
    504: "RequestTimeout",
}


def s3_code_for_status(status: int) -> str:
    """The S3 error code that goes with an HTTP error status."""
    return _STATUS_CODES.get(status, "InternalError")


def _class_code(exc: ProxyError) -> str | None:
    if exc.status_hint != type(exc).status_hint:
        return None  # a status of its own: the code of that status
    for cls in type(exc).__mro__:
        code = _CLASS_CODES.get(cls)
        if code is not None:
            return code
    return None


@dataclass(frozen=True)
class ErrorAnswer:
    """What a client is told: the status, the S3 code, a one-line message, the header
    fields of the answer and, for an S3 ``<Error>`` body, its further elements."""

    status: int
    code: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)
    details: Mapping[str, str] = field(default_factory=dict)


def error_answer(exc: ProxyError | web.HTTPException) -> ErrorAnswer:
    """What a client is told about ``exc``. An upstream's own error answer
    (``exc.answer``, status >= 400) is told with its status (401 as 403: the upstream
    refused the proxy's own credentials) and, when its body is an S3 error document, its
    code and message; an answer below 400 is the caller's to pass on as it was."""
    if isinstance(exc, web.HTTPException):
        return ErrorAnswer(exc.status, s3_code_for_status(exc.status), exc.text or exc.reason)
    answer = exc.answer
    if isinstance(answer, PassedAnswer) and answer.status >= 400:
        status = 403 if answer.status == 401 else answer.status
        code, message = store_error(answer.body)
        return ErrorAnswer(status, code or s3_code_for_status(status), message or str(exc))
    status = exc.status_hint
    code = exc.s3_code or _class_code(exc) or s3_code_for_status(status)
    headers = dict(exc.headers)
    details: dict[str, str] = {}
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = exc.allow
    if isinstance(exc, RangeNotSatisfiable) and exc.size is not None:
        # what S3 says of a range past the end; the CRT (s3torchconnector) reads an empty
        # object's size from it
        headers["Content-Range"] = f"bytes */{exc.size}"
        details["ActualObjectSize"] = str(exc.size)
    message = exc.message if isinstance(exc, S3Error) else str(exc)
    return ErrorAnswer(status, code, message, headers, details)
