"""Real servers for the proxy tests: an aiohttp origin with fault modes (in a thread with
its own event loop, so blocking clients such as curl and webdataset can use it too) and the
proxy daemon as a subprocess."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


@dataclass
class Fault:
    """How the origin misbehaves for one path."""

    status: int | None = None  # answer this status instead
    hang: bool = False  # accept, then never answer
    truncate_at: int | None = None  # every GET: send this many bytes, then drop
    drop_once_at: int | None = None  # the first GET drops here; later (Range) GETs work
    delay: float = 0.0  # seconds between chunks
    chunk: int = 64 << 10
    etag: bool = True  # send an ETag
    chunked: bool = False  # no Content-Length (Transfer-Encoding: chunked)
    bad_md5: bool = False  # send a wrong Content-MD5
    ignore_range: bool = False  # answer 200 to Range requests
    gate: threading.Event | None = None  # wait for this before sending the body


@dataclass
class Origin:
    """An HTTP origin on 127.0.0.1 serving ``files``; counts requests per path."""

    files: dict[str, bytes] = field(default_factory=dict)
    faults: dict[str, Fault] = field(default_factory=dict)
    gets: Counter = field(default_factory=Counter)
    ranges: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    if_ranges: list[str | None] = field(default_factory=list)  # If-Range of each GET
    port: int = 0
    active: int = 0  # GETs being answered now
    max_active: int = 0  # the most GETs answered at once

    def __post_init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def etag(self, name: str) -> str:
        return '"' + hashlib.md5(self.files[name]).hexdigest() + '"'

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET":
            return await self._answer(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._answer(request)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        fault = self.faults.get(name, Fault())
        if request.method == "GET":
            self.gets[name] += 1
            self.ranges.append(
                (name, request.headers.get("Range"), request.headers.get("If-Match"))
            )
            self.if_ranges.append(request.headers.get("If-Range"))
        if fault.hang:
            await asyncio.sleep(3600)
        if fault.status is not None:
            return web.Response(status=fault.status, text=f"fault {fault.status}\n")
        data = self.files.get(name)
        if data is None:
            return web.Response(status=404, text="not found\n")
        etag = self.etag(name)
        start, status = 0, 200
        headers = {
            "Content-Type": "application/x-tar",
            "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
        }
        if fault.etag:
            headers["ETag"] = etag
        rng = request.headers.get("Range")
        if rng and not fault.ignore_range:
            im = request.headers.get("If-Match")
            if im is not None and im != etag:
                return web.Response(status=412, text="precondition failed\n")
            m = re.match(r"bytes=(\d+)-$", rng)
            assert m, rng
            start, status = int(m.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if fault.bad_md5:
            headers["Content-MD5"] = "AAAAAAAAAAAAAAAAAAAAAA=="
        resp = web.StreamResponse(status=status, headers=headers)
        if not fault.chunked:
            resp.content_length = len(body)
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        if fault.gate is not None:
            while not fault.gate.is_set():
                await asyncio.sleep(0.01)
        cut = None
        if fault.truncate_at is not None:
            cut = fault.truncate_at - start
        elif fault.drop_once_at is not None and self.gets[name] == 1:
            cut = fault.drop_once_at
        limit = len(body) if cut is None else max(0, cut)
        pos = 0
        while pos < limit:
            piece = body[pos : min(limit, pos + fault.chunk)]
            await resp.write(piece)
            pos += len(piece)
            if fault.delay:
                await asyncio.sleep(fault.delay)
        if cut is not None:
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    def start(self) -> Origin:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_route("*", "/{name:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="origin")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("origin did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            for f in self.faults.values():
                if f.gate is not None:
                    f.gate.set()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProxyProcess:
    """``python -m shardcache serve`` as a subprocess on a free port."""

    def __init__(self, cache_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.cache_dir = cache_dir
        self.args = args
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.scheme = "http"  # "https" when the proxy says it serves TLS
        self.log_path = cache_dir.parent / f"proxy-{os.getpid()}-{time.monotonic_ns()}.log"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> ProxyProcess:
        cmd = [
            sys.executable,
            "-m",
            "shardcache",
            "serve",
            "--cache-dir",
            str(self.cache_dir),
            "--port",
            "0",
            *self.args,
        ]
        env = dict(os.environ, **(self.env or {}))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_text()
            m = re.search(r"serving on (https?)://[^:]+:(\d+)", text)
            if m:
                self.scheme, self.port = m.group(1), int(m.group(2))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        self.proc.kill()  # never leave a proxy running behind a failed start
        self.proc.wait(10)
        raise RuntimeError(f"proxy did not start:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._log.close()
        return rc


def raw_request(
    port: int, target: str, method: str = "GET", timeout: float = 10
) -> tuple[int, str]:
    """Send a request line exactly as given (no client-side normalisation)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(
            f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode("latin-1")
        )
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body.decode("utf-8", "replace")


def make_shard(n_samples: int, seed: int = 0, size: int = 1000) -> bytes:
    """A small WebDataset tar shard with .txt and .bin members."""
    import io
    import random
    import tarfile

    rnd = random.Random(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n_samples):
            key = f"sample{seed:03d}{i:05d}"
            for ext, payload in (
                ("txt", f"text {seed} {i}".encode()),
                ("bin", bytes(rnd.getrandbits(8) for _ in range(size))),
            ):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                info.mtime = 1700000000
                tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def aws_env(access_key: str | None, secret_key: str | None, tmp: Path) -> dict[str, str]:
    """This process's environment for a proxy subprocess with an s3:// upstream: the
    given key pair (None: no credentials, unsigned requests) and nothing else of the
    machine's AWS settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if access_key is not None and secret_key is not None:
        env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    env.update(
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp / "no-aws-credentials"),
    )
    return env
