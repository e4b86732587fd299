"""A file-size limit (RLIMIT_FSIZE) as the store's write fault: needs no root and no
mount, so the pass-through rule is checked on every machine, not only where a tmpfs can
be mounted. Writes past the limit fail with EFBIG, as they would against a quota."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import resource
import signal
import urllib.request

import pytest
from support.proxy_helpers import Fault, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MiB = 1 << 20
LIMIT = 6 * MiB


def start_limited(cache_dir, *args: str) -> ProxyProcess:
    """The proxy with RLIMIT_FSIZE (inherited from this process for the moment of the
    spawn; the proxy writes its log file too, which stays far below the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        return ProxyProcess(cache_dir, *args).start()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def get(url: str) -> tuple[int | None, str | None, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.headers.get("X-Cache"), r.read(), ""
    except Exception as exc:  # noqa: BLE001 - an aborted response is an outcome here
        return None, None, b"", repr(exc)


def test_a_write_refused_mid_download_still_serves_every_client_whole(origin, tmp_path):
    big = os.urandom(16 * MiB)
    small = os.urandom(1 * MiB)
    origin.files.update({"big.tar": big, "small.tar": small})
    origin.faults["big.tar"] = Fault(delay=0.002)
    p = start_limited(tmp_path / "cache", "--upstream", origin.url, "--min-free", "0")
    try:
        assert get(f"{p.url}/small.tar")[:3] == (200, "MISS", small)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(get, [f"{p.url}/big.tar"] * 4))
        for status, cache, body, err in results:
            assert (status, err) == (200, "")
            assert hashlib.sha256(body).digest() == hashlib.sha256(big).digest()
            assert cache in ("MISS", "COALESCED")
        assert not [n for n in os.listdir(tmp_path / "cache") if n.endswith(".part")]
        st = json.load(urllib.request.urlopen(f"{p.url}/-/stats", timeout=10))
        assert st["reserved"] == 0
        # (the probe may already have found the store writable again: small files fit)
        assert st["store"]["errors"] >= 1 and st["store"]["errno"] in ("EFBIG", None)
        metrics = urllib.request.urlopen(f"{p.url}/metrics", timeout=10).read().decode()
        assert 'shardcache_store_errors_total{errno="EFBIG",op="write"}' in metrics
        # what was cached before still is; the refused object was not committed
        assert get(f"{p.url}/small.tar")[:3] == (200, "HIT", small)
        assert get(f"{p.url}/big.tar")[2] == big
        assert "EFBIG" in p.log_text() and str(tmp_path / "cache") in p.log_text()
    finally:
        p.stop(signal.SIGKILL)
