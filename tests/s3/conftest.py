"""Fixtures for the S3 tests: one SeaweedFS server per session, with a populated bucket."""

from __future__ import annotations

import os
import random

import pytest
from s3server import SeaweedS3

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


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A running SeaweedFS (S3 gateway on 127.0.0.1) with bucket BUCKET holding OBJECTS."""
    server = SeaweedS3.start(tmp_path_factory.mktemp("seaweed"))
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        for key, data in OBJECTS.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=data)
        yield server
    finally:
        server.stop()


@pytest.fixture
def boto(seaweed):
    """A boto3 client with the admin keys of the server."""
    return seaweed.client()


@pytest.fixture
def aws_env(seaweed, monkeypatch, tmp_path):
    """The standard AWS environment pointing at nothing but the test server's keys."""
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    return monkeypatch
