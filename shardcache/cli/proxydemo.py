"""The proxy demo: sample shards, a loopback origin, the proxy daemon, two passes.

:func:`proxy_demo` writes sample shards to a temporary directory, serves them from an
HTTP origin on 127.0.0.1, starts ``shardcache serve`` in front of it (a subprocess on a
free port), and reads every shard through the proxy with the library twice: cold (each
shard comes from the origin once) and warm (all hits). It prints progress, samples/s,
bytes from upstream against bytes served, and the hit ratio, then shuts everything down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

__all__ = ["proxy_demo"]


@contextmanager
def _proxy(upstream: str, cache_dir: Path, cache_size: str) -> Iterator[str]:
    log_path = cache_dir.parent / "proxy.log"
    cmd = [
        sys.executable,
        "-m",
        "shardcache",
        "serve",
        "--upstream",
        upstream,
        "--cache-dir",
        str(cache_dir),
        "--cache-size",
        cache_size,
        "--port",
        "0",
        "--log-level",
        "info",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 60
            while True:
                text = log_path.read_text(errors="replace")
                m = re.search(r"serving on http://[^:]+:(\d+)", text)
                if m:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the proxy did not start:\n{text}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{m.group(1)}"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _read_pass(label: str, urls: list[str], out: TextIO) -> tuple[int, int, float]:
    """Read every sample of ``urls``; a rich progress bar on a terminal, lines otherwise."""
    from shardcache.tariterators import tarfile_samples
    from shardcache.urls import shardlist

    bar = None
    if out.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        bar = Progress(
            TextColumn(f"  {label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("shards  {task.fields[samples]:,} samples  {task.fields[rate]:,.0f}/s"),
            console=Console(file=out),
        )
        task = bar.add_task(label, total=len(urls), samples=0, rate=0.0)
        bar.start()
    t0 = time.monotonic()
    n = nbytes = shard = 0
    current = None

    def shard_done() -> None:
        """Report the shard just read to its end, with every sample so far."""
        rate = n / max(time.monotonic() - t0, 1e-9)
        if bar is not None:
            bar.update(task, completed=shard, samples=n, rate=rate)
        else:
            print(
                f"  {label}: shard {shard}/{len(urls)} {current.rsplit('/', 1)[-1]}"
                f"  {n} samples  {rate:,.0f} samples/s",
                file=out,
                flush=True,
            )

    try:
        for sample in tarfile_samples(shardlist(urls)):
            if sample["__url__"] != current:
                if current is not None:
                    shard_done()
                current = sample["__url__"]
                shard += 1
            n += 1
            nbytes += sum(len(v) for k, v in sample.items() if not k.startswith("__"))
        if current is not None:
            shard_done()
    finally:
        if bar is not None:
            bar.stop()
    return n, nbytes, time.monotonic() - t0


def _wait_committed(proxy_url: str, timeout: float = 30.0) -> None:
    """Wait until the proxy has no download in flight: a reader can hold a shard's last
    byte a moment before the proxy has verified and committed it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{proxy_url}/-/stats", timeout=10) as r:
            if json.load(r)["in_flight"] == 0:
                return
        time.sleep(0.02)


def proxy_demo(
    shards: int = 8,
    samples: int = 200,
    sample_size: int = 16384,
    out: TextIO | None = None,
) -> int:
    """Run the proxy demo; returns 0 when both passes read identical samples."""
    from shardcache.cli.demodata import make_shards, origin
    from shardcache.urls import proxied

    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="shardcache-proxy-demo-") as tmp:
        tmp_path = Path(tmp)
        print(f"writing {shards} shards of {samples} samples to {tmp_path / 'shards'}", file=out)
        paths = make_shards(tmp_path / "shards", shards, samples, size=sample_size)
        total = sum(p.stat().st_size for p in paths)
        with origin(tmp_path / "shards") as (origin_url, counts):
            print(f"origin on {origin_url}", file=out)
            with _proxy(origin_url, tmp_path / "cache", f"{total * 2}B") as proxy_url:
                print(f"proxy on {proxy_url} (cache in {tmp_path / 'cache'})", file=out)
                urls = [
                    str(u)
                    for u in proxied(
                        [f"{origin_url}/{p.name}" for p in paths], proxy_url, upstream=origin_url
                    )
                ]
                results = {}
                for label in ("cold", "warm"):
                    if label == "warm":
                        _wait_committed(proxy_url)
                    requests0, bytes0 = counts["requests"], counts["bytes"]
                    n, nbytes, secs = _read_pass(label, urls, out)
                    results[label] = (n, nbytes)
                    print(
                        f"{label}: {n} samples, {nbytes / 2**20:.1f} MiB of sample data in "
                        f"{secs:.2f} s = {n / max(secs, 1e-9):,.0f} samples/s; this pass took "
                        f"{counts['requests'] - requests0} requests and "
                        f"{(counts['bytes'] - bytes0) / 2**20:.1f} MiB from the origin",
                        file=out,
                        flush=True,
                    )
                    if label == "cold":
                        print(
                            "  (the origin sends more than the sample data: a tar file gives "
                            "each member a 512-byte header and pads it to a multiple of 512 "
                            "bytes)",
                            file=out,
                        )
                with urllib.request.urlopen(f"{proxy_url}/-/stats", timeout=10) as r:
                    stats = json.load(r)
        print(
            f"both passes: {stats['upstream_bytes'] / 2**20:.1f} MiB from the upstream, "
            f"{stats['served_bytes'] / 2**20:.1f} MiB served; hit ratio "
            f"{stats['hit_ratio']:.2f} ({stats['hits']} hits, {stats['misses']} misses), "
            f"{stats['entries']} entries cached (1 MiB = 2^20 bytes)",
            file=out,
        )
        print(
            "the hit ratio counts shard requests: the cold pass missed each shard once and "
            "the warm pass hit each one, so two passes give 0.50; every later epoch is all "
            "hits and reads no byte from the upstream",
            file=out,
        )
    ok = results["cold"] == results["warm"] and counts["requests"] == shards
    print("ok: every shard crossed the network once" if ok else "MISMATCH", file=out)
    return 0 if ok else 1
