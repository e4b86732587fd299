"""Misses of small objects: the caching proxy against nginx ``proxy_cache``, each starting
from an empty cache, N keep-alive client threads fetching distinct 1 KiB objects from one
local origin (everything on 127.0.0.1). This is the warm-up of ``bench/hits.py`` measured
on its own, with the CPU each miss costs, and beside it the disk's own floor for what the
proxy must do per miss before the last byte goes out (write, fsync, rename, fsync of the
directory).

    .venv/bin/python bench/misses.py                     # 20,000 objects, 16 threads, 3 rounds
    .venv/bin/python bench/misses.py --quick             # 3,000 objects, 2 rounds
    .venv/bin/python bench/misses.py --only proxy --profile /tmp/misses.json
    .venv/bin/python bench/misses.py --only floor        # the disk's floor alone
    git archive <commit> | tar -x -C /tmp/base
    .venv/bin/python bench/misses.py --base /tmp/base    # + the proxy of another tree

Every round restarts each cache on an empty directory and runs ``sync`` first, so none
pays for writes another left dirty; the servers run in turn, the order alternating
between rounds; figures are medians. Per server: misses/s, CPU seconds of its process
group per miss (µs), the clients' latency p50/p99, the requests the origin saw (one per
object: misses are not coalesced here), and the ``sync`` after the run (the writeback it
left behind: nginx does not fsync its cache files, the proxy fsyncs every entry before its
last byte). The origin serves the objects from tmpfs (``/dev/shm`` when it has room).

floor: in the cache's filesystem, ``--floor-files`` files of 1 KiB written, fsynced and
renamed in place, by 1 thread and by ``--threads`` threads, once without and once with an
fsync of the directory after each rename: what a miss that is durable before its last byte
costs the disk alone.

``--profile FILE`` records the proxy with py-spy (``--nonblocking``) during one extra,
untimed round and prints where its threads spent their samples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    INTERRUPTED,
    Procs,
    group_cpu_seconds,
    interruptible,
    markdown,
    rotated,
    say,
    tmpfs_parent,
)
from bench.hits import (  # noqa: E402
    NGINX,
    NginxCache,
    ShardcacheHits,
    log_lines,
    make_data,
    profile_top,
    py_spy,
    small_path,
)
from bench.proxy import ORIGIN_SERVER, AiohttpOrigin, HttpConn, NginxServer, Server  # noqa: E402

KIB = 1024


def fetch_all(base: str, paths: list[str], size: int, threads: int, timeout: float) -> dict:
    """Fetch every path once with ``threads`` keep-alive connections (each thread its
    share, in turn), bounded by ``timeout`` seconds: seconds, fetched, latencies, errors."""
    port = int(base.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    lat: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def worker(i: int) -> None:
        conn = None
        for p in paths[i::threads]:
            if time.monotonic() > deadline:
                errors.append(f"thread {i}: deadline passed")
                break
            try:
                if conn is None:
                    conn = HttpConn("127.0.0.1", port, 30)
                t = time.monotonic()
                code, n, _ = conn.get(p)
                if code != 200 or n != size:
                    errors.append(f"{p}: HTTP {code}, {n} bytes")
                else:
                    lat[i].append(time.monotonic() - t)
                if conn.closing:
                    conn.close()
                    conn = None
            except OSError as exc:
                errors.append(f"{p}: {type(exc).__name__}: {exc}")
                if conn is not None:
                    conn.close()
                conn = None
            if len(errors) > 100:
                break
        if conn is not None:
            conn.close()

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(max(0.0, deadline + 35 - time.monotonic()))
    if any(t.is_alive() for t in ts):
        errors.append("client threads still running after the deadline")
    secs = time.monotonic() - t0
    all_lat = sorted(x for xs in lat for x in xs)
    q = (lambda f: all_lat[min(len(all_lat) - 1, int(f * len(all_lat)))]) if all_lat else None
    return {
        "seconds": secs,
        "fetched": len(all_lat),
        "rate": len(all_lat) / secs if secs else 0.0,
        "p50_ms": q(0.5) * 1000 if q else None,
        "p99_ms": q(0.99) * 1000 if q else None,
        "errors": errors[:20],
        "n_errors": len(errors),
    }


# ---------------------------------------------------------------------------------------
# the disk's floor


def floor_run(d: Path, files: int, threads: int, dirsync: bool) -> float:
    """Files/s: 1 KiB written to a new ``.part`` file, fsynced, renamed into place (and
    the directory fsynced after the rename when ``dirsync``), by ``threads`` threads."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    data = os.urandom(KIB)

    def work(i: int) -> None:
        for k in range(i, files, threads):
            part = d / f"{k}.part"
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(part, d / str(k))
            if dirsync:
                dfd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

    os.sync()
    t0 = time.monotonic()
    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    rate = files / (time.monotonic() - t0)
    shutil.rmtree(d, ignore_errors=True)
    return rate


def floor(args: argparse.Namespace, tmp: Path) -> list[dict]:
    out = []
    for r in range(args.rounds):
        for threads in (1, args.threads):
            for dirsync in (False, True):
                rate = floor_run(tmp / "floor", args.floor_files, threads, dirsync)
                out.append({"round": r, "threads": threads, "dirsync": dirsync, "rate": rate})
                say(
                    f"  floor round {r + 1}: {threads:2d} threads, write+fsync+rename"
                    f"{' +fsync(dir)' if dirsync else ''}: {rate:,.0f} files/s"
                )
    return out


# ---------------------------------------------------------------------------------------
# the caches


def one_round(s: Server, paths: list[str], args: argparse.Namespace, origin_log: Path) -> dict:
    s.stop()
    s.wipe()
    s.start()
    os.sync()
    before_origin = log_lines(origin_log)
    cpu0 = group_cpu_seconds(s.pid)
    res = fetch_all(s.base, paths, KIB, args.threads, args.timeout)
    res["cpu_s"] = group_cpu_seconds(s.pid) - cpu0
    res["cpu_us_per_miss"] = 1e6 * res["cpu_s"] / max(res["fetched"], 1)
    t = time.monotonic()
    os.sync()
    res["sync_after_s"] = time.monotonic() - t
    time.sleep(0.1)
    res["origin_requests"] = log_lines(origin_log) - before_origin
    res["loadavg"] = os.getloadavg()[0]
    return res


def profile_round(args: argparse.Namespace, sc: ShardcacheHits, paths: list[str]) -> dict | None:
    spy = py_spy()
    if spy is None:
        say("py-spy not found (pip install py-spy): no profile")
        return None
    sc.stop()
    sc.wipe()
    sc.start()
    out = Path(args.profile)
    argv = [spy, "record", "-p", str(sc.pid), "-o", str(out), "--format", "speedscope"]
    argv += ["--nonblocking"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)
        res = fetch_all(sc.base, paths, KIB, args.threads, args.timeout)
        p.send_signal(2)  # SIGINT: py-spy writes its file and exits
        spy_out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    if not out.exists():
        say(f"py-spy failed ({p.returncode}): {spy_out[-500:]}")
        return None
    summary = profile_top(out, 25)
    say(f"  profile round (untimed): {res['rate']:.0f} misses/s -> {out}")
    return {"file": str(out), "rate": res["rate"], **summary}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench(args: argparse.Namespace, tmp: Path, data_parent: Path, procs: Procs) -> dict:
    res: dict = {
        "env": {
            "nproc": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "python": platform.python_version(),
            "git": subprocess.run(
                ["git", "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout.strip(),
        },
        "runs": {},
    }
    if "floor" in args.only:
        res["floor"] = floor(args, tmp)
    servers_wanted = [x for x in ("proxy", "nginx") if x in args.only]
    if not servers_wanted:
        return res
    data = data_parent / "data"
    t0 = time.monotonic()
    sizes = make_data(data, args.entries, 0)
    say(f"data: {args.entries} x 1 KiB in {data} ({time.monotonic() - t0:.1f} s)")
    paths = [small_path(k) for k in range(args.entries)]
    del sizes
    if args.origin == "nginx":
        origin: Server = NginxServer(
            "origin (nginx)",
            procs,
            tmp / "origin",
            ORIGIN_SERVER.replace("{data}", str(data)),
            "auto",  # type: ignore[arg-type]
        )
    else:
        origin = AiohttpOrigin(procs, tmp / "origin", data)
    origin.start()
    origin_log: Path = origin.access_log  # type: ignore[attr-defined]
    servers: dict[str, Server] = {}
    if "proxy" in servers_wanted:
        servers["shardcache"] = ShardcacheHits(procs, tmp / "shardcache", origin.base, args)
    if "proxy" in servers_wanted and args.base:
        # the same interpreter and packages, the other tree's code (first on sys.path)
        wrapper = tmp / "base-python"
        wrapper.write_text(
            f'#!/bin/sh\ncd {shlex.quote(args.base)} && exec {shlex.quote(args.python)} "$@"\n'
        )
        wrapper.chmod(0o755)
        base_args = argparse.Namespace(**{**vars(args), "python": str(wrapper)})
        base = ShardcacheHits(procs, tmp / "shardcache-base", origin.base, base_args)
        servers["shardcache (base)"] = base
    if "nginx" in servers_wanted:
        servers["nginx"] = NginxCache(procs, tmp / "nginx", origin.port, args.nginx_workers)
    if "shardcache" in servers:
        say(f"shardcache argv: {shlex.join(servers['shardcache'].argv())}")  # type: ignore[attr-defined]
    runs: dict[str, list[dict]] = {k: [] for k in servers}
    for r in range(args.rounds):
        for name in rotated(list(servers), r):
            w = one_round(servers[name], paths, args, origin_log)
            runs[name].append(w)
            say(
                f"  round {r + 1} {name:10s} {w['rate']:8,.0f} misses/s  "
                f"{w['cpu_us_per_miss']:7,.0f} µs CPU/miss  p50 {w['p50_ms'] or 0:6.1f} ms  "
                f"p99 {w['p99_ms'] or 0:6.1f} ms  sync after {w['sync_after_s']:.2f} s  "
                f"origin requests {w['origin_requests']}  errors {w['n_errors']}"
            )
            if w["n_errors"]:
                say("    " + "; ".join(w["errors"][:5]))
    res["runs"] = runs
    if args.profile and "shardcache" in servers:
        res["profile"] = profile_round(args, servers["shardcache"], paths)  # type: ignore[arg-type]
    for s in servers.values():
        s.stop()
    res["env"]["loadavg_end"] = os.getloadavg()
    return res


def table(res: dict, args: argparse.Namespace) -> list[list[str]]:
    rows = []
    runs = res.get("runs", {})
    for name, rs in runs.items():
        rows.append(
            [
                name,
                f"{med([w['rate'] for w in rs]):,.0f}",
                f"{med([w['cpu_us_per_miss'] for w in rs]):,.0f}",
                f"{med([w['p50_ms'] or 0 for w in rs]):.1f} / {med([w['p99_ms'] or 0 for w in rs]):.1f}",
                f"{med([w['sync_after_s'] for w in rs]):.2f}",
                f"{sum(w['origin_requests'] for w in rs)} / {sum(w['n_errors'] for w in rs)}",
            ]
        )
    if "shardcache" in runs and "nginx" in runs:
        a = med([w["rate"] for w in runs["shardcache"]])
        b = med([w["rate"] for w in runs["nginx"]])
        rows.append(["ratio shardcache / nginx", f"{a / b:.2f}x" if b else "-", "", "", "", ""])
    if "shardcache" in runs and "shardcache (base)" in runs:
        a = med([w["rate"] for w in runs["shardcache"]])
        b = med([w["rate"] for w in runs["shardcache (base)"]])
        ca = med([w["cpu_us_per_miss"] for w in runs["shardcache"]])
        cb = med([w["cpu_us_per_miss"] for w in runs["shardcache (base)"]])
        rows.append(
            [
                "ratio shardcache / base",
                f"{a / b:.2f}x" if b else "-",
                f"{ca / cb:.2f}x",
                "",
                "",
                "",
            ]
        )
    for threads in (1, args.threads):
        for dirsync in (False, True):
            xs = [
                f["rate"]
                for f in res.get("floor", [])
                if f["threads"] == threads and f["dirsync"] == dirsync
            ]
            if xs:
                rows.append(
                    [
                        f"disk floor, {threads} thread{'s' if threads > 1 else ''}, "
                        f"write+fsync+rename{' +fsync(dir)' if dirsync else ''}",
                        f"{med(xs):,.0f}",
                        "",
                        "",
                        "",
                        "",
                    ]
                )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=None, help="1 KiB objects (default 20000)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    p.add_argument("--threads", type=int, default=16, help="client threads (16)")
    p.add_argument("--quick", action="store_true", help="3000 objects, 2 rounds")
    p.add_argument(
        "--only",
        default="proxy,nginx,floor",
        help="what to run, of proxy,nginx,floor (default all three)",
    )
    p.add_argument("--timeout", type=float, default=600, help="bound on each round, s (600)")
    p.add_argument("--floor-files", type=int, default=3000, help="files per floor run (3000)")
    p.add_argument("--workers", type=int, default=0, help="shardcache serve --workers N")
    p.add_argument(
        "--log-level", default="info", help="shardcache --log-level (default info, its own)"
    )
    p.add_argument("--fast-hits", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-size", default="10G", help="shardcache --cache-size (10G)")
    p.add_argument("--nginx-workers", default="auto", help="nginx worker_processes (auto)")
    p.add_argument("--origin", choices=("nginx", "aiohttp"), default="nginx", help="origin")
    p.add_argument("--profile", default=None, help="py-spy speedscope file (extra round)")
    p.add_argument(
        "--base",
        default=None,
        help="also run the proxy of this source tree (e.g. a git archive of another commit)",
    )
    p.add_argument("--dir", default=None, help="parent of the caches' temporary directory")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--python",
        default=str(ROOT / ".venv/bin/python")
        if (ROOT / ".venv/bin/python").exists()
        else sys.executable,
        help="interpreter that runs the proxy (default .venv/bin/python)",
    )
    args = p.parse_args(argv)
    for k, v in (
        {"entries": 3000, "rounds": 2} if args.quick else {"entries": 20_000, "rounds": 3}
    ).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    if not args.only or set(args.only) - {"proxy", "nginx", "floor"}:
        p.error("--only: pick from proxy,nginx,floor")
    if min(args.entries, args.rounds, args.threads, args.floor_files) < 1:
        p.error("--entries, --rounds, --threads and --floor-files must be >= 1")
    if args.entries > 1_000_000:
        p.error("--entries: at most 1,000,000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    if ("nginx" in args.only or args.origin == "nginx") and not os.access(NGINX, os.X_OK):
        print(f"{NGINX} is required (apt-get install nginx-light)", file=sys.stderr)
        return 2
    say(f"command: {command}")
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-misses-", dir=args.dir))
    data_parent = Path(
        tempfile.mkdtemp(
            prefix="shardcache-misses-data-",
            dir=tmpfs_parent(args.entries * 8 * KIB, args.dir),
        )
    )
    t0 = time.monotonic()
    try:
        with interruptible() as interrupted, procs:
            res = bench(args, tmp, data_parent, procs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(data_parent, ignore_errors=True)
    if interrupted:
        return INTERRUPTED
    res["command"] = command
    res["wall_s"] = time.monotonic() - t0
    res["config"] = vars(args)
    rows = table(res, args)
    res["table"] = rows
    print()
    print(f"command: `{command}`")
    print(
        f"{args.rounds} rounds (medians), {args.entries} x 1 KiB objects, {args.threads} "
        f"client threads; {res['env']['nproc']} CPUs, load average "
        f"{res['env']['loadavg_start'][0]:.1f} -> {res['env'].get('loadavg_end', [0])[0]:.1f}; "
        f"code {res['env']['git']}; run took {res['wall_s']:.0f} s"
    )
    print()
    print(
        markdown(
            ["", "misses/s", "CPU µs/miss", "p50 / p99 ms", "sync after, s", "origin req / errors"],
            rows,
        )
    )
    prof = res.get("profile")
    if prof:
        print()
        print(f"py-spy of the proxy during an untimed round at {prof['rate']:.0f} misses/s")
        print(
            "samples by thread group: "
            + ", ".join(
                f"{k} x{g['threads']}: {g['samples']}"
                + (f" ({g['queue']} waiting on the pool queue)" if g["queue"] else "")
                for k, g in prof["groups"].items()
            )
        )
        print(markdown(["function", "file", "own+child", "own"], prof["main_top"]))
        print("event loop, most own time: " + "; ".join(f"{k} {v}" for k, v in prof["main_own"]))
        print(
            "other threads, busiest lines: " + "; ".join(f"{k} {v}" for k, v in prof["other_top"])
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
