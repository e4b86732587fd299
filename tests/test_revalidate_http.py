"""``--revalidate http``: RFC 9111 freshness against a real origin and the proxy as a
subprocess. A stored answer is reused without a request to the origin while it is fresh
(``max-age`` here), asked about once it is stale; a hit's ``Age`` adds the origin's;
``must-revalidate`` forbids a stale copy when the origin cannot be asked. ``--revalidate
always`` still asks on every use, fresh or not."""

from __future__ import annotations

import os
import signal
import time

import pytest
from aiohttp import web
from proxy_helpers import ProxyProcess
from test_revalidate import (
    RevalOrigin,
    Seen,
    assert_revalidated,
    get,
    got,
    settle,
    sha,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KiB = 1 << 10


class FieldsOrigin(RevalOrigin):
    """A :class:`RevalOrigin` that adds header fields per object (``Age``...) to its
    answers, 304s included."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.extra: dict[str, dict[str, str]] = {}

    def stop(self) -> None:
        """Stop serving (once: a test may stop it before the fixture does)."""
        if not getattr(self, "stopped", False):
            self.stopped = True
            super().stop()

    async def _answer(self, request: web.Request, name: str, rec: Seen) -> web.StreamResponse:
        resp = await super()._answer(request, name, rec)
        resp.headers.update(self.extra.get(name, {}))
        return resp


@pytest.fixture
def origin():
    o = FieldsOrigin().start()
    yield o
    o.stop()


@pytest.fixture
def proxies(tmp_path):
    started: list[ProxyProcess] = []

    def start(*args: str) -> ProxyProcess:
        p = ProxyProcess(tmp_path / f"cache{len(started)}", *args).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop(signal.SIGKILL)


def wait_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def test_fresh_answers_are_reused_without_the_origin_and_stale_ones_revalidated(origin, proxies):
    v1, v2 = os.urandom(200 * KiB), os.urandom(200 * KiB)
    origin.put("a.tar", v1)
    origin.cache_control["a.tar"] = "max-age=2"
    p = proxies("--upstream", origin.url, "--revalidate", "http")
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    cached = time.monotonic()
    settle(p.port)
    for _ in range(3):
        assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert time.monotonic() - cached < 1.5, "too slow to test hits within max-age=2"
    assert len(origin.seen) == 1  # fresh: not one request to the origin

    wait_until(cached + 2.5)  # stale now: one conditional request, answered 304
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)
    confirmed = time.monotonic()
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))  # fresh again for 2 s
    assert time.monotonic() - confirmed < 1.5
    assert origin.since(n) == []

    # the object changes at the origin: seen once the stored answer is stale
    origin.put("a.tar", v2)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
    wait_until(confirmed + 2.5)
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v2))
    assert origin.since(n)[0].conditional and origin.since(n)[0].status == 200
    settle(p.port)
    n = len(origin.seen)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v2))
    assert origin.since(n) == []


def test_the_upstream_age_counts(origin, proxies):
    """The origin's ``Age`` is part of a hit's ``Age`` (RFC 9111 4.2.3), and an ``Age``
    past ``max-age`` makes the answer stale from the start."""
    v1, v2 = os.urandom(64 * KiB), os.urandom(64 * KiB)
    origin.put("old.tar", v1)
    origin.cache_control["old.tar"] = "max-age=3600"
    origin.extra["old.tar"] = {"Age": "100"}
    origin.put("older.tar", v2)
    origin.cache_control["older.tar"] = "max-age=60"
    origin.extra["older.tar"] = {"Age": "600"}
    p = proxies("--upstream", origin.url, "--revalidate", "http")
    for name, data in (("old.tar", v1), ("older.tar", v2)):
        st, h, body = get(p.port, f"/{name}")
        assert st == 200 and h["X-Cache"] == "MISS" and body == data
        assert h["Age"] == origin.extra[name]["Age"]  # passed on with the miss
    settle(p.port)
    n = len(origin.seen)
    st, h, body = get(p.port, "/old.tar")
    assert st == 200 and h["X-Cache"] == "HIT" and body == v1
    assert 100 <= int(h["Age"]) < 130, h["Age"]
    assert origin.since(n) == []
    # stale on arrival (600 s old, 60 s fresh): every use asks the origin
    st, h, body = get(p.port, "/older.tar")
    assert st == 200 and h["X-Cache"] == "HIT" and body == v2
    assert int(h["Age"]) >= 600
    assert_revalidated(origin.since(n), origin.etag("older.tar"), 304)


def test_always_still_asks_on_every_use_of_a_fresh_answer(origin, proxies):
    v1 = os.urandom(100 * KiB)
    origin.put("a.tar", v1)
    origin.cache_control["a.tar"] = "max-age=3600"
    p = proxies("--upstream", origin.url, "--revalidate", "always")
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    settle(p.port)
    for _ in range(2):
        n = len(origin.seen)
        assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))
        assert_revalidated(origin.since(n), origin.etag("a.tar"), 304)


@pytest.mark.parametrize("directive", ["must-revalidate", "proxy-revalidate", None])
def test_a_stale_copy_is_refused_when_the_origin_is_gone_if_it_says_so(origin, proxies, directive):
    """Stale and the origin unreachable: ``must-revalidate`` and ``proxy-revalidate``
    answer an error (RFC 9111 4.2.4); without them the stale copy is served."""
    v1 = os.urandom(64 * KiB)
    origin.put("a.tar", v1)
    origin.cache_control["a.tar"] = "max-age=1" + (f", {directive}" if directive else "")
    p = proxies("--upstream", origin.url, "--revalidate", "http", "--retries", "0")
    assert got(p.port, "/a.tar") == (200, "MISS", sha(v1))
    cached = time.monotonic()
    settle(p.port)
    assert got(p.port, "/a.tar") == (200, "HIT", sha(v1))  # fresh
    origin.stop()
    wait_until(cached + 1.5)
    st, h, body = get(p.port, "/a.tar")
    if directive is None:
        assert (st, h.get("X-Cache"), body) == (200, "HIT", v1)
    else:
        assert st in (502, 504) and body != v1, (st, h)


def test_stale_while_revalidate_serves_at_once_and_asks_behind(origin, proxies):
    """Stale within its ``stale-while-revalidate`` window: served from the cache at once,
    the origin asked in the background; what it says serves the next request."""
    v1, v2 = os.urandom(64 * KiB), os.urandom(64 * KiB)
    origin.put("w.tar", v1)
    origin.cache_control["w.tar"] = "max-age=1, stale-while-revalidate=60"
    p = proxies("--upstream", origin.url, "--revalidate", "http")
    assert got(p.port, "/w.tar") == (200, "MISS", sha(v1))
    cached = time.monotonic()
    settle(p.port)
    origin.put("w.tar", v2)
    wait_until(cached + 1.5)
    n = len(origin.seen)
    assert got(p.port, "/w.tar") == (200, "HIT", sha(v1))  # stale, served at once
    deadline = time.monotonic() + 10
    while len(origin.seen) == n and time.monotonic() < deadline:
        time.sleep(0.05)
    behind = origin.since(n)
    assert behind and behind[0].conditional and behind[0].status == 200, behind
    settle(p.port)
    assert got(p.port, "/w.tar") == (200, "HIT", sha(v2))  # the new version, stored
    assert len(origin.since(n)) == 1
