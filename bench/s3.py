"""S3 figures of the proxy: cold reads against boto3, parallel parts against one stream,
and the S3 front against plain HTTP on warm reads.

One run starts SeaweedFS (the ``weed`` binary of the test extra) on 127.0.0.1, uploads one
object, and measures, interleaving the two sides of each comparison for ``--rounds``
rounds and reporting medians:

1. cold read of ``--size`` MiB through the proxy (``--upstream big=s3://...``, cache purged
   before each round) vs boto3 ``download_fileobj`` straight from SeaweedFS;
2. an HTTP origin that limits every connection to ``--rate`` MB/s: the proxy with parallel
   ranged parts (``--http-parts on``, 8 x 8 MiB) vs one stream (``--http-parts off``),
   ``--http-size`` MiB, cold each round;
3. warm reads of the cached object: boto3 ``get_object`` through the proxy's S3 front vs a
   plain HTTP GET from the proxy.

    .venv/bin/python bench/s3.py --size 256 --http-size 128 --rate 50 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.client
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "s3"))

from proxy_helpers import ProxyProcess  # noqa: E402
from s3server import SeaweedS3  # noqa: E402

MIB = 1024 * 1024
BUCKET = "bench"
KEY = "big/object.bin"
TOKEN = "bench-admin"


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        return len(b)


def http_read(port: int, path: str) -> int:
    """GET ``path`` from 127.0.0.1:``port``; read and drop the body; return its length."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", path)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"GET {path}: {resp.status} {resp.read()[:200]!r}")
    n = 0
    while chunk := resp.read(MIB):
        n += len(chunk)
    conn.close()
    return n


def purge(proxy: ProxyProcess, path: str) -> None:
    """Drop ``path`` from the cache once its download is committed (bounded wait), so the
    next read is cold again."""
    import json

    deadline = time.monotonic() + 10
    while True:
        req = urllib.request.Request(
            f"{proxy.url}/-/cache?url={path}",
            method="DELETE",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            if json.loads(resp.read())["removed"] or time.monotonic() > deadline:
                return
        time.sleep(0.02)


def timed(fn: Callable[[], int], size: int) -> float:
    """MB/s of one call of ``fn`` (which returns the bytes it read)."""
    t = time.perf_counter()
    n = fn()
    dt = time.perf_counter() - t
    if n != size:
        raise RuntimeError(f"read {n} bytes, expected {size}")
    return size / dt / 1e6


def interleave(rounds: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[float, float]:
    ra, rb = [], []
    for i in range(rounds):
        ra.append(a())
        rb.append(b())
        print(f"  round {i + 1}: {ra[-1]:8.1f} MB/s vs {rb[-1]:8.1f} MB/s", flush=True)
    return statistics.median(ra), statistics.median(rb)


# --------------------------------------------------------------------------- throttled origin


def serve_throttled(path: str, rate: float, port_file: str) -> None:
    """An HTTP origin serving ``path`` as /obj.bin with Range and ETag, each connection
    limited to ``rate`` MB/s."""
    from aiohttp import web

    data = Path(path).read_bytes()
    etag = '"' + hashlib.md5(data).hexdigest() + '"'
    chunk = 256 * 1024

    async def handle(request: web.Request) -> web.StreamResponse:
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        im = request.headers.get("If-Match")
        if im and im != etag:
            return web.Response(status=412)
        first, last, status = 0, len(data) - 1, 200
        rng = request.headers.get("Range")
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            first, last, status = int(a), min(int(b) if b else len(data) - 1, len(data) - 1), 206
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        headers["Content-Length"] = str(last - first + 1)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        start = time.monotonic()
        sent = 0
        for pos in range(first, last + 1, chunk):
            piece = data[pos : min(pos + chunk, last + 1)]
            try:
                await resp.write(piece)
            except ConnectionResetError:  # the proxy took the first part of a GET and left
                return resp
            sent += len(piece)
            ahead = sent / (rate * 1e6) - (time.monotonic() - start)
            if ahead > 0:
                await asyncio.sleep(ahead)
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/obj.bin", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        Path(port_file).write_text(str(port))
        await asyncio.Event().wait()

    asyncio.run(main())


def start_origin(path: Path, rate: float, work: Path) -> tuple[subprocess.Popen, int]:
    port_file = work / "origin.port"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--_origin", str(path), str(rate), str(port_file)]
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text():
            return proc, int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError("throttled origin exited")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("throttled origin did not start")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256, help="S3 object size, MiB (default 256)")
    ap.add_argument("--http-size", type=int, default=128, help="throttled object, MiB")
    ap.add_argument("--rate", type=float, default=50.0, help="origin MB/s per connection")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-rounds", type=int, default=5)
    ap.add_argument("--parallel", default="8", help="--parallel of the S3 proxy (default 8)")
    ap.add_argument("--part-size", default="8MiB", help="--part-size of the S3 proxy")
    ap.add_argument("--_origin", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._origin:
        serve_throttled(args._origin[0], float(args._origin[1]), args._origin[2])
        return 0

    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    with tempfile.TemporaryDirectory(prefix="shardcache-bench-s3-") as tmp:
        work = Path(tmp)
        print("starting SeaweedFS...", flush=True)
        seaweed = SeaweedS3.start(work / "seaweed")
        procs: list[ProxyProcess] = []
        origin: subprocess.Popen | None = None
        try:
            s3 = seaweed.client()
            s3.create_bucket(Bucket=BUCKET)
            size = args.size * MIB
            s3.upload_fileobj(io.BytesIO(os.urandom(size)), BUCKET, KEY)
            s3.put_object(Bucket=BUCKET, Key="big/warmup.bin", Body=b"x")
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(
                AWS_ACCESS_KEY_ID=seaweed.access_key,
                AWS_SECRET_ACCESS_KEY=seaweed.secret_key,
                AWS_DEFAULT_REGION="us-east-1",
                AWS_EC2_METADATA_DISABLED="true",
            )
            common = ["--admin-token", TOKEN]
            proxy = ProxyProcess(
                work / "cache-s3",
                "--upstream",
                f"big=s3://{BUCKET}/big",
                "--s3-endpoint-url",
                seaweed.endpoint_url,
                "--parallel",
                args.parallel,
                "--part-size",
                args.part_size,
                *common,
                env=env,
            ).start()
            procs.append(proxy)
            # The daemon is long-lived: its S3 client is up before the first shard.
            http_read(proxy.port, "/big/warmup.bin")

            def via_proxy() -> float:
                mbs = timed(lambda: http_read(proxy.port, "/big/object.bin"), size)
                purge(proxy, "/big/object.bin")
                return mbs

            def direct() -> float:
                def run() -> int:
                    s3.download_fileobj(BUCKET, KEY, _Discard())
                    return size

                return timed(run, size)

            print(f"(1) cold read of {args.size} MiB: proxy vs boto3 download_fileobj direct")
            p, d = interleave(args.rounds, via_proxy, direct)
            print(f"    median {p:.1f} vs {d:.1f} MB/s: {p / d:.2f}x (target >= 1.0x)\n")

            hsize = args.http_size * MIB
            blob = work / "origin.bin"
            blob.write_bytes(os.urandom(hsize))
            origin, oport = start_origin(blob, args.rate, work)
            up = f"http://127.0.0.1:{oport}"
            par = ProxyProcess(
                work / "cache-par", "--upstream", up, "--http-parts", "on", *common
            ).start()
            procs.append(par)
            one = ProxyProcess(
                work / "cache-one", "--upstream", up, "--http-parts", "off", *common
            ).start()
            procs.append(one)

            def cold(px: ProxyProcess) -> Callable[[], float]:
                def run() -> float:
                    mbs = timed(lambda: http_read(px.port, "/obj.bin"), hsize)
                    purge(px, "/obj.bin")
                    return mbs

                return run

            print(
                f"(2) {args.http_size} MiB from an origin at {args.rate:g} MB/s per connection: "
                "parallel parts (8 x 8 MiB) vs one stream"
            )
            p, o = interleave(args.rounds, cold(par), cold(one))
            print(f"    median {p:.1f} vs {o:.1f} MB/s: {p / o:.2f}x (target >= 3x)\n")

            http_read(proxy.port, "/big/object.bin")  # warm
            front = boto3.client(
                "s3",
                endpoint_url=proxy.url,
                region_name="us-east-1",
                config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
            )

            def via_front() -> float:
                def run() -> int:
                    body = front.get_object(Bucket="big", Key="object.bin")["Body"]
                    n = 0
                    while chunk := body.read(MIB):
                        n += len(chunk)
                    return n

                return timed(run, size)

            def plain() -> float:
                return timed(lambda: http_read(proxy.port, "/big/object.bin"), size)

            print(f"(3) warm read of {args.size} MiB: boto3 via the S3 front vs plain HTTP GET")
            f, h = interleave(args.warm_rounds, via_front, plain)
            print(f"    median {f:.1f} vs {h:.1f} MB/s: {f / h:.2f}x\n")
        finally:
            for px in procs:
                px.stop()
            if origin is not None:
                origin.kill()
                origin.wait(10)
            seaweed.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
