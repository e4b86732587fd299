"""S3 figures of the proxy: cold reads against boto3, and the S3 front against plain HTTP
on warm reads.

One run starts SeaweedFS (the ``weed`` binary of the test extra, its data on tmpfs when
``/dev/shm`` has room, so dropping the page cache does not slow it) on 127.0.0.1,
uploads one object of ``--size`` MiB, and measures, interleaving the two sides of each
comparison for ``--rounds`` rounds and reporting medians:

1. cold: a read of the object through the proxy (``--upstream big=s3://...``, the entry
   purged after each read once committed) vs boto3 ``download_fileobj`` straight from
   SeaweedFS (its default transfer: 8 MiB parts, 10 threads). Before every read, of
   either side: ``sync`` and drop the page cache (root only), so neither pays for the
   other's writes. The proxy's peak RSS is sampled during its reads. Target: >= 1.0x.
2. warm: reads of the cached object: boto3 ``get_object`` through the proxy's S3 front vs
   a plain HTTP GET from the proxy (reported, no target).

Parallel ranged parts against one stream from a throttled origin are measured by
``bench/cold.py --only parts``.

    .venv/bin/python bench/s3.py                 # 256 MiB, 9 cold rounds, 5 warm rounds
    .venv/bin/python bench/s3.py --quick         # 256 MiB, 3 cold rounds, 2 warm rounds
    .venv/bin/python bench/s3.py --variants default@/path/to/other/python
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "s3"))

from s3server import SeaweedS3  # noqa: E402

from bench.harness import (  # noqa: E402
    INTERRUPTED,
    MIB,
    Procs,
    RssSampler,
    add_run_options,
    drop_caches_allowed,
    group_cpu_seconds,
    interruptible,
    markdown,
    parse_sections,
    say,
    settle,
    target_row,
    workdirs,
)
from bench.proxy import (  # noqa: E402
    HttpConn,
    ShardcacheServer,
)

BUCKET = "bench"
KEY = "big/object.bin"
PATH = "/big/object.bin"
TOKEN = "bench-admin"
SECTIONS = ("cold", "warm")
TARGET_COLD = 1.0  # proxy / boto3 direct, >=
TARGET_RSS_MB = 150.0  # <=


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        return len(b)


def http_read(port: int, path: str, timeout: float = 300) -> int:
    """GET ``path`` from 127.0.0.1:``port``, discarding the body (``recv_into``); its length."""
    conn = HttpConn("127.0.0.1", port, timeout)
    try:
        status, n, _ = conn.get(path)
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}")
    return n


def purge(base: str, path: str) -> None:
    """Drop ``path`` from the cache once its download is committed (bounded wait), so the
    next read is cold again."""
    deadline = time.monotonic() + 10
    while True:
        req = urllib.request.Request(
            f"{base}/-/cache?url={path}",
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


def interleave(
    rounds: int, sides: dict[str, Callable[[], float]], what: str
) -> dict[str, list[float]]:
    """Every side once per round, the order reversed every other round."""
    res: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(rounds):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for k in order:
            res[k].append(sides[k]())
        say(f"  {what} round {i + 1}: " + ", ".join(f"{k} {res[k][-1]:.1f} MB/s" for k in sides))
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 cold rounds, 2 warm rounds")
    ap.add_argument(
        "--only",
        type=lambda t: parse_sections(t, SECTIONS),
        default=list(SECTIONS),
        help="sections: cold,warm (default both)",
    )
    ap.add_argument("--size", type=int, default=256, help="object size, MiB (default 256)")
    ap.add_argument("--rounds", type=int, default=None, help="cold rounds (9; quick 3)")
    ap.add_argument("--warm-rounds", type=int, default=None, help="warm rounds (5; quick 2)")
    ap.add_argument("--parallel", default="8", help="--parallel of the proxy (default 8)")
    ap.add_argument("--part-size", default="8MiB", help="--part-size of the proxy (8MiB)")
    ap.add_argument(
        "--variants",
        default="default",
        help="proxy variants as in bench/proxy.py (e.g. default@/other/python); each is "
        "one more side of the cold comparison; the first is compared to the target",
    )
    add_run_options(ap, cold="cold read", data="SeaweedFS's data")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 9
    if args.warm_rounds is None:
        args.warm_rounds = 2 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.drop_caches = drop_caches_allowed(args.drop_caches, "cold reads only sync")
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    t0 = time.monotonic()
    size = args.size * MIB
    procs = Procs()
    res: dict = {"config": vars(args)}
    rows: list[list[str]] = []
    with (
        interruptible() as interrupted,
        workdirs(args, 3 * size, "shardcache-s3-") as (tmp, data),
    ):
        say(f"starting SeaweedFS in {data}...")
        seaweed = SeaweedS3.start(data / "seaweed")
        try:
            s3 = seaweed.client()
            s3.create_bucket(Bucket=BUCKET)
            s3.upload_fileobj(io.BytesIO(os.urandom(size)), BUCKET, KEY)
            s3.put_object(Bucket=BUCKET, Key="big/warmup.bin", Body=b"x")
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(
                AWS_ACCESS_KEY_ID=seaweed.access_key,
                AWS_SECRET_ACCESS_KEY=seaweed.secret_key,
                AWS_DEFAULT_REGION="us-east-1",
                AWS_EC2_METADATA_DISABLED="true",
            )
            flags = ["--s3-endpoint-url", seaweed.endpoint_url, "--admin-token", TOKEN]
            flags += ["--parallel", args.parallel, "--part-size", args.part_size]
            proxies: list[ShardcacheServer] = []
            for i, v in enumerate(v for v in args.variants.split(",") if v.strip()):
                px = ShardcacheServer(
                    procs, tmp / f"proxy{i}", f"big=s3://{BUCKET}/big", v, args.python, flags, env
                )
                px.start()
                # The daemon is long-lived: its S3 client is up before the first shard.
                http_read(px.port, "/big/warmup.bin")
                proxies.append(px)
            head = proxies[0]
            rss: dict[str, float] = {}

            # CPU seconds per cold read: the proxy, SeaweedFS, this process (the client)
            cpu: dict[str, list[tuple[float, ...]]] = {}

            def cpu_now(pid: int | None) -> tuple[float, float, float]:
                t = os.times()
                weed = group_cpu_seconds(seaweed.proc.pid)
                return (group_cpu_seconds(pid), weed, t.user + t.system)

            def with_cpu(name: str, pid: int | None, fn: Callable[[], float]) -> float:
                before = cpu_now(pid)
                mbs = fn()
                after = cpu_now(pid)
                cpu.setdefault(name, []).append(
                    tuple(b - a for a, b in zip(before, after, strict=True))
                )
                return mbs

            def via(px: ShardcacheServer) -> Callable[[], float]:
                def run() -> float:
                    settle(args.drop_caches)
                    with RssSampler(px.pid) as sampler:  # type: ignore[arg-type]
                        mbs = with_cpu(
                            px.name, px.pid, lambda: timed(lambda: http_read(px.port, PATH), size)
                        )
                    rss[px.name] = max(rss.get(px.name, 0.0), sampler.peak_kib / 1024)
                    purge(px.base, PATH)
                    return mbs

                return run

            def direct() -> float:
                def run() -> int:
                    s3.download_fileobj(BUCKET, KEY, _Discard())
                    return size

                settle(args.drop_caches)
                return with_cpu("boto3 direct", None, lambda: timed(run, size))

            if "cold" in args.only:
                say(f"(1) cold read of {args.size} MiB: proxy vs boto3 download_fileobj direct")
                sides = {px.name: via(px) for px in proxies}
                sides["boto3 direct"] = direct
                cold = interleave(args.rounds, sides, "cold")
                med = {k: statistics.median(v) for k, v in cold.items()}
                cpu_med = {
                    k: [statistics.median(x) for x in zip(*v, strict=True)] for k, v in cpu.items()
                }
                res["cold"] = {"rounds": cold, "median_mbs": med, "rss_mib": rss, "cpu": cpu}
                d = med["boto3 direct"]
                for k, (c_proxy, c_weed, c_self) in cpu_med.items():
                    say(
                        f"    {k}: median CPU s per read: proxy {c_proxy:.2f}, "
                        f"SeaweedFS {c_weed:.2f}, client {c_self:.2f}"
                    )
                for px in proxies:
                    say(
                        f"    {px.name}: median {med[px.name]:.1f} vs {d:.1f} MB/s: "
                        f"{med[px.name] / d:.2f}x (target >= {TARGET_COLD:.1f}x), "
                        f"peak RSS {rss[px.name]:.0f} MiB"
                    )
                rows.append(
                    target_row(
                        f"cold {args.size} MiB s3:// read, proxy vs boto3 download_fileobj",
                        f"{med[head.name]:.0f} MB/s",
                        f"{d:.0f} MB/s",
                        med[head.name] / d,
                        ">=",
                        TARGET_COLD,
                    )
                )
                rows.append(
                    target_row(
                        "proxy peak RSS during its cold reads",
                        f"{rss[head.name]:.0f} MiB",
                        "",
                        rss[head.name] * MIB / 1e6,
                        "<=",
                        TARGET_RSS_MB,
                        " MB",
                        ".0f",
                    )
                )

            if "warm" in args.only:
                http_read(head.port, PATH)  # warm
                front = boto3.client(
                    "s3",
                    endpoint_url=head.base,
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
                    return timed(lambda: http_read(head.port, PATH), size)

                say(f"(2) warm read of {args.size} MiB: boto3 via the S3 front vs plain HTTP GET")
                warm = interleave(
                    args.warm_rounds, {"S3 front": via_front, "plain GET": plain}, "warm"
                )
                f, h = (statistics.median(warm[k]) for k in ("S3 front", "plain GET"))
                res["warm"] = {"rounds": warm, "median_mbs": {"S3 front": f, "plain GET": h}}
                say(f"    median {f:.1f} vs {h:.1f} MB/s: {f / h:.2f}x\n")
                rows.append(
                    [
                        f"warm {args.size} MiB: boto3 via the S3 front vs plain GET",
                        f"{f:.0f} MB/s",
                        f"{h:.0f} MB/s",
                        f"{f / h:.2f}x",
                        "(report)",
                        "-",
                    ]
                )
        finally:
            procs.stop_all()
            seaweed.stop()
    if interrupted:
        return INTERRUPTED
    res["elapsed_s"] = time.monotonic() - t0
    print()
    print(
        f"{args.rounds} cold / {args.warm_rounds} warm rounds, medians; proxy {head.name}; "
        f"page cache dropped before each cold read: {'yes' if args.drop_caches else 'no'}; "
        f"took {res['elapsed_s']:.0f} s"
    )
    print(markdown(["measure", "shardcache", "compared with", "ratio", "target", "result"], rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; the finally blocks cleaned up
        print("interrupted; cleaned up", file=sys.stderr)
        raise SystemExit(130) from None
