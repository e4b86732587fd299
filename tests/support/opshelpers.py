"""Real servers for the deployment and operator-tool tests: a counting origin and proxy
subprocesses (``shardcache serve``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .data import pseudo_random_bytes as make_shard
from .proxy import free_port
from .wait import wait_until

REPO = Path(__file__).resolve().parents[2]

__all__ = [
    "Origin",
    "ProxyProcess",
    "free_port",
    "http_get",
    "make_shard",
    "running",
    "wait_healthy",
]


class Origin:
    """An HTTP origin on 127.0.0.1 serving ``files`` (path → bytes), counting GETs per path.

    ``delay`` seconds are slept between 64 KiB chunks (a slow origin keeps downloads in
    flight long enough to interleave events with them).
    """

    def __init__(self, files: Mapping[str, bytes], delay: float = 0.0) -> None:
        self.files = dict(files)
        self.delay = delay
        self.gets: Counter[str] = Counter()
        self.lock = threading.Lock()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _head(self) -> bytes | None:
                data = origin.files.get(self.path)
                if data is None:
                    body = b"no such shard\n"
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command == "GET":
                        self.wfile.write(body)
                    return None
                self.send_response(200)
                self.send_header("Content-Type", "application/x-tar")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", '"' + hashlib.md5(data).hexdigest() + '"')
                self.end_headers()
                return data

            def do_HEAD(self) -> None:
                self._head()

            def do_GET(self) -> None:
                with origin.lock:
                    origin.gets[self.path] += 1
                data = self._head()
                if data is None:
                    return
                try:
                    for i in range(0, len(data), 65536):
                        self.wfile.write(data[i : i + 65536])
                        if origin.delay:
                            time.sleep(origin.delay)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Origin:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def http_get(url: str, timeout: float = 30.0) -> tuple[int, bytes, dict[str, str]]:
    """GET ``url``: (status, body, headers); HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode} before healthy")
        with urllib.request.urlopen(f"{url}/-/healthz", timeout=2) as resp:
            return resp.status == 200

    try:
        wait_until(healthy, timeout, interval=0.1, ignore=(urllib.error.URLError, OSError))
    except AssertionError as exc:
        raise TimeoutError(f"{url}/-/healthz not healthy after {timeout} s ({exc})") from None


class ProxyProcess:
    """``shardcache serve`` as a subprocess on 127.0.0.1 (output to ``log``)."""

    def __init__(
        self,
        upstream: str | Sequence[str],
        cache_dir: Path,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        name: str = "proxy",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cache_dir = Path(cache_dir)
        self.log = self.cache_dir.parent / f"{name}.log"
        ups = [upstream] if isinstance(upstream, str) else list(upstream)
        self.argv = [
            sys.executable,
            "-m",
            "shardcache",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--cache-dir",
            str(cache_dir),
        ]
        for u in ups:
            self.argv += ["--upstream", u]
        self.argv += list(extra_args)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProxyProcess:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=self._logf, stderr=subprocess.STDOUT, cwd=REPO
        )
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n--- {self.log}:\n{self.output()}") from None

    def output(self, tail: int | None = 4000) -> str:
        """The process's log (its last ``tail`` characters; None for all)."""
        if not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._logf.close()
        return self.proc.returncode


@contextlib.contextmanager
def running(*proxies: ProxyProcess) -> Iterator[None]:
    """Start all proxies (in parallel), wait until healthy, stop them all at the end."""
    try:
        for p in proxies:
            p.start()
        for p in proxies:
            p.wait_healthy()
        yield
    finally:
        for p in proxies:
            p.stop(timeout=15)
