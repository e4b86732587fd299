"""Example training job for the compose and Kubernetes examples.

    python trainer.py make --out DIR [--shards 8 --samples 64 --sample-size 65536]
    python trainer.py seed --filer http://seaweedfs:8888/buckets/shards/train [...]
    python trainer.py read --urls 'http://localhost:8080/train/train-{000000..000007}.tar'

``make`` writes WebDataset shards to a directory; ``seed`` writes them and uploads each
with an HTTP PUT to a SeaweedFS filer (which backs the S3 bucket of the same name);
``read`` reads the shards through the shardcache sidecar with ``webdataset`` for a few
epochs and prints samples/s and MB/s per epoch (the first epoch is cold, the rest are
served from the sidecar's cache), then the sidecar's hit ratio from ``/-/stats``.

Settings may also come from the environment (TRAINER_URLS, TRAINER_EPOCHS, SEED_FILER_URL,
SIDECAR_URL), so a container needs no command line.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

log = logging.getLogger("trainer")


def shard_bytes(index: int, samples: int, sample_size: int) -> bytes:
    """One tar shard of ``samples`` samples (``.cls`` label + ``.bin`` payload each)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for j in range(samples):
            key = f"s{index:06d}_{j:05d}"
            payload = bytes([(index * 131 + j) % 251]) * sample_size
            for ext, data in (("cls", str(j % 10).encode()), ("bin", payload)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def shard_names(n: int) -> list[str]:
    return [f"train-{i:06d}.tar" for i in range(n)]


def cmd_make(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    for i, name in enumerate(shard_names(args.shards)):
        tmp = os.path.join(args.out, f".{name}.tmp")
        with open(tmp, "wb") as f:
            f.write(shard_bytes(i, args.samples, args.sample_size))
        os.replace(tmp, os.path.join(args.out, name))
    print(f"wrote {args.shards} shards to {args.out}")
    return 0


def cmd_seed(args: argparse.Namespace) -> int:
    filer = (args.filer or os.environ.get("SEED_FILER_URL", "")).rstrip("/")
    if urlsplit(filer).scheme not in ("http", "https"):
        print(f"trainer seed: --filer must be an http(s) URL, got {filer!r}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    for i, name in enumerate(shard_names(args.shards)):
        data = shard_bytes(i, args.samples, args.sample_size)
        url = f"{filer}/{name}"
        while True:
            req = urllib.request.Request(url, data=data, method="PUT")
            req.add_header("Content-Type", "application/x-tar")
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    resp.read()
                break
            except (urllib.error.URLError, OSError) as exc:
                error = exc
            # The filer may still be starting: retry until --wait runs out.
            if time.monotonic() > deadline:
                print(f"trainer seed: {url}: {error}", file=sys.stderr)
                return 1
            time.sleep(2)
        print(f"uploaded {url} ({len(data)} bytes)")
    return 0


def gopen_urllib(url: str, mode: str = "rb", bufsize: int = 8192, **kw):
    """webdataset opener for http(s) without the curl binary (absent from slim images).

    ``http.client`` raises ``IncompleteRead`` when the body is shorter than its
    Content-Length, so a truncated shard is an error, never a clean end.
    """
    if mode[0] != "r":
        raise ValueError(f"{url}: only reading is supported")
    return urllib.request.urlopen(url, timeout=300)


def sidecar_stats(sidecar: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{sidecar.rstrip('/')}/-/stats", timeout=10) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.warning("cannot read %s/-/stats: %s", sidecar, exc)
        return None


def cmd_read(args: argparse.Namespace) -> int:
    import importlib

    import webdataset as wds

    # the module (webdataset's package namespace re-exports a function of the same name)
    wds_gopen = importlib.import_module("webdataset.gopen")

    if args.opener == "urllib" or (args.opener == "auto" and shutil.which("curl") is None):
        wds_gopen.gopen_schemes["http"] = gopen_urllib
        wds_gopen.gopen_schemes["https"] = gopen_urllib
    urls = args.urls or os.environ.get("TRAINER_URLS")
    if not urls:
        print("trainer read: --urls (or TRAINER_URLS) is required", file=sys.stderr)
        return 2
    epochs = args.epochs if args.epochs is not None else int(os.environ.get("TRAINER_EPOCHS", 2))
    results = []
    for epoch in range(epochs):
        t0 = time.monotonic()
        n = nbytes = 0
        for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            n += 1
            nbytes += sum(len(v) for k, v in sample.items() if isinstance(v, bytes))
        dt = max(time.monotonic() - t0, 1e-9)
        results.append({"epoch": epoch, "samples": n, "bytes": nbytes, "seconds": dt})
        print(
            f"epoch {epoch}: {n} samples, {nbytes / 1e6:.1f} MB in {dt:.2f} s: "
            f"{n / dt:.0f} samples/s, {nbytes / 1e6 / dt:.1f} MB/s",
            flush=True,
        )
    sidecar = args.sidecar or os.environ.get("SIDECAR_URL")
    if sidecar:
        stats = sidecar_stats(sidecar)
        if stats is not None:
            print("sidecar /-/stats: " + json.dumps(stats, sort_keys=True), flush=True)
    if args.json:
        print(json.dumps(results))
    if not results or results[0]["samples"] == 0:
        print("trainer read: no samples read", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def shard_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--shards", type=int, default=8)
        p.add_argument("--samples", type=int, default=64, help="samples per shard")
        p.add_argument("--sample-size", type=int, default=65536, help="payload bytes per sample")

    m = sub.add_parser("make", help="write shards to a directory")
    m.add_argument("--out", required=True)
    shard_opts(m)
    m.set_defaults(func=cmd_make)

    s = sub.add_parser("seed", help="write shards and PUT them to a SeaweedFS filer")
    s.add_argument("--filer", default=None, help="filer URL of the bucket prefix")
    s.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the filer")
    shard_opts(s)
    s.set_defaults(func=cmd_seed)

    r = sub.add_parser("read", help="read shards through the sidecar and print throughput")
    r.add_argument("--urls", default=None, help="brace pattern of shard URLs")
    r.add_argument("--epochs", type=int, default=None)
    r.add_argument("--sidecar", default=None, help="sidecar URL for /-/stats at the end")
    r.add_argument("--json", action="store_true", help="also print the epochs as JSON")
    r.add_argument(
        "--opener",
        choices=("auto", "curl", "urllib"),
        default="auto",
        help="how webdataset opens http URLs (auto: curl when installed, else urllib)",
    )
    r.set_defaults(func=cmd_read)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
