"""Digests an ``s3://`` upstream declares are checked: the single-part ETag (S3's hex MD5,
on every answer, ranged ones too) and the full-object ``x-amz-checksum-*`` the proxy asks
for with ``x-amz-checksum-mode: ENABLED`` (on whole-object answers).

Against SeaweedFS the right bytes pass and the digests are recorded with the entry; a
:mod:`badorigin` speaking S3 with one byte inverted under a right ETag is refused: a
visible error and no entry. Both S3 transports (presigned GETs on worker threads,
aiobotocore), one stream and parallel parts.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
from conftest import BUCKET
from support.badorigin import BadOrigin, Version
from support.faultclient import COMMON, LM_OLD, SIZE, check_rule, fetch, settle
from support.proxy import ProxyProcess, aws_env, entry_digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

MODES = {
    "stream": ("--part-size", "8MiB"),
    "parts": ("--part-size", "64KiB", "--parallel", "4"),
}
TRANSPORTS = {
    "threads": ("--http-transport", "threads"),
    "aiohttp": ("--http-transport", "aiohttp"),
}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_seaweedfs_digests_are_checked_and_recorded(seaweed, boto, tmp_path, mode, transport):
    data = os.urandom(SIZE + 5)
    key = f"digests/{mode}-{transport}.tar"
    boto.put_object(Bucket=BUCKET, Key=key, Body=data, ChecksumAlgorithm="SHA256")
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        f"d=s3://{BUCKET}/digests",
        "--s3-endpoint-url",
        seaweed.endpoint_url,
        *COMMON,
        *MODES[mode],
        *TRANSPORTS[transport],
        env=aws_env(seaweed.access_key, seaweed.secret_key, tmp_path),
    ).start()
    try:
        r = fetch(p.port, f"/d/{mode}-{transport}.tar")
        assert r.status == 200 and r.clean and r.body == data, r.describe() + p.log_text()[-2000:]
        settle(p)
    finally:
        p.stop(timeout=10)
    (recorded,) = entry_digests(p).values()
    # the ETag's MD5, declared on every answer: computed (and so checked) in both modes
    assert recorded.get("md5") == hashlib.md5(data).hexdigest(), recorded
    if mode == "stream":
        # x-amz-checksum-sha256 comes with a whole-object answer only (asked for with
        # x-amz-checksum-mode; S3 sends none on a ranged one)
        assert recorded.get("sha256") == hashlib.sha256(data).hexdigest(), recorded


def bad_s3_proxy(tmp_path: Path, origin: BadOrigin, *args: str) -> ProxyProcess:
    """The proxy in front of the misbehaving origin speaking S3, as bucket ``bkt`` under
    the front bucket ``shards``, started with ``args``."""
    return ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        "shards=s3://bkt/pre",
        "--s3-endpoint-url",
        origin.url,
        "--s3-region",
        "us-east-1",
        *COMMON,
        *args,
        env=aws_env(None, None, tmp_path),
    ).start()


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_s3_etag_mismatch_is_never_committed(tmp_path, mode, transport):
    data = os.urandom(SIZE)
    etag = '"' + hashlib.md5(data).hexdigest() + '"'
    with BadOrigin(s3=True) as origin:
        origin.add(
            "/bkt/pre/obj.tar",
            versions=[Version(data, etag=etag, last_modified=LM_OLD)],
            flip_at=700 * 1024 + 3,
        )
        p = bad_s3_proxy(tmp_path, origin, *MODES[mode], *TRANSPORTS[transport])
        try:
            r = fetch(p.port, "/shards/obj.tar")
            assert not check_rule(r, [data], p.log_text()[-3000:]), r.describe()
            assert settle(p)["entries"] == 0
            assert "md5 digest mismatch" in p.log_text()
        finally:
            p.stop(timeout=10)


def test_s3_checksum_of_a_whole_answer_is_checked(tmp_path):
    """A full-object x-amz-checksum-sha256 on a 200 that disagrees with the bytes."""
    data = os.urandom(SIZE)
    sha = base64.b64encode(hashlib.sha256(data).digest()).decode()
    with BadOrigin(s3=True) as origin:
        origin.add(
            "/bkt/pre/obj.tar",
            versions=[Version(data, etag='"v1-opaque"', last_modified=LM_OLD)],
            headers={"x-amz-checksum-sha256": sha, "x-amz-checksum-type": "FULL_OBJECT"},
            flip_at=5,
        )
        p = bad_s3_proxy(tmp_path, origin, *MODES["stream"])
        try:
            r = fetch(p.port, "/shards/obj.tar")
            assert not check_rule(r, [data], p.log_text()[-3000:]), r.describe()
            assert settle(p)["entries"] == 0
            assert "sha256 digest mismatch" in p.log_text()
            gets = origin.log("/bkt/pre/obj.tar", "GET")
            assert gets and all(g.header("x-amz-checksum-mode") == "ENABLED" for g in gets)
        finally:
            p.stop(timeout=10)
