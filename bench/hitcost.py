"""What a cache hit costs the proxy in CPU: microseconds of proxy CPU time (user + system,
from ``/proc/PID/stat``) per request, for a 64 KiB and a 1 KiB object served from the
cache, against the floor of a bare aiohttp handler answering the same bytes from memory
and nginx serving the file. CPU per request holds up on a busy machine, where req/s does
not (other processes take the cores; the work per request stays what it is).

    git worktree add /tmp/base <commit>   # or: git archive <commit> | tar -x -C /tmp/base
    python bench/hitcost.py --base /tmp/base               # 5 rounds of 5 s per case
    python bench/hitcost.py --rounds 3 --seconds 3         # this tree only
    python bench/hitcost.py --base /tmp/base --profile /tmp/prof   # and py-spy profiles

Servers, each one process (one nginx worker), all started once and warmed up:

- shardcache of this tree (and of ``--base``) at its default log level (an access-log
  line per request, written to a file) and with ``--log-level warning``; this tree's
  with ``--fast-hits on`` and ``off`` (``--fast-hits on|off|both``, default both); its
  upstream is the nginx below; every object fetched once and checked to be an
  ``X-Cache: HIT``.
- bare aiohttp: one handler returning the bytes from memory, ``access_log=None``.
- nginx: one worker serving the files (``sendfile on``, ``access_log off``).

Each measure: proxy CPU seconds read, ``wrk -t1 -c{conns} -d{seconds}s`` on one object,
CPU read again; divided by the requests wrk reports. Rounds are interleaved (the order of
the cases reversed every other round) and the table gives medians (min–max).
``--profile DIR``: after the timed rounds, ``py-spy record --nonblocking`` on each
shardcache (default log level) during one 64 KiB wrk run; the raw profiles are written
to DIR and their top functions (own samples, and samples with the function on the
stack) printed.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import free_port, nginx_argv  # noqa: E402

WRK = shutil.which("wrk") or "/usr/bin/wrk"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
PYSPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
OBJECTS = {"64 KiB": ("/obj64k.bin", 64 << 10), "1 KiB": ("/obj1k.bin", 1 << 10)}

# the http block after the harness's NGINX_HEAD (one worker)
NGINX_HTTP = """    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 1000000;
    access_log off;
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        root {data};
    }}
"""

BARE_AIOHTTP = """
import sys
from pathlib import Path
from aiohttp import web
data = Path(sys.argv[1])
bodies = {"/" + p.name: p.read_bytes() for p in data.iterdir()}
async def handler(request):
    return web.Response(body=bodies[request.path], content_type="application/octet-stream")
app = web.Application()
for path in bodies:
    app.router.add_get(path, handler)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(port: int, path: str) -> tuple[int, dict[str, str], int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, len(body)
    finally:
        conn.close()


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"exited ({proc.returncode}): {log.read_text(errors='replace')[-2000:]}"
            )
        try:
            get(port, "/obj1k.bin")
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"no answer on port {port}: {log.read_text(errors='replace')[-2000:]}")


class Server:
    def __init__(self, name: str, proc: subprocess.Popen, port: int, pid: int, log: Path):
        self.name, self.proc, self.port, self.pid, self.log = name, proc, port, pid, log


def start_nginx(tmp: Path, data: Path) -> Server:
    port = free_port()
    argv = nginx_argv(NGINX, tmp, NGINX_HTTP.format(port=port, data=data))
    log = tmp / "nginx.log"
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_port(port, proc, log)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"nginx: expected one worker, found {children}")
    return Server("nginx (file, 1 worker)", proc, port, int(children[0]), log)


def start_bare(tmp: Path, data: Path) -> Server:
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp / "bare.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE_AIOHTTP, str(data), str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_port(port, proc, log)
    return Server("bare aiohttp", proc, port, proc.pid, log)


def start_proxy(name: str, src: Path, tmp: Path, origin: int, extra: list[str]) -> Server:
    """The proxy of source tree ``src``, warm; a second try on a failed start (the free
    port taken meanwhile)."""
    try:
        return _start_proxy(name, src, tmp / "1", origin, extra)
    except RuntimeError as exc:
        print(f"{exc}; starting again", file=sys.stderr)
        return _start_proxy(name, src, tmp / "2", origin, extra)


def _start_proxy(name: str, src: Path, tmp: Path, origin: int, extra: list[str]) -> Server:
    cache = tmp / "cache"
    cache.mkdir(parents=True)
    cmd = [sys.executable, "-m", "shardcache", "serve", "--cache-dir", str(cache)]
    port = free_port()
    cmd += ["--port", str(port), "--upstream", f"http://127.0.0.1:{origin}", "--min-free", "0"]
    cmd += ["--cache-size", "1G", *extra]
    env = dict(os.environ, PYTHONPATH=str(src))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = tmp / "proxy.log"
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=src)
    try:
        wait_port(port, proc, log, timeout=60)
    except RuntimeError as exc:
        proc.kill()
        raise RuntimeError(f"{name}: {exc}") from None
    for path, size in OBJECTS.values():
        for _ in range(2):
            status, headers, n = get(port, path)
            if status != 200 or n != size:
                raise RuntimeError(f"{name}: GET {path}: {status}, {n} bytes")
        if headers.get("x-cache") != "HIT":
            raise RuntimeError(f"{name}: {path} not a hit: {headers}")
    return Server(name, proc, port, proc.pid, log)


def wrk(port: int, path: str, conns: int, seconds: float) -> int:
    """Requests wrk completed (all of them 200s, or RuntimeError)."""
    out = subprocess.run(
        [WRK, "-t1", f"-c{conns}", f"-d{seconds:g}s", f"http://127.0.0.1:{port}{path}"],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    ).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk on port {port}{path}:\n{out}")
    m = re.search(r"(\d+) requests in", out)
    if not m:
        raise RuntimeError(f"wrk output not understood:\n{out}")
    return int(m.group(1))


def measure(server: Server, path: str, conns: int, seconds: float) -> float:
    """Microseconds of the server's CPU per request over one wrk run."""
    c0 = cpu_seconds(server.pid)
    n = wrk(server.port, path, conns, seconds)
    c1 = cpu_seconds(server.pid)
    return (c1 - c0) / n * 1e6


def profile(server: Server, out: Path, conns: int, seconds: float) -> Path:
    """py-spy's raw (collapsed) profile of ``server`` during one 64 KiB wrk run."""
    raw = out / (re.sub(r"\W+", "-", server.name).strip("-") + ".txt")
    spy = subprocess.Popen(
        [PYSPY, "record", "--nonblocking", "--format", "raw", "-r", "500"]
        + ["-d", str(int(seconds) + 1), "-p", str(server.pid), "-o", str(raw)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    wrk(server.port, OBJECTS["64 KiB"][0], conns, seconds)
    spy.wait(seconds + 60)
    return raw


def top_functions(raw: Path, n: int = 15) -> tuple[int, list[tuple[str, int, int]]]:
    """(samples, [(function, own samples, samples with it on the stack)]) of a collapsed
    py-spy profile, by own samples."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        samples += k
        frames = [re.sub(r" \((.*/)?([^/]+):\d+\)$", r" (\2)", f) for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    return samples, [(f, c, total[f]) for f, c in own.most_common(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="another source tree's proxy to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--profile", type=Path, help="write py-spy profiles here and summarise")
    ap.add_argument(
        "--fast-hits",
        choices=("on", "off", "both"),
        default="both",
        help="this tree's proxy with the fast path for hits on, off, or each (default)",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hitcost-"))
    data = tmp / "data"
    data.mkdir()
    for path, size in OBJECTS.values():
        (data / path[1:]).write_bytes(os.urandom(size))
    servers: list[Server] = []
    try:
        nginx = start_nginx(tmp / "nginx", data)
        servers.append(nginx)
        trees = [("this tree", ROOT)]
        if args.base is not None:
            trees.insert(0, ("base", args.base.resolve()))
        proxies = []
        modes = ["on", "off"] if args.fast_hits == "both" else [args.fast_hits]
        for label, src in trees:
            # the base tree may predate --fast-hits: it runs as it is
            fast = (
                [("", [])]
                if label == "base"
                else [(f", --fast-hits {m}", ["--fast-hits", m]) for m in modes]
            )
            for level, extra in (
                ("default log level", []),
                ("--log-level warning", ["--log-level", "warning"]),
            ):
                for note, flag in fast:
                    name = f"shardcache {label}, {level}{note}"
                    d = tmp / re.sub(r"\W+", "-", name)
                    proxies.append(start_proxy(name, src, d, nginx.port, [*extra, *flag]))
        servers.extend(proxies)
        servers.append(start_bare(tmp / "bare", data))
        order = [*proxies, servers[-1], nginx]
        cases = [(s, size) for s in order for size in OBJECTS]
        got: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for r in range(args.rounds):
            for server, size in cases if r % 2 == 0 else cases[::-1]:
                got[server.name, size].append(
                    measure(server, OBJECTS[size][0], args.conns, args.seconds)
                )
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        load = os.getloadavg()[0]
        print(
            f"µs of server CPU per hit, wrk -t1 -c{args.conns} -d{args.seconds:g}s on one "
            f"object, {args.rounds} interleaved rounds, medians (min–max); load {load:.1f}\n"
        )
        print("| server | " + " | ".join(f"µs CPU per {s} hit" for s in OBJECTS) + " |")
        print("| --- |" + " --- |" * len(OBJECTS))
        for server in order:
            cells = []
            for size in OBJECTS:
                xs = got[server.name, size]
                cells.append(f"{statistics.median(xs):.0f} ({min(xs):.0f}–{max(xs):.0f})")
            print(f"| {server.name} | " + " | ".join(cells) + " |")
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            for server in proxies:
                if "default" not in server.name:
                    continue
                raw = profile(server, args.profile, args.conns, args.seconds)
                samples, top = top_functions(raw)
                print(f"\npy-spy, {server.name}, 64 KiB hits: {samples} samples ({raw})\n")
                print("| function | own % | on stack % |")
                print("| --- | --- | --- |")
                for f, c, t in top:
                    print(f"| `{f}` | {100 * c / samples:.1f} | {100 * t / samples:.1f} |")
    finally:
        for s in servers:
            s.proc.send_signal(signal.SIGTERM)
        for s in servers:
            try:
                s.proc.wait(20)
            except subprocess.TimeoutExpired:
                s.proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
