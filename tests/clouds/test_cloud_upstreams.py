"""``gs://`` and ``az://`` upstreams against real emulators (fake-gcs-server, Azurite).

Every test runs for both providers. One proxy subprocess per provider and module serves
``--upstream shards=<bucket>/shards`` and ``--upstream all=<bucket>`` with 1 MiB parts,
so the 3 MiB fixture object is fetched as parallel ranged parts; what the proxy took
from the upstream is read from its own ``shardcache_upstream_bytes_total``. Each object
read through the proxy is also read with the provider's own client (google-cloud-storage,
azure-storage-blob), to prove the emulator holds what the test thinks.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.data import BUCKET, OBJECTS  # noqa: E402
from support.proxy_helpers import ProxyProcess, make_shard  # noqa: E402

MEDIUM = OBJECTS["shards/medium.tar"]
PART = 1 << 20


@dataclass
class Provider:
    """One emulator and how the proxy and the provider's own client reach it."""

    kind: str  # "gs" or "az"
    server: Any

    @property
    def meta_prefix(self) -> str:
        return "x-goog-meta-" if self.kind == "gs" else "x-ms-meta-"

    def base(self, prefix: str = "") -> str:
        root = f"gs://{BUCKET}" if self.kind == "gs" else f"az://{self.server.account}/{BUCKET}"
        return f"{root}/{prefix}" if prefix else root

    def endpoint_args(self) -> list[str]:
        if self.kind == "gs":
            return ["--gcs-endpoint-url", self.server.url]
        return ["--azure-endpoint-url", f"http://127.0.0.1:{self.server.port}/{{account}}"]

    def env(self) -> dict[str, str]:
        """The provider's standard credential variables for the emulator."""
        if self.kind == "gs":
            return {"GOOGLE_SKIP_SIGNATURE": "true"}  # fake-gcs-server checks no signature
        return {"AZURE_STORAGE_ACCOUNT_KEY": self.server.key}

    def put(self, key: str, data: bytes, **kw: Any) -> None:
        """Upload with the provider's client; ``content_type``, ``content_encoding``,
        ``content_language`` and ``metadata`` as the object's stored fields."""
        if self.kind == "gs":
            blob = self.server.client().bucket(BUCKET).blob(key)
            blob.content_encoding = kw.get("content_encoding")
            blob.content_language = kw.get("content_language")
            blob.metadata = kw.get("metadata")
            blob.upload_from_string(data, content_type=kw.get("content_type"))
            return
        from azure.storage.blob import ContentSettings

        settings = ContentSettings(
            content_type=kw.get("content_type"),
            content_encoding=kw.get("content_encoding"),
            content_language=kw.get("content_language"),
        )
        self.server.client().get_blob_client(BUCKET, key).upload_blob(
            data, overwrite=True, metadata=kw.get("metadata"), content_settings=settings
        )

    def read(self, key: str) -> bytes:
        """The object's bytes as the provider's own client reads them (raw, undecoded)."""
        if self.kind == "gs":
            blob = self.server.client().bucket(BUCKET).blob(key)
            return blob.download_as_bytes(raw_download=True, checksum=None)
        blob = self.server.client().get_blob_client(BUCKET, key)
        return blob.download_blob(decompress=False).readall()


@pytest.fixture(scope="module", params=["gs", "az"])
def provider(request) -> Provider:
    server = request.getfixturevalue("gcs" if request.param == "gs" else "azurite")
    return Provider(request.param, server)


def _start(provider: Provider, tmp: Path, *extra: str, env: dict | None = None) -> ProxyProcess:
    return ProxyProcess(
        tmp / "cache",
        "--upstream",
        f"shards={provider.base('shards')}",
        "--upstream",
        f"all={provider.base()}",
        *provider.endpoint_args(),
        "--part-size",
        "1MiB",
        "--parallel",
        "4",
        *extra,
        env=provider.env() if env is None else env,
    ).start()


@pytest.fixture(scope="module", params=["threads", "aiohttp"])
def proxy(provider, tmp_path_factory, request):
    """The proxy with each GET path: ``threads`` (presigned GETs received by worker
    threads where the store allows: Azure's account key, a public GCS bucket) and
    ``aiohttp`` (every request through obstore). ``tag`` keeps their objects apart."""
    transport = request.param
    p = _start(
        provider,
        tmp_path_factory.mktemp(f"{provider.kind}proxy"),
        "--http-transport",
        transport,
    )
    p.tag = f"{provider.kind}-{transport}"  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        p.stop()


def _get(
    url: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _upstream_bytes(proxy: ProxyProcess) -> float:
    _, _, text = _get(proxy.url + "/metrics")
    m = re.search(rb"^shardcache_upstream_bytes_total (\S+)$", text, re.MULTILINE)
    assert m, text[:500]
    return float(m.group(1))


def test_cold_read_is_byte_exact_and_the_second_a_hit(provider, proxy):
    for key in ("shards/small.tar", "shards/medium.tar", "shards/dir/x one+two.tar"):
        path = "/" + key.replace(" ", "%20").replace("+", "%2B")
        before = _upstream_bytes(proxy)
        status, headers, body = _get(proxy.url + path)
        assert status == 200 and body == OBJECTS[key], (key, status, body[:200])
        assert headers["x-cache"] == "MISS"
        status, headers, body = _get(proxy.url + path)
        assert status == 200 and body == OBJECTS[key]
        assert headers["x-cache"] == "HIT"
        # one download, in parts for the 3 MiB object, nothing fetched twice
        assert _upstream_bytes(proxy) - before == len(OBJECTS[key])
        assert provider.read(key) == body


def test_an_empty_object_is_served(provider, proxy):
    status, _, body = _get(proxy.url + "/shards/empty.tar")
    assert (status, body) == (200, b"")
    assert provider.read("shards/empty.tar") == b""


def test_head_and_the_stored_fields_travel_with_the_bytes(provider, proxy):
    """HEAD (cold) tells size, ETag, Last-Modified, type and the stored fields; GET
    serves the bytes as stored (gzip stays gzip) with the same fields, miss and hit."""
    encoded = gzip.compress(os.urandom(300_000), compresslevel=1)
    key = f"shards/encoded-{proxy.tag}.tar.gz"
    provider.put(
        key,
        encoded,
        content_type="application/x-tar",
        content_encoding="gzip",
        content_language="de",
        metadata={"color": "blue"},
    )
    url = f"{proxy.url}/{key}"
    status, head, body = _get(url, method="HEAD")
    assert status == 200 and body == b""
    assert head["content-length"] == str(len(encoded))
    assert head["etag"].startswith('"') and head["last-modified"].endswith("GMT")
    assert head["content-type"] == "application/x-tar"
    assert head["content-encoding"] == "gzip"
    assert head[provider.meta_prefix + "color"] == "blue"
    for expect in ("MISS", "HIT"):
        status, headers, body = _get(url, {"Accept-Encoding": "identity"})
        assert status == 200 and body == encoded, (status, len(body))
        assert headers["x-cache"] == expect
        assert headers["etag"] == head["etag"]
        assert headers["content-encoding"] == "gzip"
        assert headers["content-language"] == "de"
        assert headers[provider.meta_prefix + "color"] == "blue"
    assert provider.read(key) == encoded


def test_range_cold_and_warm(provider, proxy):
    key = f"shards/ranged-{proxy.tag}.bin"
    data = os.urandom(2 * PART + 99)
    provider.put(key, data)
    url = f"{proxy.url}/{key}"
    status, headers, body = _get(url, {"Range": "bytes=1048570-1048599"})
    assert status == 206 and body == data[1048570:1048600]
    assert headers["content-range"] == f"bytes 1048570-1048599/{len(data)}"
    status, _, body = _get(url, {"Range": "bytes=-10"})
    assert status == 206 and body == data[-10:]
    assert _get(url)[::2] == (200, data)
    status, headers, body = _get(url, {"Range": "bytes=5-9"})
    assert (status, body, headers["x-cache"]) == (206, data[5:10], "HIT")
    status, headers, _ = _get(url, {"Range": f"bytes={len(data) + 5}-"})
    assert status == 416 and headers["content-range"] == f"bytes */{len(data)}"
    assert provider.read(key) == data


def test_missing_object_is_404_and_not_cached(provider, proxy):
    key = f"shards/late-{proxy.tag}.tar"
    status, _, body = _get(f"{proxy.url}/{key}")
    assert status == 404, body
    provider.put(key, b"now here")
    assert _get(f"{proxy.url}/{key}")[::2] == (200, b"now here")
    assert provider.read(key) == b"now here"


def test_the_s3_front_lists_the_bucket(provider, proxy):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    front = boto3.client(
        "s3",
        endpoint_url=proxy.url,
        region_name="us-east-1",
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
    )
    pages = front.get_paginator("list_objects_v2").paginate(
        Bucket="all", Prefix="many/", Delimiter="/", PaginationConfig={"PageSize": 7}
    )
    keys, prefixes, n = [], [], 0
    for page in pages:
        n += 1
        keys += [o["Key"] for o in page.get("Contents", [])]
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    assert keys == sorted(k for k in OBJECTS if k.startswith("many/obj-"))
    assert prefixes == ["many/sub/"]
    assert n == 4  # 24 entries, 7 a page
    # a bucket mapped to a prefix: keys relative to it; a plain string prefix
    got = front.list_objects_v2(Bucket="shards", Prefix="sm")
    assert [(o["Key"], o["Size"]) for o in got["Contents"]] == [("small.tar", 10_000)]
    assert got["Contents"][0]["ETag"].startswith('"')
    # ListObjects V1 with a marker
    v1 = front.list_objects(Bucket="all", Prefix="many/sub/", Marker="many/sub/a.bin")
    assert [o["Key"] for o in v1["Contents"]] == ["many/sub/b.bin"]
    # and the objects listed are read through the front, byte-exact
    body = front.get_object(Bucket="shards", Key="medium.tar")["Body"].read()
    assert body == MEDIUM == provider.read("shards/medium.tar")


def test_webdataset_reads_shards_through_the_proxy(provider, proxy):
    import webdataset as wds

    shard = make_shard(20, seed=7)
    key = f"shards/wds-{proxy.tag}-000000.tar"
    provider.put(key, shard)
    before = _upstream_bytes(proxy)
    for _ in range(2):  # two epochs, one download
        samples = list(wds.WebDataset(f"{proxy.url}/{key}", shardshuffle=False))
        assert len(samples) == 20
    assert _upstream_bytes(proxy) - before == len(shard)
    assert provider.read(key) == shard


@pytest.mark.parametrize("threaded", [True, False])
def test_replaced_between_parts_is_an_error_never_a_splice(provider, monkeypatch, threaded):
    """The object is replaced (same size, other bytes) after the first part's answer
    pinned its ETag: the later parts fail with ObjectChanged, no byte of the new version
    is delivered as the old one's."""
    from proxy.upstream import Fetcher
    from proxy.upstream.cloud import CloudUpstream
    from shardcache.errors import ObjectChanged

    for k, v in provider.env().items():
        monkeypatch.setenv(k, v)
    key = f"race/replaced-{provider.kind}-{threaded}.bin"
    old, new = os.urandom(4 * PART), os.urandom(4 * PART)
    provider.put(key, old)
    endpoints = {
        "gs": {"gcs_endpoint_url": provider.server.url},
        "az": {"azure_endpoint_url": f"http://127.0.0.1:{provider.server.port}/{{account}}"},
    }[provider.kind]

    async def run() -> bytes:
        cloud = CloudUpstream(**endpoints)
        fetcher = Fetcher(
            cloud=cloud,
            part_size=PART,
            parallel=2,
            retries=1,
            retry_backoff=0.01,
            threaded=threaded,
        )
        try:
            body = await fetcher.open(provider.base(key))
            assert body.meta.size == len(old)
            provider.put(key, new)  # after part 0's answer, before the others are asked
            got = b""
            async for chunk in body.chunks():
                got += chunk
            return got
        finally:
            await fetcher.close()

    with pytest.raises(ObjectChanged):
        got = asyncio.run(run())
        pytest.fail(f"read {len(got)} bytes, {'old' if got == old else 'spliced'}")
    assert provider.read(key) == new


def test_a_replaced_object_is_fetched_anew_after_revalidation(provider, tmp_path):
    """--revalidate 0 asks the upstream each time: a replaced object is the new bytes."""
    key = f"shards/reval-{provider.kind}.bin"
    provider.put(key, b"first version")
    p = _start(provider, tmp_path, "--revalidate", "0")
    try:
        assert _get(f"{p.url}/{key}")[::2] == (200, b"first version")
        provider.put(key, b"second version!")
        assert _get(f"{p.url}/{key}")[::2] == (200, b"second version!")
    finally:
        p.stop()
    assert provider.read(key) == b"second version!"
