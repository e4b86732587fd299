"""Samples/s of shardcache's tar pipeline against webdataset 1.0.2 over the same local shards.

Writes ``--shards`` tar shards of ``--samples`` samples each (``--exts`` members per sample,
``--size`` bytes each) into a temporary directory, then reads them all, alternating
shardcache (``tarfile_samples(shardlist(urls))``) and webdataset
(``WebDataset(urls, shardshuffle=False)``) for ``--rounds`` rounds, and prints each
round's figures and the median ratio (shardcache / webdataset; > 1 means faster).

    .venv/bin/python bench/pipeline.py --shards 8 --samples 1000 --size 4096 --rounds 5
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable

from shardcache.tariterators import tarfile_samples
from shardcache.urls import shardlist


def make_shards(directory: str, shards: int, samples: int, exts: int, size: int) -> str:
    """Write the shards and return their brace pattern."""
    payload = os.urandom(size)
    for s in range(shards):
        with tarfile.open(os.path.join(directory, f"shard-{s:06d}.tar"), "w") as tf:
            for i in range(samples):
                for e in range(exts):
                    info = tarfile.TarInfo(f"sample{s:06d}{i:06d}.ext{e}")
                    info.size = size
                    info.mtime = 1700000000
                    tf.addfile(info, io.BytesIO(payload))
    return os.path.join(directory, f"shard-{{000000..{shards - 1:06d}}}.tar")


def ours(urls: str) -> Iterable[dict]:
    return tarfile_samples(shardlist(urls))


def theirs(urls: str) -> Iterable[dict]:
    import webdataset as wds

    return wds.WebDataset(urls, shardshuffle=False)


def timed(make: Callable[[str], Iterable[dict]], urls: str) -> tuple[int, float]:
    start = time.perf_counter()
    count = 0
    for _ in make(urls):
        count += 1
    return count, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1000, help="samples per shard")
    parser.add_argument("--exts", type=int, default=2, help="members per sample")
    parser.add_argument("--size", type=int, default=4096, help="bytes per member")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write shards (default: a temp dir)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # webdataset's shardshuffle notices

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        urls = make_shards(directory, args.shards, args.samples, args.exts, args.size)
        total = args.shards * args.samples
        print(
            f"{args.shards} shards x {args.samples} samples x {args.exts} members x "
            f"{args.size} bytes; {args.rounds} rounds, interleaved"
        )
        # warm the page cache and imports once for both
        timed(ours, urls)
        timed(theirs, urls)
        ratios = []
        for r in range(args.rounds):
            n1, t1 = timed(ours, urls)
            n2, t2 = timed(theirs, urls)
            if n1 != total or n2 != total:
                print(f"sample count mismatch: ours {n1}, webdataset {n2}, expected {total}")
                return 1
            ratio = (n1 / t1) / (n2 / t2)
            ratios.append(ratio)
            print(
                f"round {r + 1}: shardcache {n1 / t1:10.0f} samples/s   "
                f"webdataset {n2 / t2:10.0f} samples/s   ratio {ratio:.2f}x"
            )
        print(f"median ratio (shardcache / webdataset): {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
