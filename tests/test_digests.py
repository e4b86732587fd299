"""Every digest an origin declares is checked however the object arrives, and recorded
with the entry; ``shardcache check --verify`` recomputes it.

The parser (:func:`shardcache.digests.declared_digests`) and :class:`Digester` are tested
directly; the proxy is read from a :mod:`badorigin` that declares digests of the right
bytes and sends one byte inverted, on each http transport (one stream on worker threads,
one stream on aiohttp, parallel ranged parts). A mismatch must end in a visible error,
never a clean response, and leave no entry behind; the right bytes pass and their
digests are kept with the entry.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

import google_crc32c
import pytest
from support.faultclient import (
    COMMON,
    ETAG_OLD,
    LM_OLD,
    SIZE,
    TRANSPORTS,
    check_rule,
    fetch,
    settle,
    stats,
)
from support.origins import BadOrigin, Version
from support.proxy import ProxyProcess, entry_digests

from shardcache.digests import Digester, declared_digests, file_digests
from shardcache.store import Store

NAME = "obj.tar"
FLIP = 600 * 1024 + 7  # in the 10th 64 KiB part, not the first


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def crc32c_raw(data: bytes) -> bytes:
    return google_crc32c.value(data).to_bytes(4, "big")


# --- the parser (pure) ----------------------------------------------------------------------

DATA = b"hello digests\n" * 1000
MD5 = hashlib.md5(DATA).hexdigest()
SHA256 = hashlib.sha256(DATA).hexdigest()
CRC32C = crc32c_raw(DATA).hex()


def test_content_md5_counts_on_a_200_only():
    h = {"Content-MD5": b64(hashlib.md5(DATA).digest())}
    assert declared_digests(h, 200) == (("md5", MD5),)
    assert declared_digests({**h, "Content-Range": "bytes 0-9/100"}, 206) == ()
    # a 206 of the whole object is the whole object
    assert declared_digests({**h, "Content-Range": "bytes 0-99/100"}, 206) == (("md5", MD5),)
    assert declared_digests({"Content-MD5": "not base64!"}, 200) == ()
    assert declared_digests({"Content-MD5": b64(b"short")}, 200) == ()


def test_x_goog_hash_is_the_objects_on_ranged_answers_too():
    h = {
        "x-goog-hash": f"crc32c={b64(crc32c_raw(DATA))},md5={b64(hashlib.md5(DATA).digest())}",
        "Content-Range": "bytes 0-9/14000",
    }
    assert declared_digests(h, 206) == (("crc32c", CRC32C), ("md5", MD5))
    # decompressed by GCS on the way: the stored object's hashes are not of these bytes
    assert declared_digests({**h, "x-goog-stored-content-encoding": "gzip"}, 200) == ()
    assert declared_digests(
        {**h, "x-goog-stored-content-encoding": "gzip", "Content-Encoding": "gzip"}, 200
    ) == (("crc32c", CRC32C), ("md5", MD5))


def test_s3_etag_is_an_md5_only_from_s3_and_unencrypted_single_part():
    etag = {"ETag": f'"{MD5}"'}
    assert declared_digests(etag, 200) == ()  # any origin's ETag is an opaque token
    assert declared_digests(etag, 200, s3=True) == (("md5", MD5),)
    assert declared_digests({**etag, "x-amz-request-id": "X"}, 206) == (("md5", MD5),)
    for enc in (
        {"x-amz-server-side-encryption": "aws:kms"},
        {"x-amz-server-side-encryption": "aws:kms:dsse"},
        {"x-amz-server-side-encryption-customer-algorithm": "AES256"},
    ):
        assert declared_digests({**etag, **enc}, 200, s3=True) == ()
    assert declared_digests({**etag, "x-amz-server-side-encryption": "AES256"}, 200, s3=True) == (
        ("md5", MD5),
    )
    assert declared_digests({"ETag": f'"{MD5}-3"'}, 200, s3=True) == ()


def test_s3_checksums_full_object_only():
    sha = b64(hashlib.sha256(DATA).digest())
    crc = b64(zlib.crc32(DATA).to_bytes(4, "big"))
    h = {"x-amz-checksum-sha256": sha, "x-amz-checksum-crc32": crc}
    got = dict(declared_digests(h, 200, s3=True))
    assert got == {"sha256": SHA256, "crc32": f"{zlib.crc32(DATA):08x}"}
    assert declared_digests({**h, "x-amz-checksum-type": "COMPOSITE"}, 200, s3=True) == ()
    assert declared_digests({"x-amz-checksum-crc32c": "AAAAAA==-4"}, 200, s3=True) == ()
    # a part's checksum is not the object's
    assert declared_digests({**h, "Content-Range": "bytes 0-9/14000"}, 206, s3=True) == ()


def test_x_linked_etag_is_a_sha256():
    assert declared_digests({"X-Linked-Etag": f'"{SHA256}"'}, 200) == (("sha256", SHA256),)
    assert declared_digests({"X-Linked-Etag": f'"{MD5}"'}, 200) == ()


def test_digester_checks_and_records():
    d = Digester([("md5", MD5), ("sha256", SHA256)])
    for i in range(0, len(DATA), 999):
        d.update(memoryview(bytearray(DATA[i : i + 999])))
    assert d.mismatches() == []
    assert dict(d.computed()) == {"md5": MD5, "sha256": SHA256, "crc32c": CRC32C}
    bad = Digester([("crc32c", "00000000")])
    bad.update(DATA)
    (m,) = bad.mismatches()
    assert (m.algorithm, m.expected, m.got) == ("crc32c", "00000000", CRC32C)


def test_digester_takes_a_206_content_md5_as_the_parts_or_the_objects():
    part = hashlib.md5(DATA[:100]).hexdigest()
    as_part = Digester(prefix_md5=(100, part))
    as_part.update(DATA)
    assert as_part.mismatches() == []  # the first 100 bytes' MD5, as RFC 2616 says
    as_object = Digester(prefix_md5=(100, MD5))
    as_object.update(DATA)
    assert as_object.mismatches() == []  # the whole object's, as some origins send
    wrong = Digester(prefix_md5=(100, MD5))
    wrong.update(DATA[:-1] + b"?")
    assert [m.algorithm for m in wrong.mismatches()] == ["md5"]


def test_file_digests(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(DATA)
    assert file_digests(str(p), ["md5", "crc32c", "nope"]) == {"md5": MD5, "crc32c": CRC32C}


# --- through the proxy ----------------------------------------------------------------------


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


def assert_refused(p: ProxyProcess, data: bytes, algorithm: str) -> None:
    """The client saw an error (never a clean response), nothing was committed, and the
    mismatch was counted and logged with the algorithm."""
    r = fetch(p.port, f"/{NAME}")
    assert not check_rule(r, [data], p.log_text()[-3000:]), "a clean response: " + r.describe()
    st = settle(p)
    assert st["entries"] == 0, st
    again = fetch(p.port, f"/{NAME}")  # not served from a bad entry either
    assert not check_rule(again, [data], p.log_text()[-3000:]), again.describe()
    settle(p)
    log = p.log_text()
    assert f"{algorithm} digest mismatch" in log, log[-3000:]
    metrics = fetch(p.port, "/metrics").body.decode()
    assert f'shardcache_digest_mismatches_total{{algorithm="{algorithm}"}}' in metrics


def add(origin: BadOrigin, data: bytes, **kw):
    return origin.add(
        f"/{NAME}", versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)], **kw
    )


def test_content_md5_mismatch_is_never_committed(origin, proxy, transport):
    data = os.urandom(SIZE)
    add(origin, data, content_md5="object", flip_at=FLIP)
    assert_refused(proxy, data, "md5")


def test_x_goog_hash_crc32c_mismatch(origin, proxy, transport):
    data = os.urandom(SIZE)
    add(origin, data, headers={"x-goog-hash": f"crc32c={b64(crc32c_raw(data))}"}, flip_at=FLIP)
    assert_refused(proxy, data, "crc32c")


def test_x_linked_etag_sha256_mismatch(origin, proxy, transport):
    data = os.urandom(SIZE)
    sha = hashlib.sha256(data).hexdigest()
    add(origin, data, headers={"X-Linked-Etag": f'"{sha}"'}, flip_at=FLIP)
    assert_refused(proxy, data, "sha256")


def test_right_digests_pass_and_are_recorded(origin, proxy, transport):
    data = os.urandom(SIZE)
    sha = hashlib.sha256(data).hexdigest()
    add(
        origin,
        data,
        content_md5="object",
        headers={"x-goog-hash": f"crc32c={b64(crc32c_raw(data))}", "X-Linked-Etag": f'"{sha}"'},
    )
    r = fetch(proxy.port, f"/{NAME}")
    assert r.status == 200 and r.clean and r.body == data, r.describe()
    settle(proxy)
    assert stats(proxy.port)["entries"] == 1
    proxy.stop(timeout=10)
    (recorded,) = entry_digests(proxy).values()
    assert recorded == {
        "crc32c": crc32c_raw(data).hex(),
        "md5": hashlib.md5(data).hexdigest(),
        "sha256": sha,
    }


def test_undeclared_objects_record_a_crc32c(origin, proxy, transport):
    data = os.urandom(SIZE)
    add(origin, data)
    r = fetch(proxy.port, f"/{NAME}")
    assert r.status == 200 and r.clean and r.body == data, r.describe()
    settle(proxy)
    proxy.stop(timeout=10)
    assert list(entry_digests(proxy).values()) == [{"crc32c": crc32c_raw(data).hex()}]


@pytest.mark.parametrize("transport", ["parts"])
@pytest.mark.parametrize("flip", [None, 1000], ids=["right", "first-part"])
def test_per_part_content_md5(origin, proxy, transport, flip):
    """An origin sending each answer's own MD5 (RFC 2616 on a 206): the first part's is
    checked as that part's, never mistaken for the object's (no false failure)."""
    data = os.urandom(SIZE)
    add(origin, data, content_md5="body", flip_at=flip)
    r = fetch(proxy.port, f"/{NAME}")
    if flip is None:
        assert r.status == 200 and r.clean and r.body == data, r.describe()
        settle(proxy)
        assert stats(proxy.port)["entries"] == 1
    else:
        assert_refused(proxy, data, "md5")


# --- check --verify -------------------------------------------------------------------------


def run_check(cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "check", "--cache-dir", str(cache_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_verify_finds_an_entry_changed_on_disk(origin, tmp_path):
    p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *COMMON).start()
    datas = {}
    try:
        for name in ("a.tar", "b.tar"):
            datas[name] = os.urandom(256 * 1024)
            origin.add(f"/{name}", versions=[Version(datas[name], etag=ETAG_OLD)])
            r = fetch(p.port, f"/{name}")
            assert r.status == 200 and r.body == datas[name], r.describe()
        settle(p)
    finally:
        p.stop(timeout=10)
    cache = tmp_path / "cache"
    assert run_check(cache, "--verify").returncode == 0
    store = Store(cache, cache_size=1 << 30)
    victim = store.entry_path(f"{origin.url}/a.tar")
    store.close()
    with open(victim, "r+b") as f:  # same size, one byte changed
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    plain = run_check(cache)
    assert plain.returncode == 0, plain.stdout  # sizes alone cannot tell
    found = run_check(cache, "--verify")
    assert found.returncode == 1, found.stdout + found.stderr
    assert "a.tar" in found.stdout and "crc32c" in found.stdout, found.stdout
    assert "b.tar" not in found.stdout, found.stdout
    fixed = run_check(cache, "--verify", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert not victim.exists()
    assert run_check(cache, "--verify").returncode == 0
    store = Store(cache, cache_size=1 << 30)
    try:
        assert [e.url for e in store.entries()] == [f"{origin.url}/b.tar"]
    finally:
        store.close()


@pytest.mark.parametrize("flip", [None, FLIP], ids=["right", "flipped"])
def test_an_uncached_object_is_checked_too(origin, transport, tmp_path, flip):
    """Too big for the cache: streamed through (X-Cache: BYPASS), still checked; the last
    bytes go out only once the digest matched."""
    data = os.urandom(SIZE)
    add(origin, data, content_md5="object", flip_at=flip)
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        origin.url,
        *COMMON,
        *TRANSPORTS[transport],
        "--cache-size",
        "256KiB",
    ).start()
    try:
        r = fetch(p.port, f"/{NAME}")
        assert r.headers.get("x-cache") == "BYPASS", r.describe()
        if flip is None:
            assert r.status == 200 and r.clean and r.body == data, r.describe()
        else:
            assert not check_rule(r, [data], p.log_text()[-3000:]), r.describe()
            assert "md5 digest mismatch" in p.log_text()
        assert settle(p)["entries"] == 0
    finally:
        p.stop(timeout=10)


def test_digester_copy_goes_on_independently():
    d = Digester([("md5", MD5)])
    d.update(DATA[:5000])
    other = d.copy()
    other.update(DATA[5000:])
    d.update(b"wrong")
    assert other.mismatches() == [] and other.size == len(DATA)
    assert [m.algorithm for m in d.mismatches()] == ["md5"]
