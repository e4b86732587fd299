"""Training epochs through the proxy (webdataset, with and without read plans, and
shardcache's own ShardDataset, also with same-node direct reads), against webdataset
straight from the origin, MosaicML Streaming and LitData, on an origin with limited
bandwidth.

    make .venv-clients/.installed
    .venv-clients/bin/python bench/epoch.py                 # 48 x 32 MiB, 2 rounds (~20 min)
    .venv-clients/bin/python bench/epoch.py --quick         # 24 x 32 MiB, 1 round (~5 min)
    .venv-clients/bin/python bench/epoch.py --scenarios half --variants proxy,plan,plan3

Data: ``--shards`` WebDataset tar shards of about ``--shard-mib`` MiB, samples of a
``.jpg`` (random bytes, ``--sample-kb`` kB on average, +-25%) and a ``.cls``, and the
same samples written once as MosaicML Streaming MDS shards (``MDSWriter``, size limit
``--shard-mib``) and as LitData chunks (``litdata.optimize``); all on tmpfs (``/dev/shm`` when it has room), removed at the end
(``--data DIR`` keeps and reuses them).

Origin (a subprocess of this script): a threaded HTTP/1.1 file server, GET and HEAD,
one ``Range``, ``ETag``, ``Last-Modified``, ``Content-Length``, keep-alive; every
response ``--delay`` s (0.01) after its request, each connection paced to
``--conn-mbs`` MB/s (50) and all of them together to ``--total-mbs`` MB/s (250, one
token bucket). It counts the body bytes it sends: that is "origin bytes". Streaming
reads it as path-style S3 (``S3_ENDPOINT_URL``; Streaming has no http(s) downloader):
boto3 ``download_file`` without threads, i.e. a HEAD and sequential 8 MiB ranged GETs.

Readers: a torch ``DataLoader`` with ``num_workers=2`` (``batch_size=None``); in each
worker the dataset's samples are consumed at ``--consume-mbs`` / 2 MB/s (150 MB/s for
both): after each sample the worker sleeps its bytes / rate ("compute"), and the time it
waited for the next sample is its stall. Workers hand the main process only sizes and
times, not the bytes.

Variants (``--variants``), each run on a fresh proxy with an empty cache (a 4 KiB
warm-up GET, then ``sync`` and the page cache dropped when root) for ``--epochs`` epochs:

- direct: ``webdataset.WebDataset(urls, shardshuffle=False)`` (``split_by_worker``)
  straight from the origin;
- proxy: the same URLs through ``shardcache serve --upstream ORIGIN``;
- plan: the same, and each worker registers its own shards in its order for the epoch
  (``shardcache.plan``, or ``POST /-/plans``) before reading and closes it after;
- plan2 (``half`` only): as plan, but each worker's plan also holds its shards of the
  next epoch, is left registered when the epoch ends and is replaced by the next epoch's
  (``ShardDataset(plan_epochs=2)``; in the last epoch too, as a reader that does not know
  it is the last);
- plan3 (``half`` only): the main process registers each worker's shards of all epochs
  as one plan per worker before epoch 1 (the order is known up front);
- unlimited (``same`` only): webdataset straight from a second origin without bandwidth
  limits: the readers' own floor (what curl, the tar reader and the pacing cost);
- shardds: shardcache's own ``ShardDataset(urls, plan=True)`` through the proxy (each
  worker registers its shards as a read plan, as plan does);
- direct-read: as shardds, with same-node direct reads
  (``ShardDataset(proxy_cache_dir=<the proxy's --cache-dir>)``): committed entries are
  read from the proxy's cache directory, misses go through the proxy;
- streaming: ``StreamingDataset(remote=s3://..., local=fresh dir, batch_size=1,
  predownload=--predownload, shuffle=...)``, the same DataLoader and pacing;
- litdata: LitData's ``StreamingDataset("s3://lit/ds", cache_dir=fresh dir,
  storage_options={"endpoint_url": origin}, max_cache_size="25GB")`` (the whole
  dataset kept, as Streaming keeps it) over the same samples converted by
  ``litdata.optimize`` (chunks of at most ``--shard-mib``), from the same origin and so
  with the same per-connection and total limits; ``set_epoch`` before each epoch.

Scenarios (``--scenarios``): ``same`` (the shard order of every epoch is the same),
``shuffled`` (the shard list is shuffled with a seed per epoch, each worker taking every
other shard of it; Streaming shuffles with its own algorithm, ``shuffle=True``), ``half``
(same order, ``--cache-size`` of the proxy = half the dataset; proxy, plan, plan2, plan3).
The ``same`` and ``shuffled`` tables compare shardds and direct-read with LitData's epoch 1
and with the fastest local-file loader's (Streaming or LitData) warm epochs.

Rounds (``--rounds``): every scenario runs each of its variants once per round, the
order reversed every other round; figures are medians over rounds.

Per epoch: wall time (from the DataLoader's iterator to its last sample), reader stall
(mean over the two workers of the seconds spent waiting for a next sample), the proxy's
``shardcache_client_wait_seconds_total`` increase (summed over requests, when it has the
metric), origin bytes (after the last epoch, counted until the proxy's downloads are
idle), the proxy's data requests by ``X-Cache`` and the hit ratio (HIT / requests).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import resource
import shutil
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.cold import ThrottledOrigin  # noqa: E402
from bench.harness import (  # noqa: E402
    INTERRUPTED,
    MIB,
    Procs,
    RssSampler,
    add_run_options,
    check_alive,
    drop_caches_allowed,
    group_cpu_seconds,
    interruptible,
    markdown,
    median,
    rotated,
    say,
    settle,
    target_row,
    tmpfs_parent,
    wait_until,
)
from bench.proxy import (  # noqa: E402
    WARMUP,
    Server,
    ShardcacheServer,
)

SCENARIOS = ("same", "shuffled", "half")
VARIANTS = (
    "direct",
    "proxy",
    "plan",
    "plan2",
    "plan3",
    "shardds",
    "direct-read",
    "streaming",
    "litdata",
    "unlimited",
)
SCENARIO_VARIANTS = {
    "same": (
        "direct",
        "proxy",
        "plan",
        "shardds",
        "direct-read",
        "streaming",
        "litdata",
        "unlimited",
    ),
    "shuffled": ("direct", "proxy", "plan", "shardds", "direct-read", "streaming", "litdata"),
    "half": ("proxy", "plan", "plan2", "plan3"),
}
# the variants that read through a proxy (a fresh one per run)
PROXY_VARIANTS = ("proxy", "plan", "plan2", "plan3", "shardds", "direct-read")
# the variants that read local files once a shard is downloaded (the warm-epoch reference)
LOCAL_FILE_VARIANTS = ("streaming", "litdata")
WORKERS = 2
UNLIMITED = 1e5  # MB/s: the origin of the "unlimited" variant, not a limit in practice
BUCKET = "mds"  # the MDS shards are at /mds/ds/... on the origin: s3://mds/ds
LIT_BUCKET = "lit"  # LitData's chunks are at /lit/ds/... on the origin: s3://lit/ds
TARGETS = {
    "plan_e1_vs_e2": 1.15,  # <=
    "plan_stall_frac": 0.05,  # <=
    "plan_e1_vs_streaming": 1.0,  # <=
    "half_hit_ratio": 0.45,  # >=
    "upstream_x": 1.0,  # <= per epoch, when the dataset fits
    "plan_e1_vs_litdata": 1.0,  # <= ShardDataset through the proxy with a plan, epoch 1
    "warm_vs_local": 1.0,  # <= epochs 2+ against the fastest local-file loader's
    "client_wait_frac": 0.02,  # <= proxy client wait per reader / epoch-1 wall
}


# ---------------------------------------------------------------------------------------
# data


def make_data(data: Path, args: argparse.Namespace) -> dict:
    """Tar shards under ``data/wds`` and the same samples as MDS under ``data/mds/ds``;
    returns the manifest (also written to ``data/manifest.json``). Reused when the
    manifest matches the requested sizes."""
    want = {
        "shards": args.shards,
        "shard_mib": args.shard_mib,
        "sample_kb": args.sample_kb,
        "seed": args.seed,
    }
    manifest = data / "manifest.json"
    if manifest.exists():
        got = json.loads(manifest.read_text())
        if got.get("spec") == want:
            say(f"data: reusing {data}")
            if "lit" not in got:  # kept from before the LitData variant
                got.update(make_lit(data, args))
                manifest.write_text(json.dumps(got, indent=1))
            return got
        raise SystemExit(f"{data} holds other data ({got.get('spec')}); remove it or pick another")
    from streaming import MDSWriter

    t0 = time.monotonic()
    rng = random.Random(args.seed)
    pool = os.urandom(4 * MIB + int(args.sample_kb * 1250))
    shard_bytes = int(args.shard_mib * MIB)
    mean = int(args.sample_kb * 1000)
    (data / "wds").mkdir(parents=True, exist_ok=True)
    (data / "mds").mkdir(parents=True, exist_ok=True)
    (data / WARMUP).write_bytes(os.urandom(4096))
    sizes: dict[str, int] = {}
    samples = 0
    sample_bytes = 0

    def member(tf: tarfile.TarFile, name: str, payload: bytes) -> None:
        ti = tarfile.TarInfo(name)
        ti.size = len(payload)
        ti.mtime = 1_700_000_000
        tf.addfile(ti, io.BytesIO(payload))

    with MDSWriter(
        out=str(data / "mds" / "ds"),
        columns={"key": "str", "jpg": "bytes", "cls": "int"},
        size_limit=shard_bytes,
    ) as mds:
        for i in range(args.shards):
            name = f"shard-{i:06d}.tar"
            used = 1024 + 10240  # end of archive and record padding, roughly
            with tarfile.open(data / "wds" / name, "w", format=tarfile.USTAR_FORMAT) as tf:
                while True:
                    n = rng.randint(mean * 3 // 4, mean * 5 // 4)
                    cost = 512 + (n + 511) // 512 * 512 + 1024
                    if used + cost > shard_bytes:
                        break
                    used += cost
                    off = rng.randrange(len(pool) - n)
                    jpg = pool[off : off + n]
                    cls = rng.randrange(1000)
                    key = f"s{samples:08d}"
                    member(tf, f"{key}.jpg", jpg)
                    member(tf, f"{key}.cls", str(cls).encode())
                    mds.write({"key": key, "jpg": jpg, "cls": cls})
                    samples += 1
                    sample_bytes += n + len(str(cls))
            sizes[name] = (data / "wds" / name).stat().st_size
    mds_files = {
        str(p.relative_to(data / "mds" / "ds")): p.stat().st_size
        for p in sorted((data / "mds" / "ds").iterdir())
    }
    out = {
        "spec": want,
        "tar": sizes,
        "tar_bytes": sum(sizes.values()),
        "mds": mds_files,
        "mds_bytes": sum(mds_files.values()),
        "samples": samples,
        "sample_bytes": sample_bytes,
    }
    out.update(make_lit(data, args))
    manifest.write_text(json.dumps(out, indent=1))
    say(
        f"data: {args.shards} tar shards, {out['tar_bytes'] / MIB:.0f} MiB, {samples} samples; "
        f"{len(mds_files) - 1} MDS shards, {out['mds_bytes'] / MIB:.0f} MiB; "
        f"written in {time.monotonic() - t0:.1f} s to {data}"
    )
    return out


def lit_samples(path: str):
    """The samples of one tar shard as LitData's ``optimize`` stores them (the key, the
    ``.jpg`` bytes, the class as an int: the columns of the MDS copy)."""
    with tarfile.open(path) as tf:
        members = {m.name: m for m in tf.getmembers()}
        for name in sorted(n for n in members if n.endswith(".jpg")):
            key = name[: -len(".jpg")]
            jpg = tf.extractfile(members[name]).read()  # type: ignore[union-attr]
            cls = int(tf.extractfile(members[key + ".cls"]).read())  # type: ignore[union-attr]
            yield {"key": key, "jpg": jpg, "cls": cls}


def make_lit(data: Path, args: argparse.Namespace) -> dict:
    """The tar shards' samples in LitData's optimize format under ``data/lit/ds`` (chunks
    of at most ``--shard-mib``), as ``litdata.optimize`` writes them; returns the
    manifest's ``lit`` part."""
    import litdata

    t0 = time.monotonic()
    out_dir = data / LIT_BUCKET / "ds"
    shutil.rmtree(out_dir, ignore_errors=True)
    tars = sorted(str(p) for p in (data / "wds").glob("shard-*.tar"))
    litdata.optimize(
        fn=lit_samples,
        inputs=tars,
        output_dir=str(out_dir),
        chunk_bytes=int(args.shard_mib * MIB),
        num_workers=1,
        reorder_files=False,
        verbose=False,
        start_method="fork",
    )
    files = {str(p.relative_to(out_dir)): p.stat().st_size for p in sorted(out_dir.iterdir())}
    say(
        f"data: {len(files) - 1} LitData chunks, {sum(files.values()) / MIB:.0f} MiB, "
        f"written in {time.monotonic() - t0:.1f} s"
    )
    return {"lit": files, "lit_bytes": sum(files.values())}


# ---------------------------------------------------------------------------------------
# the origin: bench/cold.py's threaded server, paced per connection and in total


class Bucket:
    """A token bucket shared by all connections: ``take(n)`` reserves n bytes and returns
    how long the caller must wait before sending them (debt at ``rate`` bytes/s)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> float:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            self.tokens -= n
            return -self.tokens / self.rate if self.tokens < 0 else 0.0


class LimitedOrigin(ThrottledOrigin):
    """Files under ``root``; each connection paced to ``rate`` bytes/s, all connections
    together to ``total`` bytes/s. ``/-/stats`` adds the body bytes sent per path."""

    chunk = 64 * 1024
    content_type = "application/octet-stream"
    if_match = False

    def __init__(self, root: Path, rate: float, total: float, delay: float) -> None:
        super().__init__(root, rate, delay)
        self.bucket = Bucket(total, 2 * self.chunk)
        self.per_path: dict[str, int] = {}

    def respond(self, conn, method, target, hdrs, keep) -> None:  # type: ignore[override]
        url = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(url.path)
        if path == "/-/stats":
            with self.lock:
                doc = {
                    "body_bytes": self.body_bytes,
                    "count": len(self.requests),
                    "open": sum(1 for r in self.requests if not r["done"]),
                    "per_path": dict(self.per_path),
                }
            self.send_json(conn, doc, keep)
            return
        rec = self.record(method, path, hdrs)
        try:
            f, status, headers, first, length = self.head_for(method, path, hdrs)
            time.sleep(self.delay)
            self.send_head(conn, status, headers, keep)
            rec["status"] = status
            sent = 0
            if method == "GET" and length:
                with open(f, "rb") as fh:
                    t_body = time.monotonic()
                    while sent < length:
                        n = min(self.chunk, length - sent)
                        wait = max(
                            self.bucket.take(n), sent / self.rate - (time.monotonic() - t_body)
                        )
                        if wait > 0:
                            time.sleep(wait)
                        n = os.sendfile(conn.fileno(), fh.fileno(), first + sent, n)
                        if n == 0:
                            break
                        sent += n
                        with self.lock:
                            self.body_bytes += n
                            self.per_path[path] = self.per_path.get(path, 0) + n
                            rec["sent"] = sent
        finally:
            rec["done"] = True


class OriginServer(Server):
    def __init__(
        self, procs: Procs, tmp: Path, data: Path, args: argparse.Namespace, limited: bool = True
    ) -> None:
        super().__init__("origin", procs, tmp)
        self.data = data
        self.args = args
        self.limited = limited

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        port_file = self.tmp / "port"
        port_file.unlink(missing_ok=True)
        self.log = self.tmp / "stderr.log"
        a = self.args
        conn, total = (a.conn_mbs, a.total_mbs) if self.limited else (UNLIMITED, UNLIMITED)
        argv = [sys.executable, __file__, "--_origin", str(self.data), str(conn * 1e6)]
        argv += [str(total * 1e6), str(a.delay), str(port_file)]
        self.proc = self.procs.start(argv, self.log)
        wait_until(
            lambda: (
                check_alive(self.proc, "origin", self.log)
                and port_file.exists()
                and bool(port_file.read_text())
            ),
            20,
            "origin",
        )
        self.port = int(port_file.read_text())

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.base}/-/stats", timeout=10) as r:
            return json.loads(r.read())


def serve_origin(root: str, rate: str, total: str, delay: str, port_file: str) -> None:
    o = LimitedOrigin(Path(root), float(rate), float(total), float(delay))
    o.serve(Path(port_file), Path(os.devnull))


# ---------------------------------------------------------------------------------------
# readers (the datasets run inside the DataLoader's worker processes)


def paced(it, rate: float, wid: int, extra: dict | None = None):
    """Consume ``it`` at ``rate`` bytes/s: after each sample sleep its bytes / rate;
    yield small records (sizes and the wait for each sample), then a final one."""
    wait = 0.0
    n_samples = 0
    n_bytes = 0
    keys = []
    while True:
        t0 = time.monotonic()
        try:
            s = next(it)
        except StopIteration:
            break
        t1 = time.monotonic()
        wait += t1 - t0
        # webdataset: jpg and cls as bytes; Streaming: jpg bytes, cls an int; LitData: jpg
        # a memoryview, cls an int
        n = sum(
            v.nbytes
            if isinstance(v, memoryview)
            else len(v)
            if isinstance(v, bytes | bytearray)
            else len(str(v))
            for k, v in s.items()
            if k in ("jpg", "cls")
        )
        n_samples += 1
        n_bytes += n
        keys.append(s.get("__key__") or s.get("key"))
        left = t1 + n / rate - time.monotonic()
        if left > 0:
            time.sleep(left)
    yield {
        "final": 1,
        "w": wid,
        "wait": wait,
        "samples": n_samples,
        "bytes": n_bytes,
        "keys": json.dumps(keys),
        **(extra or {}),
    }


def worker_id() -> tuple[int, int]:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


def register_plan(proxy: str, urls: list[str], name: str, lookahead, replace: bool = False):
    """``shardcache.plan`` when the library has it, else ``POST /-/plans``; returns an
    object with ``.id``, ``.status()`` and ``.close()``. ``replace``: the plans of the
    same name end once this one is registered."""
    try:
        from shardcache import plan as client_plan
    except ImportError:
        client_plan = None
    if client_plan is not None:
        kw = {"replace": True} if replace else {}
        return client_plan(urls, proxy=proxy, name=name, lookahead=lookahead, **kw)
    return RawPlan(proxy, urls, name, lookahead, replace)


class RawPlan:
    def __init__(
        self, proxy: str, urls: list[str], name: str, lookahead, replace: bool = False
    ) -> None:
        self.proxy = proxy.rstrip("/")
        body: dict = {"urls": urls, "name": name}
        if lookahead is not None:
            body["lookahead"] = lookahead
        if replace:
            body["replace"] = True
        req = urllib.request.Request(
            self.proxy + "/-/plans",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            self.id = json.loads(r.read())["id"]

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.proxy}/-/plans/{self.id}", timeout=10) as r:
            return json.loads(r.read())

    def close(self) -> None:
        req = urllib.request.Request(f"{self.proxy}/-/plans/{self.id}", method="DELETE")
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(req, timeout=10).close()


def plan_lookahead(text: str | None):
    if text is None:
        return None
    return int(text) if text.isdigit() else text


def _make_wds_dataset():
    import torch.utils.data
    import webdataset as wds

    class PacedWebDataset(torch.utils.data.IterableDataset):
        """``wds.WebDataset(urls)`` split by worker, consumed at ``rate`` bytes/s per
        worker; with ``plan_proxy`` each worker registers its shards first."""

        def __init__(self, urls, rate, plan_proxy=None, plan_name="", lookahead=None, next_urls=()):
            self.urls = list(urls)
            self.next_urls = list(next_urls)
            self.rate = rate
            self.plan_proxy = plan_proxy
            self.plan_name = plan_name
            self.lookahead = lookahead

        def __iter__(self):
            wid, n = worker_id()
            plan = None
            if self.plan_proxy:
                mine = self.urls[wid::n]  # what split_by_worker gives this worker
                mine += self.next_urls[wid::n]
                plan = register_plan(
                    self.plan_proxy,
                    mine,
                    f"{self.plan_name}/worker-{wid}",
                    self.lookahead,
                    replace=bool(self.next_urls),
                )
            ds = wds.WebDataset(self.urls, shardshuffle=False, workersplitter=wds.split_by_worker)
            try:
                for rec in paced(iter(ds), self.rate, wid):
                    if rec.get("final") and plan is not None:
                        rec["plan"] = json.dumps(plan.status())
                        if not self.next_urls:
                            plan.close()
                        # else it holds the next epoch until that epoch's plan replaces it,
                        # as ShardDataset(plan_epochs=2) leaves it
                        plan = None
                    yield rec
            finally:
                if plan is not None:
                    plan.close()

    return PacedWebDataset


def _make_shard_dataset():
    import torch.utils.data

    class PacedShardDataset(torch.utils.data.IterableDataset):
        """shardcache's own ``ShardDataset(urls, plan=True)`` (split by worker, each
        worker registering its shards as a read plan), consumed at ``rate`` bytes/s per
        worker; with ``proxy_cache_dir`` committed entries are read from the proxy's cache
        directory (same-node direct reads)."""

        def __init__(self, urls, rate, plan_name: str, lookahead=None, proxy_cache_dir=None):
            self.urls = list(urls)
            self.rate = rate
            self.plan_name = plan_name
            self.lookahead = lookahead
            self.proxy_cache_dir = proxy_cache_dir

        def __iter__(self):
            from shardcache import ShardDataset

            wid, _ = worker_id()
            ds = ShardDataset(
                self.urls,
                plan=True,
                plan_name=self.plan_name,
                plan_lookahead=self.lookahead,
                proxy_cache_dir=self.proxy_cache_dir,
            )
            yield from paced(iter(ds), self.rate, wid)

    return PacedShardDataset


_LIT_CLS = None


def _make_lit_dataset():
    global _LIT_CLS
    if _LIT_CLS is None:
        from litdata import StreamingDataset as LitStreamingDataset
        from litdata.streaming import downloader as lit_downloader

        # LitData's chunk downloads go through obstore (Rust object_store), which refuses
        # an http:// endpoint unless its client options allow it; LitData passes no such
        # option, so the bench's plain-HTTP origin is allowed here (an https endpoint
        # needs nothing)
        opts = getattr(lit_downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(opts, dict):
            opts["allow_http"] = "true"

        _LIT_CLS = _paced_class(LitStreamingDataset)
    return _LIT_CLS


def _paced_class(base: type) -> type:
    """``base`` (a streaming dataset class) whose iteration is paced at ``rate`` bytes/s
    per worker, as the bench's readers consume."""

    class Paced(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a, rate: float, **kw):
            super().__init__(*a, **kw)
            self.rate = rate

        def __iter__(self):
            wid, _ = worker_id()
            yield from paced(super().__iter__(), self.rate, wid)

    Paced.__name__ = Paced.__qualname__ = "Paced" + base.__name__
    return Paced


_STREAMING_CLS = None


def _make_streaming_dataset():
    global _STREAMING_CLS
    if _STREAMING_CLS is None:
        from streaming import StreamingDataset

        _STREAMING_CLS = _paced_class(StreamingDataset)
    return _STREAMING_CLS


def run_epoch(ds, timeout: float) -> dict:
    """Read ``ds`` once with a 2-worker DataLoader; returns wall time and what the
    workers reported."""
    import torch.utils.data

    dl = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=WORKERS, timeout=timeout, prefetch_factor=4
    )
    t0 = time.monotonic()
    finals = []
    for rec in dl:
        if rec.get("final"):
            finals.append(rec)
    wall = time.monotonic() - t0
    waits = [f["wait"] for f in finals]
    plans = [json.loads(f["plan"]) for f in finals if f.get("plan")]
    return {
        "wall": wall,
        "stall": sum(waits) / WORKERS if waits else None,
        "stall_per_worker": waits,
        "samples": sum(f["samples"] for f in finals),
        "bytes": sum(f["bytes"] for f in finals),
        "keys": sorted(k for f in finals for k in json.loads(f["keys"])),
        "workers_done": len(finals),
        "plans": plans,
    }


# ---------------------------------------------------------------------------------------
# proxy metrics

METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")


def scrape(base: str) -> dict:
    """``/metrics`` as {name: {labels string: value}}."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = METRIC_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        try:
            out.setdefault(name, {})[labels] = float(value)
        except ValueError:
            continue
    return out


def msum(snap: dict, name: str, **labels: str) -> float | None:
    if name not in snap:
        return None
    total = 0.0
    for lab, v in snap[name].items():
        if all(f'{k}="{val}"' in lab for k, val in labels.items()):
            total += v
    return total


def proxy_delta(a: dict, b: dict) -> dict:
    def d(name: str, **labels: str) -> float | None:
        x, y = msum(a, name, **labels), msum(b, name, **labels)
        if y is None:
            return None
        return y - (x or 0.0)  # a labelled counter has no sample before its first use

    req = {
        c: d("shardcache_requests_total", cache=c) for c in ("HIT", "MISS", "COALESCED", "BYPASS")
    }
    total = d("shardcache_requests_total")
    return {
        "requests": total,
        "by_cache": req,
        "hit_ratio": (req["HIT"] / total) if total and req["HIT"] is not None else None,
        "upstream_bytes": d("shardcache_upstream_bytes_total"),
        "client_wait": d("shardcache_client_wait_seconds_total"),
        "prefetch_bytes": d("shardcache_prefetch_bytes_total"),
        "evictions": d("shardcache_evictions_total"),
        "errors": sum(
            v or 0
            for v in (
                d("shardcache_upstream_requests_total", outcome="error"),
                d("shardcache_upstream_requests_total", outcome="timeout"),
                d("shardcache_upstream_requests_total", outcome="aborted"),
                d("shardcache_failed_downloads_total"),
            )
        ),
        "non_2xx": (total or 0)
        - (d("shardcache_requests_total", code="200") or 0)
        - (d("shardcache_requests_total", code="206") or 0),
    }


def has_plans(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/-/plans", timeout=5) as r:
            return r.status == 200 and "plans" in json.loads(r.read())
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------
# the run


class Bench:
    def __init__(self, args, tmp: Path, data: Path, manifest: dict, procs: Procs) -> None:
        self.args = args
        self.tmp = tmp
        self.data = data
        self.m = manifest
        self.procs = procs
        self.origin = OriginServer(procs, tmp / "origin", data, args)
        self.origin.start()
        self.fast: OriginServer | None = None
        if "unlimited" in args.variants and "same" in args.scenarios:
            self.fast = OriginServer(procs, tmp / "fast-origin", data, args, limited=False)
            self.fast.start()
        self.names = sorted(manifest["tar"])
        self.dataset_bytes = manifest["tar_bytes"]
        self.n = 0
        self.rate = args.consume_mbs * 1e6 / WORKERS
        self.plans_ok: bool | None = None
        self.cpu_base = 0.0
        self.proxy_logs: list[str] = []
        os.environ.update(
            {
                "S3_ENDPOINT_URL": self.origin.base,
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
                "AWS_EC2_METADATA_DISABLED": "true",
                # LitData's chunk downloads (obstore, Rust object_store) refuse http://
                # endpoints unless told
                "AWS_ALLOW_HTTP": "true",
            }
        )

    def order(self, scenario: str, epoch: int) -> list[str]:
        names = list(self.names)
        if scenario == "shuffled":
            random.Random(self.args.seed * 1000 + epoch).shuffle(names)
        return names

    def proxy(self, half: bool) -> ShardcacheServer:
        self.n += 1
        size = self.dataset_bytes // 2 if half else 4 * self.dataset_bytes
        extra = ["--cache-size", f"{size}B"]
        extra += self.args.proxy_arg
        return ShardcacheServer(
            self.procs,
            self.tmp / f"proxy{self.n}",
            self.origin.base,
            "default",
            self.args.python,
            args=extra,
        )

    def cpu(self, px: ShardcacheServer | None, org: OriginServer) -> dict:
        """CPU seconds so far: the proxy's process group, the origin, and the readers
        (DataLoader workers and their curl processes, counted once reaped)."""
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "proxy": group_cpu_seconds(px.pid) if px is not None else 0.0,
            "origin": group_cpu_seconds(org.pid),
            "readers": ru.ru_utime + ru.ru_stime - self.cpu_base,
        }

    def wait_idle(self, px: ShardcacheServer | None, org: OriginServer, limit: float = 30) -> None:
        """Until the origin has no request open (and the proxy no download)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            busy = org.stats()["open"]
            if px is not None:
                busy += int(msum(scrape(px.base), "shardcache_downloads_in_progress") or 0)
            if not busy:
                return
            time.sleep(0.2)

    def one(self, scenario: str, variant: str) -> dict:
        """One variant for ``--epochs`` epochs on a fresh cache; per-epoch figures."""
        a = self.args
        px = None
        sampler = None
        local = None
        plans3: list = []
        out: dict = {"scenario": scenario, "variant": variant, "epochs": []}
        org = self.fast if variant == "unlimited" and self.fast else self.origin
        try:
            if variant in PROXY_VARIANTS:
                px = self.proxy(scenario == "half")
                px.restart_cold(a.drop_caches, "/" + WARMUP)
                if variant != "proxy":
                    if self.plans_ok is None:
                        self.plans_ok = has_plans(px.base)
                    if not self.plans_ok:
                        out["skipped"] = "the proxy has no /-/plans"
                        return out
                sampler = RssSampler(px.pid).__enter__() if px.pid else None
                base = px.base
            else:
                settle(a.drop_caches)
                base = org.base
            if variant == "streaming":
                from streaming.base.util import clean_stale_shared_memory

                clean_stale_shared_memory()
                self.n += 1
                local = self.tmp / f"streaming{self.n}"
                sds = _make_streaming_dataset()(
                    remote=f"s3://{BUCKET}/ds",
                    local=str(local),
                    batch_size=1,
                    shuffle=scenario == "shuffled",
                    shuffle_seed=a.seed,
                    predownload=a.predownload,
                    download_retry=1,
                    rate=self.rate,
                )
                # the boto3 client that fetched index.json here would be inherited by both
                # forked workers, one connection pool for two processes (their responses
                # interleave: corrupt shards); each worker makes its own
                for st in sds.streams:
                    st._downloader.clean_up()
            if variant == "litdata":
                self.n += 1
                local = self.tmp / f"litdata{self.n}"
                lds = _make_lit_dataset()(
                    f"s3://{LIT_BUCKET}/ds",
                    cache_dir=str(local),
                    shuffle=scenario == "shuffled",
                    seed=a.seed,
                    storage_options={"endpoint_url": org.base},
                    # its default budget is 75% of the free disk less 50 GB: on a smaller
                    # disk it deletes each chunk once read, and every epoch is a cold one
                    max_cache_size="25GB",
                    rate=self.rate,
                )
            if variant == "plan3":
                urls_all = [
                    [f"{base}/wds/{n}" for n in self.order(scenario, e)][w::WORKERS]
                    for e in range(a.epochs)
                    for w in range(WORKERS)
                ]
                for w in range(WORKERS):
                    mine = [u for e in range(a.epochs) for u in urls_all[e * WORKERS + w]]
                    plans3.append(
                        register_plan(
                            base,
                            mine,
                            f"{scenario}/all-epochs/worker-{w}",
                            plan_lookahead(a.lookahead),
                        )
                    )
            snap = scrape(base) if px else None
            ostat = org.stats()
            cpu = self.cpu(px, org)
            for e in range(a.epochs):
                if variant == "streaming":
                    ds = sds
                elif variant == "litdata":
                    ds = lds
                    lds.set_epoch(e + 1)
                elif variant in ("shardds", "direct-read"):
                    assert px is not None
                    ds = _make_shard_dataset()(
                        [f"{base}/wds/{n}" for n in self.order(scenario, e)],
                        self.rate,
                        plan_name=f"{scenario}/{variant}/epoch-{e + 1}",
                        lookahead=plan_lookahead(a.lookahead),
                        proxy_cache_dir=str(px.tmp / "cache") if variant == "direct-read" else None,
                    )
                else:
                    urls = [f"{base}/wds/{n}" for n in self.order(scenario, e)]
                    ds = _make_wds_dataset()(
                        urls,
                        self.rate,
                        plan_proxy=base if variant in ("plan", "plan2") else None,
                        # plan2's plans keep their names across epochs: each replaces the last
                        plan_name=f"{scenario}/plan2"
                        if variant == "plan2"
                        else f"{scenario}/epoch-{e + 1}",
                        lookahead=plan_lookahead(a.lookahead),
                        next_urls=[f"{base}/wds/{n}" for n in self.order(scenario, e + 1)]
                        if variant == "plan2"
                        else (),
                    )
                r = run_epoch(ds, a.timeout)
                if e == a.epochs - 1:
                    self.wait_idle(px, org)
                snap2 = scrape(base) if px else None
                ostat2 = org.stats()
                cpu2 = self.cpu(px, org)
                r["cpu"] = {k: cpu2[k] - cpu[k] for k in cpu}
                r["origin_bytes"] = ostat2["body_bytes"] - ostat["body_bytes"]
                r["origin_requests"] = ostat2["count"] - ostat["count"]
                dup = {
                    p: v - ostat["per_path"].get(p, 0)
                    for p, v in ostat2["per_path"].items()
                    if v - ostat["per_path"].get(p, 0) > 0
                }
                r["origin_paths"] = len(dup)
                # shards the origin sent more than once over in this epoch (bytes beyond
                # one copy): a prefetched shard evicted and fetched again, or overlapping
                # ranged parts
                r["origin_over"] = {
                    p: n - self.m["tar"][p[len("/wds/") :]]
                    for p, n in dup.items()
                    if p.startswith("/wds/") and n > self.m["tar"].get(p[len("/wds/") :], n)
                }
                if px:
                    r["proxy"] = proxy_delta(snap, snap2)
                keys = r.pop("keys")
                r["repeated"] = len(keys) - len(set(keys))
                r["complete"] = (
                    set(keys) == {f"s{i:08d}" for i in range(self.m["samples"])}
                    and r["workers_done"] == WORKERS
                )
                out["epochs"].append(r)
                snap, ostat, cpu = snap2, ostat2, cpu2
                px_part = ""
                if px:
                    p = r["proxy"]
                    px_part = (
                        f", proxy wait {fmtn(p['client_wait'], '.1f')} s, HIT "
                        f"{fmtn(p['by_cache']['HIT'], '.0f')}/{fmtn(p['requests'], '.0f')}"
                        f" (coalesced {fmtn(p['by_cache']['COALESCED'], '.0f')})"
                    )
                say(
                    f"    {scenario:8s} {variant:9s} epoch {e + 1}: {r['wall']:6.2f} s, "
                    f"stall {r['stall']:5.2f} s/worker, origin "
                    f"{r['origin_bytes'] / self.dataset_bytes:.2f}x{px_part}"
                    + (
                        f", {len(r['origin_over'])} shards sent more than once "
                        f"(+{sum(r['origin_over'].values()) / MIB:.0f} MiB)"
                        if r["origin_over"]
                        else ""
                    )
                    + ("" if r["complete"] else f"  INCOMPLETE ({r['samples']} samples)")
                )
        except Exception as exc:
            lines = [x for x in str(exc).splitlines() if x.strip()]
            out["error"] = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
            say(f"    {scenario} {variant}: ERROR {out['error']}")
            traceback.print_exc()
        finally:
            for p in plans3:
                with contextlib.suppress(Exception):
                    out.setdefault("plan3_status", []).append(p.status())
                with contextlib.suppress(Exception):
                    p.close()
            if sampler is not None:
                sampler.__exit__()
                out["proxy_rss_mib"] = sampler.peak_kib / 1024
            if px is not None:
                px.stop()
                out["proxy_log"] = log_problems(px.log)
                if out["proxy_log"]:
                    say(
                        f"    proxy log: {len(out['proxy_log'])} warning/error lines, first: "
                        f"{out['proxy_log'][0][:300]}"
                    )
                shutil.rmtree(px.tmp / "cache", ignore_errors=True)
            if local is not None:
                if variant == "litdata":
                    with contextlib.suppress(Exception):
                        del lds
                if variant == "streaming":
                    with contextlib.suppress(Exception):
                        del sds
                    from streaming.base.util import clean_stale_shared_memory

                    clean_stale_shared_memory()
                shutil.rmtree(local, ignore_errors=True)
        return out


def log_problems(log: Path) -> list[str]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if re.search(r"\b(WARNING|ERROR|CRITICAL|Traceback)\b", line):
            out.append(line)
    return out


def fmtn(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------
# summary and report


def summarize(runs: list[dict], epochs: int) -> dict:
    """{scenario: {variant: [per epoch medians]}}."""
    out: dict = {}
    for r in runs:
        if r.get("skipped"):
            continue
        out.setdefault(r["scenario"], {}).setdefault(r["variant"], []).append(r)
    res: dict = {}
    for sc, by in out.items():
        res[sc] = {}
        for v, rs in by.items():
            per = []
            for e in range(epochs):
                es = [r["epochs"][e] for r in rs if len(r["epochs"]) > e]
                if not es:
                    per.append(None)
                    continue

                def med(f, es=es):
                    xs = [f(x) for x in es]
                    xs = [x for x in xs if x is not None]
                    return median(xs)

                per.append(
                    {
                        "n": len(es),
                        "wall": med(lambda x: x["wall"]),
                        "stall": med(lambda x: x["stall"]),
                        "stall_frac": med(lambda x: x["stall"] / x["wall"]),
                        "origin_bytes": med(lambda x: x["origin_bytes"]),
                        "client_wait": med(lambda x: (x.get("proxy") or {}).get("client_wait")),
                        "hit_ratio": med(lambda x: (x.get("proxy") or {}).get("hit_ratio")),
                        "coalesced": med(
                            lambda x: ((x.get("proxy") or {}).get("by_cache") or {}).get(
                                "COALESCED"
                            )
                        ),
                        "requests": med(lambda x: (x.get("proxy") or {}).get("requests")),
                        "over_bytes": med(lambda x: sum((x.get("origin_over") or {}).values())),
                        "evictions": med(lambda x: (x.get("proxy") or {}).get("evictions")),
                        "cpu": {
                            k: med(lambda x, k=k: (x.get("cpu") or {}).get(k))
                            for k in ("proxy", "origin", "readers")
                        },
                        "complete": all(x["complete"] for x in es),
                        "walls": [round(x["wall"], 2) for x in es],
                    }
                )
            totals = [
                sum(e["origin_bytes"] for e in r["epochs"])
                for r in rs
                if len(r["epochs"]) == epochs
            ]
            res[sc][v] = {
                "epochs": per,
                "origin_bytes_all_epochs": median(totals),
                "errors": [r["error"] for r in rs if r.get("error")],
                "proxy_log_lines": sum(len(r.get("proxy_log") or []) for r in rs),
                "rss_mib": max((r.get("proxy_rss_mib") or 0) for r in rs) or None,
            }
    return res


def report(res: dict, args, dataset_bytes: int) -> list[str]:
    rows = []
    for sc, by in res.items():
        for v, s in by.items():
            for e, x in enumerate(s["epochs"]):
                if x is None:
                    rows.append([sc, v, str(e + 1)] + ["-"] * 10 + ["; ".join(s["errors"]) or "-"])
                    continue
                rows.append(
                    [
                        sc,
                        v,
                        str(e + 1),
                        f"{x['wall']:.2f}",
                        f"{x['stall']:.2f}",
                        f"{100 * x['stall_frac']:.1f}%",
                        fmtn(x["client_wait"], ".2f"),
                        f"{x['origin_bytes'] / dataset_bytes:.2f}x",
                        fmtn(x["hit_ratio"], ".2f"),
                        fmtn(x["coalesced"], ".0f"),
                        fmtn(x["evictions"], ".0f"),
                        "/".join(fmtn(x["cpu"][k], ".1f") for k in ("proxy", "origin", "readers")),
                        "/".join(f"{w:g}" for w in x["walls"]),
                        ("" if x["complete"] else "INCOMPLETE ")
                        + ("; ".join(s["errors"]) if s["errors"] else ""),
                    ]
                )
    out = [
        markdown(
            [
                "scenario",
                "variant",
                "epoch",
                "wall s",
                "reader stall s/worker",
                "stall / wall",
                "proxy client wait s",
                "origin bytes / dataset",
                "HIT ratio",
                "coalesced",
                "evictions",
                "CPU s proxy/origin/readers",
                "walls per round",
                "notes",
            ],
            rows,
        ),
        "",
    ]
    T = TARGETS
    t: list[list[str]] = []

    def ep(sc, v, e):
        try:
            return res[sc][v]["epochs"][e]
        except (KeyError, IndexError, TypeError):
            return None

    for sc in ("same", "shuffled"):
        p1, p2 = ep(sc, "plan", 0), ep(sc, "plan", 1)
        if p1 and p2:
            t.append(
                target_row(
                    f"{sc}: plan epoch 1 / epoch 2 wall",
                    f"{p1['wall']:.2f} s",
                    f"{p2['wall']:.2f} s",
                    p1["wall"] / p2["wall"],
                    "<=",
                    T["plan_e1_vs_e2"],
                )
            )
            worst = max((x for x in res[sc]["plan"]["epochs"] if x), key=lambda x: x["stall_frac"])
            t.append(
                target_row(
                    f"{sc}: plan reader stall / wall, worst epoch",
                    f"{worst['stall']:.2f} s",
                    f"{worst['wall']:.2f} s",
                    worst["stall_frac"],
                    "<=",
                    T["plan_stall_frac"],
                )
            )
            worst = max(
                (x for x in res[sc]["plan"]["epochs"] if x and x["client_wait"] is not None),
                key=lambda x: x["client_wait"] / x["wall"],
                default=None,
            )
            if worst is not None:
                per_reader = worst["client_wait"] / WORKERS
                t.append(
                    target_row(
                        f"{sc}: plan proxy client wait per reader / wall, worst epoch",
                        f"{per_reader:.2f} s",
                        f"{worst['wall']:.2f} s",
                        per_reader / worst["wall"],
                        "<=",
                        T["plan_stall_frac"],
                    )
                )
        s1 = ep(sc, "streaming", 0)
        if p1 and s1:
            t.append(
                target_row(
                    f"{sc}: plan epoch 1 / Streaming epoch 1 wall",
                    f"{p1['wall']:.2f} s",
                    f"{s1['wall']:.2f} s",
                    p1["wall"] / s1["wall"],
                    "<=",
                    T["plan_e1_vs_streaming"],
                )
            )
        for v in ("proxy", "plan"):
            xs = [x for x in (res.get(sc, {}).get(v) or {}).get("epochs", []) if x]
            if xs:
                worst = max(x["origin_bytes"] for x in xs)
                t.append(
                    target_row(
                        f"{sc}: {v}: origin bytes / dataset, worst epoch",
                        f"{worst / MIB:.0f} MiB",
                        f"{dataset_bytes / MIB:.0f} MiB",
                        worst / dataset_bytes,
                        "<=",
                        T["upstream_x"],
                    )
                )
    for v in ("plan", "plan2", "plan3", "proxy"):
        xs = [ep("half", v, e) for e in range(1, args.epochs)]
        xs = [x for x in xs if x and x["hit_ratio"] is not None]
        if xs:
            hr = median([x["hit_ratio"] for x in xs])
            saved = median([1 - x["origin_bytes"] / dataset_bytes for x in xs])
            t.append(
                target_row(
                    f"half: {v}: HIT ratio, epochs 2-{args.epochs}",
                    f"{hr:.2f}",
                    "",
                    hr,
                    ">=",
                    T["half_hit_ratio"],
                    "",
                )
            )
            t.append(
                target_row(
                    f"half: {v}: 1 - origin bytes / dataset, epochs 2-{args.epochs}",
                    f"{saved:.2f}",
                    "",
                    saved,
                    ">=",
                    T["half_hit_ratio"],
                    "",
                )
            )
    for sc in ("same", "shuffled"):
        lit1 = ep(sc, "litdata", 0)
        # the fastest local-file loader's warm epochs (Streaming or LitData, epochs 2+)
        local_warm = [
            (v, x["wall"])
            for v in LOCAL_FILE_VARIANTS
            for x in (((res.get(sc) or {}).get(v) or {}).get("epochs") or [])[1:]
            if x
        ]
        best = min(local_warm, key=lambda vw: vw[1], default=None)
        for v in ("shardds", "direct-read", "plan"):
            e1 = ep(sc, v, 0)
            if e1 is None:
                continue
            if lit1 and v != "plan":
                t.append(
                    target_row(
                        f"{sc}: {v} epoch 1 / LitData epoch 1 wall",
                        f"{e1['wall']:.2f} s",
                        f"{lit1['wall']:.2f} s",
                        e1["wall"] / lit1["wall"],
                        "<=",
                        T["plan_e1_vs_litdata"],
                    )
                )
            warm = [x for x in res[sc][v]["epochs"][1:] if x]
            if best and warm:
                w = max(x["wall"] for x in warm)
                t.append(
                    target_row(
                        f"{sc}: {v} slowest warm epoch / fastest local-file loader's "
                        f"({best[0]}) warm epoch wall",
                        f"{w:.2f} s",
                        f"{best[1]:.2f} s",
                        w / best[1],
                        "<=",
                        T["warm_vs_local"],
                    )
                )
            if v != "plan" and e1["client_wait"] is not None:
                per_reader = e1["client_wait"] / WORKERS
                t.append(
                    target_row(
                        f"{sc}: {v} proxy client wait per reader / epoch 1 wall",
                        f"{per_reader:.2f} s",
                        f"{e1['wall']:.2f} s",
                        per_reader / e1["wall"],
                        "<=",
                        T["client_wait_frac"],
                    )
                )
    floor = ep("same", "unlimited", 1) or ep("same", "unlimited", 0)
    if floor:
        t.append(
            [
                "same: reader stall / wall straight from an unlimited origin (the readers' floor)",
                f"{floor['stall']:.2f} s",
                f"{floor['wall']:.2f} s",
                f"{floor['stall_frac']:.2f}x",
                "report",
                "-",
            ]
        )
    for v in ("proxy", "plan", "plan2", "plan3"):
        tot = ((res.get("half") or {}).get(v) or {}).get("origin_bytes_all_epochs")
        if tot is not None:
            t.append(
                [
                    f"half: {v}: origin bytes over {args.epochs} epochs / dataset",
                    f"{tot / MIB:.0f} MiB",
                    f"{dataset_bytes / MIB:.0f} MiB",
                    f"{tot / dataset_bytes:.2f}x",
                    f"report (best possible about {1 + (args.epochs - 1) / 2:.1f}x)",
                    "-",
                ]
            )
    if t:
        out.append(markdown(["measure", "figure", "against", "ratio", "target", "result"], t))
    return out


def parse_list(text: str, allowed: tuple[str, ...]) -> list[str]:
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"pick from {','.join(allowed)} (got {text!r})")
    return got


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="24 shards, 1 round (unless given)")
    p.add_argument("--shards", type=int, default=None, help="tar shards (48; quick 24)")
    p.add_argument("--shard-mib", type=float, default=32, help="shard size, MiB (32)")
    p.add_argument("--sample-kb", type=float, default=1000, help="mean .jpg size, kB (1000)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (2; quick 1)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (3)")
    p.add_argument("--scenarios", type=lambda t: parse_list(t, SCENARIOS), default=list(SCENARIOS))
    p.add_argument(
        "--variants",
        type=lambda t: parse_list(t, VARIANTS),
        default=list(VARIANTS),
        help=f"{','.join(VARIANTS)} (default all; each scenario runs those of its own that "
        "are listed)",
    )
    p.add_argument("--conn-mbs", type=float, default=50, help="origin MB/s per connection (50)")
    p.add_argument("--total-mbs", type=float, default=250, help="origin MB/s in all (250)")
    p.add_argument("--delay", type=float, default=0.01, help="origin time to first byte, s")
    p.add_argument("--consume-mbs", type=float, default=150, help="both readers' MB/s (150)")
    p.add_argument(
        "--lookahead", default=None, help="plan lookahead (shards or size; proxy default)"
    )
    p.add_argument(
        "--predownload",
        type=int,
        default=None,
        help="Streaming predownload, samples per worker (default: 8 shards' worth, like the "
        "plan lookahead)",
    )
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more argument for shardcache serve (repeat: --proxy-arg=--http-parts "
        "--proxy-arg=on)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120, help="bound on the wait for one sample")
    add_run_options(p, cold="run", data=None)
    p.add_argument("--data", default=None, help="keep the generated data in DIR (reused)")
    p.add_argument("--_origin", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.shards is None:
        a.shards = 24 if a.quick else 48
    if a.rounds is None:
        a.rounds = 1 if a.quick else 2
    if a.predownload is None:
        a.predownload = max(8, int(8 * a.shard_mib * MIB / (a.sample_kb * 1000)))
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._origin:
        serve_origin(*args._origin)
        return 0
    import torch

    torch.set_num_threads(1)
    args.drop_caches = drop_caches_allowed(args.drop_caches, "runs only sync")
    procs = Procs()
    t0 = time.monotonic()
    res: dict = {"config": {k: v for k, v in vars(args).items() if k != "_origin"}, "runs": []}
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-epoch-", dir=args.dir))
    need = int(2.2 * args.shards * args.shard_mib * MIB)
    data_root = None
    if args.data:
        data = Path(args.data)
    else:
        data_root = Path(
            tempfile.mkdtemp(prefix="shardcache-epoch-data-", dir=tmpfs_parent(need, args.dir))
        )
        data = data_root / "data"
    try:
        with interruptible() as interrupted, procs:
            manifest = make_data(data, args)
            res["data"] = {k: v for k, v in manifest.items() if k not in ("tar", "mds", "lit")}
            b = Bench(args, tmp, data, manifest, procs)
            ds_mib = manifest["tar_bytes"] / MIB
            say(
                f"origin {b.origin.base}: {args.conn_mbs:g} MB/s per connection, "
                f"{args.total_mbs:g} MB/s in all, {args.delay * 1000:g} ms; readers "
                f"{WORKERS} x {args.consume_mbs / WORKERS:g} MB/s; dataset {ds_mib:.0f} MiB "
                f"(ideal epoch {manifest['sample_bytes'] / args.consume_mbs / 1e6:.1f} s); "
                f"page cache dropped before each run: {'yes' if args.drop_caches else 'no'}"
            )
            for r in range(args.rounds):
                for sc in args.scenarios:
                    vs = [v for v in SCENARIO_VARIANTS[sc] if v in args.variants]
                    for v in rotated(vs, r):
                        say(f"  round {r + 1}: {sc} / {v}")
                        res["runs"].append({"round": r + 1, **b.one(sc, v)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if data_root is not None:
            shutil.rmtree(data_root, ignore_errors=True)
    if interrupted:
        return INTERRUPTED
    res["elapsed_s"] = time.monotonic() - t0
    res["summary"] = summarize(res["runs"], args.epochs)
    print()
    print(
        f"{args.rounds} round(s), medians; {args.shards} shards, "
        f"{manifest['tar_bytes'] / MIB:.0f} MiB; origin {args.conn_mbs:g} MB/s per connection, "
        f"{args.total_mbs:g} in all; readers {args.consume_mbs:g} MB/s; took "
        f"{res['elapsed_s']:.0f} s"
    )
    print("\n".join(report(res["summary"], args, manifest["tar_bytes"])))
    for sc, by in res["summary"].items():
        for v, s in by.items():
            if s["proxy_log_lines"] or s["errors"]:
                print(
                    f"{sc}/{v}: {s['proxy_log_lines']} proxy warning/error log lines; "
                    f"errors: {s['errors'] or 'none'}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
