"""The S3 tests' bucket and objects, and the proxy in front of SeaweedFS (s3:// upstreams
with 1 MiB parts, the S3 front)."""

from __future__ import annotations

import random
from pathlib import Path

from .data import sha
from .proxy import ProxyProcess, aws_env

BUCKET = "shardcache-test"


def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# key -> bytes, uploaded once per session
OBJECTS: dict[str, bytes] = {
    "shards/small.tar": _payload(10_000, 1),
    "shards/medium.tar": _payload(3 * 1024 * 1024 + 17, 2),
    "shards/empty.tar": b"",
    "shards/dir/x one+two.tar": _payload(1234, 3),
    **{f"many/obj-{i:03d}.bin": _payload(100 + i, 100 + i) for i in range(23)},
    "many/sub/a.bin": b"a",
    "many/sub/b.bin": b"bb",
    "toplevel.bin": b"top",
}

MEDIUM = OBJECTS["shards/medium.tar"]


def proxy_env(access_key: str, secret_key: str, tmp: Path) -> dict[str, str]:
    return aws_env(access_key, secret_key, tmp)


def start_s3_proxy(
    seaweed, tmp: Path, access_key: str, secret_key: str, *extra: str
) -> ProxyProcess:
    return ProxyProcess(
        tmp / "cache",
        "--upstream",
        f"shards=s3://{BUCKET}/shards",
        "--upstream",
        f"all=s3://{BUCKET}",
        "--s3-endpoint-url",
        seaweed.endpoint_url,
        "--part-size",
        "1MiB",
        "--parallel",
        "4",
        *extra,
        env=proxy_env(access_key, secret_key, tmp),
    ).start()


def start_signed_front(seaweed, tmp: Path) -> ProxyProcess:
    """A proxy whose S3 front requires the key pair front-key / front-secret."""
    return start_s3_proxy(
        seaweed,
        tmp,
        seaweed.access_key,
        seaweed.secret_key,
        "--s3-front-access-key",
        "front-key",
        "--s3-front-secret-key",
        "front-secret",
    )


def fixture_sha(key: str) -> str:
    """sha256 of a fixture object, by its key in BUCKET."""
    return sha(OBJECTS[key])


def bucket_listing(boto, prefix: str = "", strip: str = "") -> dict[str, int]:
    """key -> size of BUCKET under ``prefix`` as SeaweedFS lists it (keys less ``strip``)."""
    out = {}
    for page in boto.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(strip) :]] = o["Size"]
    return out
