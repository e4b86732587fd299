"""SIGTERM and Ctrl-C: the proxy exits within the grace period it was given (plus a
second at most), a second signal stops it at once with nothing partial committed, a
response cut off is logged with the status it had sent, and ``shardcache prefetch``
ends a Ctrl-C with its summary and says what the proxy keeps doing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from proxy_helpers import Fault, Origin, ProxyProcess

from shardcache.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SIZE = 4 << 20
# 16 KiB every 0.5 s: the 4 MiB shard would take two minutes; the reader stalls on it


@pytest.fixture
def origin():
    o = Origin().start()
    for i in range(4):
        o.files[f"s{i}.tar"] = os.urandom(SIZE)
        o.faults[f"s{i}.tar"] = Fault(delay=0.5, chunk=16 << 10)
    o.files["hang.tar"] = b"h" * 1000
    o.faults["hang.tar"] = Fault(hang=True)
    yield o
    o.stop()


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _wait_for(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def _parts(cache: Path) -> list[str]:
    return [n for n in os.listdir(cache) if n.endswith(".part")]


def _reader(url: str, procs: list) -> subprocess.Popen:
    """A client reading a shard of the slow origin through the proxy."""
    p = subprocess.Popen(["curl", "-sS", "-o", os.devnull, "--max-time", "60", url])
    procs.append(p)
    return p


def _nothing_committed(cache: Path) -> None:
    assert _parts(cache) == []
    assert [n for n in os.listdir(cache) if not n.startswith(".")] == []
    with Store(cache, reconcile=False) as store:
        assert list(store.entries()) == []


def _exit_seconds(proc: subprocess.Popen, since: float, bound: float) -> float:
    try:
        proc.wait(bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"still running {bound:.1f} s after the signal")
    return time.monotonic() - since


def test_sigterm_exits_within_the_grace_period(origin, tmp_path, procs):
    cache = tmp_path / "cache"
    p = ProxyProcess(cache, "--upstream", origin.url, "--grace-period", "2").start()
    try:
        reader = _reader(f"{p.url}/s0.tar", procs)
        waiting = _reader(f"{p.url}/hang.tar", procs)  # the upstream never answers
        _wait_for(lambda: _parts(cache) and origin.gets["hang.tar"])
        time.sleep(0.3)
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        took = _exit_seconds(p.proc, t0, 10.0)
    finally:
        p.stop(signal.SIGKILL)
    # the grace period, not twice it (responses, then downloads), nor its aiohttp double
    assert 1.8 <= took <= 3.0, f"exited {took:.2f} s after SIGTERM with --grace-period 2"
    assert p.proc.returncode == 0
    assert reader.wait(10) != 0  # the reader saw a cut, never a clean end
    log = p.log_text()
    # the response cut off is logged with the status it had sent, marked as cut off
    line = [x for x in log.splitlines() if '"GET /s0.tar"' in x]
    assert len(line) == 1 and re.search(r'"GET /s0\.tar" 200 MISS \d+ [\d.]+s cut-off$', line[0])
    assert " 500 " not in line[0]
    # one cut off before its status was sent: 499, as nginx logs a request left unanswered
    line = [x for x in log.splitlines() if '"GET /hang.tar"' in x]
    assert len(line) == 1 and re.search(r'"GET /hang\.tar" 499 NONE 0 [\d.]+s cut-off$', line[0])
    assert waiting.wait(10) != 0
    _nothing_committed(cache)


def test_a_second_signal_stops_at_once(origin, tmp_path, procs):
    cache = tmp_path / "cache"
    p = ProxyProcess(cache, "--upstream", origin.url, "--grace-period", "30").start()
    try:
        readers = [_reader(f"{p.url}/s{i}.tar", procs) for i in range(2)]
        _wait_for(lambda: len(_parts(cache)) == 2)
        p.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert p.proc.poll() is None  # the first one drains: readers may still finish
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGINT)
        took = _exit_seconds(p.proc, t0, 5.0)
    finally:
        p.stop(signal.SIGKILL)
    assert took < 2.0, f"exited {took:.2f} s after the second SIGINT"
    assert p.proc.returncode == 0
    assert all(r.wait(10) != 0 for r in readers)
    assert "SIGINT again: stopping now" in p.log_text()
    _nothing_committed(cache)  # the downloads were cancelled, their partial files gone


def test_workers_drain_on_ctrl_c_and_stop_on_the_second(origin, tmp_path, procs):
    """Ctrl-C reaches the whole process group (parent and workers): the first one is one
    request to drain, not two, and the second stops every worker at once."""
    cache = tmp_path / "cache"
    log_path = tmp_path / "workers.log"
    with open(log_path, "wb") as log:
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardcache",
                "serve",
                "--cache-dir",
                str(cache),
                "--port",
                "0",
                "--workers",
                "2",
                "--upstream",
                origin.url,
                "--grace-period",
                "30",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's job is
        )
    procs.append(proxy)
    m = None
    deadline = time.monotonic() + 60
    while m is None and time.monotonic() < deadline and proxy.poll() is None:
        m = re.search(r"serving on http://[^:]+:(\d+) \(2 workers\)", log_path.read_text())
        time.sleep(0.05)
    assert m, log_path.read_text()
    url = f"http://127.0.0.1:{m.group(1)}"
    reader = _reader(f"{url}/s0.tar", procs)
    _wait_for(lambda: _parts(cache))
    os.killpg(proxy.pid, signal.SIGINT)
    time.sleep(1.5)
    assert proxy.poll() is None, log_path.read_text()  # draining, for up to 30 s
    assert reader.poll() is None  # its response goes on
    t0 = time.monotonic()
    os.killpg(proxy.pid, signal.SIGINT)
    took = _exit_seconds(proxy, t0, 6.0)
    assert took < 3.0, f"exited {took:.2f} s after the second Ctrl-C"
    assert reader.wait(10) != 0
    _nothing_committed(cache)


def test_prefetch_ctrl_c_prints_a_summary(origin, tmp_path, procs):
    cache = tmp_path / "cache"
    origin.files["ready.tar"] = b"r" * 1000  # one shard that ends before the Ctrl-C
    p = ProxyProcess(cache, "--upstream", origin.url, "--grace-period", "1").start()
    try:
        pre = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardcache",
                "prefetch",
                "--proxy",
                p.url,
                "--concurrency",
                "2",
                f"{origin.url}/{{ready,s0,s1,s2,s3}}.tar",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(pre)
        _wait_for(lambda: len(_parts(cache)) == 2)
        time.sleep(0.5)
        pre.send_signal(signal.SIGINT)
        out, err = pre.communicate(timeout=20)
        # what it says goes on does: the proxy still downloads the two shards
        with urllib.request.urlopen(f"{p.url}/-/stats", timeout=10) as r:
            assert json.load(r)["in_flight"] == 2
    finally:
        p.stop(signal.SIGKILL)
    assert pre.returncode == 130, err
    text = out + err
    assert "interrupted: 1 of 5 shards ended" in text, text
    assert re.search(r"total\s+1\b", out), out  # the summary table of what ended
    assert "interrupted; 1 of 5 shards done" in err
    assert "The proxy keeps downloading the 2 shards being fetched" in err
    assert "the 2 not yet asked for are not fetched" in err
    assert err.count("still downloading at the proxy:") == 2
