"""Upstream redirects followed inside the proxy, to safe targets only, against an origin
pair that behaves like the Hugging Face Hub (:mod:`huborigin`): resolve URLs answered
with a 302 to a CDN on another address with a signed query that expires.

- a shard behind a redirect is fetched from the CDN once and cached under the URL the
  client asked for; clients with and without redirect-following, a cold HEAD and a cold
  Range all get the object itself; no redirect and no signed URL reaches a client;
- the Hub's metadata on the redirect (X-Repo-Commit, X-Linked-Etag, X-Linked-Size) is
  served with the object;
- a relative redirect (a renamed repo) is followed, never handed out as an absolute URL
  of the upstream;
- an expired signature sends the proxy back to the first URL for a fresh redirect;
- targets an attacker would choose (metadata addresses, other hosts, other schemes,
  userinfo, numeric host forms, loops) are refused with a 502 naming the target and the
  setting, and never contacted.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from support.data import sha
from support.faultclient import TRANSPORTS, fetch, settle
from support.huborigin import COMMIT, Hub, hf_env
from support.proxy_helpers import ProxyProcess

from proxy.policy import DEFAULT_REDIRECT_HOSTS
from proxy.upstream.redirects import RedirectPolicy, RedirectRefused, check_target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MiB = 1 << 20
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")
SHARDS = {f"org/ds/train/shard-{i:06d}.tar": os.urandom(MiB + 4096 * i) for i in range(4)}


def resolve(i: int, org: str = "org") -> str:
    return f"/datasets/{org}/ds/resolve/main/train/shard-{i:06d}.tar"


# --- the pure rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "location, allowed",
    [
        ("http://cdn-lfs.hf.co/blob/x?sig=1", True),
        ("https://cas-bridge.xethub.hf.co/x", True),
        ("/datasets/a/b/resolve/main/x", True),  # relative: the upstream's own host
        ("http://hf.co.evil.example/x", False),
        ("http://evil-hf.co/x", False),
        ("http://169.254.169.254/latest/meta-data/", False),
        ("http://[fe80::1]/x", False),
        ("http://metadata.google.internal/computeMetadata/v1/", False),
        ("http://0xa9fea9fe/", False),  # 169.254.169.254 in hex
        ("http://2852039166/", False),  # ... as one number
        ("http://user:pw@cdn-lfs.hf.co/x", False),
        ("file:///etc/passwd", False),
        ("ftp://cdn-lfs.hf.co/x", False),
        ("http://other.example/x", False),
    ],
)
def test_check_target(location, allowed):
    policy = RedirectPolicy(hosts=DEFAULT_REDIRECT_HOSTS)
    current = "https://huggingface.co/datasets/a/b/resolve/main/x"
    if allowed:
        assert check_target(current, location, "huggingface.co", policy).startswith("http")
    else:
        with pytest.raises(RedirectRefused) as info:
            check_target(current, location, "huggingface.co", policy)
        assert "sig=" not in str(info.value) and "pw" not in str(info.value)


def test_metadata_address_only_when_named_exactly():
    policy = RedirectPolicy(hosts=("169.254.169.254",))
    assert check_target("http://a/x", "http://169.254.169.254/y", "a", policy)
    with pytest.raises(RedirectRefused):
        check_target(
            "http://a/x", "http://169.254.169.254/y", "a", RedirectPolicy(hosts=("*.254",))
        )


# --- through the proxy -------------------------------------------------------------------


@pytest.fixture
def hub():
    with Hub(SHARDS) as h:
        yield h


def start_proxy(hub: Hub, tmp_path, *extra: str) -> ProxyProcess:
    return ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        hub.hub.url,
        "--redirect-host",
        "127.0.0.2",
        *COMMON,
        *extra,
    ).start()


def test_hub_shards_are_fetched_once_and_cached(hub, tmp_path, transport):
    p = start_proxy(hub, tmp_path, *TRANSPORTS[transport])
    try:
        for epoch in range(2):
            for i, data in enumerate(SHARDS.values()):
                r = fetch(p.port, resolve(i))
                assert r.status == 200 and r.clean and r.body == data, r.describe()
                assert r.headers.get("x-cache") == ("HIT" if epoch else "MISS"), r.describe()
                assert "location" not in r.headers
                assert r.headers.get("x-repo-commit") == COMMIT
                assert r.headers.get("x-linked-etag") == f'"{sha(data)}"'
                assert r.headers.get("x-linked-size") == str(len(data))
            settle(p)
        for data in SHARDS.values():
            gets = hub.cdn_gets(sha(data))
            full = [g for g in gets if g[2] is None or g[2].startswith("bytes=0-")]
            assert len(full) == 1, gets  # one download per shard over two epochs
    finally:
        p.stop(timeout=10)
    assert "Signature=" not in p.log_text()  # every line written, the access lines too


def test_cold_head_range_and_plain_curl(hub, tmp_path):
    data = list(SHARDS.values())[3]
    p = start_proxy(hub, tmp_path)
    try:
        head = fetch(p.port, resolve(3), method="HEAD")
        assert head.status == 200, head.describe()
        assert head.headers.get("content-length") == str(len(data))
        assert head.headers.get("x-repo-commit") == COMMIT
        rng = fetch(p.port, resolve(3), headers={"Range": "bytes=100-199"})
        assert rng.status == 206 and rng.body == data[100:200], rng.describe()
        out = subprocess.run(
            ["curl", "-s", "-f", f"{p.url}{resolve(3)}"], capture_output=True, timeout=30
        )
        assert out.returncode == 0 and out.stdout == data
    finally:
        p.stop(timeout=10)


def test_relative_redirect_is_followed_inside(hub, tmp_path):
    data = list(SHARDS.values())[1]
    p = start_proxy(hub, tmp_path)
    try:
        r = fetch(p.port, resolve(1, org="old-org"))
        assert r.status == 200 and r.body == data, r.describe()
        assert "location" not in r.headers
    finally:
        p.stop(timeout=10)


def test_an_expired_signature_is_asked_for_again(tmp_path):
    """The CDN's signatures last 1 s. A cold HEAD leaves the proxy with a remembered
    target; once its signature has expired, the GET that uses it is refused (403), and
    the proxy goes back to the resolve URL for a fresh redirect instead of failing."""
    data = os.urandom(2 * MiB)
    with Hub({"org/ds/train/shard-000000.tar": data}, ttl=1.0) as hub:
        p = start_proxy(hub, tmp_path)
        try:
            first = fetch(p.port, resolve(0), method="HEAD")
            assert first.status == 200, first.describe()
            time.sleep(1.5)
            again = fetch(p.port, resolve(0))
            assert again.status == 200 and again.body == data, again.describe()
            resolves = [e for e in hub.hub.log if e[1] == resolve(0)]
            assert len(resolves) == 2, hub.hub.log
        finally:
            p.stop(timeout=10)


@pytest.mark.parametrize(
    "kind", ["metadata", "other-host", "file", "userinfo", "hex-ip", "gopher", "loop"]
)
def test_unsafe_redirects_are_refused(hub, tmp_path, kind):
    p = start_proxy(hub, tmp_path)
    try:
        before = len(hub.cdn.log)
        r = fetch(p.port, f"/evil/{kind}")
        assert r.status == 502, r.describe()
        text = r.body.decode()
        assert "redirect" in text, text
        if kind not in ("loop",):
            assert "--redirect-host" in text or "never followed" in text, text
        assert "secret" not in text
        assert len(hub.cdn.log) == before, "a refused target was contacted"
    finally:
        p.stop(timeout=10)


def test_webdataset_reads_hub_urls_for_two_epochs(hub, tmp_path):
    wds = pytest.importorskip("webdataset")
    import io
    import tarfile

    files = {}
    for i in range(3):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for j in range(4):
                payload = f"sample {i}-{j}".encode()
                info = tarfile.TarInfo(f"s{i:03d}{j:03d}.txt")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
        files[f"org/tars/train/part-{i}.tar"] = buf.getvalue()
    with Hub(files) as h:
        p = start_proxy(h, tmp_path)
        try:
            urls = [f"{p.url}/datasets/org/tars/resolve/main/train/part-{i}.tar" for i in range(3)]
            for _ in range(2):
                keys = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
                assert len(keys) == 12, keys
            for data in files.values():
                assert len(h.cdn_gets(sha(data))) == 1, h.cdn.log
        finally:
            p.stop(timeout=10)


def test_hf_hub_download_through_the_proxy_as_hf_endpoint(hub, tmp_path, monkeypatch):
    """``HF_ENDPOINT`` pointing at the proxy (mirror mode): ``hf_hub_download`` reads the
    Hub's metadata from the proxy's answer and downloads the file through it; a second
    download (another local cache) is a hit."""
    data = list(SHARDS.values())[2]
    p = start_proxy(hub, tmp_path)
    try:
        code = (
            "import sys, huggingface_hub as h\n"
            "path = h.hf_hub_download('org/ds', 'train/shard-000002.tar', repo_type='dataset',"
            " cache_dir=sys.argv[1])\n"
            "sys.stdout.buffer.write(open(path, 'rb').read())\n"
        )
        import sys

        env = hf_env(p.url)
        for n in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code, str(tmp_path / f"hf-cache-{n}")],
                capture_output=True,
                env=env,
                timeout=60,
            )
            assert out.returncode == 0, (out.stderr.decode()[-800:], hub.hub.log, p.log_text()[-1500:])
            assert out.stdout == data
        assert len(hub.cdn_gets(sha(data))) == 1, hub.cdn.log
    finally:
        p.stop(timeout=10)
