"""The proxy daemon as a subprocess (started, waited on until it serves, stopped), and its
bookkeeping read back: ``/-/stats``, the wait until nothing is in flight (for an
in-process app too) and the digests recorded with its entries."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from shardcache.store import Store

from .wait import until, wait_until


def free_port() -> int:

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
        proc = self.proc

        def serving() -> re.Match[str] | None:
            text = self.log_text()
            m = re.search(r"serving on (https?)://[^:]+:(\d+)", text)
            if m is None and proc.poll() is not None:
                raise RuntimeError(f"proxy exited {proc.returncode}:\n{text}")
            return m

        try:
            m = wait_until(serving, timeout, what="the proxy's 'serving on' line")
        except AssertionError:
            proc.kill()  # never leave a proxy running behind a failed start
            proc.wait(10)
            raise RuntimeError(f"proxy did not start:\n{self.log_text()}") from None
        self.scheme, self.port = m.group(1), int(m.group(2))
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, pattern: str, timeout: float = 10) -> str:
        """The log, once the regex ``pattern`` matches in it: access-log lines are
        written up to a second after their requests (``--access-log buffered``)."""
        return wait_until(
            lambda: re.search(pattern, text := self.log_text()) and text,
            timeout,
            what=lambda: f"{pattern!r} in the log:\n{self.log_text()[-3000:]}",
        )

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


def call(
    proxy: ProxyProcess,
    method: str,
    path: str,
    body: object | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    """``method path`` on ``proxy``: (status, the body as JSON, or as text when it is not
    JSON, headers). ``body`` goes as it is when bytes, as JSON otherwise."""
    if body is None or isinstance(body, bytes):
        data = body
    else:
        data = json.dumps(body).encode()
    req = urllib.request.Request(proxy.url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        raw, status, hdrs = exc.read(), exc.code, dict(exc.headers)
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text), hdrs
    except ValueError:
        return status, text, hdrs


class Pinned:
    """A keep-alive connection, and so a conversation with the one worker that accepted it.

    It never reconnects on its own (``auto_open = 0``): a connection the server closed is
    an error here, not a silent move to another worker."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.conn.connect()
        self.conn.auto_open = 0
        self.pid = self.stats()["pid"]

    def get(self, path: str, headers: dict[str, str] | None = None):
        self.conn.request("GET", path, headers=headers or {})
        r = self.conn.getresponse()
        body = r.read()
        assert not r.will_close, f"{path}: the server closed a keep-alive connection"
        return r.status, r.headers, body

    def stats(self) -> dict:
        status, _, body = self.get("/-/stats")
        assert status == 200, body
        return json.loads(body)

    def close(self) -> None:
        self.conn.close()


def pin_connections(
    connect: Callable[[], http.client.HTTPConnection],
    per_worker: int,
    workers: int = 2,
    tries: int = 400,
) -> dict[int, list[Pinned]]:
    """``per_worker`` open connections (each made by ``connect``) to each of ``workers``
    workers: {pid: [Pinned]}; the connections beyond that are closed."""
    pinned: dict[int, list[Pinned]] = {}
    spare = 0
    for _ in range(tries):
        c = Pinned(connect())
        conns = pinned.setdefault(c.pid, [])
        if len(conns) < per_worker:
            conns.append(c)
        else:
            c.close()
            spare += 1
        if len(pinned) >= workers and all(len(v) >= per_worker for v in pinned.values()):
            return pinned
    counts = {pid: len(v) for pid, v in pinned.items()}
    raise AssertionError(f"{tries} connections reached {counts} (+{spare} spare)")


def raw_request(
    port: int, target: str, method: str = "GET", timeout: float = 10
) -> tuple[int, str]:
    """Send a request line exactly as given (no client-side normalisation)."""

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


def stats(port: int, timeout: float = 10.0) -> dict:
    """The proxy's ``/-/stats``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/-/stats")
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, f"/-/stats answered {resp.status}: {body[:200]!r}"
    return json.loads(body)


def part_files(cache_dir: Path) -> list[str]:
    """The ``.part`` files (downloads in progress or left behind) in ``cache_dir``, in
    either layout: ``name`` at the top, ``ab/name`` in a fan-out subdirectory."""
    try:
        names = os.listdir(cache_dir)
    except FileNotFoundError:
        return []
    found = [n for n in names if n.endswith(".part")]
    for sub in names:
        if len(sub) == 2 and os.path.isdir(os.path.join(cache_dir, sub)):
            with contextlib.suppress(FileNotFoundError):
                found += [f"{sub}/{n}" for n in os.listdir(os.path.join(cache_dir, sub))
                          if n.endswith(".part")]  # fmt: skip
    return sorted(found)


def wait_idle(port: int, timeout: float = 15.0) -> dict:
    """Wait (bounded) until the proxy has no download in flight and nothing reserved
    (commits follow the last byte); return the last stats."""
    seen: dict = {}

    def idle() -> dict | None:
        st = seen["stats"] = stats(port)
        return st if st["in_flight"] == 0 and st.get("reserved", 0) == 0 else None

    return wait_until(idle, timeout, what=lambda: f"downloads to finish: {seen.get('stats')}")


def settle(p: ProxyProcess, timeout: float = 5.0) -> dict:
    """Wait (bounded) until no download is in flight, nothing is reserved and no
    ``.part`` file is left; return the last stats."""
    seen: dict = {}

    def idle() -> dict | None:
        seen["stats"], seen["left"] = stats(p.port), part_files(p.cache_dir)
        st = seen["stats"]
        return st if not seen["left"] and st["in_flight"] == 0 and st["reserved"] == 0 else None

    def left_behind() -> str:
        st = seen["stats"]
        return (
            f"an idle proxy; left behind: .part files {seen['left']}, in_flight "
            f"{st['in_flight']}, reserved {st['reserved']}\n{p.log_text()[-3000:]}"
        )

    return wait_until(idle, timeout, what=left_behind)


def entry_digests(p: ProxyProcess) -> dict[str, dict[str, str]]:
    """url -> the digests recorded with each entry of the proxy's store."""
    store = Store(p.cache_dir, cache_size=1 << 30)
    try:
        return {e.url: dict(e.digests) for e in store.entries()}
    finally:
        store.close()


async def downloads_done(app: web.Application, timeout: float = 5.0) -> None:
    """Wait (bounded) until an in-process proxy ``app`` has no download running: its
    commit, and the report of its end, come after the last byte a client reads."""
    from proxy.context import INFLIGHT

    inflight = app[INFLIGHT]
    await until(
        lambda: len(inflight) == 0,
        timeout,
        what=lambda: f"downloads to end ({len(inflight)} running)",
    )


async def committed(client: Any, entries: int, timeout: float = 10.0) -> dict:
    """Wait (bounded) until an in-process proxy (an aiohttp test ``client``) counts
    ``entries`` entries in ``/-/stats`` (commits come after the last byte); return those
    stats."""
    seen: dict = {}

    async def counted() -> dict | None:
        async with client.get("/-/stats") as r:
            st = seen["stats"] = await r.json()
        return st if st["entries"] == entries else None

    return await until(counted, timeout, what=lambda: f"{entries} entries: {seen.get('stats')}")
