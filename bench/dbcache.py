"""DBCache fill and read rates, side by side with raw sqlite3 and with reading tar shards.

Each round runs every contender once, in turn (interleaved, so drift in machine load hits
them alike); the figures are medians over the rounds.

    python bench/dbcache.py [--samples 5000] [--bytes 10000] [--rounds 5]

- fill: ``DBCache(path, N, source)`` consuming the source (encoding included) vs raw
  ``sqlite3`` ``executemany`` of the same, already encoded, rows into the same schema in
  one transaction.
- read: iterating a full DBCache (decoding included, samples built) vs a raw ``SELECT`` of
  the same columns holding the same bytes (``raw_read``: url, key, layout, data, payload,
  exactly what DBCache reads), vs a raw ``SELECT`` of one blob per sample holding all its
  fields (``raw_read_1blob``: the sample encoded as one ``safe_encode`` record), vs
  reading the same samples from local tar shards with the tar pipeline.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sqlite3
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dbcache import DBCache, safe_encode, safe_encode_row  # noqa: E402


def make_samples(n: int, nbytes: int, shards: int) -> list[dict]:
    per = -(-n // shards)
    return [
        {
            "__key__": f"sample-{i:07d}",
            "__url__": f"/data/val-{i // per:04d}.tar",
            "jpg": os.urandom(nbytes),
            "cls": str(i % 1000).encode(),
        }
        for i in range(n)
    ]


def write_shards(root: Path, samples: list[dict], shards: int) -> list[str]:
    per = -(-len(samples) // shards)
    paths = []
    for k in range(shards):
        path = root / f"val-{k:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in samples[k * per : (k + 1) * per]:
                for name, value in sample.items():
                    if name.startswith("__"):
                        continue
                    member = tarfile.TarInfo(f"{sample['__key__']}.{name}")
                    member.size = len(value)
                    tar.addfile(member, io.BytesIO(value))
        paths.append(str(path))
    return paths


def tar_reader():
    try:
        from shardcache.tariterators import tarfile_samples

        return "shardcache.tariterators", tarfile_samples
    except ImportError:
        from webdataset.tariterators import tarfile_samples

        return "webdataset.tariterators", tarfile_samples


def raw_open(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def raw_fill(path: str, rows: list[tuple]) -> None:
    """The DBCache schema, filled with the rows DBCache writes, in one transaction."""
    conn = raw_open(path)
    conn.execute(
        "CREATE TABLE samples (id INTEGER PRIMARY KEY, url TEXT NOT NULL,"
        " key TEXT NOT NULL, layout INTEGER NOT NULL, data BLOB NOT NULL, payload BLOB)"
    )
    conn.execute("CREATE UNIQUE INDEX samples_ident ON samples (url, key)")
    conn.execute("CREATE TABLE layouts (id INTEGER PRIMARY KEY, fields BLOB NOT NULL UNIQUE)")
    conn.execute("BEGIN")
    layouts = {fields: i for i, fields in enumerate(dict.fromkeys(r[2] for r in rows), 1)}
    conn.executemany("INSERT INTO layouts (fields, id) VALUES (?, ?)", layouts.items())
    conn.executemany(
        "INSERT INTO samples (url, key, layout, data, payload) VALUES (?, ?, ?, ?, ?)",
        [(url, key, layouts[fields], data, payload) for url, key, fields, data, payload in rows],
    )
    conn.execute("COMMIT")
    conn.close()


def raw_fill_1blob(path: str, rows: list[tuple[str, str, bytes]]) -> None:
    """One blob per sample (its ``safe_encode`` record)."""
    conn = raw_open(path)
    conn.execute(
        "CREATE TABLE samples (id INTEGER PRIMARY KEY, url TEXT NOT NULL,"
        " key TEXT NOT NULL, data BLOB NOT NULL)"
    )
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO samples (url, key, data) VALUES (?, ?, ?)", rows)
    conn.execute("COMMIT")
    conn.close()


def raw_read(path: str) -> int:
    conn = raw_open(path)
    n = 0
    for row in conn.execute("SELECT url, key, layout, data, payload FROM samples ORDER BY id"):
        n += len(row) > 0
    conn.close()
    return n


def raw_read_1blob(path: str) -> int:
    conn = raw_open(path)
    n = 0
    for (data,) in conn.execute("SELECT data FROM samples ORDER BY id"):
        n += len(data) > 0
    conn.close()
    return n


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--bytes", type=int, default=10000, help="payload bytes per sample")
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    n = args.samples
    samples = make_samples(n, args.bytes, args.shards)
    rows = [(s["__url__"], s["__key__"], *safe_encode_row(s)) for s in samples]
    blobs = [(s["__url__"], s["__key__"], safe_encode(s)) for s in samples]
    reader_name, tarfile_samples = tar_reader()
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "dbcache_fill",
            "raw_fill",
            "dbcache_read",
            "raw_read",
            "raw_read_1blob",
            "tar_read",
        )
    }
    with tempfile.TemporaryDirectory(prefix="bench-dbcache-") as tmp:
        root = Path(tmp)
        shard_paths = write_shards(root, samples, args.shards)
        for r in range(args.rounds):
            db = str(root / f"dbcache-{r}.db")
            raw = str(root / f"raw-{r}.db")
            raw1 = str(root / f"raw1-{r}.db")
            raw_fill_1blob(raw1, blobs)

            def fill_db(db=db):
                for _ in DBCache(db, n, samples, verbose=False):
                    pass

            times["dbcache_fill"].append(timed(fill_db))
            times["raw_fill"].append(timed(lambda raw=raw: raw_fill(raw, rows)))

            def read_db(db=db):
                got = sum(1 for _ in DBCache(db, n, verbose=False))
                if got != n:
                    raise RuntimeError(f"read {got} of {n}")

            times["dbcache_read"].append(timed(read_db))
            times["raw_read"].append(timed(lambda raw=raw: raw_read(raw)))
            times["raw_read_1blob"].append(timed(lambda raw1=raw1: raw_read_1blob(raw1)))

            def read_tar():
                got = sum(1 for _ in tarfile_samples(iter([{"url": p} for p in shard_paths])))
                if got != n:
                    raise RuntimeError(f"read {got} of {n} from tar")

            times["tar_read"].append(timed(read_tar))
            for path in (db, raw, raw1):
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(path + suffix):
                        os.unlink(path + suffix)

    rate = {k: n / statistics.median(v) for k, v in times.items()}
    result = {
        "samples": n,
        "payload_bytes": args.bytes,
        "rounds": args.rounds,
        "tar_reader": reader_name,
        "rates_samples_per_s": {k: round(v) for k, v in rate.items()},
        "fill_vs_raw": round(rate["dbcache_fill"] / rate["raw_fill"], 3),
        "read_vs_raw": round(rate["dbcache_read"] / rate["raw_read"], 3),
        "read_vs_raw_1blob": round(rate["dbcache_read"] / rate["raw_read_1blob"], 3),
        "read_vs_tar": round(rate["dbcache_read"] / rate["tar_read"], 3),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{n} samples of {args.bytes} payload bytes, {args.rounds} interleaved rounds, medians")
    for name, value in rate.items():
        print(f"  {name:13s} {value:10.0f} samples/s")
    print(f"  fill vs raw sqlite3 executemany: {result['fill_vs_raw']:.2f}x (target >= 0.5x)")
    print(f"  read vs raw sqlite3 SELECT:      {result['read_vs_raw']:.2f}x (target >= 0.8x)")
    print(f"  read vs raw SELECT of one blob:  {result['read_vs_raw_1blob']:.2f}x")
    print(f"  read vs tar shards ({reader_name}): {result['read_vs_tar']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
