"""The caching proxy side by side with nginx ``proxy_cache`` and Varnish, on loopback.

    python bench/proxy.py                                   # 16 x 64 MiB + 256 MiB, 3 rounds
    python bench/proxy.py --shard-mib 16 --big-mib 64 --rounds 3   # quick
    python bench/proxy.py --variants default,asyncio --json out.json

Every contender runs once per round, in turn, with the order alternating between rounds
(interleaved, so drift in machine load hits them alike); figures are medians over rounds.

- origin: nginx serving the generated shards with sendfile (an aiohttp origin when nginx
  is not installed); its access log counts the bytes sent upstream.
- clients: one thread per client with a minimal HTTP/1.1 client that fetches its list
  of URLs over one keep-alive connection, discarding bodies with ``recv_into`` a 1 MiB
  buffer and checking status and length; time to first byte is to the first body byte.
  (``--client curl`` runs one curl process per client instead: on this 2-core machine
  curl's 16 KiB reads capped direct-from-origin at ~0.8 GB/s, the threads at ~1.3.)
  The direct-from-origin row is the ceiling the clients and loopback allow.
- 1 warm throughput: 8 clients read the 16 shards (2 each) from a filled cache.
- 2 cold throughput: the same with the cache wiped (server restarted on an empty
  directory) before each round; nginx has ``proxy_cache_lock on``.
- 3 coalescing: 16 clients start together on one cold big shard: wall time, median time
  to first byte (curl's ``time_starttransfer``), bytes the origin sent.
- 4 the proxy's peak RSS during 3 (``VmRSS`` sampled every 50 ms).

Proxy variants (``--variants``): ``default`` runs ``python -m shardcache serve`` as is
(it uses uvloop when importable); ``asyncio`` hides uvloop from it; ``uvloop`` requires
it; a ``:N`` suffix (e.g. ``asyncio:4``) sets the proxy's read/write chunk to N MiB by
patching its settings at startup (the proxy has no flag for it); an ``@PYTHON`` suffix
runs that variant with another interpreter (e.g. a wrapper that sets PYTHONPATH to try a
change side by side). The first variant is the
one compared against the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NGINX = "/usr/sbin/nginx"
VARNISHD = "/usr/sbin/varnishd"
CURL = shutil.which("curl") or "/usr/bin/curl"
MIB = 1 << 20

# ---------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def http_status(url: str, timeout: float = 2.0, method: str = "GET") -> int | None:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def http_headers(url: str, timeout: float = 5.0) -> dict[str, str]:
    req = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(r.headers)


class Procs:
    """Every process this script starts, each the leader of its own process group, so
    that stopping it also stops its workers (nginx, varnishd children)."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        with open(log, "ab") as f:
            p = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=str(ROOT),
            )
        self.live.append(p)
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 15.0) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        # workers of a group whose leader exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        if p in self.live:
            self.live.remove(p)

    def stop_all(self) -> None:
        for p in list(self.live):
            with contextlib.suppress(Exception):
                self.stop(p, timeout=5.0)


def check_alive(p: subprocess.Popen, name: str, log: Path) -> bool:
    if p.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")
    return True


# ---------------------------------------------------------------------------------------
# servers


NGINX_COMMON = """
worker_processes {workers};
{user}
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type application/x-tar;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 10000;
    log_format bytes '$request_uri $status $body_bytes_sent $upstream_cache_status';
    access_log {tmp}/access.log bytes;
{server}
}}
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

    def restart_cold(self) -> None:
        self.stop()
        self.wipe()
        self.start()

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
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "cache", "logs"):
            (self.tmp / d).mkdir(parents=True, exist_ok=True)
        server = self.server_block.format(port=self.port, tmp=self.tmp)
        conf = NGINX_COMMON.format(
            workers=self.workers,
            user="user root;" if os.geteuid() == 0 else "",
            tmp=self.tmp,
            server=server,
        )
        cpath = self.tmp / "nginx.conf"
        cpath.write_text(conf)
        self.log = self.tmp / "stderr.log"
        g = f"daemon off; pid {self.tmp}/nginx.pid; error_log {self.tmp}/error.log warn;"
        self.proc = self.procs.start(
            [NGINX, "-p", str(self.tmp), "-c", str(cpath), "-g", g], self.log
        )
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


class VarnishServer(Server):
    def __init__(self, procs: Procs, tmp: Path, origin_port: int, storage: str):
        super().__init__("varnish", procs, tmp)
        self.origin_port = origin_port
        self.storage = storage
        self.port = free_port()

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
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


PROXY_WRAPPER = """
import dataclasses, sys
mode, chunk = sys.argv[1], int(sys.argv[2])
del sys.argv[1:3]
if mode == "asyncio":
    sys.modules["uvloop"] = None  # import uvloop -> ImportError: the proxy keeps asyncio
elif mode == "uvloop":
    import uvloop  # noqa: F401  (fail loudly when missing)
if chunk:
    import proxy.cli, proxy.inflight
    proxy.inflight.READ_CHUNK = chunk
    _orig = proxy.cli.settings_from_args
    proxy.cli.settings_from_args = lambda a, e: dataclasses.replace(_orig(a, e), chunk_size=chunk)
from shardcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


class ShardcacheServer(Server):
    def __init__(self, procs: Procs, tmp: Path, upstream: str, variant: str, python: str):
        variant, _, python_override = variant.partition("@")
        mode, _, chunk = variant.partition(":")
        if python_override:
            variant = f"{variant}@{python_override}"
        if mode not in ("default", "asyncio", "uvloop"):
            raise SystemExit(f"--variants: unknown variant {variant!r}")
        python = python_override or python
        if mode == "default":
            # say which loop the proxy will pick: it uses uvloop whenever it is importable
            probe = subprocess.run([python, "-c", "import uvloop"], capture_output=True)
            variant = variant.replace(
                "default", "uvloop" if probe.returncode == 0 else "asyncio", 1
            )
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
        args += ["--log-level", "warning", "--grace-period", "2"]
        if self.mode == "default" and not self.chunk:
            argv = [self.python, "-m", "shardcache", *args]
        else:
            argv = [self.python, "-c", PROXY_WRAPPER, self.mode, str(self.chunk), *args]
        self.proc = self.procs.start(argv, self.log)
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

    def get(self, path: str) -> tuple[int, int, float | None]:
        """(status, body bytes, monotonic time of the first body byte)."""
        req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench\r\n\r\n"
        self.sock.sendall(req.encode())
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        first: list[float] = []
        if "content-length" in headers:
            n = self._discard(int(headers["content-length"]), first)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
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
        self.closing = headers.get("connection", "").lower() == "close"
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


class RssSampler:
    """Peak VmRSS of one process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        path = f"/proc/{self.pid}/status"
        while not self._stop.is_set():
            try:
                with open(path) as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.peak_kib = max(self.peak_kib, int(line.split()[1]))
                            self.samples += 1
                            break
            except OSError:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


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


def rotated(items: list, r: int) -> list:
    """Round r runs the contenders in turn, alternating direction between rounds."""
    return list(items) if r % 2 == 0 else list(reversed(items))


def say(msg: str) -> None:
    print(msg, flush=True)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def throughput_plan(servers: dict[str, Server], names: list[str], clients: int) -> dict:
    return {
        label: [[f"{servers[label].base}/{n}" for n in names[i::clients]] for i in range(clients)]
        for label in servers
    }


def bench(args: argparse.Namespace, tmp: Path, procs: Procs) -> dict:
    have_nginx = os.access(NGINX, os.X_OK) and not args.no_nginx
    have_varnish = os.access(VARNISHD, os.X_OK) and not args.no_varnish
    if not have_nginx:
        say(f"nginx not found at {NGINX} (or --no-nginx): aiohttp origin, no proxy_cache rows")
    if not have_varnish:
        say(f"varnishd not found at {VARNISHD} (or --no-varnish): no Varnish rows")

    say(f"generating {args.shards} x {args.shard_mib} MiB + {args.big_mib} MiB in {tmp}/data")
    sizes = make_data(tmp / "data", args.shards, args.shard_mib, args.big_mib)
    shard_names = sorted(n for n in sizes if n.startswith("shard-"))
    big = "big-0000.tar"

    if have_nginx:
        origin: Server = NginxServer(
            "origin (nginx)",
            procs,
            tmp / "origin",
            ORIGIN_SERVER.replace("{data}", str(tmp / "data")),
            args.nginx_workers,
        )
    else:
        origin = AiohttpOrigin(procs, tmp / "origin", tmp / "data")
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
        VarnishServer(procs, tmp / "varnish", origin.port, args.varnish_storage)
        if (have_varnish)
        else None
    )

    caches: dict[str, Server] = dict(proxies)
    if nginx_cache:
        caches[nginx_cache.name] = nginx_cache
    for s in caches.values():
        s.start()
    say("servers: " + ", ".join(f"{s.name} :{s.port}" for s in [origin, *caches.values()]))

    timeout = args.timeout
    res: dict = {"config": vars(args) | {"sizes": sizes}, "warm": {}, "cold": {}, "big": {}}
    tp_servers: dict[str, Server] = {"direct origin": origin, **caches}
    plans = throughput_plan(tp_servers, shard_names, args.clients)

    # -- 1 warm ---------------------------------------------------------------------------
    say("filling caches for the warm rounds")
    for label, s in caches.items():
        run_clients(plans[label], sizes, timeout, args.client)
        h = http_headers(f"{s.base}/{shard_names[0]}")
        status = h.get("X-Cache") or h.get("X-Cache-Status")
        if status != "HIT":
            say(f"  warning: {label} answers {status!r} after filling, not HIT")
    warm: dict[str, list[float]] = {k: [] for k in tp_servers}
    for r in range(args.rounds):
        for label in rotated(list(tp_servers), r):
            m = run_clients(plans[label], sizes, timeout, args.client)
            warm[label].append(m["gbps"])
            say(f"  warm round {r + 1} {label:28s} {m['gbps']:6.2f} GB/s  ({m['wall']:.2f} s)")
    res["warm"] = {k: {"rounds": v, "median_gbps": median(v)} for k, v in warm.items()}

    # -- 2 cold ---------------------------------------------------------------------------
    cold: dict[str, list[float]] = {k: [] for k in caches}
    upstream_cold: dict[str, list[int]] = {k: [] for k in caches}
    for r in range(args.rounds):
        for label in rotated(list(caches), r):
            s = caches[label]
            s.restart_cold()
            off = log_size(access_log)
            m = run_clients(plans[label], sizes, timeout, args.client)
            time.sleep(0.2)
            up = sum(log_bytes(access_log, off, n) for n in shard_names)
            cold[label].append(m["gbps"])
            upstream_cold[label].append(up)
            say(
                f"  cold round {r + 1} {label:28s} {m['gbps']:6.2f} GB/s  ({m['wall']:.2f} s, "
                f"upstream {up / sum(sizes[n] for n in shard_names):.2f}x)"
            )
    res["cold"] = {
        k: {"rounds": v, "median_gbps": median(v), "upstream_bytes": upstream_cold[k]}
        for k, v in cold.items()
    }

    # -- 3/4 many clients on one cold big shard ------------------------------------------
    big_servers: dict[str, Server] = dict(proxies)
    if varnish:
        big_servers[varnish.name] = varnish
    if nginx_cache:
        big_servers[nginx_cache.name] = nginx_cache
    big_res: dict[str, dict[str, list]] = {
        k: {"wall": [], "ttfb": [], "upstream": [], "rss_mib": []} for k in big_servers
    }
    for r in range(args.rounds):
        for label in rotated(list(big_servers), r):
            s = big_servers[label]
            s.restart_cold()
            plan = [[f"{s.base}/{big}"] for _ in range(args.big_clients)]
            off = log_size(access_log)
            pid = s.pid
            sampler = RssSampler(pid) if isinstance(s, ShardcacheServer) and pid else None
            with sampler or contextlib.nullcontext():
                m = run_clients(plan, sizes, timeout, args.client)
            time.sleep(0.3)
            up = log_bytes(access_log, off, big)
            b = big_res[label]
            b["wall"].append(m["wall"])
            b["ttfb"].append(m["ttfb_median"])
            b["upstream"].append(up)
            extra = ""
            if sampler:
                b["rss_mib"].append(sampler.peak_kib / 1024)
                metric = s.metric("shardcache_upstream_bytes_total")  # type: ignore[union-attr]
                b.setdefault("metric_upstream", []).append(metric)
                extra = f", peak RSS {sampler.peak_kib / 1024:.0f} MiB ({sampler.samples} samples)"
            say(
                f"  {args.big_clients} on one round {r + 1} {label:28s} wall {m['wall']:.2f} s, "
                f"median TTFB {m['ttfb_median'] * 1000:.0f} ms, "
                f"upstream {up / sizes[big]:.2f}x{extra}"
            )
    res["big"] = {
        k: {
            "rounds": v,
            "wall": median(v["wall"]),
            "ttfb": median(v["ttfb"]),
            "upstream_ratio": max(v["upstream"]) / sizes[big],
            "rss_mib": max(v["rss_mib"]) if v["rss_mib"] else None,
        }
        for k, v in big_res.items()
    }
    res["head"] = head
    res["nginx"] = nginx_cache.name if nginx_cache else None
    res["varnish"] = varnish.name if varnish else None
    return res


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict, big_clients: int) -> list[list[str]]:
    """Rows: measure, shardcache, comparison, ratio, target, result."""
    head, ngx, var = res["head"], res["nginx"], res["varnish"]
    b = res["big"]
    rows: list[list[str]] = []

    def ratio(a: float | None, z: float | None) -> float | None:
        return None if a is None or not z else a / z

    for key, label, target in (
        ("warm", "1 warm throughput", 1.0),
        ("cold", "2 cold throughput", 1.2),
    ):
        mine = res[key][head]["median_gbps"]
        theirs = res[key][ngx]["median_gbps"] if ngx else None
        r = ratio(mine, theirs)
        rows.append(
            [
                f"{label}, {res['config']['clients']} clients",
                f"{mine:.2f} GB/s",
                f"nginx {fmt(theirs, '.2f')} GB/s" if ngx else "nginx missing",
                "-" if r is None else f"{r:.2f}x",
                f">= {target:.1f}x",
                verdict(None if r is None else r >= target),
            ]
        )
    bh = b[head]
    rows.append(
        [
            f"3 upstream bytes, {big_clients} clients on 1 cold shard",
            f"{bh['upstream_ratio']:.2f}x shard",
            f"varnish {b[var]['upstream_ratio']:.2f}x" if var else "varnish missing",
            f"{bh['upstream_ratio']:.2f}x",
            "= 1.00x",
            verdict(abs(bh["upstream_ratio"] - 1.0) < 1e-6),
        ]
    )
    rows.append(
        [
            "3 median time to first byte",
            f"{bh['ttfb'] * 1000:.0f} ms",
            f"varnish {b[var]['ttfb'] * 1000:.0f} ms" if var else "varnish missing",
            f"{bh['ttfb']:.3f} s",
            "<= 0.100 s",
            verdict(bh["ttfb"] <= 0.1),
        ]
    )
    wr = ratio(bh["wall"], b[var]["wall"]) if var else None
    rows.append(
        [
            "3 wall time",
            f"{bh['wall']:.2f} s",
            f"varnish {b[var]['wall']:.2f} s" if var else "varnish missing",
            "-" if wr is None else f"{wr:.2f}x",
            "<= 1.00x",
            verdict(None if wr is None else wr <= 1.0),
        ]
    )
    rows.append(
        [
            "4 proxy peak RSS during 3",
            f"{bh['rss_mib']:.0f} MiB",
            "",
            f"{bh['rss_mib'] * MIB / 1e6:.0f} MB",
            "<= 150 MB",
            verdict(bh["rss_mib"] * MIB / 1e6 <= 150),
        ]
    )
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def detail_rows(res: dict) -> list[list[str]]:
    """Every contender's medians (and the proxy variants against each other)."""
    rows = []
    names = list(res["warm"]) + [k for k in res["big"] if k not in res["warm"]]
    for k in names:
        w = res["warm"].get(k, {}).get("median_gbps")
        c = res["cold"].get(k, {}).get("median_gbps")
        b = res["big"].get(k)
        rows.append(
            [
                k,
                fmt(w, ".2f"),
                fmt(c, ".2f"),
                fmt(b and b["wall"], ".2f"),
                "-" if not b else f"{b['ttfb'] * 1000:.0f}",
                "-" if not b else f"{b['upstream_ratio']:.2f}",
                fmt(b and b["rss_mib"], ".0f"),
            ]
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=16, help="number of shards (default 16)")
    p.add_argument("--shard-mib", type=float, default=64, help="shard size, MiB (default 64)")
    p.add_argument("--big-mib", type=float, default=256, help="big shard size, MiB (default 256)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per measure (default 3)")
    p.add_argument("--clients", type=int, default=8, help="throughput clients (default 8)")
    p.add_argument("--big-clients", type=int, default=16, help="clients on the big shard (16)")
    p.add_argument(
        "--variants",
        default="default",
        help="proxy variants, comma separated: default, asyncio, uvloop, with optional "
        ":MiB chunk size (e.g. asyncio:4) and @PYTHON interpreter; the first is compared to the targets",
    )
    p.add_argument("--nginx-workers", type=int, default=1, help="nginx worker_processes (1)")
    p.add_argument("--varnish-storage", default="malloc,1G", help="varnishd -s (malloc,1G)")
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
    p.add_argument("--dir", default=None, help="parent of the temporary directory")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--python",
        default=str(ROOT / ".venv/bin/python")
        if (ROOT / ".venv/bin/python").exists()
        else sys.executable,
        help="interpreter that runs the proxy (default .venv/bin/python)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.clients < 1 or args.big_clients < 1 or args.shards < 1:
        p.error("--rounds, --clients, --big-clients and --shards must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.access(CURL, os.X_OK):
        print("curl is required for the clients", file=sys.stderr)
        return 2
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-bench-", dir=args.dir))

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        res = bench(args, tmp, procs)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, old)

    print()
    print(
        f"shards: {args.shards} x {args.shard_mib:g} MiB, big shard {args.big_mib:g} MiB, "
        f"{args.rounds} rounds, medians; proxy variant {res['head']}"
    )
    print(
        markdown(
            ["measure", "shardcache", "compared with", "ratio", "target", "result"],
            table(res, args.big_clients),
        )
    )
    print()
    print(
        markdown(
            [
                "server",
                "warm GB/s",
                "cold GB/s",
                "big wall s",
                "big TTFB ms",
                "big upstream x",
                "peak RSS MiB",
            ],
            detail_rows(res),
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
