"""Cache hits: the caching proxy against nginx ``proxy_cache`` in front of one origin, with
wrk as the client, everything on 127.0.0.1.

    .venv/bin/python bench/hits.py                      # 100,000 small entries, 3 rounds
    .venv/bin/python bench/hits.py --entries 20000      # fewer small entries
    .venv/bin/python bench/hits.py --quick              # short run: 5,000 entries, 2 s, 2 rounds
    .venv/bin/python bench/hits.py --out hits.json --profile /tmp/hits-profile.json

Both caches are warm (every object fetched once through each, then a sample checked for
HIT) before anything is timed, and the origin's access log confirms that no timed request
reached it. Every measure runs both servers once per round, the order alternating between
rounds (interleaved, so drift in machine load hits both alike); figures are medians.

1. 64 KiB hits: ``wrk -c64 -t2 -d5s`` on one hot object (``--hot N``: N objects, picked in
   turn by a Lua script). Target: shardcache >= 0.5x nginx req/s.
2. 1 MiB hits: the same. Target >= 0.9x.
3. random hits over ``--entries`` 1 KiB objects (default 100,000; a Lua script picks a
   random path per request). The warm-up of the entries is a pool of keep-alive client
   threads, bounded by ``--warm-timeout``; its duration is reported. Target >= 0.3x.
4. restart to ready: SIGTERM the proxy (wait for it to exit), start it again on the same
   cache directory and time from the spawn to the first 200 of ``GET /-/readyz``
   (target <= 2 s); nginx beside it: spawn to the first HIT on a cached object. And the
   proxy's RSS (``VmRSS``) right after the random-hit rounds (target <= 200 MB).

nginx: ``worker_processes auto``, ``proxy_cache_path ... keys_zone``, ``proxy_cache_valid
200 1d``, ``sendfile on``, ``access_log off``, upstream keepalive. The proxy runs with
``--log-level info`` unless told otherwise: that is its default, at which it writes one
access-log line per request (to a file here); ``--log-level warning`` suppresses them.
``--workers N`` is passed to ``shardcache serve`` only when its ``--help`` lists it.
``--profile FILE`` records the proxy with py-spy during one extra (untimed) 64 KiB wrk run
and prints its top functions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    INTERRUPTED,
    Procs,
    RssSampler,
    check_alive,
    default_python,
    interruptible,
    markdown,
    nginx_argv,
    rotated,
    say,
)
from bench.proxy import (  # noqa: E402
    NGINX,
    ORIGIN_SERVER,
    AiohttpOrigin,
    HttpConn,
    NginxServer,
    Server,
    ShardcacheServer,
)

KIB = 1024
MIB = 1024 * KIB
WRK = shutil.which("wrk") or "/usr/bin/wrk"

# nginx as a cache. No tcp_nopush (nginx's default is off): with it on, a cached 64 KiB
# response stalls ~40 ms per request on loopback (1.6k against 30k req/s at -c64).
# (the http block after the harness's NGINX_HEAD, with worker_connections 4096)
NGINX_CACHE_HTTP = """    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 100000;
    access_log off;
    proxy_cache_path {tmp}/cache levels=1:2 keys_zone=hits:64m max_size=10g
                     inactive=7d use_temp_path=off;
    upstream origin {{ server 127.0.0.1:{origin}; keepalive 32; }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache hits;
            proxy_cache_valid 200 1d;
            proxy_cache_lock on;
            add_header X-Cache-Status $upstream_cache_status;
        }}
    }}
"""

WRK_LUA_HOT = """
local paths = {{{paths}}}
local i = 0
request = function()
    i = i % #paths + 1
    return wrk.format(nil, paths[i])
end
"""

WRK_LUA_RANDOM = """
local n = {n}
local counter = 0
function setup(thread)
    thread:set("id", counter)
    counter = counter + 1
end
function init(args)
    math.randomseed(os.time() * 1009 + 7919 * (id or 0))
end
function request()
    local k = math.random(0, n - 1)
    return wrk.format(nil, string.format("/small/%03d/%06d.bin", math.floor(k / 1000), k))
end
"""


def small_path(k: int) -> str:
    return f"/small/{k // 1000:03d}/{k:06d}.bin"


# ---------------------------------------------------------------------------------------
# servers


def poll_ready(check, timeout: float, what: str, interval: float = 0.01) -> float:
    """Seconds until ``check()`` is true, polled every ``interval``; raises after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def get_status(url: str, timeout: float = 2.0) -> tuple[int | None, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers or {})
    except OSError:
        return None, {}


class NginxCache(NginxServer):
    """nginx ``proxy_cache`` with the config above; ``start`` records ``ready_s``, the
    time from spawn to the first 200 on ``ready_path`` (a HIT when ``want_hit``)."""

    def __init__(self, procs: Procs, tmp: Path, origin_port: int, workers: str):
        super().__init__("nginx", procs, tmp, "", workers)  # type: ignore[arg-type]
        self.origin_port = origin_port
        self.ready_path = "/-/probe"
        self.want_hit = False
        self.ready_s = 0.0

    def start(self) -> None:
        http = NGINX_CACHE_HTTP.format(tmp=self.tmp, origin=self.origin_port, port=self.port)
        argv = nginx_argv(NGINX, self.tmp, http, self.workers, connections=4096)
        self.log = self.tmp / "stderr.log"
        t0 = time.monotonic()
        self.proc = self.procs.start(argv, self.log)

        def ready() -> bool:
            check_alive(self.proc, self.name, self.log)
            code, headers = get_status(self.base + self.ready_path)
            if self.want_hit:
                return code == 200 and headers.get("X-Cache-Status") == "HIT"
            return code is not None

        poll_ready(ready, 30, f"{self.name} on port {self.port}")
        self.ready_s = time.monotonic() - t0


class ShardcacheHits(ShardcacheServer):
    """The proxy as ``python -m shardcache serve``; ``start`` records ``ready_s``, the time
    from spawn to the first 200 of ``/-/readyz``."""

    def __init__(self, procs: Procs, tmp: Path, upstream: str, args: argparse.Namespace):
        super().__init__(procs, tmp, upstream, "default", args.python)
        self.name = "shardcache"
        self.log_level = args.log_level
        self.workers = args.workers
        self.fast_hits = args.fast_hits
        self.cache_size = args.cache_size
        self.ready_s = 0.0

    def argv(self) -> list[str]:
        a = [self.python, "-m", "shardcache", "serve", "--upstream", self.upstream]
        a += ["--cache-dir", str(self.tmp / "cache"), "--cache-size", self.cache_size]
        a += ["--host", "127.0.0.1", "--port", str(self.port)]
        a += ["--log-level", self.log_level, "--grace-period", "2"]
        if self.workers:
            a += ["--workers", str(self.workers)]
        if self.fast_hits:
            a += ["--fast-hits", self.fast_hits]
        return a

    def start(self) -> None:
        (self.tmp / "cache").mkdir(parents=True, exist_ok=True)
        self.log = self.tmp / "stderr.log"
        t0 = time.monotonic()
        self.proc = self.procs.start(self.argv(), self.log)

        def ready() -> bool:
            check_alive(self.proc, self.name, self.log)
            return get_status(self.base + "/-/readyz", timeout=5)[0] == 200

        poll_ready(ready, 120, f"{self.name} on port {self.port}")
        self.ready_s = time.monotonic() - t0


def serve_help_lists(python: str, flag: str) -> bool:
    out = subprocess.run(
        [python, "-m", "shardcache", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(ROOT),
    )
    return flag in out.stdout


def _group(pid: int) -> list[str]:
    """The pids (as /proc names) of every process in ``pid``'s process group."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pid:  # field 5, pgrp
                out.append(p)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _status_kib(path: str, field: str) -> int:
    """A ``Field:   N kB`` line of a /proc file, in KiB (0 when the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def group_pss_kib(pid: int) -> int:
    """Summed Pss (shared pages divided among their processes) of ``pid``'s process group,
    KiB: memory of several worker processes without counting shared pages twice."""
    return sum(_status_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in _group(pid))


def group_rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS of ``pid``, summed VmRSS of every process in its process group), KiB."""
    total = sum(_status_kib(f"/proc/{p}/status", "VmRSS:") for p in _group(pid))
    return _status_kib(f"/proc/{pid}/status", "VmRSS:"), total


# ---------------------------------------------------------------------------------------
# data and warm-up


def make_data(data: Path, entries: int, hot: int) -> dict[str, int]:
    """Files the origin serves: ``hot`` objects of 64 KiB and of 1 MiB, ``entries`` of
    1 KiB (1000 to a directory). Returns path -> size."""
    sizes: dict[str, int] = {}
    for i in range(hot):
        for d, size in (("hot64k", 64 * KIB), ("hot1m", MIB)):
            p = f"/{d}/obj-{i}.bin"
            (data / d).mkdir(parents=True, exist_ok=True)
            (data / p[1:]).write_bytes(os.urandom(size))
            sizes[p] = size
    blob = os.urandom(KIB + 4096)
    for k in range(entries):
        p = small_path(k)
        if k % 1000 == 0:
            (data / p[1:]).parent.mkdir(parents=True, exist_ok=True)
        off = (k * 37) % 4096
        (data / p[1:]).write_bytes(blob[off : off + KIB])
        sizes[p] = KIB
    return sizes


def warm(base: str, paths: list[str], sizes: dict[str, int], threads: int, timeout: float):
    """Fetch every path once with ``threads`` keep-alive connections, bounded by
    ``timeout`` seconds. Returns (seconds, fetched, errors)."""
    host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    done = [0] * threads
    errors: list[str] = []

    def worker(i: int) -> None:
        conn = None
        for p in paths[i::threads]:
            if time.monotonic() > deadline:
                errors.append(f"thread {i}: warm-up deadline passed")
                break
            try:
                if conn is None:
                    conn = HttpConn(host, port, 30)
                code, n, _ = conn.get(p)
                if code != 200 or n != sizes[p]:
                    errors.append(f"{p}: HTTP {code}, {n} bytes")
                else:
                    done[i] += 1
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
    last = t0
    while any(t.is_alive() for t in ts) and time.monotonic() < deadline + 35:
        time.sleep(0.2)
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            n = sum(done)
            say(f"  warm-up {base}: {n} of {len(paths)} after {last - t0:.0f} s")
    if any(t.is_alive() for t in ts):
        errors.append("warm-up threads still running after the deadline")
    return time.monotonic() - t0, sum(done), errors


def count_hits(s: Server, paths: list[str]) -> int:
    """How many of ``paths`` the server answers 200 with a HIT header."""
    n = 0
    for p in paths:
        code, h = get_status(s.base + p, timeout=10)
        if code == 200 and (h.get("X-Cache") or h.get("X-Cache-Status")) == "HIT":
            n += 1
    return n


def log_lines(log: Path) -> int:
    if not log.exists():
        return 0
    with open(log, "rb") as f:
        return sum(buf.count(b"\n") for buf in iter(lambda: f.read(MIB), b""))


# ---------------------------------------------------------------------------------------
# wrk


def parse_wrk(out: str) -> dict:
    res: dict = {"rps": 0.0, "requests": 0, "non2xx": 0, "socket_errors": 0, "latency": {}}
    lines = out.splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("Requests/sec:"):
            res["rps"] = float(s.split()[1])
        elif "requests in" in s:
            res["requests"] = int(s.split()[0])
        elif s.startswith("Non-2xx or 3xx responses:"):
            res["non2xx"] = int(s.split(":")[1])
        elif s.startswith("Socket errors:"):
            res["socket_errors"] = sum(
                int(part.split()[-1]) for part in s.split(":", 1)[1].split(",")
            )
        elif s.startswith("Latency Distribution"):
            for row in lines[i + 1 : i + 5]:
                pct, _, val = row.strip().partition(" ")
                res["latency"][pct] = val.strip()
    return res


def run_wrk(url: str, args: argparse.Namespace, lua: Path | None) -> dict:
    argv = [WRK, f"-t{args.threads}", f"-c{args.connections}", f"-d{args.duration}s"]
    argv += ["--latency", "--timeout", "10s"]
    if lua is not None:
        argv += ["-s", str(lua)]
    argv.append(url)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.duration + 60)
    if p.returncode != 0 or "Requests/sec:" not in p.stdout:
        raise RuntimeError(f"wrk failed ({p.returncode}): {p.stdout[-1000:]} {p.stderr[-1000:]}")
    res = parse_wrk(p.stdout)
    res["errors"] = res["non2xx"] + res["socket_errors"]
    return res


# ---------------------------------------------------------------------------------------
# profile


def profile_top(path: Path, n: int = 15) -> dict:
    """Summary of a py-spy speedscope file: samples per thread group; the top ``n``
    functions of the event-loop thread (MainThread) by inclusive samples (own + child);
    the frames every sample shares (runpy, ``asyncio.run``, the loop) left out; the top
    leaf lines of the other threads. A pool thread that py-spy samples in
    ``_worker`` is waking up for or waiting on its queue, not working: such samples are
    counted apart ("queue")."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]
    keys = [(f["name"], f.get("file", "")) for f in frames]

    def short(file: str) -> str:
        return "/".join(Path(file).parts[-2:]) if file else ""

    groups: dict[str, dict[str, int]] = {}
    incl: dict[tuple[str, str], int] = {}
    own: dict[tuple[str, str], int] = {}
    other: dict[str, int] = {}
    main_total = 0
    # --nonblocking reads some stacks partially: count only the event-loop thread's
    # samples that start at its usual root frame
    roots: dict[int, int] = {}
    for prof in doc["profiles"]:
        if '"MainThread"' in prof.get("name", ""):
            for stack in prof["samples"]:
                if stack:
                    roots[stack[0]] = roots.get(stack[0], 0) + 1
    root = max(roots, key=lambda k: roots[k]) if roots else -1
    partial = 0
    for prof in doc["profiles"]:
        tname = prof.get("name", "").split('"')[1] if '"' in prof.get("name", "") else "?"
        group = tname.rstrip("0123456789").rstrip("_")
        g = groups.setdefault(group, {"threads": 0, "samples": 0, "queue": 0})
        g["threads"] += 1
        for stack in prof["samples"]:
            if not stack:
                continue
            g["samples"] += 1
            leaf = frames[stack[-1]]
            if group == "MainThread":
                if stack[0] != root:
                    partial += 1
                    continue
                main_total += 1
                for k in {keys[i] for i in stack}:
                    incl[k] = incl.get(k, 0) + 1
                own[keys[stack[-1]]] = own.get(keys[stack[-1]], 0) + 1
            elif leaf["name"] == "_worker" and leaf.get("file", "").endswith("thread.py"):
                g["queue"] += 1
            else:
                where = f"{leaf['name']} ({short(leaf.get('file', ''))}:{leaf.get('line')})"
                other[where] = other.get(where, 0) + 1
    top = [
        [
            name,
            short(file),
            f"{100 * v / main_total:.0f}%",
            f"{100 * own.get((name, file), 0) / main_total:.0f}%",
        ]
        for (name, file), v in sorted(incl.items(), key=lambda kv: -kv[1])
        if v < main_total  # not the trunk every sample shares (runpy, asyncio.run, ...)
    ][:n]
    return {
        "groups": groups,
        "main_samples": main_total,
        "main_partial": partial,
        "main_top": top,
        "main_own": [
            [f"{name} ({short(file)})", f"{100 * v / main_total:.0f}%"]
            for (name, file), v in sorted(own.items(), key=lambda kv: -kv[1])[:10]
        ],
        "other_top": sorted(other.items(), key=lambda kv: -kv[1])[:8],
    }


def py_spy() -> str | None:
    cand = Path(sys.executable).parent / "py-spy"
    if cand.exists():
        return str(cand)
    cand = ROOT / ".venv/bin/py-spy"
    return str(cand) if cand.exists() else shutil.which("py-spy")


# ---------------------------------------------------------------------------------------
# the run


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench(args: argparse.Namespace, tmp: Path, procs: Procs) -> dict:
    res: dict = {"env": {}, "cases": {}, "warm": {}, "restart": {}, "rss": {}}
    workers_ok = serve_help_lists(args.python, "--workers")
    if args.workers and not workers_ok:
        say(f"shardcache serve --help does not list --workers: --workers {args.workers} ignored")
        args.workers = 0
    res["env"] = {
        "nproc": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "nginx": subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip(),
        "git": subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        or f"{ROOT} (not a git checkout)",
        "serve_lists_workers": workers_ok,
    }

    t0 = time.monotonic()
    data = tmp / "data"
    sizes = make_data(data, args.entries, args.hot)
    say(
        f"data: {args.hot} x 64 KiB, {args.hot} x 1 MiB, {args.entries} x 1 KiB in {data} "
        f"({time.monotonic() - t0:.1f} s)"
    )

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

    sc = ShardcacheHits(procs, tmp / "shardcache", origin.base, args)
    ngx = NginxCache(procs, tmp / "nginx", origin.port, args.nginx_workers)
    servers: dict[str, Server] = {"shardcache": sc, "nginx": ngx}
    for s in servers.values():
        s.start()
    say("servers: " + ", ".join(f"{s.name} :{s.port}" for s in [origin, sc, ngx]))
    say(f"shardcache argv: {shlex.join(sc.argv())}")

    hot = {
        "64k": [f"/hot64k/obj-{i}.bin" for i in range(args.hot)],
        "1m": [f"/hot1m/obj-{i}.bin" for i in range(args.hot)],
    }
    small = [small_path(k) for k in range(args.entries)]

    # -- warm-up ------------------------------------------------------------------------
    for name, s in servers.items():
        w_hot = warm(s.base, hot["64k"] + hot["1m"], sizes, 2, 60)
        secs, n, errs = warm(s.base, small, sizes, args.warm_threads, args.warm_timeout)
        errs = w_hot[2] + errs
        res["warm"][name] = {
            "seconds": secs,
            "fetched": n,
            "rate": n / secs if secs else 0,
            "errors": errs[:20],
        }
        say(
            f"warm-up {name}: {n} of {args.entries} entries in {secs:.1f} s "
            f"({n / secs:.0f}/s, {args.warm_threads} threads), {len(errs)} errors"
        )
        if errs:
            raise RuntimeError(f"warm-up of {name} failed: " + "; ".join(errs[:5]))
    rng = random.Random(1)
    sample = hot["64k"] + hot["1m"] + rng.sample(small, min(args.check, len(small)))
    for name, s in servers.items():
        h = count_hits(s, sample)
        res["warm"][name]["sample_hits"] = f"{h}/{len(sample)}"
        say(f"  {name}: {h} of {len(sample)} sampled objects answer HIT")
        if h != len(sample):
            say(f"  warning: {name} is not warm")

    # -- wrk cases ----------------------------------------------------------------------
    lua_dir = tmp / "lua"
    lua_dir.mkdir()
    luas: dict[str, Path | None] = {}
    for case in ("64k", "1m"):
        if args.hot > 1:
            luas[case] = lua_dir / f"hot-{case}.lua"
            luas[case].write_text(  # type: ignore[union-attr]
                WRK_LUA_HOT.format(paths=", ".join(f'"{p}"' for p in hot[case]))
            )
        else:
            luas[case] = None
    luas["random"] = lua_dir / "random.lua"
    luas["random"].write_text(WRK_LUA_RANDOM.format(n=args.entries))
    urls = {
        "64k": hot["64k"][0],
        "1m": hot["1m"][0],
        "random": "/",
    }

    order = list(servers)
    for case in ("64k", "1m", "random"):
        runs: dict[str, list[dict]] = {k: [] for k in servers}
        for r in range(args.rounds):
            for name in rotated(order, r):
                s = servers[name]
                before = log_lines(origin_log)
                sampler = RssSampler(s.pid) if name == "shardcache" and s.pid else None
                with sampler or contextlib.nullcontext():
                    w = run_wrk(s.base + urls[case], args, luas[case])
                time.sleep(0.1)
                w["origin_requests"] = log_lines(origin_log) - before
                if sampler:
                    w["peak_rss_kib"] = sampler.peak_kib
                w["loadavg"] = os.getloadavg()[0]
                runs[name].append(w)
                say(
                    f"  {case:6s} round {r + 1} {name:10s} {w['rps']:10.0f} req/s  "
                    f"p50 {w['latency'].get('50%', '?'):>8s} p99 {w['latency'].get('99%', '?'):>8s}"
                    f"  errors {w['errors']}  origin requests {w['origin_requests']}"
                )
        res["cases"][case] = {
            name: {
                "rounds": rs,
                "median_rps": med([w["rps"] for w in rs]),
                "errors": sum(w["errors"] for w in rs),
                "non2xx": sum(w["non2xx"] for w in rs),
                "socket_errors": sum(w["socket_errors"] for w in rs),
                "origin_requests": sum(w["origin_requests"] for w in rs),
            }
            for name, rs in runs.items()
        }
        if case == "random":
            own, group = group_rss_kib(sc.pid)  # type: ignore[arg-type]
            res["rss"]["shardcache"] = {
                "vmrss_kib": own,
                "group_kib": group,
                "group_pss_kib": group_pss_kib(sc.pid),  # type: ignore[arg-type]
                "peak_during_random_kib": max(w.get("peak_rss_kib", 0) for w in runs["shardcache"]),
            }
            res["rss"]["nginx"] = {"group_kib": group_rss_kib(ngx.pid)[1]}  # type: ignore[arg-type]
            say(
                f"  RSS after the random rounds: shardcache {own / 1024:.0f} MiB "
                f"(process group {group / 1024:.0f} MiB), nginx (all processes) "
                f"{res['rss']['nginx']['group_kib'] / 1024:.0f} MiB"
            )
        if case == "64k" and args.profile:
            res["profile"] = profile_run(args, sc, urls[case], luas[case])

    # -- restart to ready ---------------------------------------------------------------
    ngx.ready_path, ngx.want_hit = small[len(small) // 2], True
    rest: dict[str, dict[str, list[float]]] = {k: {"stop": [], "ready": []} for k in servers}
    for r in range(args.rounds):
        for name in rotated(order, r):
            s = servers[name]
            t = time.monotonic()
            s.stop()
            rest[name]["stop"].append(time.monotonic() - t)
            s.start()
            rest[name]["ready"].append(s.ready_s)  # type: ignore[attr-defined]
            say(
                f"  restart round {r + 1} {name:10s} stop {rest[name]['stop'][-1]:.2f} s, "
                f"spawn to ready {s.ready_s:.3f} s"  # type: ignore[attr-defined]
            )
    after = rng.sample(small, min(args.check, len(small)))
    before = log_lines(origin_log)
    hits_after = count_hits(sc, after)
    time.sleep(0.1)
    res["restart"] = {
        name: {
            "stop_s": v["stop"],
            "ready_s": v["ready"],
            "median_ready_s": med(v["ready"]),
            "median_stop_s": med(v["stop"]),
        }
        for name, v in rest.items()
    }
    res["restart"]["shardcache"]["sample_hits_after"] = f"{hits_after}/{len(after)}"
    res["restart"]["shardcache"]["origin_requests_after"] = log_lines(origin_log) - before
    say(f"  after the restarts shardcache answers HIT on {hits_after} of {len(after)} entries")
    res["env"]["loadavg_end"] = os.getloadavg()
    res["shardcache_log_lines"] = log_lines(sc.log)
    return res


def profile_run(args: argparse.Namespace, sc: ShardcacheHits, url: str, lua: Path | None):
    """One extra, untimed wrk run on the proxy while py-spy records it."""
    spy = py_spy()
    if spy is None:
        say("py-spy not found (pip install py-spy): no profile")
        return None
    out = Path(args.profile)
    argv = [spy, "record", "-d", str(args.duration), "-p", str(sc.pid), "-o", str(out)]
    # --nonblocking: pausing ~80 threads for every sample cut the proxy from ~800 to ~140
    # req/s; reading its memory without pausing it perturbs far less
    argv += ["--format", "speedscope", "--nonblocking"]
    if args.workers:
        argv.append("--subprocesses")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)
        w = run_wrk(sc.base + url, args, lua)
        spy_out, _ = p.communicate(timeout=args.duration + 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    if p.returncode != 0 or not out.exists():
        say(f"py-spy failed ({p.returncode}): {spy_out[-500:]}")
        return None
    summary = profile_top(out)
    say(f"  profile run (64k, untimed): {w['rps']:.0f} req/s -> {out}")
    return {"file": str(out), "rps": w["rps"], "seconds": args.duration, **summary}


# ---------------------------------------------------------------------------------------
# report


def met(ok: bool) -> str:
    return "yes" if ok else "NO"


def table(res: dict, args: argparse.Namespace) -> list[list[str]]:
    rows: list[list[str]] = []
    labels = {
        "64k": ("1 64 KiB hits", 0.5),
        "1m": ("2 1 MiB hits", 0.9),
        "random": (f"3 random hits, {args.entries} x 1 KiB", 0.3),
    }
    for case, (label, target) in labels.items():
        c = res["cases"][case]
        a, b = c["shardcache"]["median_rps"], c["nginx"]["median_rps"]
        ratio = a / b if b else float("nan")
        rows.append(
            [
                f"{label}, req/s",
                f"{a:,.0f}",
                f"{b:,.0f}",
                f"{ratio:.2f}x",
                f">= {target}x",
                met(ratio >= target),
            ]
        )
        ea, eb = c["shardcache"]["errors"], c["nginx"]["errors"]
        oa, ob = c["shardcache"]["origin_requests"], c["nginx"]["origin_requests"]
        rows.append(
            [
                f"{case} errors (non-2xx + socket) / origin requests",
                f"{ea} / {oa}",
                f"{eb} / {ob}",
                "",
                "0 / 0",
                met(ea == 0 and oa == 0),
            ]
        )
    w = res["warm"]
    rows.append(
        [
            f"3 warm-up of {args.entries} entries ({args.warm_threads} threads)",
            f"{w['shardcache']['seconds']:.1f} s ({w['shardcache']['rate']:,.0f}/s)",
            f"{w['nginx']['seconds']:.1f} s ({w['nginx']['rate']:,.0f}/s)",
            f"{w['shardcache']['seconds'] / max(w['nginx']['seconds'], 1e-9):.2f}x",
            f"<= {args.warm_timeout:.0f} s",
            met(max(w["shardcache"]["seconds"], w["nginx"]["seconds"]) <= args.warm_timeout),
        ]
    )
    r = res["restart"]
    rs, rn = r["shardcache"]["median_ready_s"], r["nginx"]["median_ready_s"]
    rows.append(
        [
            f"4 restart to ready, {args.entries} entries",
            f"{rs:.3f} s",
            f"{rn:.3f} s (first HIT)",
            f"{rs / rn:.2f}x" if rn else "-",
            "<= 2 s",
            met(rs <= 2.0),
        ]
    )
    rss = res["rss"]["shardcache"]
    # every process of the proxy: with --workers, the parent and its workers
    mb = max(rss["vmrss_kib"], rss.get("group_kib", 0)) * KIB / 1e6
    pss = rss.get("group_pss_kib", 0) * KIB / 1e6
    rows.append(
        [
            "4 proxy RSS after the random hits (all processes)",
            f"{mb:.0f} MB (Pss {pss:.0f} MB; peak of the main process "
            f"{rss['peak_during_random_kib'] * KIB / 1e6:.0f} MB)",
            f"{res['rss']['nginx']['group_kib'] * KIB / 1e6:.0f} MB (all processes)",
            "",
            "<= 200 MB",
            met(mb <= 200),
        ]
    )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=None, help="1 KiB entries (default 100000)")
    p.add_argument("--hot", type=int, default=1, help="hot objects per size for 1 and 2 (1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per measure (default 3)")
    p.add_argument("--duration", type=int, default=None, help="wrk -d, seconds (default 5)")
    p.add_argument("--connections", type=int, default=64, help="wrk -c (default 64)")
    p.add_argument("--threads", type=int, default=2, help="wrk -t (default 2)")
    p.add_argument("--quick", action="store_true", help="5000 entries, 2 s, 2 rounds")
    p.add_argument(
        "--workers", type=int, default=0, help="shardcache serve --workers N (if it has it)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        help="shardcache --log-level (default info, its own default: one access-log line "
        "per request; warning suppresses them)",
    )
    p.add_argument(
        "--fast-hits",
        choices=("on", "off"),
        default=None,
        help="shardcache --fast-hits (default: not passed, the proxy's own default)",
    )
    p.add_argument("--cache-size", default="10G", help="shardcache --cache-size (10G)")
    p.add_argument("--nginx-workers", default="auto", help="nginx worker_processes (auto)")
    p.add_argument("--origin", choices=("nginx", "aiohttp"), default="nginx", help="origin")
    p.add_argument("--warm-threads", type=int, default=16, help="warm-up connections (16)")
    p.add_argument("--warm-timeout", type=float, default=600, help="bound on each warm-up, s (600)")
    p.add_argument("--check", type=int, default=200, help="entries sampled for HIT checks")
    p.add_argument("--profile", default=None, help="py-spy speedscope file (extra 64k run)")
    p.add_argument("--dir", default=None, help="parent of the temporary directory")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--python",
        default=default_python(),
        help="interpreter that runs the proxy (default .venv/bin/python)",
    )
    args = p.parse_args(argv)
    quick = {"entries": 5000, "rounds": 2, "duration": 2}
    full = {"entries": 100_000, "rounds": 3, "duration": 5}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if min(args.entries, args.rounds, args.duration, args.hot, args.warm_threads) < 1:
        p.error("--entries, --rounds, --duration, --hot and --warm-threads must be >= 1")
    if args.entries > 1_000_000:
        p.error("--entries: at most 1,000,000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    for tool in (NGINX, WRK):
        if not os.access(tool, os.X_OK):
            print(f"{tool} is required (apt-get install nginx-light wrk)", file=sys.stderr)
            return 2
    say(f"command: {command}")
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-hits-", dir=args.dir))
    t0 = time.monotonic()
    try:
        with interruptible() as interrupted, procs:
            res = bench(args, tmp, procs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
        f"{args.rounds} rounds (medians), wrk -t{args.threads} -c{args.connections} "
        f"-d{args.duration}s; {res['env']['nproc']} CPUs, load average "
        f"{res['env']['loadavg_start'][0]:.1f} -> {res['env']['loadavg_end'][0]:.1f}; "
        f"code {res['env']['git']}; {res['env']['nginx']}; run took {res['wall_s']:.0f} s"
    )
    print(
        f"shardcache: --log-level {args.log_level}"
        + (
            " (its default: one access-log line per request, to a file)"
            if args.log_level in ("info", "debug")
            else " (no access-log lines)"
        )
        + (f", --workers {args.workers}" if args.workers else ", one process")
        + f"; nginx: worker_processes {args.nginx_workers}, access_log off"
    )
    print()
    print(markdown(["metric", "shardcache", "nginx", "ratio", "target", "met?"], rows))
    prof = res.get("profile")
    if prof:
        print()
        print(
            f"py-spy --nonblocking (100 Hz, {prof['seconds']} s) of shardcache under the 64 KiB wrk load, "
            f"an extra untimed run at {prof['rps']:.0f} req/s; {prof['file']}"
        )
        print(
            "samples by thread group: "
            + ", ".join(
                f"{k} x{g['threads']}: {g['samples']}"
                + (f" ({g['queue']} waiting on the pool queue)" if g["queue"] else "")
                for k, g in prof["groups"].items()
            )
        )
        print(
            f"event-loop thread (MainThread), {prof['main_samples']} whole stacks "
            f"({prof['main_partial']} partial ones left out):"
        )
        print(markdown(["function", "file", "own+child", "own"], prof["main_top"]))
        print(
            "event-loop thread, most own time: "
            + "; ".join(f"{k} {v}" for k, v in prof["main_own"])
        )
        print(
            "other threads, busiest lines (samples): "
            + "; ".join(f"{k} {v}" for k, v in prof["other_top"])
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
