"""Fixtures for the S3 tests: one SeaweedFS server per session, with a populated bucket."""

from __future__ import annotations

import os
import socket

import pytest
from s3server import SeaweedS3
from support.s3 import BUCKET, OBJECTS, start_s3_proxy


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


@pytest.fixture(scope="module")
def proxy(seaweed, tmp_path_factory):
    """One proxy per module in front of SeaweedFS (:func:`support.s3.start_s3_proxy`)."""
    p = start_s3_proxy(
        seaweed, tmp_path_factory.mktemp("s3proxy"), seaweed.access_key, seaweed.secret_key
    )
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def localhost_subdomains(monkeypatch):
    """Resolve ``*.localhost`` to 127.0.0.1 in this process, as systemd-resolved and
    browsers do (this machine's resolver does not), so boto3 can use virtual hosts."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if isinstance(host, str) and host.endswith(".localhost"):
            host = "127.0.0.1"
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
