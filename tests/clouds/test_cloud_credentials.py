"""The providers' standard credential chains reach the upstream, and no credential
reaches a log or a client.

GCS: a service-account key file named by ``GOOGLE_APPLICATION_CREDENTIALS`` signs each
request; fake-gcs-server checks no signature, so a gate in front of it does (it verifies
the bearer JWT against the service account's public key and answers 401 otherwise).
Azure: Azurite checks signatures itself: the account key, a SAS token and a connection
string are each enough, a wrong key or SAS is a 403 naming the variables to check.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.data import BUCKET, OBJECTS  # noqa: E402
from support.proxy_helpers import ProxyProcess  # noqa: E402

SMALL = OBJECTS["shards/small.tar"]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


_OURS = ("GOOGLE_", "AZURE_")


def _clean_env(**extra: str) -> dict[str, str]:
    """Only the test's GOOGLE_*/AZURE_* credentials, none of the machine's."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(_OURS)}
    env.update(extra)
    return env


class _Proxy(ProxyProcess):
    """A ProxyProcess that inherits none of this process's GOOGLE_*/AZURE_* variables."""

    def start(self, timeout: float = 30) -> ProxyProcess:
        import os

        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(_OURS)}
        try:
            return super().start(timeout)
        finally:
            os.environ.update(saved)


# -- GCS: a service account file ---------------------------------------------------------


def _service_account(token_uri: str) -> tuple[dict, bytes]:
    """A service account key file's contents and its public key (PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    info = {
        "type": "service_account",
        "project_id": "test",
        "private_key_id": "key-1",
        "private_key": pem,
        "client_email": "reader@test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    return info, public


class _Gate:
    """An HTTP server in front of fake-gcs-server that forwards only requests whose
    bearer token is a JWT signed by the service account's key (401 otherwise)."""

    def __init__(self, upstream_port: int, public_pem: bytes) -> None:
        self.upstream_port = upstream_port
        self.public_pem = public_pem
        self.verified: list[str] = []  # the JWT issuer of each forwarded request
        self.refused = 0
        self.busy = 0  # answer this many more requests 503 (GCS's "slow down")
        self.anonymous = False  # forward unsigned requests too (a public bucket)
        self.extra: dict[str, str] = {}  # header fields added to every answer
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                from google.auth import jwt

                auth = self.headers.get("Authorization", "")
                try:
                    if gate.anonymous and not auth:
                        claims = {"iss": "anonymous"}
                    else:
                        claims = jwt.decode(
                            auth.removeprefix("Bearer "), certs=gate.public_pem, verify=True
                        )
                except Exception:
                    gate.refused += 1
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                gate.verified.append(claims["iss"])
                if gate.busy > 0:
                    gate.busy -= 1
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection("127.0.0.1", gate.upstream_port, timeout=30)
                keep = ("range", "if-match", "if-none-match", "accept-encoding")
                conn.request(
                    self.command,
                    self.path,
                    headers={k: v for k, v in self.headers.items() if k.lower() in keep},
                )
                resp = conn.getresponse()
                body = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                for k, v in gate.extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                conn.close()

            do_GET = do_HEAD = _forward

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gate(gcs, tmp_path):
    info, public = _service_account("http://127.0.0.1:9/token")  # never asked: self-signed
    g = _Gate(gcs.port, public)
    g.key_file = tmp_path / "service-account.json"  # type: ignore[attr-defined]
    g.key_file.write_text(json.dumps(info))  # type: ignore[attr-defined]
    try:
        yield g
    finally:
        g.stop()


def _gcs_proxy(gate: _Gate, tmp: Path, key_file: Path) -> ProxyProcess:
    return _Proxy(
        tmp / "cache",
        "--upstream",
        f"data=gs://{BUCKET}/shards",
        "--gcs-endpoint-url",
        gate.url,
        env=_clean_env(GOOGLE_APPLICATION_CREDENTIALS=str(key_file)),
    ).start()


def test_gcs_service_account_file_signs_the_requests(gate, tmp_path):
    p = _gcs_proxy(gate, tmp_path, gate.key_file)
    try:
        got = _get(p.url + "/data/small.tar")
        log = p.log_text()
        assert got == (200, SMALL), (got[0], got[1][:300], log[-2000:])
    finally:
        p.stop()
    log = p.log_text()  # once stopped: every access line written
    assert gate.verified and set(gate.verified) == {"reader@test.iam.gserviceaccount.com"}
    assert gate.refused == 0
    assert "BEGIN PRIVATE KEY" not in log and "Bearer" not in log


def test_gcs_throttling_is_retried(gate, tmp_path):
    gate.busy = 2
    p = _gcs_proxy(gate, tmp_path, gate.key_file)
    try:
        assert _get(p.url + "/data/small.tar") == (200, SMALL)
        log = p.log_text()
    finally:
        p.stop()
    assert gate.busy == 0
    assert "GCS is throttling or unavailable" in log


@pytest.mark.parametrize("transport", ["threads", "aiohttp"])
def test_gcs_vary_origin_does_not_keep_objects_out_of_the_cache(gate, tmp_path, transport):
    """GCS's XML API answers with ``Vary: Origin`` (CORS bookkeeping): a public bucket's
    objects are still cached, on both GET paths (presigned on threads, obstore)."""
    gate.anonymous = True
    gate.extra = {"Vary": "Origin"}
    p = _Proxy(
        tmp_path / "cache",
        "--upstream",
        f"data=gs://{BUCKET}/shards",
        "--gcs-endpoint-url",
        gate.url,
        "--http-transport",
        transport,
        env=_clean_env(GOOGLE_SKIP_SIGNATURE="true"),
    ).start()
    try:
        caches = []
        for _ in range(2):
            with urllib.request.urlopen(p.url + "/data/small.tar", timeout=30) as resp:
                assert resp.read() == SMALL
                caches.append(resp.headers["X-Cache"])
    finally:
        p.stop()
    assert caches == ["MISS", "HIT"]


def test_gcs_another_key_is_refused_with_a_hint(gate, tmp_path):
    other, _ = _service_account("http://127.0.0.1:9/token")
    key_file = tmp_path / "other.json"
    key_file.write_text(json.dumps(other))
    p = _gcs_proxy(gate, tmp_path, key_file)
    try:
        status, body = _get(p.url + "/data/small.tar")
        log = p.log_text()
    finally:
        p.stop()
    log = p.log_text()  # once stopped: every access line written
    assert status == 403, body
    assert b"GOOGLE_APPLICATION_CREDENTIALS" in body
    assert gate.refused >= 1 and not gate.verified
    assert "eyJ" not in log and b"eyJ" not in body  # no token, in the log or the answer


# -- Azure: account key, SAS, connection string ------------------------------------------


def _az_proxy(azurite, tmp: Path, endpoint: bool = True, **env: str) -> ProxyProcess:
    args = ["--upstream", f"data=az://{azurite.account}/{BUCKET}/shards"]
    if endpoint:
        args += ["--azure-endpoint-url", f"http://127.0.0.1:{azurite.port}/{{account}}"]
    return _Proxy(tmp / "cache", *args, env=_clean_env(**env)).start()


def _sas(azurite, **kw) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    return generate_container_sas(
        azurite.account,
        BUCKET,
        account_key=azurite.key,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
        **kw,
    )


@pytest.mark.parametrize("how", ["account key", "SAS token", "connection string"])
def test_azure_credentials_from_the_environment(azurite, tmp_path, how):
    if how == "account key":
        p = _az_proxy(azurite, tmp_path, AZURE_STORAGE_ACCOUNT_KEY=azurite.key)
    elif how == "SAS token":
        p = _az_proxy(azurite, tmp_path, AZURE_STORAGE_SAS_TOKEN=_sas(azurite))
    else:  # the endpoint too comes from the connection string
        p = _az_proxy(
            azurite,
            tmp_path,
            endpoint=False,
            AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string,
        )
    try:
        assert _get(p.url + "/data/small.tar") == (200, SMALL)
        status, body = _get(p.url + "/data?list-type=2&prefix=dir/")
        assert status == 200 and b"<Key>dir/x one+two.tar</Key>" in body
    finally:
        p.stop()
    assert azurite.client().get_blob_client(BUCKET, "shards/small.tar").download_blob().readall()


@pytest.mark.parametrize("how", ["account key", "SAS token"])
def test_azure_refused_credentials_are_403_and_never_shown(azurite, tmp_path, how):
    if how == "account key":
        secret = "A" * 20 + azurite.key[20:]
        p = _az_proxy(azurite, tmp_path, AZURE_STORAGE_ACCOUNT_KEY=secret)
    else:
        sas = _sas(azurite)
        sig = sas.split("sig=")[1].split("&")[0]
        secret = sig
        # signed for another permission than it claims: Azurite refuses the signature
        p = _az_proxy(azurite, tmp_path, AZURE_STORAGE_SAS_TOKEN=sas.replace("sp=rl", "sp=r"))
    try:
        status, body = _get(p.url + "/data/small.tar")
        log = p.log_text()
    finally:
        p.stop()
    log = p.log_text()  # once stopped: every access line written
    assert status == 403, body
    assert b"AZURE_STORAGE_ACCOUNT_KEY" in body and b"AZURE_STORAGE_SAS_TOKEN" in body
    assert secret not in log and secret.encode() not in body
    assert "sig=" not in log and b"sig=" not in body


@pytest.mark.parametrize("transport", ["threads", "aiohttp"])
def test_gcs_retries_count_each_try_once(gate, tmp_path, transport):
    """A throttled gs:// request is retried by one loop: ``--retries N`` means N more
    tries of each request the proxy makes, not N more of each of N more."""
    asked = []
    for retries in (0, 1):
        gate.busy = 1000  # always "slow down"
        gate.verified.clear()
        p = _Proxy(
            tmp_path / f"cache{retries}",
            "--upstream",
            f"data=gs://{BUCKET}/shards",
            "--gcs-endpoint-url",
            gate.url,
            "--http-transport",
            transport,
            "--retries",
            str(retries),
            env=_clean_env(GOOGLE_APPLICATION_CREDENTIALS=str(gate.key_file)),
        ).start()
        try:
            status, _ = _get(p.url + "/data/small.tar")
        finally:
            p.stop()
        assert status >= 500, status
        asked.append(len(gate.verified))
    assert asked[0] > 0, asked
    assert asked[1] == 2 * asked[0], asked
