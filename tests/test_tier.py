"""The shared tier on loopback: nginx (docker/tier/shardcache-tier.conf, consistent hash of
the path) over 3 shardcache proxies, 2 sidecars whose upstream is nginx, and an origin that
counts GETs. Reading the dataset from both sidecars costs one origin GET per shard;
stopping one tier proxy mid-run loses no request and costs at most one extra origin GET
per shard it owned."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.opshelpers import (
    Origin,
    ProxyProcess,
    free_port,
    http_get,
    make_shard,
    running,
    wait_healthy,
)
from support.wait import wait_until

from shardcache.store import Store

REPO = Path(__file__).resolve().parent.parent
TIER_CONF = REPO / "docker" / "tier" / "shardcache-tier.conf"

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NGINX is None,
        reason="nginx is not installed (Debian: apt-get install -y nginx-light); "
        "the shared-tier test needs it",
    ),
]

N1, N2 = 12, 12
D1 = {f"/ds1/shard-{i:04d}.tar": make_shard(i, 256 * 1024) for i in range(N1)}
D2 = {f"/ds2/shard-{i:04d}.tar": make_shard(1000 + i, 512 * 1024) for i in range(N2)}


def render_tier_conf(tier_ports: list[int], listen_port: int) -> str:
    """docker/tier/shardcache-tier.conf with loopback addresses, directives unchanged."""
    text = TIER_CONF.read_text()
    servers = re.findall(r"^([ \t]*server[ \t]+)([^\s{;]+)([ \t][^;\n]*;|;)", text, flags=re.M)
    assert len(servers) == len(tier_ports), "one server line per tier proxy expected"
    for (lead, addr, rest), port in zip(servers, tier_ports, strict=True):
        text = text.replace(f"{lead}{addr}{rest}", f"{lead}127.0.0.1:{port}{rest}", 1)
    text, n = re.subn(
        r"^(\s*)listen\s+8080;", rf"\g<1>listen 127.0.0.1:{listen_port};", text, flags=re.M
    )
    assert n == 1
    return text


def nginx_main_conf(tmp: Path, tier_conf: Path) -> str:
    for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / d).mkdir(exist_ok=True)
        (tmp / d).chmod(0o777)
    return f"""
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 512; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tier_conf};
}}
"""


def owners(tier: list[ProxyProcess], paths: list[str], origin_url: str) -> dict[str, int]:
    """Which tier proxy holds each path (index into ``tier``), from their stores."""
    wait_idle(tier)
    out: dict[str, int] = {}
    for i, p in enumerate(tier):
        with Store(p.cache_dir, reconcile=False) as store:  # read-only look at a live cache
            for e in store.entries():
                path = e.url[len(origin_url) :]
                if path in paths:
                    assert path not in out, f"{path} is cached by two tier proxies"
                    out[path] = i
    return out


def wait_idle(proxies: list[ProxyProcess], timeout: float = 30.0) -> None:
    """Wait until no running proxy has a download in flight: a client may have every byte
    of a shard a moment before the proxy has verified and committed it."""
    deadline = time.monotonic() + timeout
    for p in proxies:
        if p.proc is None or p.proc.poll() is not None:
            continue
        while True:
            with urllib.request.urlopen(f"{p.url}/-/stats", timeout=5) as r:
                if json.load(r)["in_flight"] == 0:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.url}: downloads still in flight after {timeout}s")
            time.sleep(0.05)


def served_by(proxy: ProxyProcess, paths: list[str]) -> set[str]:
    """Paths ``proxy`` answered 200 for, from its access log (one line per request)."""
    got = set(re.findall(r'"GET (\S+)" 200 ', proxy.output(tail=None)))
    return got & set(paths)


def read_all(sidecars, dataset, workers=4, on_done=None) -> list[str]:
    """GET every shard from every sidecar concurrently; return the failures."""
    failures: list[str] = []
    lock = threading.Lock()

    def one(job):
        sc, path = job
        status, body, _ = http_get(sc.url + path, timeout=60)
        with lock:
            if status != 200 or body != dataset[path]:
                failures.append(f"{sc.url}{path}: {status}, {len(body)} bytes")
        if on_done:
            on_done()

    jobs = [(sc, path) for path in dataset for sc in sidecars]
    with ThreadPoolExecutor(workers * len(sidecars)) as pool:
        list(pool.map(one, jobs))
    return failures


def test_tier_one_origin_get_per_shard_and_failover(tmp_path, capsys):
    with Origin({**D1, **D2}, delay=0.01) as origin:
        tier = [
            ProxyProcess(
                origin.url,
                tmp_path / f"tier{i}" / "cache",
                name=f"tier{i}",
                extra_args=["--grace-period", "5"],
            )
            for i in range(3)
        ]
        with running(*tier):
            nginx_port = free_port()
            conf = tmp_path / "tier.conf"
            conf.write_text(render_tier_conf([p.port for p in tier], nginx_port))
            main = tmp_path / "nginx.conf"
            main.write_text(nginx_main_conf(tmp_path, conf))
            test = subprocess.run(
                [NGINX, "-t", "-c", str(main), "-p", str(tmp_path)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert test.returncode == 0, test.stderr
            nginx = subprocess.Popen(
                [NGINX, "-c", str(main), "-p", str(tmp_path)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            tier_url = f"http://127.0.0.1:{nginx_port}"
            try:
                wait_healthy(tier_url, nginx, timeout=15)
                sidecars = [
                    ProxyProcess(tier_url, tmp_path / f"node{i}" / "cache", name=f"node{i}")
                    for i in range(2)
                ]
                with running(*sidecars):
                    _run_scenario(origin, tier, sidecars, tier_url, capsys)
            finally:
                nginx.send_signal(signal.SIGQUIT)
                try:
                    nginx.wait(15)
                except subprocess.TimeoutExpired:
                    nginx.kill()
                    nginx.wait(5)


def _run_scenario(origin, tier, sidecars, tier_url, capsys):
    # 1. both nodes read the whole dataset at once: one origin GET per shard
    failures = read_all(sidecars, D1)
    assert not failures, failures
    d1_gets = {p: origin.gets[p] for p in D1}
    assert set(d1_gets.values()) == {1}, d1_gets
    own1 = owners(tier, list(D1), origin.url)
    assert set(own1) == set(D1), "every shard is on exactly one tier proxy"
    spread = [list(own1.values()).count(i) for i in range(3)]
    assert sum(1 for n in spread if n) >= 2, f"consistent hashing spread {spread}"

    # 2. a second dataset; one tier proxy is stopped half way through
    victim = max(range(3), key=lambda i: spread[i])
    done = [0]
    stopped = threading.Event()
    lock = threading.Lock()

    def on_done():
        with lock:
            done[0] += 1
            trigger = done[0] == N2 and not stopped.is_set()  # half of the 2 x N2 reads
            if trigger:
                stopped.set()
        if trigger:
            threading.Thread(target=tier[victim].stop, daemon=True).start()

    failures = read_all(sidecars, D2, workers=2, on_done=on_done)
    assert stopped.is_set()
    assert not failures, f"requests lost while tier proxy {victim} stopped: {failures}"
    wait_until(lambda: tier[victim].proc.poll() is not None, 30, 0.1, "the tier proxy's exit")
    assert tier[victim].proc.returncode == 0, tier[victim].output()
    d2_gets = {p: origin.gets[p] for p in D2}
    # Who owned what: the tier proxy that answered for the shard (its access log).
    served_victim = served_by(tier[victim], list(D2))

    def served_live_now() -> set[str]:
        return set().union(*(served_by(p, list(D2)) for i, p in enumerate(tier) if i != victim))

    # the live proxies write their access lines up to a second after the requests
    wait_until(lambda: served_victim | served_live_now() == set(D2), 10, 0.1, "access lines")
    served_live = served_live_now()
    assert served_victim | served_live == set(D2)
    for path, n in d2_gets.items():
        assert 1 <= n <= 2, (path, n)
        if n == 2:
            assert path in served_victim, f"{path} fetched twice but the stopped proxy never had it"
    # What the stopped proxy kept: shards it served may be missing from its store when the
    # stop came between the last byte sent and the commit (a wasted download, no harm).
    own2_victim = set(owners([tier[victim]], list(D2), origin.url))
    assert own2_victim <= served_victim

    # 3. a new node reads the first dataset through the tier: the stopped proxy's shards
    #    move to their next owner on the hash ring (one more origin GET each), the rest hit
    for path, data in D1.items():
        status, body, _ = http_get(tier_url + path, timeout=60)
        assert status == 200 and body == data, path
    d1_after = {p: origin.gets[p] for p in D1}
    for path, n in d1_after.items():
        assert n == (2 if own1[path] == victim else 1), (path, n, own1[path], victim)

    with capsys.disabled():
        print(
            "\ntier origin GETs: dataset 1 read by 2 nodes: "
            f"{sum(d1_gets.values())} for {N1} shards (max {max(d1_gets.values())}/shard); "
            f"shards per tier proxy {spread}; "
            f"dataset 2 with tier proxy {victim} stopped mid-run: {sum(d2_gets.values())} "
            f"for {N2} shards ({sum(n - 1 for n in d2_gets.values())} extra, "
            f"{len(served_victim)} served by the stopped proxy before it stopped, "
            f"{len(own2_victim)} of them kept in its cache); "
            f"dataset 1 re-read by a new node: {sum(d1_after.values()) - sum(d1_gets.values())} "
            f"extra for the {spread[victim]} shards the stopped proxy owned"
        )
