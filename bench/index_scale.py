"""The index at scale: restart to ready, RSS, hit and miss latency of the proxy over a
store of N entries, the index seeded directly (no N downloads).

    .venv/bin/python bench/index_scale.py                       # 100,000 and 1,000,000
    .venv/bin/python bench/index_scale.py --sizes 100000 --runs 3
    .venv/bin/python bench/index_scale.py --sizes 100000,1000000,8000000 --links --tmp /big/disk
    .venv/bin/python bench/index_scale.py --sizes 100000,1000000,10000000 --links \
        --cache-layout fanout

Seeding: a :class:`~shardcache.store.Store` makes the empty index; the N names are
hashed once (MD5, as ``shard_uuid``), then N rows are inserted in key order in one
transaction (URL ``<origin>/obj/<i>``, key ``shard_uuid`` of it, ``--size`` bytes,
distinct access times; ``executemany`` of 50,000 rows, no journal, the eviction-order
indexes and the totals triggers made again after the rows, the index put back in WAL
mode) while ``--procs`` forked processes create the N sparse files of that size
(``ftruncate``: no data blocks), or with ``--links`` hard links of one sparse file per
60,000 names (one system call and no inode per name: 8M entries in 3 minutes on a
quiet 2-CPU VM, 8 at a load of 15-20; the store compares a file's size and, for its memo, its inode and
times, each name with its own row, so shared inodes change nothing it checks, but for
one thing: an eviction's unlink changes the shared inode's ctime, after which this
process's memo reads a sibling's row again once — each run's hits come before its
misses, in a new process, so the figures do not see it). The store on disk is
consistent, as after a clean shutdown. ``--cache-size`` is exactly the
seeded bytes: the cache is full, and every miss evicts an entry.

The store keeps every entry in one directory: on ext4 without the ``large_dir``
feature (a two-level hashed directory) that directory holds ~9.4M such names, then
any new name fails with ENOSPC whatever the free space (seeding 10M stopped at 9.36M
on a 4 KiB-block ext4): N = 10M needs ``large_dir``, XFS or tmpfs, or the store's
fan-out layout: with ``--cache-layout fanout`` the store is created in it and every file
goes to the subdirectory of its key (256 of them; hard links cross them, on one
filesystem), and the proxies are started with the same flag (a mismatch stops the run).

For each N, ``--runs`` times: ``shardcache serve`` is spawned on the directory and timed
to the first 200 of ``GET /-/readyz`` (restart to ready); its ``VmRSS`` is read when
ready, after ``--hits`` random hits of seeded entries (one keep-alive client, one request
at a time: p50/p99 latency) and after ``--misses`` misses of new objects from a local
origin (each one evicting: p50/p99 latency), each phase bounded by ``--phase-time``
seconds (the figures then cover the requests made in time); then it is stopped with SIGTERM. The origin
counts its requests: a hit that reaches it fails the run. Then ``--crash-runs`` times a
proxy is killed with SIGKILL once ready and started again: restart to ready after the
crash, the seconds from ready until the name pass it owes has ended (``/-/stats``
``store.names_pass``), the largest RSS meanwhile. Figures are medians over the
runs. Everything is deleted at the end. Targets (issue #24): ready <= 2 / 5 / 30 s, RSS
<= 150 / 250 / 600 MB at 100k / 1M / 10M, hit latency and miss latency flat within 20%
from the smallest N to the largest.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import http.server
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shardcache.store import INDEX_NAME, LAYOUTS, Store  # noqa: E402
from shardcache.store.names import FANOUT, FANOUT_DIRS, place  # noqa: E402
from shardcache.urls import shard_uuid  # noqa: E402

BODY_BYTE = b"x"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Origin:
    """A local origin: ``GET /obj/<name>`` answers ``size`` bytes; requests are counted.
    On ``port`` (0: any free one)."""

    def __init__(self, size: int, port: int = 0) -> None:
        self.size = size
        self.requests = 0
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                origin.requests += 1
                body = BODY_BYTE * origin.size
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/x-tar")
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self) -> None:  # noqa: N802
                origin.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(origin.size))
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


NS_URL = uuid.NAMESPACE_URL.bytes


def digests(origin: str, n: int) -> bytearray:
    """The 16 bytes of ``shard_uuid(f"{origin}/obj/{i}")`` for ``i`` in ``0..n-1``, one
    after another: MD5 straight from hashlib, then the version and variant bits set for
    all rows at once (``uuid.uuid3`` takes ~3x as long a name)."""
    import numpy as np

    out = bytearray(16 * n)
    md5 = hashlib.md5
    prefix = NS_URL + f"{origin}/obj/".encode()
    for i in range(n):
        out[16 * i : 16 * i + 16] = md5(prefix + str(i).encode()).digest()
    a = np.frombuffer(out, dtype=np.uint8).reshape(n, 16)
    a[:, 6] = (a[:, 6] & 0x0F) | 0x30
    a[:, 8] = (a[:, 8] & 0x3F) | 0x80
    return out


def name_of(raw: bytes | bytearray | memoryview) -> str:
    """The text form of a UUID's 16 bytes, as ``str(uuid.UUID(bytes=raw))``."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def key_order(raw: bytearray, n: int) -> list[int]:
    """The indexes ``0..n-1`` in the order of their keys (the UUIDs' text sorts as their
    bytes do): rows inserted in that order append to the key index instead of landing
    at random in a B-tree larger than the page cache."""
    import numpy as np

    words = np.frombuffer(raw, dtype=">u8").reshape(n, 2)
    return np.lexsort((words[:, 1], words[:, 0])).tolist()


def _row(
    origin: str, i: int, n: int, size: int, now: float, order: list[int] | None, key: str
) -> tuple:
    """The index row of seeded object ``i`` (ENTRY_COLS order)."""
    url = f"{origin}/obj/{i}"
    created = now + i * 1e-3
    # access order unrelated to the names (a shuffle when it fits in memory, else a
    # fixed permutation of the indexes: multiplication by a prime not dividing n)
    access = order[i] if order is not None else (i * PERMUTE) % n
    return (key, url, size, None, None, "application/x-tar", created,
            now + access * 1e-3, 0, created, None, None)  # fmt: skip


def _make_files(
    base: str, raw: bytearray, lo: int, hi: int, size: int, links: bool, layout: str = "flat"
) -> None:
    """The files of objects ``lo`` to ``hi - 1`` (names from ``raw``, see
    :func:`digests`), where ``layout`` puts them: sparse files of ``size`` bytes, each
    its own inode, or with ``links`` hard links of one sparse file per LINKS_PER_INODE
    names (a link is one system call and no inode). Names relative to the descriptor of
    their directory: no path walk per name."""
    fanout = layout == FANOUT
    subdirs = FANOUT_DIRS if fanout else ("",)
    fds = {d: os.open(os.path.join(base, d), os.O_RDONLY | os.O_DIRECTORY) for d in subdirs}
    view = memoryview(raw)
    link, flags = os.link, os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        src, src_fd = None, -1
        for i in range(lo, hi):
            name = name_of(view[16 * i : 16 * i + 16])
            dfd = fds[name[:2]] if fanout else fds[""]
            if links and src is not None and (i - lo) % LINKS_PER_INODE:
                link(src, name, src_dir_fd=src_fd, dst_dir_fd=dfd)
                continue
            fd = os.open(name, flags, 0o644, dir_fd=dfd)
            os.ftruncate(fd, size)
            os.close(fd)
            src, src_fd = name, dfd
    finally:
        for dfd in fds.values():
            os.close(dfd)


LINKS_PER_INODE = 60_000  # ext4 allows 65,000 links to an inode
ORDER_IN_MEMORY = 2_000_000  # up to this many entries, access times are a shuffle
PERMUTE = 1_000_003  # a prime: i -> i * PERMUTE mod n permutes 0..n-1 unless it divides n
CHUNK = 50_000  # rows per executemany


def seed(
    cache_dir: Path,
    origin: str,
    n: int,
    size: int,
    procs: int = 2,
    links: bool = False,
    layout: str = "flat",
) -> float:
    """An index of ``n`` rows and their ``n`` sparse files; returns the seconds taken.

    The names are hashed once, here, before ``procs`` forked processes make the files
    from them while this one writes the rows in key order (appends to the key index),
    in one transaction, ``executemany`` of CHUNK rows at a time, with the eviction-order
    indexes and the totals triggers dropped meanwhile and made again at the end (a sort
    instead of ``n`` random inserts; the totals added once), and no rollback journal
    nor syncs while loading (a seed that fails is deleted, never used): the index is
    then put back in WAL mode, as the store keeps it. The store is made in ``layout``,
    which places the files.
    """
    t0 = time.monotonic()
    with Store(cache_dir, reconcile=False, layout=layout) as store:  # type: ignore[arg-type]
        store.used()  # the schema, as this shardcache makes it (and the layout's directories)
    raw = digests(origin, n)
    base = str(cache_dir)
    step = -(-n // max(1, procs))
    makers = []
    for lo in range(0, n, step):
        pid = os.fork()
        if pid == 0:  # a child: its share of the files, then out
            code = 0
            try:
                _make_files(base, raw, lo, min(n, lo + step), size, links, layout)
            except BaseException:  # noqa: BLE001 - reported through the exit status
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        makers.append(pid)
    try:
        _seed_rows(cache_dir, origin, n, size, raw)
    finally:
        failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in makers)
    if failed:
        raise RuntimeError(f"{failed} of the processes making the files failed")
    return time.monotonic() - t0


def _seed_rows(cache_dir: Path, origin: str, n: int, size: int, raw: bytearray) -> None:
    """The ``n`` rows of :func:`seed`, in key order, in one transaction."""
    conn = sqlite3.connect(cache_dir / INDEX_NAME, isolation_level=None)
    try:
        conn.execute("PRAGMA cache_size = -262144")  # 256 MiB
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        # the indexes and triggers on entries the store made, made again after the rows
        schema = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE type IN ('index', 'trigger') "
            "AND tbl_name = 'entries' AND sql IS NOT NULL"
        ).fetchall()
        now = time.time() - 86400
        order = None
        if n <= ORDER_IN_MEMORY:
            order = list(range(n))
            random.Random(n).shuffle(order)
        by_key = key_order(raw, n)
        view = memoryview(raw)
        conn.execute("BEGIN IMMEDIATE")
        for kind, name, _ in schema:
            conn.execute(f"DROP {kind.upper()} {name}")
        for start in range(0, n, CHUNK):
            conn.executemany(
                "INSERT INTO entries (key, url, size, etag, last_modified, content_type, "
                "created, last_access, hits, validated, fields, digests) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    _row(origin, i, n, size, now, order, name_of(view[16 * i : 16 * i + 16]))
                    for i in by_key[start : start + CHUNK]
                ],
            )
        conn.execute(
            "UPDATE totals SET entries = entries + ?, bytes = bytes + ? WHERE id = 0",
            (n, n * size),
        )
        for _, _, sql in schema:
            conn.execute(sql)
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = WAL")
    finally:
        conn.close()


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and its children (the workers, if any), in MB (10^6 bytes)."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total / 1e6


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed_gets(port: int, paths: list[str], deadline: float, errors: list[str]) -> list[float]:
    """GET each path in turn on one keep-alive connection until ``deadline``; the
    seconds of each (fewer than ``paths`` when the time ran out). A request that fails
    is recorded in ``errors`` (and the connection made again), not timed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    out = []
    try:
        for path in paths:
            if time.monotonic() > deadline or len(errors) > 10:
                break
            t0 = time.perf_counter()
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"GET {path}: {exc!r}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                continue
            out.append(time.perf_counter() - t0)
            if resp.status != 200 or not body:
                errors.append(f"GET {path}: {resp.status}, {len(body)} bytes")
    finally:
        conn.close()
    return out


def spawn(
    args: argparse.Namespace, cache_dir: Path, origin: Origin, n: int, log: Path
) -> tuple[subprocess.Popen, int, float]:
    """``shardcache serve`` on ``cache_dir``: (process, port, seconds to the first 200 of
    ``/-/readyz``)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "shardcache", "serve",
        "--upstream", origin.base,
        "--cache-dir", str(cache_dir),
        "--cache-size", str(n * args.size),
        "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip
    if args.cache_layout:  # as seeded: a store of another layout stops the run
        argv += ["--cache-layout", args.cache_layout]
    with open(log, "ab") as logf:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=logf, stderr=logf, start_new_session=True)
    deadline = t0 + args.ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/-/readyz")
            status = c.getresponse().status
            c.close()
            if status == 200:
                return proc, port, time.monotonic() - t0
        time.sleep(0.01)
    stop(proc)
    raise TimeoutError(f"not ready in {args.ready_timeout} s")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def names_pass(port: int) -> str | None:
    """The proxy's deferred name pass, from ``/-/stats`` (``"absent"``: a proxy that
    has none, its pass made before ready)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", "/-/stats")
        body = json.loads(c.getresponse().read())
    finally:
        c.close()
    return body.get("store", {}).get("names_pass", "absent")


def crash_run(
    args: argparse.Namespace, cache_dir: Path, origin: Origin, n: int, log: Path
) -> dict[str, float]:
    """A proxy killed with SIGKILL once ready (its sessions row left behind: an unclean
    end), then started again: seconds to ready, seconds from ready until the name pass
    it owes has ended, the largest RSS seen meanwhile (sampled every 0.2 s)."""
    proc, _, _ = spawn(args, cache_dir, origin, n, log)
    stop(proc, signal.SIGKILL)
    proc, port, ready = spawn(args, cache_dir, origin, n, log)
    try:
        t0 = time.monotonic()
        rss_peak = rss_mb(proc.pid)
        state = names_pass(port)
        while state in ("pending", "running") and time.monotonic() - t0 < args.ready_timeout:
            time.sleep(0.2)
            rss_peak = max(rss_peak, rss_mb(proc.pid))
            state = names_pass(port)
        passed = time.monotonic() - t0
        if state not in ("done", "absent", None):  # None, "absent": made before ready
            raise RuntimeError(f"name pass {state!r}; see {log}")
    finally:
        stop(proc)
    return {
        "crash_ready_s": ready,
        "crash_pass_s": passed if state == "done" else 0.0,
        "crash_rss_peak": rss_peak,
    }


def warm(cache_dir: Path) -> float:
    """Read the index and list the directory (``--warm``), so that the page cache holds
    what hits and misses read, when it can; returns the seconds taken."""
    t0 = time.monotonic()
    for path in sorted(cache_dir.glob(f"{INDEX_NAME}*")):
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    for sub in [""] + [d for d in FANOUT_DIRS if (cache_dir / d).is_dir()]:
        with os.scandir(cache_dir / sub) as it:
            for _ in it:
                pass
    return time.monotonic() - t0


def one_run(
    args: argparse.Namespace, cache_dir: Path, origin: Origin, n: int, log: Path, run: int
) -> dict[str, float]:
    proc, port, ready = spawn(args, cache_dir, origin, n, log)
    try:
        rss_ready = rss_mb(proc.pid)
        rng = random.Random(run * 7919 + n)
        before = origin.requests
        # seeded entries still cached (the misses of earlier runs evicted some)
        layout = layout_of(cache_dir)
        paths = []
        for _ in range(args.hits * 10):
            i = rng.randrange(n)
            key = shard_uuid(f"{origin.base}/obj/{i}")
            if os.path.exists(place(str(cache_dir), layout, key)):
                paths.append(f"/obj/{i}")
                if len(paths) == args.hits:
                    break
        errors: list[str] = []
        warmed = warm(cache_dir) if args.warm else 0.0
        hit = timed_gets(port, paths, time.monotonic() + args.phase_time, errors)
        if origin.requests != before:
            raise RuntimeError(f"{origin.requests - before} hits reached the origin")
        rss_hits = rss_mb(proc.pid)
        # new names in every process: a --reuse run must not find an earlier run's misses
        paths = [f"/obj/new-{n}-{run}-{os.getpid()}-{i}" for i in range(args.misses)]
        miss = timed_gets(port, paths, time.monotonic() + args.phase_time, errors)
        if origin.requests - before < len(miss):
            raise RuntimeError("misses did not reach the origin")
        rss_misses = rss_mb(proc.pid)
        for e in errors:
            print(f"  error: {e}", flush=True)
        if proc.poll() is not None:
            print(f"  the proxy exited with {proc.returncode}; see {log}", flush=True)
    finally:
        stop(proc)
    return {
        "ready_s": ready,
        "rss_ready": rss_ready,
        "rss_hits": rss_hits,
        "rss_misses": rss_misses,
        "hit_p50": pct(hit, 0.5) * 1e3,
        "hit_p99": pct(hit, 0.99) * 1e3,
        "miss_p50": pct(miss, 0.5) * 1e3,
        "miss_p99": pct(miss, 0.99) * 1e3,
        "warm_s": warmed,
        "hits": len(hit),
        "misses": len(miss),
        "errors": len(errors),
    }


def layout_of(cache_dir: Path) -> str:
    """The layout a store's index records (flat when it records none)."""
    conn = sqlite3.connect(f"file:{cache_dir / INDEX_NAME}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM store_meta WHERE name = 'layout'").fetchone()
    except sqlite3.OperationalError:  # no such table: made before layouts were recorded
        row = None
    finally:
        conn.close()
    return row[0] if row else "flat"


def seeded_port(cache_dir: Path) -> int:
    """The port of the origin a seeded cache's URLs name (``--reuse``)."""
    conn = sqlite3.connect(f"file:{cache_dir / INDEX_NAME}?mode=ro", uri=True)
    try:
        (url,) = conn.execute("SELECT url FROM entries WHERE url LIKE '%/obj/%' LIMIT 1").fetchone()
    finally:
        conn.close()
    return int(url.split("/")[2].rsplit(":", 1)[1])


def summary(runs: list[dict[str, float]], crashes: list[dict[str, float]]) -> dict[str, float]:
    """Medians of the runs and of the restarts after a crash (but their load)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if crashes:
        out.update({k: statistics.median(r[k] for r in crashes) for k in crashes[0] if k != "load"})
    return out


def interleaved(
    args: argparse.Namespace,
    tmp: Path,
    origin: Origin,
    sizes: list[int],
    log: Path,
    results: dict[int, dict[str, float]],
) -> None:
    """``--reuse``: each run, then each restart after a crash, made for every N in turn."""
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    crashes: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for run in range(args.runs):
        for n in sizes:
            r = one_run(args, tmp / f"cache-{n}", origin, n, log, run)
            r["load"] = os.getloadavg()[0]
            print(f"N={n:,} run {run + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()),
                  flush=True)  # fmt: skip
            runs[n].append(r)
    for run in range(args.crash_runs):
        for n in sizes:
            r = crash_run(args, tmp / f"cache-{n}", origin, n, log)
            r["load"] = os.getloadavg()[0]
            print(f"N={n:,} after a crash {run + 1}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)  # fmt: skip
            crashes[n].append(r)
    for n in sizes:
        results[n] = summary(runs[n], crashes[n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="entry counts, comma-separated")
    ap.add_argument("--size", type=int, default=4096, help="bytes of each entry (sparse files)")
    ap.add_argument("--runs", type=int, default=3, help="proxy starts per N (medians)")
    ap.add_argument("--hits", type=int, default=2000)
    ap.add_argument("--misses", type=int, default=300)
    ap.add_argument("--tmp", default=None, help="directory for the cache (default: $TMPDIR)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument(
        "--phase-time",
        type=float,
        default=60.0,
        help="seconds at most for the hits, and "
        "for the misses (the figures then cover the requests made in that time)",
    )
    ap.add_argument("--crash-runs", type=int, default=3, help="restarts after a SIGKILL per N")
    ap.add_argument(
        "--links",
        action="store_true",
        help="seed hard links of one sparse file per 60,000 names instead of a file each "
        "(a link is a single system call and no inode: millions of entries in minutes)",
    )
    ap.add_argument("--procs", type=int, default=2, help="processes making the files")
    ap.add_argument("--keep", action="store_true", help="leave the seeded cache in place")
    ap.add_argument(
        "--cache-layout",
        choices=LAYOUTS,
        default=None,
        help="the layout of the seeded stores: flat (one directory, the default) or "
        "fanout (256 subdirectories); given to the proxies too",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="before each run's hits, read the index and list the directory, so that "
        "the page cache holds them if it can: latency without disk reads, where it fits",
    )
    ap.add_argument(
        "--reuse",
        default=None,
        help="measure the caches an earlier --keep run left in this directory (its "
        "cache-<N> for each of --sizes) instead of seeding, the sizes taken in turn within "
        "each run (the same load for every N); deleted at the end unless --keep",
    )
    args = ap.parse_args()
    sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s]
    results: dict[int, dict[str, float]] = {}
    seeded: dict[int, float] = {}
    if args.reuse:
        tmp = Path(args.reuse)
        origin = Origin(args.size, seeded_port(tmp / f"cache-{sizes[0]}"))
    else:
        tmp = Path(tempfile.mkdtemp(prefix="index-scale-", dir=args.tmp))
        origin = Origin(args.size)
    log = tmp.parent / f"{tmp.name}.proxy.log"  # kept: the proxies' output
    print(f"proxy output: {log}", flush=True)
    try:
        if args.reuse:
            interleaved(args, tmp, origin, sizes, log, results)
            seeded.update((n, float("nan")) for n in sizes)
        for n in sizes if not args.reuse else []:
            cache_dir = tmp / f"cache-{n}"
            seeded[n] = seed(
                cache_dir,
                origin.base,
                n,
                args.size,
                args.procs,
                args.links,
                args.cache_layout or "flat",
            )
            print(f"N={n:,}: seeded in {seeded[n]:.1f} s", flush=True)
            runs = []
            for run in range(args.runs):
                r = one_run(args, cache_dir, origin, n, log, run)
                r["load"] = os.getloadavg()[0]
                print(f"  run {run + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()),
                      flush=True)  # fmt: skip
                runs.append(r)
            crashes = []
            for run in range(args.crash_runs):
                r = crash_run(args, cache_dir, origin, n, log)
                r["load"] = os.getloadavg()[0]
                print(f"  after a crash {run + 1}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)  # fmt: skip
                crashes.append(r)
            results[n] = summary(runs, crashes)
            if not args.keep:
                t0 = time.monotonic()
                shutil.rmtree(cache_dir)
                print(f"  removed in {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        origin.close()
        if not args.keep:
            t0 = time.monotonic()
            shutil.rmtree(tmp, ignore_errors=True)
            if args.reuse:
                print(f"removed in {time.monotonic() - t0:.1f} s", flush=True)
    print()
    print(f"{args.size}-byte entries ({'hard links' if args.links else 'a file each'}, "
          f"{args.cache_layout or 'flat'} layout), "
          f"{args.runs} runs per N (medians), {args.hits} hits, {args.misses} evicting misses, "
          f"{args.crash_runs} restarts after SIGKILL; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print()
    print("| entries | seed | restart to ready | RSS ready | RSS after hits | RSS after misses "
          "| hit p50 / p99 | miss p50 / p99 (count) | errors | load |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in results.items():
        print(
            f"| {n:,} | {'-' if args.reuse else f'{seeded[n]:.0f} s'} | {r['ready_s']:.2f} s | {r['rss_ready']:.0f} MB "
            f"| {r['rss_hits']:.0f} MB | {r['rss_misses']:.0f} MB "
            f"| {r['hit_p50']:.2f} / {r['hit_p99']:.2f} ms "
            f"| {r['miss_p50']:.1f} / {r['miss_p99']:.1f} ms ({r['misses']:.0f}) "
            f"| {r['errors']:.0f} | {r['load']:.1f} |"
        )
    if args.crash_runs:
        print()
        print("| entries | restart to ready after a crash | name pass after ready "
              "| RSS peak during the pass |")  # fmt: skip
        print("|---:|---:|---:|---:|")
        for n, r in results.items():
            print(f"| {n:,} | {r['crash_ready_s']:.2f} s | {r['crash_pass_s']:.1f} s "
                  f"| {r['crash_rss_peak']:.0f} MB |")  # fmt: skip


if __name__ == "__main__":
    main()
