"""Credentials for http(s) upstreams: a bearer token or a header per upstream, read from
the environment or a file (re-read when it changes), sent to that upstream's host only
(never across a redirect to a CDN), never in a log line, an error or /-/stats."""

from __future__ import annotations

import os

import pytest
from support.faultclient import fetch, settle
from support.huborigin import Hub
from support.proxy_helpers import ProxyProcess

from proxy.credentials import SecretSource, parse_credential

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MiB = 1 << 20
TOKEN = "hf_SECRETtoken0123456789"
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")


def test_parse():
    c = parse_credential("hub=env:HF_TOKEN", bearer=True)
    assert (c.upstream, c.header, str(c.source), c.bearer) == (
        "hub",
        "Authorization",
        "env:HF_TOKEN",
        True,
    )
    c = parse_credential("X-Api-Key:file:/run/secrets/key", bearer=False)
    assert (c.upstream, c.header, str(c.source)) == (None, "X-Api-Key", "file:/run/secrets/key")
    with pytest.raises(ValueError, match="literal"):
        parse_credential("hub=hf_literal", bearer=True)
    with pytest.raises(ValueError):
        parse_credential("Bad Header:env:X", bearer=False)


def test_file_secret_is_reread_when_it_changes(tmp_path):
    f = tmp_path / "token"
    f.write_text("one\n")
    src = SecretSource.parse(f"file:{f}")
    assert src.read() == "one"
    f.write_text("two-longer\n")
    assert src.read() == "two-longer"
    assert "one" not in repr(src) and "two" not in repr(src)


class Gated(Hub):
    """The hub refuses resolve requests without the token; the CDN must never see it."""

    async def _hub(self, request):  # type: ignore[override]
        if (
            request.path.startswith("/datasets/")
            and request.headers.get("Authorization") != f"Bearer {TOKEN}"
        ):
            from aiohttp import web

            self.hub.log.append((request.method, request.path, "refused"))
            return web.Response(status=401, text="Invalid credentials")
        return await super()._hub(request)

    async def _cdn(self, request):  # type: ignore[override]
        self.cdn_auth = getattr(self, "cdn_auth", []) + [request.headers.get("Authorization")]
        return await super()._cdn(request)


def test_bearer_token_reaches_the_hub_only(tmp_path):
    data = os.urandom(MiB)
    with Gated({"org/ds/train/a.tar": data}) as hub:
        base = ("--upstream", f"hub={hub.hub.url}", "--redirect-host", "127.0.0.2", *COMMON)
        # without the token the hub refuses: 403 (the proxy's own credentials refused)
        p = ProxyProcess(tmp_path / "c0", *base).start()
        try:
            r = fetch(p.port, "/hub/datasets/org/ds/resolve/main/train/a.tar")
            assert r.status == 403, r.describe()
        finally:
            p.stop(timeout=10)
        p = ProxyProcess(
            tmp_path / "c1",
            *base,
            "--upstream-auth",
            "hub=env:HUB_TOKEN_FOR_TEST",
            env={"HUB_TOKEN_FOR_TEST": TOKEN},
        ).start()
        try:
            for expect in ("MISS", "HIT"):
                r = fetch(p.port, "/hub/datasets/org/ds/resolve/main/train/a.tar")
                assert r.status == 200 and r.body == data, r.describe()
                assert r.headers.get("x-cache") == expect
                settle(p)
            stats = fetch(p.port, "/-/stats").body.decode()
            metrics = fetch(p.port, "/metrics").body.decode()
        finally:
            p.stop(timeout=10)
        assert getattr(hub, "cdn_auth", None) and set(hub.cdn_auth) == {None}, hub.cdn_auth
        for text in (p.log_text(), stats, metrics):
            assert TOKEN not in text


def test_a_missing_secret_stops_startup_naming_the_flag(tmp_path):
    with Hub({}) as hub:
        p = ProxyProcess(
            tmp_path / "c",
            "--upstream",
            hub.hub.url,
            "--upstream-auth",
            f"file:{tmp_path / 'absent'}",
        )
        with pytest.raises(RuntimeError) as info:
            p.start(timeout=15)
        assert "--upstream-auth" in str(info.value)
        assert "absent" in str(info.value)


def test_a_redirect_to_another_port_of_the_host_gets_no_credentials(tmp_path):
    """The upstream's own host name is not its origin: a redirect to another port of it
    (another service) or from https to http (the clear) must not carry the token."""
    from aiohttp import web
    from huborigin import Server

    data = os.urandom(MiB)
    seen: list[str | None] = []

    async def other(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        return web.Response(body=data, headers={"ETag": '"o1"'})

    target = Server("127.0.0.1", other).start()

    async def upstream(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"{target.url}{request.path}")

    first = Server("127.0.0.1", upstream).start()
    p = ProxyProcess(
        tmp_path / "c",
        "--upstream",
        first.url,
        "--upstream-auth",
        "env:TOKEN_FOR_TEST",
        *COMMON,
        env={"TOKEN_FOR_TEST": TOKEN},
    ).start()
    try:
        r = fetch(p.port, "/a.tar")
        assert r.status == 200 and r.body == data, r.describe()
    finally:
        p.stop(timeout=10)
        first.stop()
        target.stop()
    assert seen and set(seen) == {None}, seen


def test_credentials_follow_the_same_origin_or_an_upgrade_to_https():
    from proxy.upstream.redirects import _may_carry_credentials as carry

    assert carry("https://hub.example/a", "https://hub.example/b?x=1")
    assert carry("https://hub.example/a", "https://HUB.example:443/b")
    assert carry("http://hub.example/a", "https://hub.example/b")
    assert not carry("https://hub.example/a", "http://hub.example/b")
    assert not carry("https://hub.example/a", "https://hub.example:8443/b")
    assert not carry("http://hub.example:8080/a", "https://hub.example/b")
    assert not carry("https://hub.example/a", "https://cdn.example/b")
