"""The Hugging Face Hub's API through the proxy as ``HF_ENDPOINT`` (mirror mode):
``HfFileSystem`` (which ``datasets`` streaming reads through) lists, inspects and reads
a dataset; the API's JSON is forwarded for every request and never kept, so a branch
that moves is seen at once, while the shards themselves are fetched once and cached.

Against :mod:`huborigin` (a hub and its CDN on two loopback addresses) and, for a body
the upstream cuts short, :mod:`badorigin`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from badorigin import BadOrigin, Version
from faultclient import fetch
from huborigin import COMMIT, Hub, hf_env
from proxy_helpers import ProxyProcess

from proxy.passthrough import is_uncached, upstream_path
from proxy.policy import Upstream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MiB = 1 << 20
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")
SHARDS = {f"org/ds/train/shard-{i:06d}.tar": os.urandom(MiB // 2 + 4096 * i) for i in range(3)}

# ls, info, a ranged read and a whole read, as datasets' streaming does through HfFileSystem
READER = """
import json, sys, hashlib, huggingface_hub as hh
fs = hh.HfFileSystem(skip_instance_cache=True)
names = sorted(fs.ls("datasets/org/ds/train", detail=False))
size = fs.info(names[0])["size"]
with fs.open(names[-1], "rb") as f:
    f.seek(1000)
    part = f.read(5000)
with fs.open(names[0], "rb", block_size=0) as f:  # streamed, as datasets does
    whole = f.read()
print(json.dumps({"names": names, "size": size, "part": hashlib.sha256(part).hexdigest(),
                  "whole": hashlib.sha256(whole).hexdigest()}))
"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hf(p: ProxyProcess, code: str, *args: str) -> subprocess.CompletedProcess:
    env = hf_env(p.url)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=90
    )


@pytest.fixture
def hub():
    with Hub(SHARDS) as h:
        yield h


def start_proxy(hub: Hub, tmp_path, *extra: str) -> ProxyProcess:
    return ProxyProcess(
        tmp_path / "cache", "--upstream", hub.hub.url, "--redirect-host", "127.0.0.2",
        *COMMON, *extra,
    ).start()  # fmt: skip


# --- the pure rule ---------------------------------------------------------------------


def test_paths_are_matched_relative_to_their_upstream():
    ups = [Upstream(None, "http://h/root"), Upstream("hub", "https://huggingface.co")]
    assert upstream_path("https://huggingface.co/api/datasets/a/b?x=1", ups) == "api/datasets/a/b"
    assert upstream_path("http://h/root/api/x", ups) == "api/x"
    assert upstream_path("http://other/api/x", ups) is None
    assert is_uncached("https://huggingface.co/api/datasets/a/b/tree/main", ups, ("api/*",))
    assert not is_uncached(
        "https://huggingface.co/datasets/a/b/resolve/main/api/x", ups, ("api/*",)
    )
    assert not is_uncached("http://h/root/api/x", ups, ())
    assert not is_uncached("http://h/rootapi/x", ups, ("api/*",))


# --- through the proxy -------------------------------------------------------------------


def test_hffilesystem_reads_through_the_proxy_and_shards_are_cached(hub, tmp_path):
    p = start_proxy(hub, tmp_path)
    try:
        first, last = SHARDS[min(SHARDS)], SHARDS[max(SHARDS)]
        for _ in range(2):
            out = hf(p, READER)
            assert out.returncode == 0, (out.stderr[-1500:], p.log_text()[-1500:])
            got = json.loads(out.stdout)
            assert got["names"] == [f"datasets/{k}" for k in sorted(SHARDS)]
            assert got["size"] == len(first)
            assert got["part"] == sha(last[1000:6000])
            assert got["whole"] == sha(first)
        api = [e for e in hub.hub.log if e[1].startswith("/api/")]
        assert len(api) >= 4, hub.hub.log  # every listing and repo info asked again
        for data in (first, last):
            full = [g for g in hub.cdn_gets(sha(data)) if g[2] in (None, "bytes=0-")]
            assert len(hub.cdn_gets(sha(data))) >= 1 and len(full) <= 1, hub.cdn.log
        p.logged('"GET /api/datasets/org/ds" 200 BYPASS')
        log = p.logged("HIT")
        assert '"GET /api/datasets/org/ds" 200 BYPASS' in log and "HIT" in log
    finally:
        p.stop(timeout=10)


def test_a_branch_that_moves_is_seen_at_once(hub, tmp_path):
    """The API's answers are never kept: a file added by a new commit is listed by the
    next HfFileSystem, and the repository's commit is the new one."""
    p = start_proxy(hub, tmp_path)
    code = (
        "import huggingface_hub as hh\n"
        "fs = hh.HfFileSystem(skip_instance_cache=True)\n"
        "print(len(fs.ls('datasets/org/ds/train', detail=False)))\n"
        "print(hh.HfApi().dataset_info('org/ds').sha)\n"
    )
    try:
        out = hf(p, code)
        assert out.returncode == 0, out.stderr[-1500:]
        assert out.stdout.split() == [str(len(SHARDS)), COMMIT]
        hub.files["org/ds/train/shard-000009.tar"] = b"new" * 1000
        hub.blobs[sha(b"new" * 1000)] = b"new" * 1000
        hub.commit = "f" * 40
        out = hf(p, code)
        assert out.returncode == 0, out.stderr[-1500:]
        assert out.stdout.split() == [str(len(SHARDS) + 1), "f" * 40]
    finally:
        p.stop(timeout=10)


def test_paths_info_is_posted_through(hub, tmp_path):
    """``paths-info`` is a POST with a form body: forwarded as it was, answered as the
    hub answered; an over-long body is refused before it is forwarded."""
    p = start_proxy(hub, tmp_path)
    code = (
        "import huggingface_hub as hh\n"
        "info = hh.HfApi().get_paths_info('org/ds', ['train/shard-000001.tar'],"
        " repo_type='dataset')\n"
        "print(info[0].path, info[0].size, info[0].lfs.sha256)\n"
    )
    try:
        out = hf(p, code)
        assert out.returncode == 0, out.stderr[-1500:]
        data = SHARDS["org/ds/train/shard-000001.tar"]
        assert out.stdout.split() == ["train/shard-000001.tar", str(len(data)), sha(data)]
        assert ("POST", "/api/datasets/org/ds/paths-info/main", None) in hub.hub.log
        big = fetch(
            p.port,
            "/api/datasets/org/ds/paths-info/main",
            "POST",
            body=b"paths=" + b"x" * (2 * MiB),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert big.status == 413, big.describe()
        put = fetch(p.port, "/api/datasets/org/ds/paths-info/main", "PUT", body=b"")
        assert put.status == 405 and "POST" in put.headers.get("allow", ""), put.describe()
        # a POST anywhere else is still refused: objects are read with GET and HEAD
        post = fetch(
            p.port, "/datasets/org/ds/resolve/main/train/shard-000001.tar", "POST", body=b""
        )
        assert post.status == 405, post.describe()
        # nor is a POST to another API path: it would carry the proxy's credentials to
        # whatever a client (or a web page, through a loopback proxy) names
        create = fetch(
            p.port,
            "/api/repos/create",
            "POST",
            body=b'{"name": "x"}',
            headers={"Content-Type": "text/plain"},
        )
        assert create.status == 405 and "POST" not in create.headers.get("allow", "")
        assert b"--uncached-post-path" in create.body, create.describe()
        posts = [e for e in hub.hub.log if e[0] == "POST"]
        assert len(posts) == 1, hub.hub.log
    finally:
        p.stop(timeout=10)


def test_credentials_go_to_the_api_and_the_clients_do_not(hub, tmp_path):
    p = ProxyProcess(
        tmp_path / "cache", "--upstream", hub.hub.url, "--upstream-auth", "env:HUB_TOKEN",
        *COMMON, env={"HUB_TOKEN": "hf_proxy_secret"},
    ).start()  # fmt: skip
    try:
        r = fetch(p.port, "/api/datasets/org/ds", headers={"Authorization": "Bearer hf_client"})
        assert r.status == 200 and json.loads(r.body)["sha"] == COMMIT, r.describe()
        assert hub.hub_auth[-1] == "Bearer hf_proxy_secret"
        assert "hf_proxy_secret" not in p.log_text() and "hf_client" not in p.log_text()
    finally:
        p.stop(timeout=10)


def test_a_resolve_url_on_a_moved_branch_is_revalidated(hub, tmp_path):
    """With ``--revalidate always``, a shard under ``resolve/main`` whose file a new commit
    replaced is served with the new bytes (the CDN's ETag, the Hub's linked ETag, differs)."""
    p = start_proxy(hub, tmp_path, "--revalidate", "always")
    path = "/datasets/org/ds/resolve/main/train/shard-000000.tar"
    try:
        old = SHARDS["org/ds/train/shard-000000.tar"]
        r = fetch(p.port, path)
        assert r.status == 200 and r.body == old and r.clean, r.describe()
        new = os.urandom(len(old))
        hub.files["org/ds/train/shard-000000.tar"] = new
        hub.blobs[sha(new)] = new
        hub.commit = "e" * 40
        r = fetch(p.port, path)
        assert r.status == 200 and r.clean and r.body == new, r.describe()
        assert r.headers.get("x-linked-etag") == f'"{sha(new)}"'
        assert r.headers.get("x-repo-commit") == "e" * 40
    finally:
        p.stop(timeout=10)


def test_an_api_body_cut_short_never_ends_cleanly(tmp_path):
    body = json.dumps({"rows": ["x" * 100] * 2000}).encode()
    with BadOrigin() as origin:
        origin.add("api/rows", versions=[Version(body, etag='"r1"')], cut_at=len(body) // 2)
        p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *COMMON).start()
        try:
            r = fetch(p.port, "/api/rows")
            assert not (r.status == 200 and r.clean), r.describe()
            assert r.body != body
            r = fetch(p.port, "/api/rows")  # the origin behaves now: whole, and still uncached
            assert r.status == 200 and r.clean and r.body == body, r.describe()
            assert r.headers.get("x-cache") == "BYPASS"
            assert len(origin.log("api/rows", "GET")) == 2
        finally:
            p.stop(timeout=10)


def _post_in_two_segments(port: int, path: str, body: bytes, split: int) -> tuple[int, bytes]:
    """A POST whose body arrives in two TCP segments, the second a moment later (as a
    client on a real network sends a body of more than one segment)."""
    import socket
    import time

    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\nConnection: close\r\n\r\n".encode()
            + body[:split]
        )
        time.sleep(0.3)
        s.sendall(body[split:])
        raw = b""
        for _ in range(10_000):
            piece = s.recv(65536)
            if not piece:
                break
            raw += piece
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def test_a_post_body_in_several_segments_is_forwarded_whole(hub, tmp_path):
    """The body forwarded is the whole body the client sent, not the part of it that had
    arrived when the proxy first read: a paths-info form cut after its first path would
    be answered 200 with one file's info instead of three."""
    p = start_proxy(hub, tmp_path)
    names = [f"train/shard-{i:06d}.tar" for i in range(3)]
    body = "&".join(f"paths={n}" for n in names).encode()
    try:
        status, payload = _post_in_two_segments(
            p.port, "/api/datasets/org/ds/paths-info/main", body, len(b"paths=") + len(names[0])
        )
        assert status == 200, payload
        got = sorted(e["path"] for e in json.loads(payload))
        assert got == names, got
    finally:
        p.stop(timeout=10)


def test_api_paths_are_objects_under_a_file_upstream(tmp_path):
    """Only an http(s) upstream has an API: under a file:// (or s3://, gs://, az://)
    upstream, ``api/...`` is an object like any other, fetched and cached."""
    data = os.urandom(100_000)
    root = tmp_path / "data"
    (root / "api").mkdir(parents=True)
    (root / "api" / "shard-0.tar").write_bytes(data)
    p = ProxyProcess(tmp_path / "cache", "--upstream", f"file://{root}", *COMMON).start()
    try:
        for cache in ("MISS", "HIT"):
            r = fetch(p.port, "/api/shard-0.tar")
            assert r.status == 200 and r.clean and r.body == data, r.describe()
            assert r.headers.get("x-cache") == cache, r.describe()
    finally:
        p.stop(timeout=10)
