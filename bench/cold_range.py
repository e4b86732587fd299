"""Upstream bytes per object for a cold Range, by ``--cold-range`` mode and transport.

    python bench/cold_range.py              # the table in BENCHMARKS.md
    python bench/cold_range.py --size-mib 64 --rate 20

A cold object of ``--size-mib`` MiB (default 12) is served by the misbehaving-origin test
server of this repository (``tests/support/badorigin.py``, here well-behaved: 200/206 with
ETag, ``--rate`` MB/s per connection, 20 ms before each answer), which records every
request and the body bytes it sent. For each transport (one stream on threads, parallel
parts of 1 MiB, 4 at once) and each ``--cold-range`` mode, a proxy started on an empty
cache receives one cold ranged GET:

- tail: ``bytes=5MiB-`` (``wget -c`` resuming at 5 MiB);
- member: 1 MiB at 8 MiB (a tar member read through an index).

The range's time to first byte is measured, then the proxy is left to finish the
object's download (a HEAD answers HIT), and the origin's GET count and body bytes for
the object are read, with ``shardcache_upstream_extra_bytes_total{reason="cold_range"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.origins import BadOrigin, Version  # noqa: E402
from support.proxy import ProxyProcess  # noqa: E402

MiB = 1 << 20
TRANSPORTS = {
    "one stream": ("--http-transport", "threads"),
    "parts": ("--http-parts", "on", "--part-size", "1MiB", "--parallel", "4"),
}


def request(port: int, path: str, method: str = "GET", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.monotonic()
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    ttfb = None
    body = b""
    while method != "HEAD":
        piece = resp.read1(1 << 20)
        if not piece:
            break
        if ttfb is None:
            ttfb = time.monotonic() - t0
        body += piece
    if method == "HEAD":
        resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body, ttfb


@contextlib.contextmanager
def cold_object(
    data: bytes, rate: float, *proxy_args: str
) -> Iterator[tuple[BadOrigin, ProxyProcess]]:
    """The test origin serving ``data`` as ``obj.tar`` (strong ETag, ``rate`` bytes/s per
    connection, 20 ms before each answer) and a proxy on an empty cache in front of it,
    started with ``proxy_args``: (origin, proxy), both stopped on leaving."""
    with BadOrigin() as origin, tempfile.TemporaryDirectory() as tmp:
        origin.add(
            "obj.tar", versions=[Version(data, etag='"v1"')], rate=rate, first_byte_delay=0.02
        )
        p = ProxyProcess(
            Path(tmp) / "cache", "--upstream", origin.url, "--min-free", "0", *proxy_args
        ).start()
        try:
            yield origin, p
        finally:
            p.stop(timeout=10)


def run(data: bytes, transport: str, mode: str, rng: tuple[int, int | None], rate: float):
    args = ("--cache-size", "1G", "--cold-range", mode, *TRANSPORTS[transport])
    with cold_object(data, rate, *args) as (origin, p):
        a, b = rng
        header = f"bytes={a}-" + ("" if b is None else str(b))
        status, _, body, ttfb = request(p.port, "/obj.tar", headers={"Range": header})
        assert status == 206 and body == data[a : None if b is None else b + 1], status
        deadline = time.monotonic() + 120
        while request(p.port, "/obj.tar", "HEAD")[1].get("X-Cache") != "HIT":
            if time.monotonic() > deadline:
                raise RuntimeError("never cached")
            time.sleep(0.05)
        gets = origin.log("obj.tar", "GET")
        metrics = request(p.port, "/metrics")[2].decode()
        m = re.search(r'upstream_extra_bytes_total\{reason="cold_range"\} (\S+)', metrics)
        extra = int(float(m.group(1))) if m else 0
        return ttfb, len(gets), sum(g.sent for g in gets), extra, len(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=12)
    ap.add_argument("--rate", type=float, default=50, help="MB/s per origin connection")
    args = ap.parse_args()
    size = args.size_mib * MiB
    data = os.urandom(size)
    cases = {"tail": (5 * MiB, None), "member": (8 * MiB, 9 * MiB - 1)}
    print(f"object {size} bytes, origin {args.rate:g} MB/s per connection\n")
    print(
        "| transport | --cold-range | range | range bytes | TTFB | origin GETs "
        "| origin bytes | per object | counted extra |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for transport in TRANSPORTS:
        for mode in ("fast", "once"):
            for name, rng in cases.items():
                ttfb, gets, sent, extra, n = run(data, transport, mode, rng, args.rate * 1e6)
                print(
                    f"| {transport} | {mode} | {name} | {n} | {ttfb * 1000:.0f} ms | {gets} "
                    f"| {sent} | {sent / size:.2f}x | {extra} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
