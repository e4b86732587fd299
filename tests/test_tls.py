"""HTTPS serving (``--tls-cert``/``--tls-key``): the proxy and its S3 front over TLS.

Real processes and real clients on loopback: a throwaway CA and a server certificate for
``localhost``/``127.0.0.1`` from trustme, the proxy as a subprocess, an aiohttp origin in
a thread (SeaweedFS for the S3 front), and curl, http.client, aiohttp and boto3 trusting
only that CA. Over TLS the proxy cannot ``sendfile``; every body path (hits, the RAM
tier, followers of a download, bypass, a worker forwarding to another) copies instead,
and each is checked here byte for byte.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
from support.data import sha
from support.proxy import Pinned, pin_connections
from support.proxy_helpers import Fault, aws_env
from support.tls import Certs
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KiB, MiB = 1024, 1024 * 1024


# ---------------------------------------------------------------------------------------
# certificates, servers


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


def https_get(
    certs: Certs, port: int, path: str, headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """GET over a fresh TLS connection that trusts only the test CA."""
    conn = http.client.HTTPSConnection(
        "localhost", port, context=certs.client_context(), timeout=30
    )
    try:
        conn.request("GET", path, headers={"Connection": "close", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def stats(certs: Certs, port: int) -> dict:
    status, _, body = https_get(certs, port, "/-/stats")
    assert status == 200, body
    return json.loads(body)


def settle(certs: Certs, port: int, timeout: float = 10) -> None:
    """Wait until no download is in flight: a request made before a download's commit is
    answered from the download (``X-Cache: HIT`` too), after it from the entry."""
    deadline = time.monotonic() + timeout
    while stats(certs, port)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)


def curl(url: str, *args: str) -> tuple[int, bytes, str, str]:
    """curl -sS: (exit code, body, response headers, stderr)."""
    res = subprocess.run(
        ["curl", "-sS", "-D", "-", "-o", "-", "--max-time", "30", *args, url],
        capture_output=True,
        timeout=40,
    )
    head, _, body = res.stdout.partition(b"\r\n\r\n")
    return res.returncode, body, head.decode("latin-1"), res.stderr.decode(errors="replace")


# ---------------------------------------------------------------------------------------
# one process


def test_curl_reads_misses_hits_ranges_and_ram_hits_over_https(certs, origin, proxies):
    big = os.urandom(3 * MiB + 5)  # sendfile-sized: copied over TLS
    small = os.urandom(10 * KiB)  # RAM tier
    origin.files.update({"big.tar": big, "small.tar": small})
    p = proxies("--upstream", origin.url, *certs.args())
    assert p.scheme == "https"
    assert f"serving on https://127.0.0.1:{p.port}" in p.log_text()
    url = f"https://localhost:{p.port}"
    ca = ("--cacert", str(certs.ca))

    rc, body, head, err = curl(f"{url}/big.tar", *ca, "-f")
    assert rc == 0, err
    assert "X-Cache: MISS" in head and sha(body) == sha(big)
    settle(certs, p.port)  # the hits below are served from the entry, not the download
    rc, body, head, err = curl(f"{url}/big.tar", *ca, "-f")
    assert rc == 0 and "X-Cache: HIT" in head and sha(body) == sha(big), err
    rc, body, head, err = curl(f"{url}/big.tar", *ca, "-f", "-r", "1048570-2097200")
    assert rc == 0 and "206" in head.split("\r\n")[0] and "X-Cache: HIT" in head, err
    assert body == big[1048570:2097201]
    rc, body, head, err = curl(f"{url}/big.tar", *ca, "-f", "-I")
    assert rc == 0 and f"Content-Length: {len(big)}" in head, err

    for expect in ("MISS", "HIT", "HIT"):  # the second and third from the RAM tier
        rc, body, head, err = curl(f"https://127.0.0.1:{p.port}/small.tar", *ca, "-f")
        assert rc == 0 and f"X-Cache: {expect}" in head and body == small, (expect, err)
        settle(certs, p.port)
    rc, body, head, err = curl(f"{url}/small.tar", *ca, "-f", "-r", "100-199")
    assert rc == 0 and "X-Cache: HIT" in head and body == small[100:200], err
    st = stats(certs, p.port)
    assert st["ram_tier"]["entries"] >= 1, st
    assert dict(origin.gets) == {"big.tar": 1, "small.tar": 1}

    # the operator tools and Python's default contexts trust the CA through SSL_CERT_FILE
    env = dict(os.environ, SSL_CERT_FILE=str(certs.ca), SHARDCACHE_PROXY=url)
    tool = [sys.executable, "-m", "shardcache"]
    res = subprocess.run([*tool, "prefetch", "/{big,small}.tar", "--quiet"], env=env, timeout=60)
    assert res.returncode == 0
    res = subprocess.run(
        [*tool, "stats", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["entries"] == 2

    # several hits on one keep-alive TLS connection
    conn = http.client.HTTPSConnection("localhost", p.port, context=certs.client_context())
    try:
        for path, data in (("/big.tar", big), ("/small.tar", small), ("/big.tar", big)):
            conn.request("GET", path)
            r = conn.getresponse()
            assert (r.status, r.headers["X-Cache"], sha(r.read())) == (200, "HIT", sha(data))
    finally:
        conn.close()


def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(certs, origin, proxies):
    origin.files["x.tar"] = b"x" * 100
    p = proxies("--upstream", origin.url, *certs.args())
    rc, _, _, err = curl(f"https://localhost:{p.port}/x.tar")  # the system CAs only
    assert rc == 60, err  # CURLE_PEER_FAILED_VERIFICATION
    with pytest.raises(ssl.SSLCertVerificationError):
        conn = http.client.HTTPSConnection(
            "localhost", p.port, context=ssl.create_default_context(), timeout=10
        )
        try:
            conn.request("GET", "/x.tar")
        finally:
            conn.close()
    # TLS 1.2 is enough; TLS 1.1 and older are refused by the server (the client here
    # would speak TLS 1.1: its security level is lowered so that it offers ciphers)
    tls12 = certs.client_context()
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", p.port), 10) as s:
        with tls12.wrap_socket(s, server_hostname="localhost") as t:
            assert t.version() == "TLSv1.2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = certs.client_context()
        old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        old.set_ciphers("DEFAULT:@SECLEVEL=0")
    with socket.create_connection(("127.0.0.1", p.port), 10) as s:
        with pytest.raises(ssl.SSLError) as ei:
            old.wrap_socket(s, server_hostname="localhost")
    assert "NO_CIPHERS_AVAILABLE" not in str(ei.value)
    # plain HTTP on the TLS port gets no answer
    rc, _, _, err = curl(f"http://127.0.0.1:{p.port}/x.tar")
    assert rc != 0, err
    assert origin.gets["x.tar"] == 0
    status, _, body = https_get(certs, p.port, "/x.tar")  # still serving
    assert (status, body) == (200, b"x" * 100)


def test_many_concurrent_cold_clients_follow_one_download_over_https(certs, origin, proxies):
    data = os.urandom(8 * MiB + 3)
    chunked = os.urandom(2 * MiB + 1)  # no Content-Length: followers get framed writes
    origin.files.update({"hot.tar": data, "chunked.tar": chunked})
    origin.faults["hot.tar"] = Fault(delay=0.004)  # 128 chunks: about half a second
    origin.faults["chunked.tar"] = Fault(delay=0.004, chunked=True)
    p = proxies("--upstream", origin.url, *certs.args())
    ranges = {
        3: "bytes=1000-2000000",
        5: "bytes=3000000-3100000",
        7: "bytes=2500000-",
    }
    n = 16
    go = threading.Barrier(n)

    def client(i: int):
        name = "chunked.tar" if i >= 12 else "hot.tar"
        headers = {"Range": ranges[i]} if i in ranges else {}
        go.wait(10)
        status, h, body = https_get(certs, p.port, f"/{name}", headers)
        return i, name, headers.get("Range"), status, h.get("X-Cache"), body

    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        results = list(ex.map(client, range(n), timeout=60))
    caches: Counter = Counter()
    for i, name, rng, status, cache, body in results:
        want = origin.files[name]
        if rng is None:
            assert (status, sha(body)) == (200, sha(want)), (i, status, cache, len(body))
        else:
            lo, _, hi = rng.removeprefix("bytes=").partition("-")
            part = want[int(lo) : int(hi) + 1 if hi else None]
            assert (status, sha(body)) == (206, sha(part)), (i, rng, status, len(body))
        caches[name, cache] += 1
    assert caches["hot.tar", "MISS"] == 1 and caches["chunked.tar", "MISS"] == 1, caches
    assert origin.gets["chunked.tar"] == 1, origin.gets
    assert origin.gets["hot.tar"] == 1, origin.ranges
    settle(certs, p.port)
    for name in ("hot.tar", "chunked.tar"):  # and both are now hits
        status, h, body = https_get(certs, p.port, f"/{name}")
        assert (status, h["X-Cache"], sha(body)) == (200, "HIT", sha(origin.files[name]))


def test_aiohttp_client_reads_over_https(certs, origin, proxies):
    import aiohttp

    data = os.urandom(2 * MiB)
    origin.files["a.tar"] = data
    p = proxies("--upstream", origin.url, *certs.args())

    async def main() -> list[tuple[int, str, bytes]]:
        conn = aiohttp.TCPConnector(ssl=certs.client_context())
        async with aiohttp.ClientSession(connector=conn) as s:

            async def get(headers: dict[str, str]) -> tuple[int, str, bytes]:
                async with s.get(f"https://localhost:{p.port}/a.tar", headers=headers) as r:
                    return r.status, r.headers["X-Cache"], await r.read()

            cold = await asyncio.gather(*(get({}) for _ in range(6)))
            await asyncio.to_thread(settle, certs, p.port)
            warm = await asyncio.gather(get({}), get({"Range": "bytes=5-1000004"}))
            return [*cold, *warm]

    results = asyncio.run(main())
    for status, cache, body in results[:6]:
        # a request that arrives once the entry is committed (before the first download's
        # last byte went out) is a HIT of it
        assert status == 200 and cache in ("MISS", "COALESCED", "HIT") and sha(body) == sha(data)
    assert results[6][:2] == (200, "HIT") and sha(results[6][2]) == sha(data)
    assert results[7][:2] == (206, "HIT") and results[7][2] == data[5:1000005]
    assert origin.gets["a.tar"] == 1


def test_bypass_over_https(certs, origin, proxies):
    big = os.urandom(5 * MiB)  # larger than the cache: streamed through uncached
    origin.files["huge.tar"] = big
    p = proxies("--upstream", origin.url, "--cache-size", "4MiB", *certs.args())
    status, h, body = https_get(certs, p.port, "/huge.tar")
    assert (status, h["X-Cache"], sha(body)) == (200, "BYPASS", sha(big))
    status, h, body = https_get(certs, p.port, "/huge.tar", {"Range": "bytes=4194000-4194999"})
    assert (status, h["X-Cache"], body) == (206, "BYPASS", big[4194000:4195000])
    assert origin.gets["huge.tar"] >= 2  # never cached


def test_sigterm_with_open_tls_connections_exits_cleanly(certs, origin, proxies):
    origin.files["k.tar"] = os.urandom(100 * KiB)
    p = proxies("--upstream", origin.url, *certs.args(), "--grace-period", "5")
    conn = http.client.HTTPSConnection("localhost", p.port, context=certs.client_context())
    conn.request("GET", "/k.tar")
    assert conn.getresponse().read() == origin.files["k.tar"]  # idle keep-alive now
    raw = socket.create_connection(("127.0.0.1", p.port))  # never says hello
    try:
        t0 = time.monotonic()
        assert p.stop(signal.SIGTERM, timeout=20) == 0, p.log_text()
        assert time.monotonic() - t0 < 10
    finally:
        raw.close()
        conn.close()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_key_that_does_not_match_the_certificate_exits_2_naming_tls_cert(
    certs, origin, tmp_path, workers
):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcache",
            "serve",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--port",
            "0",
            "--upstream",
            origin.url,
            "--workers",
            workers,
            "--tls-cert",
            str(certs.cert),
            "--tls-key",
            str(certs.other_key),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2, res.stderr
    assert "--tls-cert" in res.stderr and "serving on" not in res.stderr, res.stderr


# ---------------------------------------------------------------------------------------
# --workers 2


def pin_workers(certs: Certs, port: int, per_worker: int) -> dict[int, list[Pinned]]:
    """``per_worker`` keep-alive TLS connections to each of the two workers."""
    return pin_connections(
        lambda: http.client.HTTPSConnection(
            "localhost", port, context=certs.client_context(), timeout=30
        ),
        per_worker,
    )


def test_two_workers_over_https_forward_misses_and_serve_hits(certs, origin, proxies):
    data = os.urandom(8 * MiB)
    small = os.urandom(20 * KiB)
    origin.files.update({"hot.tar": data, "small.tar": small})
    origin.faults["hot.tar"] = Fault(delay=0.004)
    env = {"SHARDCACHE_TLS_CERT": str(certs.cert), "SHARDCACHE_TLS_KEY": str(certs.key)}
    p = proxies("--upstream", origin.url, "--workers", "2", env=env)
    assert p.scheme == "https"
    assert re.search(rf"serving on https://127\.0\.0\.1:{p.port} \(2 workers\)", p.log_text())
    pinned = pin_workers(certs, p.port, per_worker=4)
    conns = [c for cs in zip(*pinned.values(), strict=True) for c in cs]  # alternate workers
    go = threading.Barrier(len(conns))

    def client(i: int):
        c = conns[i]
        headers = {"Range": "bytes=1000-2000000"} if i % 4 == 1 else {}
        go.wait(10)
        status, h, body = c.get("/hot.tar", headers)
        return c.pid, bool(headers), status, h.get("X-Cache"), body

    try:
        with concurrent.futures.ThreadPoolExecutor(len(conns)) as ex:
            results = list(ex.map(client, range(len(conns)), timeout=60))
        for pid, ranged, status, cache, body in results:
            want = data[1000:2000001] if ranged else data
            assert (status, sha(body)) == ((206 if ranged else 200), sha(want)), (pid, cache)
        by_worker = {pid: Counter(r[3] for r in results if r[0] == pid) for pid in pinned}
        # the worker that did not download forwarded to the one that did (plain loopback)
        assert any(c == Counter(COALESCED=4) for c in by_worker.values()), by_worker
        assert origin.gets["hot.tar"] == 1, origin.ranges

        for cs in pinned.values():  # the download committed: hits come from the entry
            wait_until(
                lambda cs=cs: not json.loads(cs[0].get("/-/stats")[2])["in_flight"],
                10,
                0.02,
                "the download's commit",
            )
        for conns_of_worker in pinned.values():  # hits, ranges and RAM hits on each worker
            c = conns_of_worker[0]
            status, h, body = c.get("/hot.tar")
            assert (status, h["X-Cache"], sha(body)) == (200, "HIT", sha(data))
            status, h, body = c.get("/hot.tar", {"Range": "bytes=7000000-7000099"})
            assert (status, h["X-Cache"], body) == (206, "HIT", data[7000000:7000100])
            for _ in range(2):
                status, h, body = c.get("/small.tar")
                assert status == 200 and body == small, h
        assert origin.gets["small.tar"] == 1
    finally:
        for cs in pinned.values():
            for c in cs:
                c.close()
    assert p.stop(signal.SIGTERM, timeout=30) == 0, p.log_text()


# ---------------------------------------------------------------------------------------
# the S3 front over HTTPS, in front of SeaweedFS

sys.path.insert(0, str(Path(__file__).resolve().parent / "s3"))

S3_BUCKET = "shardcache-tls"
FRONT_AK = "front-access"
FRONT_SK = "front-secret-0123456789"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    from s3server import SeaweedS3

    server = SeaweedS3.start(tmp_path_factory.mktemp("seaweed"))
    try:
        server.client().create_bucket(Bucket=S3_BUCKET)
        yield server
    finally:
        server.stop()


def _s3_proxy_env(seaweed, tmp: Path) -> dict[str, str]:
    return aws_env(seaweed.access_key, seaweed.secret_key, tmp)


def _upstream_bytes(certs: Certs, port: int) -> float:
    _, _, text = https_get(certs, port, "/metrics")
    m = re.search(rb"^shardcache_upstream_bytes_total (\S+)$", text, re.MULTILINE)
    assert m, text[:500]
    return float(m.group(1))


def test_boto3_through_the_s3_front_over_https(certs, seaweed, proxies, tmp_path):
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from botocore.exceptions import SSLError

    objects = {
        "cold.bin": os.urandom(5 * MiB + 7),
        "small.bin": os.urandom(30 * KiB),
        "sub/b.bin": b"bb",
    }
    up = seaweed.client()
    for key, data in objects.items():
        up.put_object(Bucket=S3_BUCKET, Key=f"shards/{key}", Body=data)
    p = proxies(
        "--upstream",
        f"shards=s3://{S3_BUCKET}/shards",
        "--s3-endpoint-url",
        seaweed.endpoint_url,
        "--part-size",
        "1MiB",
        "--parallel",
        "4",
        "--s3-front-access-key",
        FRONT_AK,
        "--s3-front-secret-key",
        FRONT_SK,
        *certs.args(),
        env=_s3_proxy_env(seaweed, tmp_path),
    )

    def front(verify: str | bool = str(certs.ca)):
        return boto3.client(
            "s3",
            endpoint_url=f"https://localhost:{p.port}",
            verify=verify,
            region_name="us-east-1",
            aws_access_key_id=FRONT_AK,
            aws_secret_access_key=FRONT_SK,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                max_pool_connections=16,
            ),
        )

    s3 = front()
    cold = objects["cold.bin"]
    before = _upstream_bytes(certs, p.port)
    # cold: many concurrent clients, one fetch from S3
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(
            ex.map(
                lambda _: s3.get_object(Bucket="shards", Key="cold.bin")["Body"].read(), range(8)
            )
        )
    assert all(sha(g) == sha(cold) for g in got)
    assert _upstream_bytes(certs, p.port) - before == len(cold)
    settle(certs, p.port)

    # warm: a whole GET, a Range, ranged parallel downloads, HEAD
    r = s3.get_object(Bucket="shards", Key="cold.bin")
    assert r["ResponseMetadata"]["HTTPHeaders"]["x-cache"] == "HIT"
    assert sha(r["Body"].read()) == sha(cold)
    r = s3.get_object(Bucket="shards", Key="cold.bin", Range="bytes=1048570-3145800")
    assert r["ContentRange"] == f"bytes 1048570-3145800/{len(cold)}"
    assert r["Body"].read() == cold[1048570:3145801]
    dest = tmp_path / "cold.bin"
    s3.download_file(
        "shards",
        "cold.bin",
        str(dest),
        Config=TransferConfig(multipart_threshold=MiB, multipart_chunksize=MiB, max_concurrency=4),
    )
    assert sha(dest.read_bytes()) == sha(cold)
    assert s3.head_object(Bucket="shards", Key="cold.bin")["ContentLength"] == len(cold)

    # a small object: cold, then hits from the RAM tier, whole and ranged
    small = objects["small.bin"]
    caches = []
    for _ in range(3):
        r = s3.get_object(Bucket="shards", Key="small.bin")
        caches.append(r["ResponseMetadata"]["HTTPHeaders"]["x-cache"])
        assert r["Body"].read() == small
        settle(certs, p.port)
    assert caches == ["MISS", "HIT", "HIT"]
    r = s3.get_object(Bucket="shards", Key="small.bin", Range="bytes=100-199")
    assert r["Body"].read() == small[100:200]
    assert stats(certs, p.port)["ram_tier"]["entries"] >= 1

    # listing passes through
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="shards")["Contents"]]
    assert keys == sorted(objects)
    assert _upstream_bytes(certs, p.port) - before == len(cold) + len(small)

    # a client that trusts only the system CAs never gets to send its request
    with pytest.raises(SSLError):
        front(verify=True).head_object(Bucket="shards", Key="small.bin")
