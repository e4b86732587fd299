"""The S3 tests' bucket and objects, and the proxy in front of SeaweedFS (s3:// upstreams
with 1 MiB parts, the S3 front)."""

from __future__ import annotations

from pathlib import Path

from .data import BUCKET, OBJECTS, sha
from .proxy import ProxyProcess, aws_env

MEDIUM = OBJECTS["shards/medium.tar"]


def front_client(url: str, access_key: str = "x", secret_key: str = "y"):
    """A boto3 client of the S3 front at ``url``: path style, us-east-1, signing with
    ``access_key``/``secret_key`` (a front without a key pair of its own takes any)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )


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
