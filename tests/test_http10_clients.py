"""An HTTP/1.0 client reading an object of unknown size (the upstream sent no
Content-Length) gets a body without Content-Length or chunks: the connection's close is
its end. A body cut short (the upstream cut the download, the grace period ended) must
therefore end with a reset, never with the orderly close a whole body ends with."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from proxy_helpers import Fault, Origin, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SIZE = 4 << 20
COMMON = ("--min-free", "0", "--grace-period", "1", "--retries", "0", "--read-timeout", "5")


def _get10(port: int, path: str, then=None) -> tuple[bytes, bytes, str]:
    """GET ``path`` as HTTP/1.0; ``then()`` once the head arrived. (head, body, how the
    connection ended: "close" for an orderly close, else the error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        raw = b""
        end = "timeout"
        called = False
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                piece = s.recv(65536)
                if not piece:
                    end = "close"
                    break
                raw += piece
                if then is not None and not called and b"\r\n\r\n" in raw:
                    called = True
                    then()
        except OSError as exc:
            end = repr(exc)
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body, end


def _origin(**fault) -> Origin:
    o = Origin().start()
    o.files["s.tar"] = os.urandom(SIZE)
    o.faults["s.tar"] = Fault(chunked=True, chunk=16 << 10, **fault)
    return o


def test_a_download_the_upstream_cuts_resets_an_http10_client(tmp_path):
    o = _origin(truncate_at=1 << 20)
    p = ProxyProcess(tmp_path / "cache", "--upstream", o.url, *COMMON).start()
    try:
        head, body, end = _get10(p.port, "/s.tar")
        assert head.startswith(b"HTTP/1.0 200") and b"Content-Length" not in head, head
        assert len(body) < SIZE
        assert end != "close", f"{len(body)} of {SIZE} bytes ended by an orderly close"
    finally:
        p.stop(timeout=10)
        o.stop()


def test_a_response_cut_at_shutdown_resets_an_http10_client(tmp_path):
    o = _origin(delay=0.2)
    p = ProxyProcess(tmp_path / "cache", "--upstream", o.url, *COMMON).start()
    try:
        head, body, end = _get10(p.port, "/s.tar", then=lambda: p.proc.send_signal(signal.SIGTERM))
        assert head.startswith(b"HTTP/1.0 200") and b"Content-Length" not in head, head
        assert len(body) < SIZE
        assert end != "close", f"{len(body)} of {SIZE} bytes ended by an orderly close"
        assert p.stop(timeout=10) == 0
        assert "cut-off" in p.log_text()
    finally:
        p.stop(timeout=10)
        o.stop()
