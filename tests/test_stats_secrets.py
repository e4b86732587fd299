"""What ``/-/stats`` keeps of an upstream's failures names no secret, however the
upstream words its error.

An origin may echo what it was sent into its answer: the credential the proxy sent
(``--upstream-auth``, ``--upstream-header``), a presigned URL's signature, anything in
the path. The last error of each upstream (``upstream_health``, also in ``/-/healthz``
and the WARNING lines) is redacted by shape (``Bearer ...``, ``X-Amz-Signature=...``)
and by value: every secret the proxy was configured with (the admin token, upstream
credentials, the AWS secrets of its environment) and the signature values of the URL
that failed, wherever they appear in the message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from support.origins import Origin
from support.proxy import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ADMIN = "adm1n-t0ken-value-0001"
AUTH = "hf_upstreamTokenValue0002"
HEADER = "origin-pass-value-0003"
AWS = "aws/Secret+Key0004value"
SIGNATURE = "5ig0005deadbeefcafe"
TOKEN = "sess10nT0ken0006"
SECRETS = (ADMIN, AUTH, HEADER, AWS, SIGNATURE, TOKEN)


class EchoOrigin(Origin):
    """Answers 500 with a reason phrase and a body that repeat, bare (no field name, no
    ``Bearer``), what the request carried: the proxy's credentials, the query's values,
    the path; and the AWS secret it was told (an origin that knows too much)."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "").removeprefix("Bearer ")
        words = [auth, request.headers.get("X-Origin-Pass", ""), *request.query.values()]
        words += [request.path, AWS]
        echoed = " ".join(w for w in words if w)
        return web.Response(status=500, reason=f"refused {echoed}", text=f"refused {echoed}\n")


@pytest.fixture
def origin():
    o = EchoOrigin().start()
    yield o
    o.stop()


def read(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def echo_proxy(origin: Origin, tmp_path, **env: str) -> ProxyProcess:
    """A proxy in front of ``origin`` that sends it credentials from the environment
    (``--upstream-auth``, ``--upstream-header``) and knows an AWS secret: each one
    echoed back by the origin."""
    return ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        origin.url,
        "--upstream-auth",
        "env:ECHO_AUTH",
        "--upstream-header",
        "X-Origin-Pass:env:ECHO_HEADER",
        "--retries",
        "0",
        "--min-free",
        "0",
        env={"ECHO_AUTH": AUTH, "ECHO_HEADER": HEADER, "AWS_SECRET_ACCESS_KEY": AWS, **env},
    ).start()


def test_an_upstreams_echoed_secrets_are_redacted_in_stats_and_logs(origin, tmp_path):
    p = echo_proxy(origin, tmp_path, SHARDCACHE_ADMIN_TOKEN=ADMIN)
    try:
        query = f"X-Amz-Signature={SIGNATURE}&X-Amz-Credential={TOKEN}&n=1"
        for path in (f"/a/{ADMIN}/shard.tar", f"/b/shard.tar?{query}"):
            status, _ = read(p.url + path)
            assert status == 500, path  # the upstream's answer, passed on
            _, stats = read(p.url + "/-/stats")
            [u] = json.loads(stats)["upstream_health"]
            message = u["last_error"]["message"]
            assert "answered 500" in message and "[REDACTED]" in message, message
            assert "shard.tar" in message, message  # what failed is still named
            for secret in SECRETS:
                assert secret not in stats, f"{secret} in /-/stats: {message}"
        _, healthz = read(p.url + "/-/healthz")
        assert "answered 500" in healthz
    finally:
        p.stop()
    log = p.log_text()
    assert "failing: http_5xx" in log, log[-2000:]
    for secret in SECRETS:
        assert secret not in healthz, f"{secret} in /-/healthz"
        assert secret not in log, f"{secret} in the log"


def test_a_credential_rotated_since_startup_is_redacted_too(origin, tmp_path):
    """``--upstream-auth file:PATH`` is re-read when the file changes: the value the
    proxy sends now is the one redacted, not only the one it started with."""
    secret = tmp_path / "token"
    secret.write_text("hf_firstTokenValue0007\n")
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        origin.url,
        "--upstream-auth",
        f"file:{secret}",
        "--retries",
        "0",
        "--min-free",
        "0",
    ).start()
    try:
        assert read(p.url + "/one.tar")[0] == 500
        secret.write_text("hf_rotatedTokenValue0008-longer\n")  # another size: re-read
        assert read(p.url + "/two.tar")[0] == 500
        _, stats = read(p.url + "/-/stats")
        [u] = json.loads(stats)["upstream_health"]
        assert "two.tar" in u["last_error"]["message"], u
        assert "hf_rotatedTokenValue0008" not in stats, u["last_error"]["message"]
        assert "[REDACTED]" in u["last_error"]["message"]
    finally:
        p.stop()


def test_an_upstream_error_passed_to_a_client_names_no_configured_secret(origin, tmp_path):
    """The upstream's error answer is passed on (status, fields, body) with the proxy's
    account in ``X-Shardcache-Error``; an origin that echoes the proxy's own credentials
    must not hand them to the client: the account is redacted, a field or a body that
    holds a configured secret is withheld."""
    p = echo_proxy(origin, tmp_path)
    try:
        for method in ("GET", "HEAD"):
            req = urllib.request.Request(p.url + "/shard.tar", method=method)
            try:
                urllib.request.urlopen(req, timeout=10)
                raise AssertionError("expected the upstream's 500")
            except urllib.error.HTTPError as exc:
                status, fields, body = exc.code, exc.headers, exc.read()
                reason = str(exc.reason)
            assert status == 500
            shown = "\n".join([reason, *(f"{k}: {v}" for k, v in fields.items())])
            shown += "\n" + body.decode()
            assert "answered 500" in fields["X-Shardcache-Error"], shown
            for secret in (AUTH, HEADER, AWS):
                assert secret not in shown, f"{secret} reached the client ({method}): {shown}"
            if method == "GET":
                assert "withheld" in fields["X-Shardcache-Error"], shown
    finally:
        p.stop()
