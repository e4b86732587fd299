"""The S3 front's SigV4 check: a signed request (Authorization header or presigned
query) recomputed with botocore's S3 signer and compared in constant time."""

from __future__ import annotations

import datetime as dt
import hmac
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.errormap import (
    AccessDenied,
    AuthorizationHeaderMalformed,
    AuthorizationQueryParametersError,
    InvalidAccessKeyId,
    RequestTimeTooSkewed,
    SignatureDoesNotMatch,
)
from shardcache.meta import parse_decimal

log = logging.getLogger(__name__)

__all__ = ["MAX_PRESIGN_EXPIRES", "MAX_SKEW", "verify_sigv4"]

MAX_SKEW = dt.timedelta(minutes=15)
MAX_PRESIGN_EXPIRES = 7 * 24 * 3600

_AUTH_RE = re.compile(
    r"^AWS4-HMAC-SHA256\s+Credential=([^,\s]+)\s*,\s*SignedHeaders=([^,\s]+)\s*,"
    r"\s*Signature=([0-9a-fA-F]+)\s*$"
)


def _parse_amz_date(value: str) -> dt.datetime:
    try:
        return dt.datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    except (TypeError, ValueError):
        raise AccessDenied("missing or malformed X-Amz-Date") from None


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
    key pair, recomputing the signature with botocore's S3 signer. Raises an S3Error
    (:mod:`proxy.errormap`).

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
            raise AuthorizationQueryParametersError("unsupported algorithm")
        credential = qd.get("X-Amz-Credential", "")
        signed = qd.get("X-Amz-SignedHeaders", "")
        signature = qd.get("X-Amz-Signature", "")
        amz_date = qd.get("X-Amz-Date", "")
    else:
        m = _AUTH_RE.match(headers.get("Authorization", ""))
        if not m:
            raise AuthorizationHeaderMalformed("malformed Authorization header")
        credential, signed, signature = m.groups()
        amz_date = headers.get("X-Amz-Date", "")
    parts = credential.split("/")
    if len(parts) != 5 or parts[3] != "s3" or parts[4] != "aws4_request":
        raise AuthorizationHeaderMalformed("malformed credential scope")
    key_id, day, region = parts[0], parts[1], parts[2]
    if not hmac.compare_digest(key_id.encode(), access_key.encode()):
        raise InvalidAccessKeyId("the access key ID is not known to this proxy")
    when = _parse_amz_date(amz_date)
    if day != amz_date[:8]:
        raise SignatureDoesNotMatch("credential date does not match X-Amz-Date")
    if presigned:
        expires = qd.get("X-Amz-Expires", "")
        seconds = parse_decimal(expires)
        if seconds is None or seconds > MAX_PRESIGN_EXPIRES:
            raise AuthorizationQueryParametersError("bad X-Amz-Expires", status_hint=403)
        if now > when + dt.timedelta(seconds=seconds):
            raise AccessDenied(
                f"request has expired: signed {when:%Y-%m-%dT%H:%M:%SZ} for {expires} s, "
                f"now {now:%Y-%m-%dT%H:%M:%SZ}",
            )
        if when - now > MAX_SKEW:
            raise RequestTimeTooSkewed(_skew(when, now))
    elif abs(now - when) > MAX_SKEW:
        raise RequestTimeTooSkewed(_skew(when, now))

    signed_names = [h for h in signed.lower().split(";") if h]
    if "host" not in signed_names:
        raise AccessDenied("the Host header must be signed")
    req_headers: dict[str, str] = {}
    for name in signed_names:
        if hasattr(headers, "getall"):
            values = headers.getall(name, [])
        else:
            values = [v for k, v in headers.items() if k.lower() == name]
        if not values:
            raise SignatureDoesNotMatch(f"signed header {name} is missing")
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
        raise SignatureDoesNotMatch(
            "the request signature we calculated does not match the signature you provided; "
            "check the key pair given with --s3-front-access-key/--s3-front-secret-key",
        )
