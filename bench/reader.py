"""The reader alone: one DataLoader worker's share of warm epochs of ``ShardDataset`` over
local tar shards (what a same-node direct read or a cache hit hands the reader), with and
without read-ahead; CPU-based figures, for a machine shared with other work.

    .venv/bin/python bench/reader.py                      # 48 x 32 MiB, worker 0 of 2
    .venv/bin/python bench/reader.py --pace 75 --epochs 2 # as bench/epoch.py's readers

Shards: ``--shards`` tar shards of about 32 MiB as bench/epoch.py writes them (a ``.jpg``
of random bytes, 1000 kB +-25%, and a ``.cls`` per sample), in ``--data`` (kept, reused)
or a temporary directory. Each setting of ``--read-ahead`` (bytes; 0 is off) reads the
worker's shards ``--epochs`` times in a fresh process, settings alternating for
``--rounds`` rounds. Per epoch: wall time, the time spent in ``next()`` (the reader's
stall when ``--pace`` MB/s makes the consumer sleep each sample's bytes / rate, as
bench/epoch.py's readers do), the consumer thread's CPU in ``next()``, the process's CPU
(all threads) and its page faults. Figures are medians over rounds of the epochs after
the first.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def make_shards(data: Path, shards: int) -> list[str]:
    """bench/epoch.py's tar shards (same generator and seed), written once."""
    paths = [data / f"shard-{i:06d}.tar" for i in range(shards)]
    if all(p.exists() for p in paths):
        return [str(p) for p in paths]
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    mean = 1_000_000
    pool = os.urandom(4 * MIB + mean * 5 // 4)
    samples = 0
    for path in paths:
        used = 1024 + 10240
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            while True:
                n = rng.randint(mean * 3 // 4, mean * 5 // 4)
                cost = 512 + (n + 511) // 512 * 512 + 1024
                if used + cost > 32 * MIB:
                    break
                used += cost
                off = rng.randrange(len(pool) - n)
                for name, payload in (
                    (f"s{samples:08d}.jpg", pool[off : off + n]),
                    (f"s{samples:08d}.cls", str(rng.randrange(1000)).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    info.mtime = 1_700_000_000
                    tf.addfile(info, io.BytesIO(payload))
                samples += 1
    return [str(p) for p in paths]


def run_epochs(paths: list[str], read_ahead: int, epochs: int, pace: float, worker: str) -> None:
    """In this process: the epochs of one setting, one JSON line each."""
    sys.path.insert(0, str(ROOT))
    from shardcache import ShardDataset
    from shardcache.workers import WorkerEnvironment

    w, n = (int(x) for x in worker.split("/"))
    env = WorkerEnvironment(rank=0, world_size=1, worker=w, num_workers=n)
    ds = ShardDataset(paths, env=env, plan=False, read_ahead=read_ahead)

    def usage() -> tuple[float, int]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, r.ru_minflt + r.ru_majflt

    for _ in range(epochs):
        cpu0, faults0 = usage()
        t0 = time.monotonic()
        stall = next_cpu = 0.0
        samples = 0
        it = iter(ds)
        while True:
            s0, c0 = time.monotonic(), time.thread_time()
            try:
                sample = next(it)
            except StopIteration:
                break
            s1 = time.monotonic()
            stall += s1 - s0
            next_cpu += time.thread_time() - c0
            samples += 1
            if pace:
                left = s1 + (len(sample["jpg"]) + len(sample["cls"])) / (pace * 1e6)
                left -= time.monotonic()
                if left > 0:
                    time.sleep(left)
        cpu1, faults1 = usage()
        print(
            json.dumps(
                {
                    "wall": time.monotonic() - t0,
                    "stall": stall,
                    "next_cpu": next_cpu,
                    "cpu": cpu1 - cpu0,
                    "faults": faults1 - faults0,
                    "samples": samples,
                }
            ),
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=48)
    p.add_argument("--worker", default="0/2", help="this worker / workers (0/2)")
    p.add_argument("--read-ahead", default=f"0,{8 * MIB}", help="settings, bytes (0,8388608)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pace", type=float, default=0, help="MB/s consumed; 0: as fast as read")
    p.add_argument("--data", default=None, help="keep the shards in DIR (reused)")
    p.add_argument("--_run", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shardcache-reader-") as tmp:
        paths = make_shards(Path(a.data or tmp), a.shards)
        if a._run:
            run_epochs(paths, int(a._run[0]), a.epochs, a.pace, a._run[1])
            return 0
        settings = [int(x) for x in a.read_ahead.split(",")]
        runs: dict[int, list[dict]] = {s: [] for s in settings}
        for r in range(a.rounds):
            for s in settings if r % 2 == 0 else settings[::-1]:
                argv2 = [sys.executable, __file__, "--_run", str(s), a.worker, "--data"]
                argv2 += [a.data or tmp, "--shards", str(a.shards), "--epochs", str(a.epochs)]
                argv2 += ["--pace", str(a.pace)]
                out = subprocess.run(argv2, capture_output=True, text=True, check=True).stdout
                epochs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
                runs[s] += epochs[1:]
        load = os.getloadavg()[0]
        print(
            f"{a.shards} shards, worker {a.worker}, pace {a.pace or 'none'} MB/s, load {load:.1f}"
        )
        print(
            "| read_ahead | wall s | in next() s | consumer CPU in next() s | process CPU s | faults |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for s, xs in runs.items():
            med = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
            print(
                f"| {s} | {med['wall']:.3f} | {med['stall']:.3f} | {med['next_cpu']:.3f} | "
                f"{med['cpu']:.3f} | {med['faults']:.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
