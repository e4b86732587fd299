"""bench/s3_compat.py, the S3 compatibility suite's harness: which requests it sends to
the front, that its router passes requests on as sent (Host included) to the right end,
how it counts, and that it skips with a message without the suite's checkout."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.s3_compat import Router, compare, front_read, main  # noqa: E402

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "method, path, query, front",
    [
        ("GET", "/", "", True),  # ListBuckets
        ("GET", "/b", "list-type=2&prefix=a&encoding-type=url", True),
        ("GET", "/b", "delimiter=%2F&marker=x&max-keys=2", True),
        ("HEAD", "/b", "", True),
        ("GET", "/b", "location", True),
        ("GET", "/b", "versioning", True),
        ("GET", "/b/k/x.tar", "", True),
        ("GET", "/b/k", "versionId=v1&response-content-type=x&partNumber=1", True),
        ("GET", "/b/k", "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=00", True),
        ("HEAD", "/b/k", "x-id=HeadObject", True),
        ("GET", "/b", "acl", False),
        ("GET", "/b", "versions", False),
        ("GET", "/b", "uploads", False),
        ("HEAD", "/b", "location", False),
        ("GET", "/b/k", "tagging", False),
        ("GET", "/b/k", "uploadId=1", False),
        ("PUT", "/b/k", "", False),
        ("POST", "/b", "delete", False),
        ("DELETE", "/b", "", False),
        ("GET", "/", "acl", False),
    ],
)
def test_the_reads_the_front_serves_go_to_it(method, path, query, front):
    assert front_read(method, path, query) is front


class _Origin(ThreadingHTTPServer):
    def __init__(self, name: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.name = name
        self.seen: list[tuple[str, str, str, bytes]] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        self.server.seen.append((self.command, self.path, self.headers["Host"], body))
        out = self.server.name.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.send_header("X-Origin", self.server.name)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


def _send(router: Router, method: str, target: str, body: bytes | None = None):
    req = urllib.request.Request(
        f"http://127.0.0.1:{router.port}{target}", data=body, method=method,
        headers={"Host": "s3.test:9"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers["X-Origin"], resp.headers.get("Content-Length"), resp.read()


def _phase(router: Router, test: str, phase: str) -> None:
    body = json.dumps({"test": test, "phase": phase}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{router.port}/__s3compat__/phase", data=body, method="POST"
    )
    urllib.request.urlopen(req, timeout=10).read()


def test_the_router_sends_a_tests_reads_to_the_front_as_sent():
    store, front = _Origin("store"), _Origin("front")
    router = Router(store.url, front.url)
    router.start()
    try:
        router.mode = "front"
        assert _send(router, "GET", "/b/k")[0] == "store"  # a fixture's read: the store
        _phase(router, "t1", "call")
        assert _send(router, "GET", "/b/k%20x?versionId=v") == ("front", "5", b"front")
        assert _send(router, "HEAD", "/b/k") == ("front", "5", b"")
        assert _send(router, "PUT", "/b/k", b"bytes")[0] == "store"
        assert _send(router, "GET", "/b?acl")[0] == "store"
        _phase(router, "t1", "fixture")
        router.mode = "store"
        _phase(router, "t2", "call")
        assert _send(router, "GET", "/b/k")[0] == "store"  # the reference: all to the store
        _phase(router, "t2", "fixture")
    finally:
        router.stop()
        store.shutdown()
        front.shutdown()
    assert front.seen == [
        ("GET", "/b/k%20x?versionId=v", "s3.test:9", b""),
        ("HEAD", "/b/k", "s3.test:9", b""),
    ]
    assert ("PUT", "/b/k", "s3.test:9", b"bytes") in store.seen
    # the front reads of each test's body, in either mode
    assert router.reads == Counter({"t1": 2, "t2": 1})


def test_the_score_counts_the_read_tests_the_store_passes():
    def v(verdict: str, reads: int) -> dict:
        return {"verdict": verdict, "reads": reads, "message": ""}

    store = {"a": v("pass", 1), "b": v("pass", 2), "c": v("fail", 1), "d": v("pass", 0)}
    front = {"a": v("pass", 1), "b": v("fail", 2), "c": v("pass", 1), "d": v("fail", 0)}
    assert compare(store, front) == (["a", "b"], ["a"], ["b"])


def test_without_the_suite_it_says_so_and_passes(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("S3_TESTS_DIR", raising=False)
    assert main([]) == 0
    assert "skipped: S3_TESTS_DIR is not set" in capsys.readouterr().out
    assert main(["--suite", str(tmp_path)]) == 0
    assert "not a checkout of ceph/s3-tests" in capsys.readouterr().out
