"""Cold-path latency of the caching proxy against a slow origin, side by side with the
same requests sent straight to that origin.

    python bench/cold.py                      # every section, 5 rounds
    python bench/cold.py --quick              # 2 rounds (< 3 minutes)
    python bench/cold.py --only range,parts --variants asyncio,asyncio+http-transport=aiohttp

The origin is a small threaded HTTP/1.1 server in this file (run as a subprocess): it
answers every request ``--delay`` seconds (default 0.05) after reading it, then sends the
body with ``sendfile`` paced to ``--rate`` MB/s (default 50) per connection; GET and
HEAD, single ``Range`` (206, or 416 when unsatisfiable), ``ETag`` and ``If-Match``. It
counts the body bytes it sends as it sends them and keeps a list of the requests it saw
(``/-/stats``), which is how "origin bytes" and "origin requests" below are measured. The
object is ``--size-mib`` MiB (default 256) of random bytes on tmpfs (``/dev/shm`` when
it has room), so dropping the page cache does not slow the origin; the proxy's cache is
on disk under ``--dir``.

Sections (``--only``), each run for ``--rounds`` interleaved rounds (the contenders in
turn, the order reversed every other round), medians reported:

- origin: the origin's own check: ``--parallel`` connections at once, each a ranged GET
  of 32 MiB; per-connection and total MB/s and the origin's CPU seconds.
- range: ``GET`` with ``Range`` of ``--range-mib`` MiB (default 1) at ``--range-at-mib``
  MiB (default 200): time to first body byte and total, through each proxy variant
  started cold against the same request sent to the origin. Target: <= 1.5x direct.
- head: cold ``HEAD``: time, and body bytes the origin sent from the request until
  ``--after`` seconds (default 1) after the answer. Target: 0 bytes.
- unsat: cold ``GET`` with ``Range: bytes=999999999-`` (beyond the object): status (416),
  time, origin body bytes as for head. Target: ~0 bytes (<= 64 KiB).
- parts: a cold GET of the whole object through each variant with ``--http-parts on``
  (its defaults: ``--parallel 8 --part-size 8MiB``) against one direct stream from the
  origin; the first variant with ``--http-parts off`` is shown too. Target: >= 3.5x.

Every proxy run starts the proxy on an empty cache directory, GETs a tiny warm-up object
through it (so lazy start-up work is not timed), then syncs and drops the page cache
(root only; see ``bench/proxy.py settle``) before the timed request; direct runs sync and
drop too. The proxy's peak RSS (``VmRSS`` every 50 ms) is sampled from the timed request
until the proxy is stopped, ``--after`` seconds after the answer. Target: <= 150 MB.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    INTERRUPTED,
    MIB,
    Procs,
    RssSampler,
    add_run_options,
    check_alive,
    drop_caches_allowed,
    fmt,
    interruptible,
    markdown,
    median,
    parse_sections,
    rotated,
    say,
    settle,
    target_row,
    wait_until,
    workdirs,
)
from bench.proxy import (  # noqa: E402
    WARMUP,
    HttpConn,
    Server,
    ShardcacheServer,
    make_data,
    variant_flags,
)

SECTIONS = ("origin", "range", "head", "unsat", "parts")
BIG = "big-0000.tar"
UNSAT = "bytes=999999999-"
TARGETS = {
    "range_vs_direct": 1.5,  # <=, total and time to first byte
    "head_origin_bytes": 0,  # ==
    "unsat_origin_bytes": 64 * 1024,  # <=
    "parts_vs_direct": 3.5,  # >=
    "rss_mb": 150.0,  # <=
}

# ---------------------------------------------------------------------------------------
# the throttled origin (a subprocess: python bench/cold.py --_origin ...)


def parse_range(value: str, size: int) -> tuple[int, int] | str | None:
    """(first, last) of a single ``bytes=`` range, ``"unsat"`` when it starts beyond the
    object, None when it is to be ignored (several ranges, or malformed)."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    a, dash, b = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if not a:  # suffix: the last b bytes
            n = int(b)
            return "unsat" if n == 0 or size == 0 else (max(0, size - n), size - 1)
        first = int(a)
        last = int(b) if b else size - 1
    except ValueError:
        return None
    if first >= size:
        return "unsat"
    if last < first:
        return None
    return first, min(last, size - 1)


class ThrottledOrigin:
    """Serves the files under ``root``: each request answered ``delay`` s after it is
    read, its body sent with ``sendfile`` paced to ``rate`` bytes/s, a thread per
    connection. ``/-/stats?since=N`` returns the body bytes sent so far and the requests
    from the N-th on (method, path, range, status, bytes sent, done)."""

    chunk = 128 * 1024
    content_type = "application/x-tar"
    if_match = True  # a stale If-Match is answered 412

    def __init__(self, root: Path, rate: float, delay: float) -> None:
        self.root = root.resolve()
        self.rate = rate
        self.delay = delay
        self.lock = threading.Lock()
        self.body_bytes = 0
        self.requests: list[dict] = []

    def serve(self, port_file: Path, log_path: Path) -> None:
        self.log = open(log_path, "a", buffering=1)
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(256)
        port_file.write_text(str(srv.getsockname()[1]))
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=self.connection, args=(conn,), daemon=True).start()

    def connection(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    more = conn.recv(65536)
                    if not more:
                        return
                    buf += more
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
                self.respond(conn, method, target, headers, keep)
                if not keep:
                    return
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def send_head(
        self, conn: socket.socket, status: int, headers: dict[str, str], keep: bool
    ) -> None:
        reason = {200: "OK", 206: "Partial Content", 404: "Not Found", 405: "Not Allowed"}
        reason |= {412: "Precondition Failed", 416: "Range Not Satisfiable"}
        headers = dict(headers, Connection="keep-alive" if keep else "close")
        lines = [f"HTTP/1.1 {status} {reason.get(status, 'X')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def send_json(self, conn: socket.socket, doc: dict, keep: bool) -> None:
        body = json.dumps(doc).encode()
        h = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        self.send_head(conn, 200, h, keep)
        conn.sendall(body)

    def record(self, method: str, path: str, hdrs: dict[str, str]) -> dict:
        """A request's entry in ``requests``, updated as its answer goes out."""
        rec = {"method": method, "path": path, "range": hdrs.get("range"), "status": 0}
        rec |= {"sent": 0, "done": False}
        with self.lock:
            self.requests.append(rec)
        return rec

    def head_for(
        self, method: str, path: str, hdrs: dict[str, str]
    ) -> tuple[Path, int, dict[str, str], int, int]:
        """The answer to ``method path`` with request headers ``hdrs``: (file, status,
        headers, first byte, length of the body). ``If-Match`` is honoured when
        ``if_match`` is set, ``Range`` (single, with ``If-Range``) always."""
        f = (self.root / path.lstrip("/")).resolve()
        headers = {"Content-Type": self.content_type, "Accept-Ranges": "bytes"}
        first = last = 0
        if not f.is_relative_to(self.root) or not f.is_file():
            status = 404
        elif method not in ("GET", "HEAD"):
            status = 405
        else:
            st = f.stat()
            size = st.st_size
            etag = f'"{st.st_mtime_ns:x}-{size:x}"'
            headers["ETag"] = etag
            headers["Last-Modified"] = email.utils.formatdate(st.st_mtime, usegmt=True)
            status, first, last = 200, 0, size - 1
            im = hdrs.get("if-match") if self.if_match else None
            rng = hdrs.get("range")
            if im and im != "*" and etag not in [x.strip() for x in im.split(",")]:
                status = 412
            elif rng and hdrs.get("if-range", etag) == etag:
                got = parse_range(rng, size)
                if got == "unsat":
                    status = 416
                    headers["Content-Range"] = f"bytes */{size}"
                elif isinstance(got, tuple):
                    status, (first, last) = 206, got
                    headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        length = last - first + 1 if status in (200, 206) else 0
        headers["Content-Length"] = str(length)
        return f, status, headers, first, length

    def respond(
        self, conn: socket.socket, method: str, target: str, hdrs: dict[str, str], keep: bool
    ) -> None:
        url = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(url.path)
        if path == "/-/stats":
            since = int(urllib.parse.parse_qs(url.query).get("since", ["0"])[0])
            with self.lock:
                doc = {
                    "body_bytes": self.body_bytes,
                    "count": len(self.requests),
                    "requests": [dict(r) for r in self.requests[since:]],
                }
            self.send_json(conn, doc, keep)
            return
        rec = self.record(method, path, hdrs)
        t0 = time.monotonic()
        f, status, headers, first, length = self.head_for(method, path, hdrs)
        time.sleep(self.delay)  # the origin's time to first byte
        self.send_head(conn, status, headers, keep)
        rec["status"] = status
        ttfb = time.monotonic() - t0
        sent = 0
        try:
            if method == "GET" and length:
                with open(f, "rb") as fh:
                    t_body = time.monotonic()
                    while sent < length:
                        n = os.sendfile(
                            conn.fileno(), fh.fileno(), first + sent, min(self.chunk, length - sent)
                        )
                        if n == 0:
                            break
                        sent += n
                        with self.lock:
                            self.body_bytes += n
                            rec["sent"] = sent
                        ahead = sent / self.rate - (time.monotonic() - t_body)
                        if ahead > 0:
                            time.sleep(ahead)
        finally:
            rec["done"] = True
            total = time.monotonic() - t0
            self.log.write(
                f"{path} {status} {sent} {method} {(hdrs.get('range') or '-').replace(' ', '')} "
                f"{ttfb:.4f} {total:.4f}\n"
            )


class OriginServer(Server):
    """The throttled origin as a subprocess of this script."""

    def __init__(self, procs: Procs, tmp: Path, data: Path, rate: float, delay: float):
        super().__init__(f"direct origin ({rate / 1e6:g} MB/s, {delay * 1000:g} ms)", procs, tmp)
        self.data = data
        self.rate = rate
        self.delay = delay
        self.access_log = tmp / "access.log"

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        port_file = self.tmp / "port"
        port_file.unlink(missing_ok=True)
        self.log = self.tmp / "stderr.log"
        argv = [sys.executable, __file__, "--_origin", str(self.data), str(self.rate)]
        argv += [str(self.delay), str(port_file), str(self.access_log)]
        self.proc = self.procs.start(argv, self.log)
        wait_until(
            lambda: check_alive(self.proc, self.name, self.log) and bool(_read(port_file)),
            20,
            self.name,
        )
        self.port = int(port_file.read_text())

    def stats(self, since: int = 0) -> dict:
        with urllib.request.urlopen(f"{self.base}/-/stats?since={since}", timeout=10) as r:
            return json.loads(r.read())

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------
# one request, timed


@dataclass
class Shot:
    status: int
    nbytes: int
    ttfb: float  # to the first body byte, or to the status line when there is no body
    total: float
    headers: dict[str, str]


def shot(base: str, path: str, timeout: float, headers=None, method: str = "GET") -> Shot:
    parts = urllib.parse.urlsplit(base)
    t0 = time.monotonic()
    conn = HttpConn(parts.hostname or "127.0.0.1", parts.port or 80, timeout)
    try:
        status, n, first = conn.get(path, headers, method)
        t1 = time.monotonic()
        return Shot(status, n, (first or conn.t_status) - t0, t1 - t0, conn.headers)
    finally:
        conn.close()


def describe(requests: list[dict]) -> str:
    """The origin requests of one run, e.g. ``GET bytes=0- 206 12.0 MiB...``."""
    out = []
    for r in requests:
        if r["path"] == "/" + WARMUP:
            continue
        rng = (r["range"] or "").replace(" ", "")
        sent = r["sent"]
        amount = f"{sent / MIB:.1f} MiB" if sent >= MIB else f"{sent} B"
        out.append(
            f"{r['method']} {rng + ' ' if rng else ''}{r['status']} {amount}"
            + ("" if r["done"] else " (unfinished)")
        )
    if len(out) > 4:
        out = out[:3] + [f"+{len(out) - 3} more"]
    return "; ".join(out) or "none"


# ---------------------------------------------------------------------------------------
# the run


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, data: Path, procs: Procs) -> None:
        self.args = args
        self.procs = procs
        self.tmp = tmp
        self.size = make_data(data, 0, 0, args.size_mib)[BIG]
        (data / WARMUP).write_bytes(os.urandom(4096))
        self.origin = OriginServer(procs, tmp / "origin", data, args.rate * 1e6, args.delay)
        self.origin.start()
        self.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        self.rss: dict[str, float] = {}  # peak MiB per proxy name, over every run
        self.primary: set[str] = set()  # names of the proxies of the first variant
        self.n = 0

    def proxy(self, variant: str, primary: bool) -> ShardcacheServer:
        self.n += 1
        tmp = self.tmp / f"shardcache{self.n}"
        px = ShardcacheServer(self.procs, tmp, self.origin.base, variant, self.args.python)
        if primary:
            self.primary.add(px.name)
        return px

    def run(
        self, server: Server | None, path: str, headers=None, method: str = "GET"
    ) -> tuple[Shot, dict]:
        """One timed request to ``server`` (restarted cold) or, when None, to the origin
        after the same sync and drop. Returns the answer and the origin's view: body bytes
        by the end of the answer (``during``), by ``--after`` s later (``after``), and
        the requests it saw."""
        a = self.args
        sampler = None
        if server is not None:
            server.restart_cold(a.drop_caches, "/" + WARMUP)
            sampler = RssSampler(server.pid) if server.pid else None
        else:
            settle(a.drop_caches)
        before = self.origin.stats()
        with sampler or contextlib.nullcontext():
            s = shot((server or self.origin).base, path, a.timeout, headers, method)
            during = self.origin.stats()["body_bytes"] - before["body_bytes"]
            time.sleep(a.after)
            st = self.origin.stats(before["count"])
        if server is not None:
            server.stop()
        if sampler is not None:
            peak = sampler.peak_kib / 1024
            self.rss[server.name] = max(self.rss.get(server.name, 0.0), peak)  # type: ignore[union-attr]
        seen = {
            "during": during,
            "after": st["body_bytes"] - before["body_bytes"],
            "requests": describe(st["requests"]),
            "rss_mib": sampler.peak_kib / 1024 if sampler else None,
        }
        return s, seen

    def contenders(self, extra: str = "") -> dict[str, Server | None]:
        out: dict[str, Server | None] = {self.origin.name: None}
        for i, v in enumerate(self.variants):
            p = self.proxy(v + extra, i == 0)
            out[p.name] = p
        return out

    def rounds(self, contenders: dict[str, Server | None], what: str, path: str, **kw) -> dict:
        res: dict[str, list] = {k: [] for k in contenders}
        for r in range(self.args.rounds):
            for label in rotated(list(contenders), r):
                s, seen = self.run(contenders[label], path, **kw)
                res[label].append((s, seen))
                rss = seen["rss_mib"]
                say(
                    f"  {what} round {r + 1} {label:42s} {s.status} {s.nbytes} B, "
                    f"first byte {s.ttfb * 1000:6.1f} ms, total {s.total * 1000:7.1f} ms, "
                    f"origin sent {seen['during']} B (+{seen['after'] - seen['during']} B "
                    f"in {self.args.after:g} s after)"
                    + ("" if rss is None else f", peak RSS {rss:.0f} MiB")
                    + f"; origin saw: {seen['requests']}"
                )
        return res

    # -- sections ---------------------------------------------------------------------

    def check_origin(self) -> dict:
        """``--parallel`` ranged GETs of 32 MiB at once, straight from the origin."""
        n = self.args.parallel
        span = min(32 * MIB, self.size // n)
        out: list[Shot] = [None] * n  # type: ignore[list-item]
        errors: list[str] = []

        def one(i: int) -> None:
            rng = f"bytes={i * span}-{(i + 1) * span - 1}"
            try:
                out[i] = shot(self.origin.base, "/" + BIG, self.args.timeout, {"Range": rng})
            except Exception as exc:  # reported below
                errors.append(repr(exc))

        settle(self.args.drop_caches)
        cpu0 = self.origin.cpu_seconds()
        t0 = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        cpu = self.origin.cpu_seconds() - cpu0
        if errors or any(s is None or s.status != 206 or s.nbytes != span for s in out):
            raise RuntimeError(f"origin check failed: {errors or out}")
        rates = [span / (s.total - s.ttfb) / 1e6 for s in out]
        res = {
            "connections": n,
            "span_bytes": span,
            "per_conn_mbs_min": min(rates),
            "per_conn_mbs_median": statistics.median(rates),
            "total_mbs": n * span / wall / 1e6,
            "wall_s": wall,
            "origin_cpu_s": cpu,
        }
        say(
            f"  origin: {n} connections x {span / MIB:g} MiB: per connection "
            f"{res['per_conn_mbs_median']:.1f} MB/s (min {res['per_conn_mbs_min']:.1f}), "
            f"total {res['total_mbs']:.0f} MB/s in {wall:.2f} s, origin CPU {cpu:.2f} s"
        )
        return res

    def range_section(self) -> dict:
        a = self.args
        first = int(a.range_at_mib * MIB)
        last = first + int(a.range_mib * MIB) - 1
        if last >= self.size:
            raise SystemExit("--range-at-mib + --range-mib is beyond --size-mib")
        rng = f"bytes={first}-{last}"
        res = self.rounds(self.contenders(), "range", "/" + BIG, headers={"Range": rng})
        want = f"bytes {first}-{last}/{self.size}"
        for label, shots in res.items():
            for s, _ in shots:
                got = s.headers.get("content-range")
                if s.status != 206 or s.nbytes != last - first + 1 or got != want:
                    raise RuntimeError(f"{label}: {s.status}, {s.nbytes} B, {got!r} for {rng}")
        return {"range": rng, **summarize(res)}

    def head_section(self) -> dict:
        res = self.rounds(self.contenders(), "head", "/" + BIG, method="HEAD")
        for label, shots in res.items():
            for s, _ in shots:
                if s.status != 200 or s.headers.get("content-length") != str(self.size):
                    raise RuntimeError(f"{label}: HEAD {s.status} {s.headers}")
        return summarize(res)

    def unsat_section(self) -> dict:
        res = self.rounds(self.contenders(), "unsat", "/" + BIG, headers={"Range": UNSAT})
        return summarize(res)

    def parts_section(self) -> dict:
        contenders: dict[str, Server | None] = {self.origin.name: None}
        for i, v in enumerate(self.variants):
            flags = variant_flags(v)[1]
            p = self.proxy(v if "--http-parts" in flags else v + "+http-parts=on", i == 0)
            contenders[p.name] = p
        if not self.args.no_one_stream:
            base = self.variants[0]
            if "--http-parts" not in variant_flags(base)[1]:
                p = self.proxy(base + "+http-parts=off", True)
                contenders[p.name] = p
        res = self.rounds(contenders, "parts", "/" + BIG)
        for label, shots in res.items():
            for s, _ in shots:
                if s.status != 200 or s.nbytes != self.size:
                    raise RuntimeError(f"{label}: {s.status}, {s.nbytes} B of {self.size}")
        out = summarize(res)
        for v in out["by"].values():
            v["mbs"] = self.size / v["total"] / 1e6
            v["upstream_x"] = v["after"] / self.size
        return out


def summarize(res: dict[str, list]) -> dict:
    by = {}
    for label, shots in res.items():
        rss = [seen["rss_mib"] for _, seen in shots if seen["rss_mib"] is not None]
        by[label] = {
            "status": sorted({s.status for s, _ in shots}),
            "ttfb": median([s.ttfb for s, _ in shots]),
            "total": median([s.total for s, _ in shots]),
            "during": median([seen["during"] for _, seen in shots]),
            "after": median([seen["after"] for _, seen in shots]),
            "after_max": max(seen["after"] for _, seen in shots),
            "requests": shots[-1][1]["requests"],
            "rss_mib": max(rss) if rss else None,
            "rounds": [
                {"ttfb": s.ttfb, "total": s.total, "status": s.status, **seen} for s, seen in shots
            ],
        }
    return {"by": by}


# ---------------------------------------------------------------------------------------
# report


def nbytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n:.0f} B"


def report(res: dict, args: argparse.Namespace, direct: str) -> list[str]:
    out: list[str] = []
    T = TARGETS
    head = None
    targets: list[list[str]] = []
    if "origin" in res:
        o = res["origin"]
        out += [
            f"origin check: {o['connections']} connections at once, {o['per_conn_mbs_median']:.1f} "
            f"MB/s per connection (min {o['per_conn_mbs_min']:.1f}), {o['total_mbs']:.0f} MB/s "
            f"total, origin CPU {o['origin_cpu_s']:.2f} s for {o['wall_s']:.2f} s",
            "",
        ]
    if "range" in res:
        by = res["range"]["by"]
        d = by[direct]
        head = head or next(k for k in by if k != direct)
        rows = []
        for k, v in by.items():
            rows.append(
                [
                    k,
                    f"{v['ttfb'] * 1000:.1f}",
                    f"{v['total'] * 1000:.1f}",
                    "-" if k == direct else f"{v['ttfb'] / d['ttfb']:.2f}x",
                    "-" if k == direct else f"{v['total'] / d['total']:.2f}x",
                    nbytes(v["during"]),
                    nbytes(v["after"]),
                    v["requests"],
                ]
            )
        out += [
            f"range: cold GET {res['range']['range']} of a {args.size_mib:g} MiB object",
            markdown(
                [
                    "contender",
                    "first byte ms",
                    "total ms",
                    "first byte vs direct",
                    "total vs direct",
                    "origin bytes by the end",
                    f"origin bytes +{args.after:g} s",
                    "origin requests (last round)",
                ],
                rows,
            ),
            "",
        ]
        v = by[head]
        for what in ("total", "ttfb"):
            label = "total time" if what == "total" else "time to first byte"
            targets.append(
                target_row(
                    f"cold 1 MiB Range at {args.range_at_mib:g} MiB: {label} vs direct",
                    f"{v[what] * 1000:.0f} ms",
                    f"{d[what] * 1000:.0f} ms",
                    v[what] / d[what],
                    "<=",
                    T["range_vs_direct"],
                )
            )
    for sec, title in (("head", "cold HEAD"), ("unsat", f"cold GET Range: {UNSAT}")):
        if sec not in res:
            continue
        by = res[sec]["by"]
        head = head or next(k for k in by if k != direct)
        rows = [
            [
                k,
                "/".join(map(str, v["status"])),
                f"{v['total'] * 1000:.1f}",
                nbytes(v["after"]),
                nbytes(v["after_max"]),
                v["requests"],
            ]
            for k, v in by.items()
        ]
        out += [
            f"{sec}: {title}",
            markdown(
                [
                    "contender",
                    "status",
                    "time ms",
                    f"origin body bytes (median, to +{args.after:g} s)",
                    "max",
                    "origin requests (last round)",
                ],
                rows,
            ),
            "",
        ]
        v = by[head]
        limit = T["head_origin_bytes"] if sec == "head" else T["unsat_origin_bytes"]
        ok_status = 200 if sec == "head" else 416
        targets.append(
            target_row(
                f"{title}: origin body bytes (max over rounds)",
                f"{'/'.join(map(str, v['status']))}, {v['total'] * 1000:.0f} ms",
                f"direct {by[direct]['total'] * 1000:.0f} ms",
                v["after_max"],
                "<=",
                limit,
                " B",
                ".0f",
            )
        )
        if v["status"] != [ok_status]:
            targets[-1][-1] = f"MISS (status {v['status']})"
    if "parts" in res:
        by = res["parts"]["by"]
        d = by[direct]
        rows = [
            [
                k,
                f"{v['mbs']:.1f}",
                f"{v['total']:.2f}",
                f"{v['ttfb'] * 1000:.0f}",
                "-" if k == direct else f"{v['mbs'] / d['mbs']:.2f}x",
                f"{v['upstream_x']:.2f}",
                fmt(v["rss_mib"], ".0f"),
            ]
            for k, v in by.items()
        ]
        out += [
            f"parts: cold GET of the whole {args.size_mib:g} MiB object",
            markdown(
                [
                    "contender",
                    "MB/s",
                    "wall s",
                    "first byte ms",
                    "vs one direct stream",
                    "origin bytes / object",
                    "peak RSS MiB",
                ],
                rows,
            ),
            "",
        ]
        p = next(k for k in by if k != direct)
        v = by[p]
        targets.append(
            target_row(
                f"cold {args.size_mib:g} MiB GET, --http-parts on vs one direct stream",
                f"{v['mbs']:.0f} MB/s",
                f"{d['mbs']:.0f} MB/s",
                v["mbs"] / d["mbs"],
                ">=",
                T["parts_vs_direct"],
            )
        )
    if res.get("rss"):
        rows = [[k, f"{v:.0f}"] for k, v in res["rss"].items()]
        out += ["peak RSS of each proxy over all its runs", markdown(["proxy", "MiB"], rows), ""]
        primary = [v for k, v in res["rss"].items() if k in res["primary"]]
        peak = max(primary or res["rss"].values())
        targets.append(
            target_row(
                "proxy peak RSS, every run of the first variant",
                f"{peak:.0f} MiB",
                "",
                peak * MIB / 1e6,
                "<=",
                T["rss_mb"],
                " MB",
                ".0f",
            )
        )
    if targets:
        out += [
            markdown(["measure", "shardcache", "direct", "figure", "target", "result"], targets)
        ]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds (unless --rounds is given)")
    p.add_argument(
        "--only",
        type=lambda t: parse_sections(t, SECTIONS),
        default=list(SECTIONS),
        help=f"sections, comma separated: {','.join(SECTIONS)} (default all)",
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 2)")
    p.add_argument("--size-mib", type=float, default=256, help="object size, MiB (256)")
    p.add_argument("--rate", type=float, default=50, help="origin MB/s per connection (50)")
    p.add_argument("--delay", type=float, default=0.05, help="origin time to first byte, s")
    p.add_argument("--range-at-mib", type=float, default=200, help="Range offset, MiB (200)")
    p.add_argument("--range-mib", type=float, default=1, help="Range length, MiB (1)")
    p.add_argument(
        "--after", type=float, default=1.0, help="seconds origin bytes are counted after an answer"
    )
    p.add_argument("--parallel", type=int, default=8, help="connections of the origin check (8)")
    p.add_argument(
        "--variants",
        default="default",
        help="proxy variants as in bench/proxy.py (e.g. asyncio+http-transport=aiohttp); "
        "the first is compared to the targets",
    )
    p.add_argument(
        "--no-one-stream",
        action="store_true",
        help="parts: leave out the first variant with --http-parts off",
    )
    p.add_argument("--timeout", type=float, default=120, help="bound on one request, s")
    add_run_options(p)
    p.add_argument("--_origin", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._origin:
        root, rate, delay, port_file, log = args._origin
        ThrottledOrigin(Path(root), float(rate), float(delay)).serve(Path(port_file), Path(log))
        return 0
    args.drop_caches = drop_caches_allowed(args.drop_caches)
    procs = Procs()
    t0 = time.monotonic()
    res: dict = {"config": {k: v for k, v in vars(args).items() if k != "_origin"}}
    with (
        interruptible() as interrupted,
        workdirs(args, int(args.size_mib * MIB), "shardcache-cold-") as (tmp, data),
        procs,
    ):
        b = Bench(args, tmp, data, procs)
        say(
            f"origin {b.origin.base}: {args.size_mib:g} MiB in {data}, "
            f"{args.rate:g} MB/s per connection, {args.delay * 1000:g} ms to first byte; "
            f"caches in {tmp}; page cache dropped before each run: "
            f"{'yes' if args.drop_caches else 'no'}"
        )
        sections = {
            "origin": b.check_origin,
            "range": b.range_section,
            "head": b.head_section,
            "unsat": b.unsat_section,
            "parts": b.parts_section,
        }
        for name in SECTIONS:
            if name in args.only:
                res[name] = sections[name]()
        res["rss"] = b.rss
        res["primary"] = sorted(b.primary)
        direct = b.origin.name
    if interrupted:
        return INTERRUPTED
    res["elapsed_s"] = time.monotonic() - t0
    print()
    print(
        f"{args.rounds} rounds, medians; origin {args.rate:g} MB/s per connection, "
        f"{args.delay * 1000:g} ms to first byte; proxy variants {args.variants}; "
        f"took {res['elapsed_s']:.0f} s"
    )
    print("\n".join(report(res, args, direct)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=lambda o: o.__dict__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
