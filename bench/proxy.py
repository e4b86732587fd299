"""The caching proxy side by side with nginx ``proxy_cache`` and Varnish, on loopback.

    python bench/proxy.py                      # 16 x 64 MiB + 256 MiB, 5 rounds (~2.5 min)
    python bench/proxy.py --quick              # the same sizes, 2 rounds (~1 min)
    python bench/proxy.py --only cold,big --variants default,default+http-transport=aiohttp
    python bench/proxy.py --shard-mib 16 --big-mib 64 --rounds 3   # the old quick size

Every contender runs once per round, in turn, with the order alternating between rounds
(interleaved, so drift in machine load hits them alike); figures are medians over rounds.

- origin: nginx serving the generated shards with sendfile (an aiohttp origin when nginx
  is not installed); its access log counts the bytes sent upstream. The shards live on
  tmpfs (``/dev/shm`` when it has room, ``--data-dir``), the caches on disk (``--dir``).
- caches: the proxy (``--variants``), nginx ``proxy_cache`` (one worker,
  ``proxy_cache_lock on``) and Varnish with file storage (``--varnish-storage``).
- cold runs: the server is restarted on an empty cache, serves a 4 KiB warm-up object,
  then ``sync`` and the page cache is dropped (root only; ``--no-drop-caches``), so every
  system starts from a clean, synced disk and none pays for another's deferred writes.
  After the run ``sync`` is timed again: that is the writeback the run left behind
  (the proxy fsyncs each entry before its last byte; nginx and Varnish do not).
- clients: one thread per client with a minimal HTTP/1.1 client that fetches its list
  of URLs over one keep-alive connection, discarding bodies with ``recv_into`` a 1 MiB
  buffer and checking status and length; time to first byte is to the first body byte.
  (``--client curl`` runs one curl process per client instead: on this 2-core machine
  curl's 16 KiB reads capped direct-from-origin at ~0.8 GB/s, the threads at ~1.3.)
  The direct-from-origin row is the ceiling the clients and loopback allow.

Sections (``--only warm,cold,big``) and targets (the first variant is compared):

- warm: 8 clients read the 16 shards (2 each) from a filled cache: >= 1.0x nginx.
- cold (measure 1): the same, cold: >= 2.0x nginx, >= 1.5x Varnish.
- big (measure 2): 16 clients start together on one cold 256 MiB shard: wall time
  <= 0.8x Varnish, median time to first byte <= 50 ms, bytes the origin sent = 1.00x.
- the proxy's peak RSS (``VmRSS`` every 50 ms) during cold and big runs: <= 150 MB.
Each cold or big run also records the CPU seconds of the server's process group, of the
origin and of the clients (this process).

Proxy variants (``--variants``): ``default`` runs ``python -m shardcache serve`` as is
(it uses uvloop when importable); ``asyncio`` hides uvloop from it; ``uvloop`` requires
it; a ``:N`` suffix (e.g. ``asyncio:4``) sets the proxy's read/write chunk to N MiB by
patching its settings at startup (the proxy has no flag for it); an ``@PYTHON`` suffix
runs that variant with another interpreter (e.g. a wrapper that ``cd``s into a ``git
archive`` of other code, to try a change side by side); ``+FLAG=VALUE`` suffixes add
serve flags (``default+http-parts=on+http-transport=aiohttp``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    INTERRUPTED,
    Procs,
    RssSampler,
    add_run_options,
    check_alive,
    drop_caches_allowed,
    fmt,
    free_port,
    group_cpu_seconds,
    http_headers,
    http_status,
    interruptible,
    markdown,
    median,
    nginx_argv,
    parse_sections,
    ratio,
    rotated,
    say,
    settle,
    target_row,
    wait_until,
    workdirs,
)

NGINX = "/usr/sbin/nginx"
VARNISHD = "/usr/sbin/varnishd"
CURL = shutil.which("curl") or "/usr/bin/curl"
MIB = 1 << 20

# ---------------------------------------------------------------------------------------
# processes


# ---------------------------------------------------------------------------------------
# servers


# the http block of every nginx here (after the harness's NGINX_HEAD)
NGINX_HTTP = """    default_type application/x-tar;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 10000;
    log_format bytes '$request_uri $status $body_bytes_sent $upstream_cache_status';
    access_log {tmp}/access.log bytes;
{server}
"""

ORIGIN_SERVER = """
    server {{
        listen 127.0.0.1:{port};
        root {data};
        location / {{ }}
    }}
"""

CACHE_SERVER = """
    proxy_cache_path {tmp}/cache levels=1:2 keys_zone=shards:10m max_size=100g
                     inactive=1d use_temp_path=off;
    upstream origin {{ server 127.0.0.1:{origin}; keepalive 32; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache shards;
            proxy_cache_valid 200 1d;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 600s;
            proxy_cache_lock_age 600s;
            proxy_buffers 16 256k;
            proxy_busy_buffers_size 512k;
            proxy_read_timeout 600s;
            add_header X-Cache-Status $upstream_cache_status;
        }}
    }}
"""

VCL = """vcl 4.1;
backend origin {{
    .host = "127.0.0.1";
    .port = "{origin}";
    .first_byte_timeout = 600s;
    .between_bytes_timeout = 600s;
}}
sub vcl_backend_response {{
    set beresp.ttl = 1d;
    set beresp.do_stream = true;
}}
"""


@dataclass
class Server:
    """A server the clients talk to; ``restart_cold`` empties its cache."""

    name: str
    procs: Procs
    tmp: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path = field(default_factory=Path)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def wipe(self) -> None:
        """Remove the cache contents (server stopped)."""

    def restart_cold(self, drop: bool = True, warmup: str | None = None) -> float:
        """Stop, empty the cache, start; GET ``warmup`` (a tiny object, so lazy start-up
        work such as imports is not timed); then ``settle``: sync and drop the page cache,
        so the run starts from a clean disk. Returns the seconds ``sync`` took."""
        self.stop()
        self.wipe()
        self.start()
        if warmup is not None:
            http_status(self.base + warmup, timeout=30)
        return settle(drop)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


class NginxServer(Server):
    def __init__(self, name: str, procs: Procs, tmp: Path, server_block: str, workers: int):
        super().__init__(name, procs, tmp)
        self.server_block = server_block
        self.workers = workers
        self.port = free_port()
        self.access_log = tmp / "access.log"

    def start(self) -> None:
        server = self.server_block.format(port=self.port, tmp=self.tmp)
        http = NGINX_HTTP.format(tmp=self.tmp, server=server)
        self.log = self.tmp / "stderr.log"
        self.proc = self.procs.start(nginx_argv(NGINX, self.tmp, http, self.workers), self.log)
        wait_until(
            lambda: (
                check_alive(self.proc, self.name, self.log)
                and http_status(self.base + "/-/probe") is not None
            ),
            20,
            f"{self.name} on port {self.port}",
        )

    def wipe(self) -> None:
        shutil.rmtree(self.tmp / "cache", ignore_errors=True)


class AiohttpOrigin(Server):
    """Fallback origin when nginx is missing: aiohttp's static route (sendfile)."""

    def __init__(self, procs: Procs, tmp: Path, data: Path):
        super().__init__("origin (aiohttp)", procs, tmp)
        self.data = data
        self.port = free_port()
        self.access_log = tmp / "access.log"

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        code = (
            "import sys\n"
            "from aiohttp import web\n"
            "log = open(sys.argv[3], 'a', buffering=1)\n"
            "async def count(request, resp):\n"
            "    n = resp.content_length if request.method == 'GET' else 0\n"
            "    log.write(f'{request.path_qs} {resp.status} {n or 0} -\\n')\n"
            "app = web.Application()\n"
            "app.on_response_prepare.append(count)\n"
            "app.router.add_static('/', sys.argv[1])\n"
            "web.run_app(app, host='127.0.0.1', port=int(sys.argv[2]), print=None,\n"
            "            access_log=None)\n"
        )
        self.log = self.tmp / "stderr.log"
        self.proc = self.procs.start(
            [sys.executable, "-c", code, str(self.data), str(self.port), str(self.access_log)],
            self.log,
        )
        wait_until(
            lambda: (
                check_alive(self.proc, self.name, self.log)
                and http_status(self.base + "/-/probe") is not None
            ),
            20,
            self.name,
        )


def varnish_storage(spec: str, tmp: Path, nbytes: int) -> tuple[str, Path | None]:
    """``-s`` argument for varnishd: ``file`` alone means a file in ``tmp`` sized for
    ``nbytes`` of objects (returned too, so a cold restart deletes it); anything else
    (``file,PATH,SIZE``, ``malloc,1G``) is passed as is."""
    if spec == "file":
        path = tmp / "storage" / "varnish.bin"
        size_mib = int(nbytes * 1.25 / MIB) + 256
        return f"file,{path},{size_mib}M", path
    return spec, None


class VarnishServer(Server):
    def __init__(self, procs: Procs, tmp: Path, origin_port: int, storage: str, nbytes: int = 0):
        self.storage, self.storage_file = varnish_storage(storage, tmp, nbytes)
        kind = self.storage.split(",", 1)[0]
        super().__init__(f"varnish ({kind})", procs, tmp)
        self.origin_port = origin_port
        self.port = free_port()

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        if self.storage_file is not None:
            self.storage_file.parent.mkdir(parents=True, exist_ok=True)
        vcl = self.tmp / "bench.vcl"
        vcl.write_text(VCL.format(origin=self.origin_port))
        self.log = self.tmp / "stderr.log"
        argv = [VARNISHD, "-F", "-a", f"127.0.0.1:{self.port}", "-f", str(vcl)]
        argv += ["-s", self.storage, "-n", str(self.tmp / "work"), "-T", "127.0.0.1:0"]
        if os.geteuid() == 0:
            argv += ["-j", "none"]
        self.proc = self.procs.start(argv, self.log)
        wait_until(
            lambda: (
                check_alive(self.proc, self.name, self.log)
                and http_status(self.base + "/-/probe") is not None
            ),
            60,
            "varnish",
        )

    def wipe(self) -> None:
        shutil.rmtree(self.tmp / "work", ignore_errors=True)
        if self.storage_file is not None:
            self.storage_file.unlink(missing_ok=True)


PROXY_WRAPPER = """
import dataclasses, sys
mode, chunk = sys.argv[1], int(sys.argv[2])
del sys.argv[1:3]
if mode == "asyncio":
    sys.modules["uvloop"] = None  # import uvloop -> ImportError: the proxy keeps asyncio
elif mode == "uvloop":
    import uvloop  # noqa: F401  (fail loudly when missing)
if chunk:
    import proxy.cli, proxy.inflight.download
    proxy.inflight.download.READ_CHUNK = chunk  # read by Download.stream
    _orig = proxy.cli.settings_from_args
    proxy.cli.settings_from_args = lambda a, e: dataclasses.replace(_orig(a, e), chunk_size=chunk)
from shardcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def variant_flags(variant: str) -> tuple[str, list[str]]:
    """``asyncio+http-parts=on+http-transport=aiohttp`` -> (``asyncio``, serve flags
    ``--http-parts on --http-transport aiohttp``)."""
    base, *flags = variant.split("+")
    extra: list[str] = []
    for f in flags:
        name, eq, value = f.partition("=")
        if not name or not eq:
            raise SystemExit(f"--variants: {f!r} in {variant!r} is not FLAG=VALUE")
        extra += [f"--{name.lstrip('-')}", value]
    return base, extra


class ShardcacheServer(Server):
    """``python -m shardcache serve`` on a free port; ``variant`` as in ``--variants``;
    ``args`` are more serve flags and ``env`` its environment, neither shown in its name."""

    def __init__(
        self,
        procs: Procs,
        tmp: Path,
        upstream: str,
        variant: str,
        python: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        variant, self.extra = variant_flags(variant)
        flags_label = " ".join(self.extra)
        self.extra += args or []
        self.env = env
        variant, _, python_override = variant.partition("@")
        mode, _, chunk = variant.partition(":")
        if python_override:
            short = Path(python_override)
            variant = f"{variant}@{short.parent.name}/{short.name}"
        if mode not in ("default", "asyncio", "uvloop"):
            raise SystemExit(f"--variants: unknown variant {variant!r}")
        python = python_override or python
        if mode == "default":
            # say which loop the proxy will pick: it uses uvloop whenever it is importable
            probe = subprocess.run([python, "-c", "import uvloop"], capture_output=True)
            variant = variant.replace(
                "default", "uvloop" if probe.returncode == 0 else "asyncio", 1
            )
        if flags_label:
            variant = f"{variant} {flags_label}"
        super().__init__(f"shardcache[{variant}]", procs, tmp)
        self.upstream = upstream
        self.mode = mode
        self.chunk = int(float(chunk) * MIB) if chunk else 0
        self.python = python
        self.port = free_port()

    def start(self) -> None:
        (self.tmp / "cache").mkdir(parents=True, exist_ok=True)
        self.log = self.tmp / "stderr.log"
        args = ["serve", "--upstream", self.upstream, "--cache-dir", str(self.tmp / "cache")]
        args += ["--cache-size", "100G", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--log-level", "warning", "--grace-period", "2", *self.extra]
        if self.mode == "default" and not self.chunk:
            argv = [self.python, "-m", "shardcache", *args]
        else:
            argv = [self.python, "-c", PROXY_WRAPPER, self.mode, str(self.chunk), *args]
        self.proc = self.procs.start(argv, self.log, env=self.env)
        wait_until(
            lambda: (
                check_alive(self.proc, self.name, self.log)
                and http_status(self.base + "/-/readyz") == 200
            ),
            60,
            self.name,
        )

    def wipe(self) -> None:
        shutil.rmtree(self.tmp / "cache", ignore_errors=True)

    def metric(self, name: str) -> float | None:
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        total = None
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith(name + "_created"):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total


# ---------------------------------------------------------------------------------------
# clients and measures


@dataclass
class Transfer:
    url: str
    code: int
    size: int
    ttfb: float
    total: float


class HttpConn:
    """A minimal HTTP/1.1 client connection that discards bodies into one reused buffer
    (``recv_into`` of up to 1 MiB at a time, the GIL released while it waits)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.pending = b""
        self.closing = False
        self.headers: dict[str, str] = {}
        self.t_status = 0.0
        self.buf = bytearray(1 << 20)
        self.view = memoryview(self.buf)

    def close(self) -> None:
        self.sock.close()

    def _line(self) -> bytes:
        while b"\r\n" not in self.pending:
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("connection closed in headers")
            self.pending += more
        line, _, self.pending = self.pending.partition(b"\r\n")
        return line

    def _discard(self, n: int, first: list[float]) -> int:
        """Read and drop exactly n body bytes; note the time of the first one."""
        got = 0
        if self.pending:
            take = min(n, len(self.pending))
            self.pending = self.pending[take:]
            got = take
            if take and not first:
                first.append(time.monotonic())
        while got < n:
            k = self.sock.recv_into(self.view, min(len(self.buf), n - got))
            if not k:
                raise ConnectionError(f"connection closed after {got} of {n} body bytes")
            if not first:
                first.append(time.monotonic())
            got += k
        return got

    def get(
        self, path: str, headers: dict[str, str] | None = None, method: str = "GET"
    ) -> tuple[int, int, float | None]:
        """(status, body bytes, monotonic time of the first body byte). The response's
        headers (lower-case names) are left in ``self.headers`` and the time its status
        line arrived in ``self.t_status``."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        req = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench\r\n{extra}\r\n"
        self.sock.sendall(req.encode())
        status = int(self._line().split()[1])
        self.t_status = time.monotonic()
        h: dict[str, str] = {}
        self.headers = h
        while line := self._line():
            k, _, v = line.decode("latin-1").partition(":")
            h[k.strip().lower()] = v.strip()
        first: list[float] = []
        if method == "HEAD" or status in (204, 304):
            n = 0
        elif "content-length" in h:
            n = self._discard(int(h["content-length"]), first)
        elif h.get("transfer-encoding", "").lower() == "chunked":
            n = 0
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    while self._line():  # trailers
                        pass
                    break
                n += self._discard(size, first)
                self._line()
        else:
            raise ConnectionError(f"{path}: neither Content-Length nor chunked")
        self.closing = h.get("connection", "").lower() == "close"
        return status, n, first[0] if first else None


def _socket_client(urls: list[str], timeout: float, out: list, errors: list) -> None:
    conn = None
    try:
        for url in urls:
            parts = urllib.parse.urlsplit(url)
            t0 = time.monotonic()
            if conn is None:
                conn = HttpConn(parts.hostname or "127.0.0.1", parts.port or 80, timeout)
            code, n, first = conn.get(parts.path)
            t1 = time.monotonic()
            out.append(Transfer(url, code, n, (first or t1) - t0, t1 - t0))
            if conn.closing:
                conn.close()
                conn = None
    except Exception as exc:  # reported by the caller, which raises
        errors.append(f"{urls}: {type(exc).__name__}: {exc}")
    finally:
        if conn is not None:
            conn.close()


def _socket_transfers(plan: list[list[str]], timeout: float) -> tuple[list, list]:
    transfers: list[Transfer] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=_socket_client, args=(urls, timeout, transfers, errors))
        for urls in plan
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 5
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        errors.append("client threads still running after the timeout")
    return transfers, errors


def _curl_transfers(plan: list[list[str]], timeout: float) -> tuple[list, list]:
    fmt = "%{url_effective} %{http_code} %{size_download} %{time_starttransfer} %{time_total}\\n"
    t0 = time.monotonic()
    procs = []
    for urls in plan:
        argv = [CURL, "-sS", "--max-time", str(int(timeout)), "-w", fmt]
        for u in urls:
            argv += [u, "-o", "/dev/null"]
        procs.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    transfers: list[Transfer] = []
    errors: list[str] = []
    try:
        for p in procs:
            left = max(1.0, timeout + 5 - (time.monotonic() - t0))
            out, err = p.communicate(timeout=left)
            if p.returncode != 0:
                errors.append(f"curl exit {p.returncode}: {err.strip()}")
            for line in out.splitlines():
                url, code, size, ttfb, total = line.split()
                transfers.append(Transfer(url, int(code), int(size), float(ttfb), float(total)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return transfers, errors


def run_clients(
    plan: list[list[str]], sizes: dict[str, int], timeout: float, kind: str = "socket"
) -> dict:
    """Each client fetches its URLs in turn over one connection, all clients at once.
    Returns wall time, bytes, GB/s and TTFBs; raises if any transfer has the wrong status
    or length."""
    t0 = time.monotonic()
    if kind == "curl":
        transfers, errors = _curl_transfers(plan, timeout)
    else:
        transfers, errors = _socket_transfers(plan, timeout)
    wall = time.monotonic() - t0
    for t in transfers:
        want = sizes[t.url.rsplit("/", 1)[1]]
        if t.code != 200 or t.size != want:
            errors.append(f"{t.url}: HTTP {t.code}, {t.size} bytes (want 200, {want})")
    if len(transfers) != sum(len(u) for u in plan):
        errors.append(f"{len(transfers)} transfers of {sum(len(u) for u in plan)}")
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    nbytes = sum(t.size for t in transfers)
    return {
        "wall": wall,
        "bytes": nbytes,
        "gbps": nbytes / wall / 1e9,
        "ttfb_median": statistics.median(t.ttfb for t in transfers),
        "ttfb_max": max(t.ttfb for t in transfers),
    }


def log_bytes(log: Path, offset: int, name: str) -> int:
    """Body bytes the origin logged for ``/name`` after ``offset``."""
    total = 0
    with open(log, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0].split("?")[0] == "/" + name:
                total += int(parts[2])
    return total


def log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


# ---------------------------------------------------------------------------------------
# data


def make_data(data: Path, shards: int, shard_mib: float, big_mib: float) -> dict[str, int]:
    data.mkdir(parents=True)
    sizes: dict[str, int] = {}
    specs = [(f"shard-{i:04d}.tar", int(shard_mib * MIB)) for i in range(shards)]
    specs.append(("big-0000.tar", int(big_mib * MIB)))
    for name, size in specs:
        with open(data / name, "wb") as f:
            left = size
            while left:
                n = min(8 * MIB, left)
                f.write(os.urandom(n))
                left -= n
        sizes[name] = size
    return sizes


# ---------------------------------------------------------------------------------------
# the run


def throughput_plan(servers: dict[str, Server], names: list[str], clients: int) -> dict:
    return {
        label: [[f"{servers[label].base}/{n}" for n in names[i::clients]] for i in range(clients)]
        for label in servers
    }


SECTIONS = ("warm", "cold", "big")
WARMUP = "warmup.bin"  # a tiny object each cache serves once before a timed cold run

# the targets, compared against the first proxy variant
TARGETS = {
    "warm_vs_nginx": 1.0,  # >=
    "cold_vs_nginx": 2.0,  # >=
    "cold_vs_varnish": 1.5,  # >=
    "big_wall_vs_varnish": 0.8,  # <=
    "big_ttfb_s": 0.050,  # <=
    "rss_mb": 150.0,  # <=
}


def cold_run(
    s: Server,
    plan: list[list[str]],
    sizes: dict[str, int],
    args: argparse.Namespace,
    origin: Server,
) -> dict:
    """One timed cold run of ``s``: restart on an empty cache, serve the warm-up object,
    sync and drop the page cache, run the clients (sampling the proxy's RSS), then sync
    again. Returns the clients' figures plus ``writeback`` (the seconds the second sync
    took: the writes the run left behind), ``rss_mib`` (peak, shardcache only) and the
    CPU seconds the server (``cpu``), the origin (``origin_cpu``) and this script's
    clients (``client_cpu``) used during the run."""
    s.restart_cold(args.drop_caches, "/" + WARMUP)
    pid = s.pid
    sampler = RssSampler(pid) if isinstance(s, ShardcacheServer) and pid else None
    cpu0, ocpu0 = group_cpu_seconds(pid), group_cpu_seconds(origin.pid)
    self0 = os.times()
    with sampler or contextlib.nullcontext():
        m = run_clients(plan, sizes, args.timeout, args.client)
    self1 = os.times()
    m["cpu"] = group_cpu_seconds(pid) - cpu0
    m["origin_cpu"] = group_cpu_seconds(origin.pid) - ocpu0
    m["client_cpu"] = (self1.user - self0.user) + (self1.system - self0.system)
    m["writeback"] = settle(drop=False)
    m["rss_mib"] = sampler.peak_kib / 1024 if sampler else None
    return m


def run_notes(m: dict, nbytes: int) -> str:
    """The per-round line's tail: upstream bytes, writeback, CPU seconds, peak RSS."""
    out = (
        f"upstream {m['upstream'] / nbytes:.2f}x, writeback after {m['writeback']:.2f} s, "
        f"CPU s server {m['cpu']:.2f} origin {m['origin_cpu']:.2f} "
        f"clients {m['client_cpu']:.2f}"
    )
    if m["rss_mib"] is not None:
        out += f", peak RSS {m['rss_mib']:.0f} MiB"
    return out


def run_medians(runs: list[dict]) -> dict:
    rss = [m["rss_mib"] for m in runs if m["rss_mib"] is not None]
    return {
        "writeback_s": median([m["writeback"] for m in runs]),
        "cpu_s": median([m["cpu"] for m in runs]),
        "origin_cpu_s": median([m["origin_cpu"] for m in runs]),
        "client_cpu_s": median([m["client_cpu"] for m in runs]),
        "rss_mib": max(rss) if rss else None,
    }


def bench(args: argparse.Namespace, tmp: Path, data: Path, procs: Procs) -> dict:
    have_nginx = os.access(NGINX, os.X_OK) and not args.no_nginx
    have_varnish = os.access(VARNISHD, os.X_OK) and not args.no_varnish
    if not have_nginx:
        say(f"nginx not found at {NGINX} (or --no-nginx): aiohttp origin, no proxy_cache rows")
    if not have_varnish:
        say(f"varnishd not found at {VARNISHD} (or --no-varnish): no Varnish rows")
    args.drop_caches = drop_caches_allowed(args.drop_caches)

    say(f"generating {args.shards} x {args.shard_mib} MiB + {args.big_mib} MiB in {data}")
    sizes = make_data(data, args.shards, args.shard_mib, args.big_mib)
    (data / WARMUP).write_bytes(os.urandom(4096))
    shard_names = sorted(n for n in sizes if n.startswith("shard-"))
    big = "big-0000.tar"

    if have_nginx:
        origin: Server = NginxServer(
            "origin (nginx)",
            procs,
            tmp / "origin",
            ORIGIN_SERVER.replace("{data}", str(data)),
            args.nginx_workers,
        )
    else:
        origin = AiohttpOrigin(procs, tmp / "origin", data)
    origin.start()
    access_log: Path = origin.access_log  # type: ignore[attr-defined]
    upstream = origin.base

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    proxies: dict[str, ShardcacheServer] = {}
    for i, v in enumerate(variants):
        s = ShardcacheServer(procs, tmp / f"shardcache{i}", upstream, v, args.python)
        if s.name in proxies:
            s.name = f"{s.name}#{i}"
        proxies[s.name] = s
    head = next(iter(proxies))
    nginx_cache: Server | None = None
    if have_nginx:
        nginx_cache = NginxServer(
            "nginx proxy_cache",
            procs,
            tmp / "nginx-cache",
            CACHE_SERVER.replace("{origin}", str(origin.port)),
            args.nginx_workers,
        )
    varnish = (
        VarnishServer(
            procs, tmp / "varnish", origin.port, args.varnish_storage, sum(sizes.values())
        )
        if have_varnish
        else None
    )

    caches: dict[str, Server] = dict(proxies)
    if nginx_cache:
        caches[nginx_cache.name] = nginx_cache
    if varnish:
        caches[varnish.name] = varnish
    for s in caches.values():
        s.start()
    say("servers: " + ", ".join(f"{s.name} :{s.port}" for s in [origin, *caches.values()]))
    say(
        f"origin data in {data}; caches in {tmp}; before each cold run: sync"
        + (" and drop the page cache" if args.drop_caches else "")
    )

    timeout = args.timeout
    res: dict = {"config": vars(args) | {"sizes": sizes}, "warm": {}, "cold": {}, "big": {}}
    res["head"] = head
    res["nginx"] = nginx_cache.name if nginx_cache else None
    res["varnish"] = varnish.name if varnish else None
    tp_servers: dict[str, Server] = {"direct origin": origin, **caches}
    plans = throughput_plan(tp_servers, shard_names, args.clients)
    shard_bytes = sum(sizes[n] for n in shard_names)

    # -- warm: 8 clients on a filled cache ------------------------------------------------
    if "warm" in args.only:
        say("filling caches for the warm rounds")
        for label, s in caches.items():
            run_clients(plans[label], sizes, timeout, args.client)
            h = http_headers(f"{s.base}/{shard_names[0]}")
            status = h.get("X-Cache") or h.get("X-Cache-Status")
            if status != "HIT" and not (isinstance(s, VarnishServer) and "X-Varnish" in h):
                say(f"  warning: {label} answers {status!r} after filling, not HIT")
        warm: dict[str, list[float]] = {k: [] for k in tp_servers}
        for r in range(args.rounds):
            for label in rotated(list(tp_servers), r):
                m = run_clients(plans[label], sizes, timeout, args.client)
                warm[label].append(m["gbps"])
                say(f"  warm round {r + 1} {label:28s} {m['gbps']:6.2f} GB/s  ({m['wall']:.2f} s)")
        res["warm"] = {k: {"rounds": v, "median_gbps": median(v)} for k, v in warm.items()}

    # -- cold: 8 clients, every cache restarted empty on a synced, dropped page cache -----
    if "cold" in args.only:
        cold: dict[str, list[dict]] = {k: [] for k in caches}
        for r in range(args.rounds):
            for label in rotated(list(caches), r):
                off = log_size(access_log)
                m = cold_run(caches[label], plans[label], sizes, args, origin)
                time.sleep(0.2)
                m["upstream"] = sum(log_bytes(access_log, off, n) for n in shard_names)
                cold[label].append(m)
                say(
                    f"  cold round {r + 1} {label:28s} {m['gbps']:6.2f} GB/s  ({m['wall']:.2f} s, "
                    + run_notes(m, shard_bytes)
                    + ")"
                )
        res["cold"] = {
            k: {
                "rounds": [m["gbps"] for m in v],
                "median_gbps": median([m["gbps"] for m in v]),
                "upstream_bytes": [m["upstream"] for m in v],
                "upstream_ratio": max(m["upstream"] for m in v) / shard_bytes,
                **run_medians(v),
            }
            for k, v in cold.items()
        }

    # -- big: many clients on one cold big shard -------------------------------------------
    if "big" in args.only:
        big_servers: dict[str, Server] = dict(proxies)
        if varnish:
            big_servers[varnish.name] = varnish
        if nginx_cache:
            big_servers[nginx_cache.name] = nginx_cache
        big_res: dict[str, list[dict]] = {k: [] for k in big_servers}
        for r in range(args.rounds):
            for label in rotated(list(big_servers), r):
                s = big_servers[label]
                plan = [[f"{s.base}/{big}"] for _ in range(args.big_clients)]
                off = log_size(access_log)
                m = cold_run(s, plan, sizes, args, origin)
                time.sleep(0.3)
                m["upstream"] = log_bytes(access_log, off, big)
                if isinstance(s, ShardcacheServer):
                    m["metric_upstream"] = s.metric("shardcache_upstream_bytes_total")
                big_res[label].append(m)
                say(
                    f"  {args.big_clients} on one round {r + 1} {label:28s} wall {m['wall']:.2f} s, "
                    f"median TTFB {m['ttfb_median'] * 1000:.0f} ms, " + run_notes(m, sizes[big])
                )
        res["big"] = {
            k: {
                "rounds": v,
                "wall": median([m["wall"] for m in v]),
                "ttfb": median([m["ttfb_median"] for m in v]),
                "upstream_ratio": max(m["upstream"] for m in v) / sizes[big],
                **run_medians(v),
            }
            for k, v in big_res.items()
        }
    return res


def table(res: dict, big_clients: int) -> list[list[str]]:
    """Rows: measure, shardcache, comparison, ratio, target, result."""
    head, ngx, var = res["head"], res["nginx"], res["varnish"]
    clients = res["config"]["clients"]
    T = TARGETS
    rows: list[list[str]] = []
    if res["warm"]:
        mine = res["warm"][head]["median_gbps"]
        theirs = res["warm"][ngx]["median_gbps"] if ngx else None
        rows.append(
            target_row(
                f"warm throughput, {clients} clients, vs nginx",
                f"{mine:.2f} GB/s",
                f"nginx {fmt(theirs, '.2f')} GB/s",
                ratio(mine, theirs),
                ">=",
                T["warm_vs_nginx"],
            )
        )
    if res["cold"]:
        mine = res["cold"][head]["median_gbps"]
        for other, key in ((ngx, "cold_vs_nginx"), (var, "cold_vs_varnish")):
            theirs = res["cold"][other]["median_gbps"] if other else None
            rows.append(
                target_row(
                    f"1 cold throughput, {clients} clients, vs {other or 'missing'}",
                    f"{mine:.2f} GB/s",
                    f"{fmt(theirs, '.2f')} GB/s",
                    ratio(mine, theirs),
                    ">=",
                    T[key],
                )
            )
    b = res["big"]
    if b:
        bh = b[head]
        vb = b[var] if var else None
        rows.append(
            target_row(
                f"2 wall, {big_clients} clients on 1 cold shard, vs {var or 'missing'}",
                f"{bh['wall']:.2f} s",
                f"{vb['wall']:.2f} s" if vb else "-",
                ratio(bh["wall"], vb["wall"] if vb else None),
                "<=",
                T["big_wall_vs_varnish"],
            )
        )
        rows.append(
            target_row(
                "2 median time to first byte",
                f"{bh['ttfb'] * 1000:.0f} ms",
                f"{vb['ttfb'] * 1000:.0f} ms" if vb else "-",
                bh["ttfb"],
                "<=",
                T["big_ttfb_s"],
                " s",
                ".3f",
            )
        )
        rows.append(
            target_row(
                "2 upstream bytes / shard",
                f"{bh['upstream_ratio']:.2f}x",
                f"{vb['upstream_ratio']:.2f}x" if vb else "-",
                bh["upstream_ratio"],
                "=",
                1.0,
            )
        )
    rss = [x for k in ("cold", "big") for x in [res[k].get(head, {}).get("rss_mib")] if x]
    if rss:
        rows.append(
            target_row(
                "proxy peak RSS (cold and 16-on-one runs)",
                f"{max(rss):.0f} MiB",
                "",
                max(rss) * MIB / 1e6,
                "<=",
                T["rss_mb"],
                " MB",
                ".0f",
            )
        )
    return rows


DETAIL_HEADER = [
    "server",
    "warm GB/s",
    "cold GB/s",
    "cold upstream x",
    "cold CPU s (server/origin/clients)",
    "cold writeback s",
    "big wall s",
    "big TTFB ms",
    "big upstream x",
    "big CPU s (server/origin/clients)",
    "big writeback s",
    "peak RSS MiB",
]


def cpu_cell(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['cpu_s']:.2f} / {r['origin_cpu_s']:.2f} / {r['client_cpu_s']:.2f}"


def detail_rows(res: dict) -> list[list[str]]:
    """Every contender's medians (and the proxy variants against each other)."""
    rows = []
    names: list[str] = []
    for sec in ("warm", "cold", "big"):
        names += [k for k in res[sec] if k not in names]
    for k in names:
        w = res["warm"].get(k, {}).get("median_gbps")
        c = res["cold"].get(k)
        b = res["big"].get(k)
        rss = [x for x in (c and c["rss_mib"], b and b["rss_mib"]) if x]
        rows.append(
            [
                k,
                fmt(w, ".2f"),
                fmt(c and c["median_gbps"], ".2f"),
                fmt(c and c["upstream_ratio"], ".2f"),
                cpu_cell(c),
                fmt(c and c["writeback_s"], ".2f"),
                fmt(b and b["wall"], ".2f"),
                "-" if not b else f"{b['ttfb'] * 1000:.0f}",
                "-" if not b else f"{b['upstream_ratio']:.2f}",
                cpu_cell(b),
                fmt(b and b["writeback_s"], ".2f"),
                fmt(max(rss) if rss else None, ".0f"),
            ]
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 rounds in place of 5 (same sizes; about a minute)",
    )
    p.add_argument(
        "--only",
        type=lambda t: parse_sections(t, SECTIONS),
        default=list(SECTIONS),
        help="sections to run, comma separated: warm,cold,big (default all)",
    )
    p.add_argument("--shards", type=int, default=16, help="number of shards (default 16)")
    p.add_argument("--shard-mib", type=float, default=None, help="shard size, MiB (default 64)")
    p.add_argument("--big-mib", type=float, default=None, help="big shard size, MiB (default 256)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per measure (5, quick 2)")
    p.add_argument("--clients", type=int, default=8, help="throughput clients (default 8)")
    p.add_argument("--big-clients", type=int, default=16, help="clients on the big shard (16)")
    p.add_argument(
        "--variants",
        default="default",
        help="proxy variants, comma separated: default, asyncio, uvloop, with optional "
        ":MiB chunk size (e.g. asyncio:4), @PYTHON interpreter and +FLAG=VALUE serve flags "
        "(e.g. asyncio+http-transport=aiohttp); the first is compared to the targets",
    )
    p.add_argument("--nginx-workers", type=int, default=1, help="nginx worker_processes (1)")
    p.add_argument(
        "--varnish-storage",
        default="file",
        help="varnishd -s: 'file' (default: a file in the temporary directory, sized for "
        "the data, deleted on every cold restart), file,PATH,SIZE or malloc,SIZE",
    )
    p.add_argument("--no-nginx", action="store_true", help="act as if nginx were missing")
    p.add_argument("--no-varnish", action="store_true", help="act as if varnishd were missing")
    p.add_argument(
        "--client",
        choices=("socket", "curl"),
        default="socket",
        help="socket: threads with a minimal HTTP/1.1 client (default, lighter); "
        "curl: one curl process per client",
    )
    p.add_argument("--timeout", type=float, default=300, help="bound on each client run, s")
    add_run_options(p)
    args = p.parse_args(argv)
    defaults = {"shard_mib": 64.0, "big_mib": 256.0, "rounds": 2 if args.quick else 5}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rounds < 1 or args.clients < 1 or args.big_clients < 1 or args.shards < 1:
        p.error("--rounds, --clients, --big-clients and --shards must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.access(CURL, os.X_OK) and args.client == "curl":
        print("curl is required for --client curl", file=sys.stderr)
        return 2
    procs = Procs()
    need = int((args.shards * args.shard_mib + args.big_mib) * MIB)
    t0 = time.monotonic()
    with (
        interruptible() as interrupted,
        workdirs(args, need, "shardcache-bench-") as (tmp, data),
        procs,
    ):
        res = bench(args, tmp, data, procs)
    if interrupted:
        return INTERRUPTED
    res["elapsed_s"] = time.monotonic() - t0

    print()
    print(
        f"shards: {args.shards} x {args.shard_mib:g} MiB, big shard {args.big_mib:g} MiB, "
        f"{args.rounds} rounds, medians; proxy variant {res['head']}; "
        f"page cache dropped before each cold run: {'yes' if args.drop_caches else 'no'}; "
        f"took {res['elapsed_s']:.0f} s"
    )
    print(
        markdown(
            ["measure", "shardcache", "compared with", "ratio", "target", "result"],
            table(res, args.big_clients),
        )
    )
    print()
    print(markdown(DETAIL_HEADER, detail_rows(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
