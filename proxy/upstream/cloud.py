"""The Google Cloud Storage and Azure Blob backends: ``gs://BUCKET/KEY`` and
``az://ACCOUNT/CONTAINER/KEY`` (:mod:`.cloudurl`) through obstore, one Rust-backed
library for both with the providers' own credential chains (measured against their
Python clients in BENCHMARKS.md: faster in every case on the emulators).

:class:`CloudUpstream` is the client (HEAD, ranged GET pinned to an ETag, listing);
:class:`CloudTransport` answers the upstream layer's requests with it, shaped like an
HTTP origin's answers (:class:`~proxy.upstream.s3.S3Response`), so resuming,
verification and parts work as for every upstream. A pinned read whose object was
replaced answers 412, never other bytes: the ETag is sent as If-Match and the answer's
ETag checked again here (an emulator may ignore If-Match). With ``threads``, GETs whose
URL can be signed locally (:meth:`CloudUpstream.presign`) go over the threaded
transport, as presigned S3 GETs do: worker threads receive the body into the file.

Credentials come from each provider's standard chain, read by obstore from the
environment: for GCS ``GOOGLE_APPLICATION_CREDENTIALS`` (a service account or
authorized-user file), ``GOOGLE_SERVICE_ACCOUNT_KEY``, gcloud's application-default
credentials, else the metadata server (GCE, GKE workload identity);
``GOOGLE_SKIP_SIGNATURE=true`` reads public buckets unsigned. For Azure
``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN``, a service principal
(``AZURE_CLIENT_ID``, ``AZURE_TENANT_ID`` and ``AZURE_CLIENT_SECRET``), workload identity
(``AZURE_FEDERATED_TOKEN_FILE``), the Azure CLI (``AZURE_USE_AZURE_CLI``), else managed
identity (IMDS); ``AZURE_STORAGE_CONNECTION_STRING`` is read here (obstore does not) for
its account key, SAS and blob endpoint. No credential is ever logged: error texts are
cut before any URL query (:func:`~proxy.upstream.errors.cloud_error`).

GCS is read through its XML API (obstore's choice) with ``Accept-Encoding: gzip``, so an
object stored with ``Content-Encoding: gzip`` arrives as stored, never decompressed in
transit (GCS would otherwise transcode it and ignore Range).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from multidict import CIMultiDict

from proxy.upstream.cloudresponse import (
    CloudResponse,
    _object_key,
    _object_meta,
    _quoted,
    _range,
)
from proxy.upstream.cloudurl import CloudLocation, parse_cloud_url
from proxy.upstream.errors import cloud_error, cloud_status_error
from proxy.upstream.options import DEFAULT_OPTIONS, NO_RETRY, RetryPolicy, UpstreamOptions
from proxy.upstream.stream import retrying
from proxy.upstream.transport import error_document
from shardcache.errors import (
    ObjectChanged,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamError,
)
from shardcache.meta import ObjectMeta

__all__ = ["CLOUD_EXTRA_HINT", "CloudResponse", "CloudTransport", "CloudUpstream"]

CLOUD_EXTRA_HINT = "gs:// and az:// upstreams need obstore: pip install '.[cloud]' (or obstore)"

# keys presigned for the threaded transport: unreserved characters only
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9._~/\-]+$")


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _connection_string() -> dict[str, str]:
    """``AZURE_STORAGE_CONNECTION_STRING`` split into its ``Key=Value`` parts."""
    raw = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "")
    parts: dict[str, str] = {}
    for item in raw.split(";"):
        key, eq, value = item.partition("=")
        if eq and key.strip():
            parts[key.strip()] = value.strip()
    return parts


def _stale_connection(exc: BaseException) -> bool:
    """Whether obstore failed to send a request at all (its HTTP client's "error sending
    request": a kept-alive connection closed by the service between two requests)."""
    return "error sending request" in str(exc).split("\n", 1)[0].lower()


class CloudUpstream:
    """Async client for ``gs://`` and ``az://`` objects: HEAD, ranged GET pinned to an
    ETag, listing in ListObjectsV2's shape (for the S3 front).

    ``gcs_endpoint_url`` replaces ``https://storage.googleapis.com`` (an emulator);
    ``azure_endpoint_url`` replaces ``https://ACCOUNT.blob.core.windows.net`` and may
    contain ``{account}`` (``http://127.0.0.1:10000/{account}`` for Azurite). One
    obstore store per bucket or container, made on first use. Throttling and 5xx are
    retried with the one backoff (:func:`proxy.upstream.stream.retrying`) as ``options``
    says, obstore's own retries are off; timeouts and the pool's size come from
    ``options`` too.
    """

    def __init__(
        self,
        *,
        gcs_endpoint_url: str | None = None,
        azure_endpoint_url: str | None = None,
        options: UpstreamOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.gcs_endpoint_url = gcs_endpoint_url
        self.azure_endpoint_url = azure_endpoint_url
        self.options = options
        self.retry = options.retry
        self._stores: dict[str, Any] = {}
        self._presigned: dict[str, tuple[float, str | None]] = {}

    def _client_options(self, endpoint: str | None) -> dict[str, Any]:
        return {
            "connect_timeout": timedelta(seconds=self.options.connect_timeout),
            "read_timeout": timedelta(seconds=self.options.read_timeout),
            # obstore's default (30 s) would bound a whole download: a shard takes longer
            "timeout": timedelta(days=1),
            "pool_max_idle_per_host": str(self.options.connections),
            "allow_http": bool(endpoint and endpoint.startswith("http://")),
        }

    def store(self, loc: CloudLocation) -> Any:
        """The obstore store of ``loc``'s bucket or container (made once)."""
        key = loc.store_url
        found = self._stores.get(key)
        if found is not None:
            return found
        try:
            from obstore.store import AzureStore, GCSStore
        except ImportError as exc:  # checked at startup; this is a request's error
            raise UpstreamError(f"{key}: {CLOUD_EXTRA_HINT}") from exc
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=1)}
        try:
            if loc.scheme == "gs":
                kw: dict[str, Any] = {}
                if self.gcs_endpoint_url:
                    kw["base_url"] = self.gcs_endpoint_url.rstrip("/")
                options = self._client_options(self.gcs_endpoint_url)
                options["default_headers"] = {"Accept-Encoding": "gzip"}  # no transcoding
                made = GCSStore(loc.bucket, client_options=options, retry_config=retry, **kw)
            else:
                kw = {"account_name": loc.account}
                conn = _connection_string()
                endpoint = self.azure_endpoint_url
                if conn and conn.get("AccountName", loc.account) == loc.account:
                    if conn.get("AccountKey"):
                        kw["access_key"] = conn["AccountKey"]
                    if conn.get("SharedAccessSignature"):
                        kw["sas_key"] = conn["SharedAccessSignature"]
                    endpoint = endpoint or conn.get("BlobEndpoint")
                if endpoint:
                    kw["endpoint"] = endpoint.replace("{account}", loc.account or "").rstrip("/")
                made = AzureStore(
                    loc.bucket,
                    client_options=self._client_options(endpoint),
                    retry_config=retry,
                    **kw,
                )
        except ProxyError:
            raise
        except Exception as exc:  # a malformed endpoint or credential in the environment
            raise UpstreamError(
                f"{key}: cannot set up the client: {cloud_error(key, loc.scheme, exc, body=False)}"
            ) from exc
        self._stores[key] = made
        return made

    async def _call(
        self, url: str, scheme: str, retry: RetryPolicy | None, fn: Any, *args: Any, **kw: Any
    ) -> Any:
        """``fn(*args, **kw)``, its errors mapped, retried by ``retry`` (None: this
        client's policy)."""

        async def once() -> Any:
            for attempt in range(2):
                try:
                    return await fn(*args, **kw)
                except Exception as exc:
                    if attempt == 0 and _stale_connection(exc):
                        # a pooled connection the service had closed: the request never
                        # left (nothing was answered), so asking again on a fresh one is
                        # the same read, not a retry of an answer
                        continue
                    raise cloud_error(url, scheme, exc, body=False) from exc
            raise AssertionError("unreachable")

        return await retrying(once, url, self.retry if retry is None else retry)

    async def head(
        self,
        url: str,
        *,
        if_match: str | None = None,
        quoted: bool = False,
        retry: RetryPolicy | None = None,
    ) -> ObjectMeta:
        """HEAD ``gs://…`` or ``az://…``: size, ETag, Last-Modified, type, stored fields.
        ``retry``: how to retry throttling and 5xx (None: this client's policy)."""
        import obstore

        loc = parse_cloud_url(url, quoted=quoted)
        options: dict[str, Any] = {"head": True}
        if if_match:
            options["if_match"] = if_match
        key = _object_key(url, loc)
        got = await self._call(
            url, loc.scheme, retry, obstore.get_async, self.store(loc), key, options=options
        )
        meta = _object_meta(loc.scheme, got.meta, got.attributes)
        if if_match and meta.etag != if_match:
            raise ObjectChanged(f"{url}: ETag changed from {if_match} to {meta.etag}")
        return meta

    async def open(
        self,
        url: str,
        range: str | None = None,  # noqa: A002 - HTTP's name
        if_match: str | None = None,
        *,
        quoted: bool = False,
        retry: RetryPolicy | None = None,
    ) -> CloudResponse:
        """GET ``url``, optionally a ``Range`` header's single range, pinned to an ETag
        (ObjectChanged when another version answers). The response streams. ``retry`` as
        for :meth:`head`."""
        import obstore

        loc = parse_cloud_url(url, quoted=quoted)
        key = _object_key(url, loc)
        store = self.store(loc)
        wanted = _range(range)
        options: dict[str, Any] = {}
        if if_match:
            options["if_match"] = if_match
        if isinstance(wanted, int):  # a suffix: Azure has none, so from the size
            size = (await self.head(url, if_match=if_match, quoted=quoted, retry=retry)).size or 0
            if wanted == 0 or size == 0:
                raise RangeNotSatisfiable(f"{url}: range {range!r} not satisfiable")
            wanted = (max(0, size + wanted), None)
        if wanted is not None:
            first, last = wanted
            options["range"] = {"offset": first} if last is None else (first, last + 1)
        got = await self._call(
            url, loc.scheme, retry, obstore.get_async, store, key, options=options
        )
        meta = _object_meta(loc.scheme, got.meta, got.attributes)
        if if_match and meta.etag != if_match:
            raise ObjectChanged(f"{url}: ETag changed from {if_match} to {meta.etag}")
        start, stop = got.range
        status = 206 if wanted is not None else 200
        return CloudResponse(url, loc.scheme, status, meta, start, stop - start, got)

    async def presign(self, url: str, *, quoted: bool = False) -> str | None:
        """A URL that GETs ``url`` with no further signing, for the threaded transport,
        or None when the GET must stay with obstore. Azure: a SAS that obstore signs
        locally with the account key (valid an hour, reused for half of that; Azurite
        checks it). GCS: only a public bucket read unsigned (``GOOGLE_SKIP_SIGNATURE``),
        whose plain URL needs no signature; signed GCS reads stay with obstore's bearer
        tokens (obstore signs V4 URLs for storage.googleapis.com whatever the endpoint,
        and here no GCS could check them). Keys of other than unreserved characters stay
        with obstore too: signers and stores disagree on how to canonicalize them (a space
        fails Azurite's SAS check)."""
        import obstore

        now = time.monotonic()
        hit = self._presigned.get(url)
        if hit is not None and hit[0] > now:
            return hit[1]
        loc = parse_cloud_url(url, quoted=quoted)
        key = _object_key(url, loc)
        if not _PLAIN_KEY.match(key):
            return None
        signed: str | None = None
        if loc.scheme == "gs":
            if _true(os.environ.get("GOOGLE_SKIP_SIGNATURE")):
                base = (self.gcs_endpoint_url or "https://storage.googleapis.com").rstrip("/")
                signed = f"{base}/{loc.bucket}/{quote(key, safe='/')}"
        else:
            try:
                signed = await obstore.sign_async(self.store(loc), "GET", key, timedelta(hours=1))
            except Exception:  # no account key (SAS, bearer credentials): obstore reads
                signed = None
        if len(self._presigned) > 4096:
            self._presigned.clear()
        # a failure is remembered too (5 minutes): no signing attempt per request
        self._presigned[url] = (now + (1800 if signed else 300), signed)
        return signed

    async def list_objects_v2(self, base: str, **params: Any) -> dict:
        """A ListObjectsV2 of the bucket or container ``base`` (``gs://BUCKET`` or
        ``az://ACCOUNT/CONTAINER``), answered in botocore's shape from obstore's listing:
        ``Prefix`` a plain string prefix, ``Delimiter``, ``MaxKeys``, ``StartAfter`` and
        ``ContinuationToken`` (the last key or common prefix of the page before)."""
        import obstore

        loc = parse_cloud_url(base)
        prefix = params.get("Prefix") or ""
        delimiter = params.get("Delimiter") or ""
        max_keys = int(params.get("MaxKeys", 1000))
        after = max(params.get("StartAfter") or "", params.get("ContinuationToken") or "")
        # obstore lists whole path segments: ask for the prefix's folder, filter here
        folder = prefix.rpartition("/")[0] or None
        contents: list[dict] = []
        prefixes: list[dict] = []
        last_prefix = None
        truncated = False
        stream_kw: dict[str, Any] = {"chunk_size": max(1, min(1000, max_keys + 1))}
        if after:
            stream_kw["offset"] = after
        listing = obstore.list(self.store(loc), folder, **stream_kw)
        try:
            async for batch in listing:
                for obj in batch:
                    key = obj["path"]
                    if not key.startswith(prefix) or key <= after:
                        continue
                    rest = key[len(prefix) :]
                    common = None
                    if delimiter and delimiter in rest:
                        common = prefix + rest[: rest.index(delimiter) + len(delimiter)]
                        if common == last_prefix or common <= after:
                            continue
                    if len(contents) + len(prefixes) >= max_keys:
                        truncated = True
                        break
                    if common is not None:
                        prefixes.append({"Prefix": common})
                        last_prefix = common
                    else:
                        contents.append(
                            {
                                "Key": key,
                                "LastModified": obj["last_modified"],
                                "ETag": _quoted(obj.get("e_tag")) or "",
                                "Size": int(obj["size"]),
                            }
                        )
                if truncated:
                    break
        except ProxyError:
            raise
        except Exception as exc:
            raise cloud_error(base, loc.scheme, exc, body=False) from exc
        result: dict[str, Any] = {
            "Contents": contents,
            "CommonPrefixes": prefixes,
            "IsTruncated": truncated,
            "KeyCount": len(contents) + len(prefixes),
        }
        if truncated:
            result["NextContinuationToken"] = max(
                [c["Key"] for c in contents[-1:]] + [p["Prefix"] for p in prefixes[-1:]]
            )
        return result

    async def close(self) -> None:
        """Forget the stores (obstore closes their connection pools with them)."""
        self._stores.clear()


class CloudTransport:
    """The upstream layer's requests answered by GCS or Azure: HEAD, GET with ``Range``
    and ``If-Match`` (a validator in ``If-Range`` is sent as ``If-Match``, so a replaced
    object answers 412, as the S3 transport does). URLs are the proxy's canonical ones
    (key segments percent-encoded). Every request here is one try
    (:data:`~proxy.upstream.options.NO_RETRY`): the upstream layer retries it with the
    daemon's one policy, so a throttled request is retried in one loop and ``--retries``
    counts its tries, as for S3."""

    def __init__(self, cloud: CloudUpstream, threads: Any = None) -> None:
        self.cloud = cloud
        self.threads = threads

    async def _threaded_get(self, signed: str, url: str, headers: Mapping[str, str]) -> Any:
        """GET a presigned URL on the threaded transport (bodies received by worker
        threads straight into the file); an error answer mapped by the cloud table."""
        scheme = url.partition("://")[0].lower()
        h = {k: v for k, v in headers.items() if k in ("Range", "If-Match")}
        if scheme == "gs":
            h["Accept-Encoding"] = "gzip"  # the stored bytes, never transcoded
        resp = await self.threads.request("GET", signed, h, label=url)
        if resp.status < 400 or resp.status in (412, 416):
            if (resp.headers.get("Vary") or "").strip().lower() == "origin":
                # CORS bookkeeping GCS's XML API adds (this request has no Origin): the
                # bytes do not vary, and obstore's answers never carry it
                resp.headers = CIMultiDict(
                    (k, v) for k, v in resp.headers.items() if k.lower() != "vary"
                )
            return resp
        body = await error_document(resp)
        code = re.search(rb"<Code>([^<]{1,100})</Code>", body)
        raise cloud_status_error(
            url, scheme, resp.status, code.group(1).decode("ascii", "replace") if code else ""
        )

    async def request(self, method: str, url: str, headers: Mapping[str, str]) -> Any:
        scheme = url.partition("://")[0].lower()
        if_match = headers.get("If-Match")
        if if_match is None and (headers.get("If-Range") or "").startswith('"'):
            if_match = headers["If-Range"]
        if method == "HEAD" or "If-None-Match" in headers:
            meta = await self.cloud.head(url, if_match=if_match, quoted=True, retry=NO_RETRY)
            if headers.get("If-None-Match") in (meta.etag, "*"):
                return CloudResponse(url, scheme, 304, meta, 0, 0)
            return CloudResponse(url, scheme, 200, meta, 0, meta.size or 0)
        rng = headers.get("Range")
        if self.threads is not None and (rng is None or isinstance(_range(rng), tuple)):
            # suffix and multi-range requests stay with obstore (Azure has no suffix)
            signed = await self.cloud.presign(url, quoted=True)
            if signed is not None:
                pinned = {**headers, **({"If-Match": if_match} if if_match else {})}
                return await self._threaded_get(signed, url, pinned)
        try:
            return await self.cloud.open(
                url, headers.get("Range"), if_match, quoted=True, retry=NO_RETRY
            )
        except RangeNotSatisfiable:
            meta = await self.cloud.head(url, if_match=if_match, quoted=True, retry=NO_RETRY)
            return CloudResponse(url, scheme, 416, meta, 0, 0)
        except ObjectChanged:
            return CloudResponse(url, scheme, 412, ObjectMeta(size=None), 0, 0)

    async def close(self) -> None:
        await self.cloud.close()
