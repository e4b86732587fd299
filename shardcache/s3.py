"""Reading ``s3://bucket/key`` URLs on the client side.

Without a proxy, :func:`open_s3` reads the object directly with boto3 (the ``s3`` extra:
``pip install '.[s3]'`` in a checkout), credentials and endpoint from the standard AWS chain
(``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``) or
from keyword arguments. With a proxy, :func:`s3_proxy_url` maps ``s3://bucket/key`` to
``{proxy}/bucket/key``: the proxy serves the bucket as an upstream of the same name
(``--upstream bucket=s3://bucket``).
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any
from urllib.parse import quote

from shardcache.errors import S3_EXTRA_HINT, GopenError

__all__ = ["open_s3", "s3_proxy_url", "split_s3_url"]

_clients: dict[tuple, Any] = {}
_lock = threading.Lock()


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → ``(bucket, key)``; GopenError for anything else."""
    if not url.startswith("s3://"):
        raise GopenError(url, "not an s3:// URL")
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket or not key:
        raise GopenError(url, "an s3 URL needs a bucket and a key: s3://bucket/key")
    return bucket, key


def s3_proxy_url(url: str, proxy: str) -> str:
    """The proxy URL serving ``s3://bucket/key``: ``{proxy}/bucket/key`` (key quoted)."""
    bucket, key = split_s3_url(url)
    return f"{proxy.rstrip('/')}/{bucket}/{quote(key, safe='/~')}"


def _client(endpoint_url: str | None, profile: str | None, region: str | None) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise ImportError(
            f"reading s3:// URLs without a proxy needs boto3: {S3_EXTRA_HINT}"
        ) from exc
    key = (os.getpid(), endpoint_url, profile, region)  # one client per process (fork-safe)
    with _lock:
        client = _clients.get(key)
        if client is None:
            session = boto3.session.Session(profile_name=profile, region_name=region)
            cfg = Config(
                retries={"max_attempts": 5, "mode": "standard"},
                s3={"addressing_style": "path"} if endpoint_url else {},
            )
            client = session.client("s3", endpoint_url=endpoint_url, config=cfg)
            _clients[key] = client
    return client


class _S3Raw(io.RawIOBase):
    """A raw stream over a botocore StreamingBody; a short body raises GopenError."""

    def __init__(self, url: str, body: Any, size: int) -> None:
        self.url = url
        self._body = body
        self.size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        from botocore.exceptions import BotoCoreError

        try:
            data = self._body.read(len(b))
        except (BotoCoreError, OSError) as exc:
            raise GopenError(self.url, f"read failed at byte {self._pos}: {exc}") from exc
        n = len(data)
        if n == 0 and len(b) > 0 and self._pos != self.size:
            raise GopenError(self.url, f"body ended after {self._pos} of {self.size} bytes")
        b[:n] = data
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def open_s3(
    url: str,
    mode: str = "rb",
    bufsize: int = 8192,
    *,
    endpoint_url: str | None = None,
    profile: str | None = None,
    region: str | None = None,
    **kw: Any,
) -> io.BufferedReader:
    """Open ``s3://bucket/key`` for reading with boto3. Errors raise GopenError naming
    the URL (missing key, access denied with a credentials hint, connection failure)."""
    if mode != "rb":
        raise GopenError(url, f"mode {mode!r} not supported for s3 URLs (only 'rb')")
    bucket, key = split_s3_url(url)
    client = _client(endpoint_url, profile, region)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        resp = client.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code = err.get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        cause = f"S3 {code or status}: {err.get('Message', '')}".rstrip(": ")
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            cause += " (check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)"
        raise GopenError(url, cause) from exc
    except BotoCoreError as exc:
        raise GopenError(url, f"S3 request failed: {exc}") from exc
    raw = _S3Raw(url, resp["Body"], int(resp["ContentLength"]))
    return io.BufferedReader(raw, buffer_size=max(bufsize, 8192))
