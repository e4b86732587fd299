"""Fixtures shared by the test modules; the helpers they are built on live in
:mod:`support` (origins, the proxy subprocess, wait_until, test data).

- ``origin``: the aiohttp :class:`support.origins.Origin`, empty, started and stopped.
  A module whose tests read another origin under that name overrides it, e.g.
  ``def origin(bad_origin): return bad_origin`` (pytest's fixture override).
- ``bad_origin``: a :class:`support.origins.BadOrigin` (misbehaves on purpose).
- ``transport``: the name of each http transport in turn
  (:data:`support.faultclient.TRANSPORTS`).
- ``proxy_args``: the flags the ``proxy`` fixture adds after ``--upstream ORIGIN``: the
  fault tests' :data:`support.faultclient.COMMON` and the transport's. Modules override
  it to use flags of their own.
- ``proxy``: the proxy subprocess in front of ``origin`` with ``proxy_args``.
- ``proxies``: a factory, ``proxies(*args, cache_dir=None, env=None, name="cache")``
  starts ``shardcache serve *args`` with its cache in ``cache_dir`` (default
  ``tmp_path / name``); every proxy it started is killed at teardown.
- ``rig``: tmpfs mounts for store faults and the proxies on them, torn down in order.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.faultclient import COMMON, TRANSPORTS
from support.origins import BadOrigin, Origin
from support.proxy import ProxyProcess
from support.store_faults import Rig


@pytest.fixture
def origin() -> Iterator[Origin]:
    o = Origin().start()
    yield o
    o.stop()


@pytest.fixture
def bad_origin() -> Iterator[BadOrigin]:
    with BadOrigin() as o:
        yield o


@pytest.fixture(params=list(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def proxy_args(transport: str) -> tuple[str, ...]:
    return (*COMMON, *TRANSPORTS[transport])


@pytest.fixture
def proxy(origin, proxy_args: tuple[str, ...], tmp_path) -> Iterator[ProxyProcess]:
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *proxy_args).start()
    try:
        yield p
    finally:
        p.stop(timeout=10)


@pytest.fixture
def proxies(tmp_path) -> Iterator[Callable[..., ProxyProcess]]:
    started: list[ProxyProcess] = []

    def start(
        *args: str,
        cache_dir: Path | None = None,
        env: dict[str, str] | None = None,
        name: str = "cache",
    ) -> ProxyProcess:
        p = ProxyProcess(cache_dir or tmp_path / name, *args, env=env).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop(signal.SIGKILL)


@pytest.fixture
def rig(tmp_path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()
