"""An upstream that cannot be reached is seen: a WARNING with the reason (one per
upstream and interval), a counter by upstream and reason, the last error in /-/stats,
``shardcache stats`` and the probes' bodies, and a warning at startup."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from proxy_helpers import ProxyProcess, free_port
from support.faultclient import check_rule, fetch, settle, stats
from support.origins import BadOrigin, Version
from support.proxy import downloads_done
from support.wait import until

from proxy.policy import Upstream
from proxy.upstream.errors import PassedAnswer, socket_error, status_error
from proxy.upstream_health import UpstreamHealth, classify
from shardcache.errors import (
    DigestMismatch,
    DownloadFailed,
    NotFound,
    UpstreamCut,
    UpstreamError,
    UpstreamTimeout,
)


def _raised(make, cause: BaseException) -> BaseException:
    """``make(cause)`` raised from ``cause``, as the transports raise their errors."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise make(exc) from exc
    except BaseException as err:  # noqa: BLE001 - handed back to the test
        return err


def test_reasons_are_a_small_fixed_set():
    url = "http://127.0.0.1:1/x.tar"
    refused = _raised(
        lambda e: socket_error(url, e, body=False, connecting=True),
        ConnectionRefusedError(111, "x"),
    )
    assert classify(refused) == "refused"
    dns = _raised(
        lambda e: socket_error(url, e, body=False, connecting=True),
        socket.gaierror(-2, "Name or service not known"),
    )
    assert classify(dns) == "dns"
    assert classify(UpstreamTimeout(f"upstream {url} timed out")) == "timeout"
    reset = _raised(lambda e: socket_error(url, e, body=True), ConnectionResetError(104, "reset"))
    assert classify(reset) == "reset"
    assert classify(UpstreamCut(f"upstream {url}: body broke off")) == "cut"
    assert classify(DownloadFailed(url, DigestMismatch("md5"))) == "digest"
    answer = PassedAnswer(500, "Internal Server Error", (), b"oops")
    assert classify(status_error(url, 500, "Internal Server Error", answer)) == "http_5xx"
    assert classify(status_error(url, 502, "Bad Gateway")) == "http_5xx"
    assert classify(status_error(url, 503, "Slow Down")) == "throttled"
    assert classify(status_error(url, 403, "Forbidden")) == "http_4xx"
    # not a failure of the upstream: the object is missing, or the download was cancelled
    assert classify(status_error(url, 404, "Not Found")) is None
    assert classify(NotFound("no")) is None
    assert classify(asyncio.CancelledError()) is None
    assert classify(UpstreamError("something else")) == "other"
    # the words of the error, not those of its URL
    assert classify(UpstreamError("upstream https://ssl.example/timeout/x.tar failed")) == "other"
    assert classify(UpstreamError(f"upstream {url}: [SSL: CERTIFICATE_VERIFY_FAILED]")) == "tls"


def test_warnings_are_rate_limited_per_upstream(caplog):
    now = [100.0]
    ups = [Upstream(None, "http://a.example/data"), Upstream("b", "http://b.example/bucket")]
    health = UpstreamHealth(ups, interval=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="shardcache.upstream")
    for i in range(5):
        now[0] = 100.0 + i * 0.5
        health.failed("http://a.example/data/s.tar", UpstreamTimeout("timed out"))
    health.failed("http://b.example/bucket/t.tar", UpstreamTimeout("timed out"))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2  # one for each upstream
    assert lines[0].startswith("upstream http://a.example/data failing: timeout")
    assert lines[1].startswith("upstream b=http://b.example/bucket failing: timeout")
    now[0] = 111.0  # the next interval: one more line, counting those not logged
    health.failed("http://a.example/data/s.tar", UpstreamTimeout("timed out"))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 3 and "(4 more failures" in lines[2]
    snap = {s["upstream"]: s for s in health.snapshot()}
    assert snap["http://a.example/data"]["failures"] == {"timeout": 6}
    assert snap["http://a.example/data"]["state"] == "down"
    health.succeeded("http://a.example/data/s.tar")  # the upstream answers again
    snap = {s["upstream"]: s for s in health.snapshot()}
    assert snap["http://a.example/data"]["state"] == "up"
    assert snap["http://a.example/data"]["last_error"]["reason"] == "timeout"
    assert any("answers again" in r.getMessage() for r in caplog.records)
    assert "b=http://b.example/bucket" in health.lines()
    assert "http://a.example/data:" not in health.lines()


def test_one_exception_is_counted_once_and_labels_are_bounded():
    health = UpstreamHealth([Upstream(None, "http://a.example/data")])
    exc = UpstreamTimeout("timed out")
    health.failed("http://a.example/data/s.tar", exc)
    health.failed("http://a.example/data/s.tar", exc)  # the fetcher and the download
    for i in range(100):  # --allow-host URLs: scheme://host, at most MAX_HOSTS of them
        health.failed(f"https://h{i}.example/x.tar", UpstreamTimeout("timed out"))
    snap = {s["upstream"]: s for s in health.snapshot()}
    assert snap["http://a.example/data"]["failures"] == {"timeout": 1}
    assert len(snap) <= 1 + 32 + 1
    assert snap["other"]["failures"]["timeout"] == 100 - 32


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_unreachable_upstream_is_reported(tmp_path):
    port = free_port()  # nothing listens there
    upstream = f"http://user:pa55word@127.0.0.1:{port}/data"
    p = ProxyProcess(tmp_path / "cache", "--upstream", upstream).start()
    try:
        n = 12
        for _ in range(n):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(
                    f"{p.url}/train-000000.tar?X-Amz-Signature=s1gnature", timeout=10
                )
            assert err.value.code == 502
        shown = f"http://127.0.0.1:{port}/data"  # no user:password@
        # probes still pass (the cache can serve its hits) and say what is wrong
        for route in ("healthz", "readyz"):
            with urllib.request.urlopen(f"{p.url}/-/{route}", timeout=10) as r:
                text = r.read().decode()
            assert r.status == 200
            assert f"upstream {shown}: down since" in text and "(refused:" in text, text
        with urllib.request.urlopen(f"{p.url}/-/stats", timeout=10) as r:
            stats = json.load(r)
        [u] = stats["upstream_health"]
        assert u["upstream"] == shown and u["state"] == "down"
        assert u["failures"] == {"refused": n + 1}  # the startup probe and each request
        assert u["last_error"]["reason"] == "refused"
        assert "train-000000.tar" in u["last_error"]["message"]
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", u["last_error"]["at"])
        with urllib.request.urlopen(f"{p.url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert (
            f'shardcache_upstream_failures_total{{reason="refused",upstream="{shown}"}} '
            f"{float(n + 1)}" in metrics
        )
        out = subprocess.run(
            [sys.executable, "-m", "shardcache", "stats", "--proxy", p.url],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        row = [x for x in out.stdout.splitlines() if x.startswith(f"upstream_health.{shown} ")]
        assert row and f"down: refused {n + 1}; last error " in row[0], out.stdout
        assert "train-000000.tar?X-Amz-Signature=[REDACTED] unreachable" in row[0]
        everything = json.dumps(stats) + metrics + out.stdout + text
    finally:
        p.stop(signal.SIGTERM)
    log = p.log_text()
    warnings = [line for line in log.splitlines() if " WARNING shardcache.upstream:" in line]
    # the startup probe's line; the requests that followed within the interval add none
    assert len(warnings) == 1, log
    assert f"upstream {shown} failing: refused:" in warnings[0]
    assert "cannot be reached at startup" in warnings[0]
    for secret in ("pa55word", "s1gnature"):
        assert secret not in log and secret not in everything


@pytest.fixture
def origin():
    from proxy_helpers import Origin

    o = Origin().start()
    yield o
    o.stop()


async def test_failures_after_the_body_opened_are_counted_once(aiohttp_client, tmp_path, origin):
    """A body cut past the retries fails the download, not the fetcher's open: the
    download's end reports it (once, however many clients followed it)."""
    import aiohttp
    from proxy_helpers import Fault

    from proxy.app import METRICS, make_app
    from proxy.config import Settings
    from proxy.context import UPSTREAM_HEALTH

    origin.files["cut.tar"] = b"c" * (300 << 10)
    origin.faults["cut.tar"] = Fault(truncate_at=100 << 10, delay=0.01)
    origin.files["err.tar"] = b"e" * 100
    origin.faults["err.tar"] = Fault(status=500)
    settings = Settings(
        cache_dir=tmp_path / "cache",
        upstreams=(Upstream(None, origin.url),),
        cache_size=100 << 20,
        read_timeout=5.0,
        retries=0,
        retry_backoff=0.01,
    )
    c = await aiohttp_client(make_app(settings))

    async def cut() -> None:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with c.get("/cut.tar") as r:
                await r.read()

    await asyncio.gather(cut(), cut())
    await downloads_done(c.server.app, 2)  # the download's end is reported when its task is done
    health = c.server.app[UPSTREAM_HEALTH]
    [u] = await until(
        lambda: [u for u in health.snapshot() if u["failures"]], 2, what="the cut reported"
    )
    assert u["failures"] == {"cut": 1} and u["state"] == "down"
    r = await c.get("/missing.tar")  # an answer about the object: the upstream is up
    assert r.status == 404
    [u] = health.snapshot()
    assert u["state"] == "up" and u["failures"] == {"cut": 1}
    r = await c.get("/err.tar")
    assert r.status == 500  # the upstream's answer, passed on
    [u] = health.snapshot()
    assert u["failures"] == {"cut": 1, "http_5xx": 1} and u["state"] == "down"
    assert u["last_error"]["reason"] == "http_5xx"
    m = c.server.app[METRICS].upstream_failures
    assert m.labels(upstream=origin.url, reason="cut")._value.get() == 1
    r = await c.get("/-/healthz")
    assert r.status == 200 and f"upstream {origin.url}: down since" in await r.text()


def _health(port: int) -> dict:
    [u] = stats(port)["upstream_health"]
    return u


def test_a_failed_end_probe_counts_as_an_upstream_failure(tmp_path):
    """A close-delimited body is confirmed by a ranged probe of its last byte before it
    is cached; the upstream resetting that probe is a failure of the upstream like any
    other (the body is served, not cached)."""
    data = os.urandom(256 << 10)
    with BadOrigin() as o:
        o.add(
            "/obj.tar",
            versions=[Version(data, etag='"p-1"', last_modified="Mon, 01 Jan 2024 00:00:00 GMT")],
            framing="close",
            cut_at=len(data) - 1,  # the probe's one byte: never sent
            cut_on="ranged",
            cut_mode="rst",
        )
        p = ProxyProcess(
            tmp_path / "cache", "--upstream", o.url, "--retries", "0", "--min-free", "0"
        ).start()
        try:
            r = fetch(p.port, "/obj.tar")
            assert r.status == 200 and r.body == data, r.describe()
            assert settle(p)["entries"] == 0  # unconfirmed: not cached
            probes = [g for g in o.log("/obj.tar", "GET") if g.range]
            assert probes and probes[0].ended == "cut-rst", probes
            u = _health(p.port)
            assert sum(u["failures"].values()) == 1, u
            assert set(u["failures"]) <= {"reset", "cut"}, u
            assert "obj.tar" in u["last_error"]["message"], u
            # no validator to pin a probe to: nothing is asked, nothing counted
            o.add("/anon.tar", versions=[Version(data)], framing="close")
            r = fetch(p.port, "/anon.tar")
            assert r.status == 200 and r.body == data, r.describe()
            settle(p)
            assert not [g for g in o.log("/anon.tar", "GET") if g.range]
            assert _health(p.port)["failures"] == u["failures"]
        finally:
            p.stop()


def test_a_failed_read_ahead_of_a_download_counts_as_an_upstream_failure(tmp_path):
    """A Range far ahead of a running download is read straight from the upstream
    (``--cold-range fast``); that read failing (reset past its resumes) is a failure of
    the upstream: counted, its message kept. The client of that range sees a broken
    answer, never a clean short one."""
    size = 6 << 20
    start = 5 << 20
    data = os.urandom(size)
    with BadOrigin() as o:
        o.add(
            "/big.tar",
            versions=[Version(data, etag='"b-1"', last_modified="Mon, 01 Jan 2024 00:00:00 GMT")],
            rate=1 << 20,  # the download takes 6 s: the range stays far ahead of it
            cut_at=start + (64 << 10),
            cut_on="ranged",
            cut_mode="rst",
        )
        p = ProxyProcess(
            tmp_path / "cache",
            "--upstream",
            o.url,
            "--retries",
            "1",
            "--min-free",
            "0",
            "--grace-period",
            "1",
        ).start()
        whole = threading.Thread(target=fetch, args=(p.port, "/big.tar"), daemon=True)
        try:
            whole.start()
            for _ in range(100):  # until the download is running
                if o.log("/big.tar", "GET"):
                    break
                time.sleep(0.05)
            time.sleep(0.2)
            r = fetch(p.port, "/big.tar", headers={"Range": f"bytes={start}-{size - 1}"})
            assert not check_rule(r, [data], range_start=start), r.describe()
            ranged = [g for g in o.log("/big.tar", "GET") if g.range_start == start]
            assert ranged, [g.range for g in o.log("/big.tar", "GET")]
            u = _health(p.port)
            assert sum(u["failures"].values()) >= 1, u
            assert set(u["failures"]) <= {"reset", "cut"}, u
            assert "big.tar" in u["last_error"]["message"], u
        finally:
            p.stop()
            whole.join(10)
