"""Parallel parts against one stream, from an origin that limits each connection.

    python bench/parts_speedup.py                          # 64 MiB at 20 MB/s per connection
    python bench/parts_speedup.py --size-mib 128 --rate 40 --rounds 5

Object stores and CDNs cap what one connection delivers (tens of MB/s per stream is
common), so a cold shard read over one connection takes size / cap however fast the
network is. The origin here is the repository's test server (``tests/badorigin.py``,
well-behaved: 200/206 with a strong ETag, ``--rate`` MB/s per connection, 20 ms before
each answer). For each round, a proxy on an empty cache receives one cold GET of the
whole object, once over one stream (``--http-transport threads``) and once in parallel
parts (``--http-parts on --part-size 8MiB --parallel 8``); the two are interleaved and
the wall time to the client's last byte is reported as medians, with the origin's GETs
and body bytes (the object must cross once either way).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cold_range import cold_object  # noqa: E402

MiB = 1 << 20
VARIANTS = {
    "one stream": ("--http-transport", "threads"),
    "parts": ("--http-parts", "on", "--part-size", "8MiB", "--parallel", "8"),
}


def cold_get(data: bytes, variant: str, rate: float) -> tuple[float, int, int]:
    """Wall seconds of one cold whole-object GET, the origin's GETs and body bytes."""
    with cold_object(data, rate, "--cache-size", "4G", *VARIANTS[variant]) as (origin, p):
        conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=300)
        t0 = time.monotonic()
        conn.request("GET", "/obj.tar")
        resp = conn.getresponse()
        digest = hashlib.sha256()
        while piece := resp.read1(1 << 20):
            digest.update(piece)
        wall = time.monotonic() - t0
        conn.close()
        if resp.status != 200 or digest.digest() != hashlib.sha256(data).digest():
            raise RuntimeError(f"{variant}: wrong answer (HTTP {resp.status})")
        gets = origin.log("obj.tar", "GET")
        return wall, len(gets), sum(g.sent for g in gets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--rate", type=float, default=20, help="MB/s per origin connection")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size = args.size_mib * MiB
    data = os.urandom(size)
    walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sent: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            wall, gets, nbytes = cold_get(data, variant, args.rate * 1e6)
            walls[variant].append(wall)
            sent[variant] = (gets, nbytes)
            print(f"round {r + 1} {variant}: {wall:.2f} s", file=sys.stderr, flush=True)
    print(
        f"object {size} bytes, origin {args.rate:g} MB/s per connection, "
        f"{args.rounds} interleaved rounds, medians\n"
    )
    print("| variant | wall | MB/s | origin GETs | origin bytes / object | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    base = statistics.median(walls["one stream"])
    for variant in VARIANTS:
        med = statistics.median(walls[variant])
        gets, nbytes = sent[variant]
        print(
            f"| {variant} | {med:.2f} s ({min(walls[variant]):.2f}–{max(walls[variant]):.2f}) "
            f"| {size / med / 1e6:.0f} | {gets} | {nbytes / size:.2f}x | {base / med:.2f}x |"
        )


if __name__ == "__main__":
    main()
