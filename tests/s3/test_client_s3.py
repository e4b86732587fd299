"""shardcache.s3: reading s3:// URLs directly with boto3, and mapping them to the proxy."""

from __future__ import annotations

import pytest
from conftest import BUCKET, OBJECTS

from shardcache.errors import GopenError
from shardcache.s3 import _S3Raw, open_s3, s3_proxy_url, split_s3_url


def test_split_and_proxy_url():
    assert split_s3_url("s3://b/k/x.tar") == ("b", "k/x.tar")
    for bad in ("s3://b", "s3:///k", "http://b/k"):
        with pytest.raises(GopenError):
            split_s3_url(bad)
    assert s3_proxy_url("s3://b/d/x y.tar", "http://p:8080/") == "http://p:8080/b/d/x%20y.tar"


def test_open_s3_with_standard_environment(seaweed, aws_env):
    aws_env.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    aws_env.setenv("AWS_ENDPOINT_URL_S3", seaweed.endpoint_url)
    aws_env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with open_s3(f"s3://{BUCKET}/shards/medium.tar") as f:
        assert f.read() == OBJECTS["shards/medium.tar"]
    with pytest.raises(GopenError, match="NoSuchKey") as ei:
        open_s3(f"s3://{BUCKET}/shards/absent.tar")
    assert "absent.tar" in str(ei.value)


def test_open_s3_bad_credentials(seaweed, aws_env):
    aws_env.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(GopenError, match="AWS_ACCESS_KEY_ID"):
        open_s3(
            f"s3://{BUCKET}/shards/small.tar", endpoint_url=seaweed.endpoint_url, region="eu-west-2"
        )


def test_short_body_is_an_error():
    import io

    raw = _S3Raw("s3://b/k", io.BytesIO(b"abc"), size=5)
    with pytest.raises(GopenError, match="ended after 3 of 5"):
        io.BufferedReader(raw).read()


def test_gopen_opens_s3_urls_with_boto3(seaweed, aws_env):
    from shardcache.gopen import gopen

    aws_env.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    aws_env.setenv("AWS_ENDPOINT_URL_S3", seaweed.endpoint_url)
    aws_env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with gopen(f"s3://{BUCKET}/shards/small.tar") as f:
        assert f.read() == OBJECTS["shards/small.tar"]
    with pytest.raises(GopenError, match="NoSuchKey"):
        gopen(f"s3://{BUCKET}/shards/absent.tar")
    with pytest.raises(GopenError, match="only 'rb'"):
        gopen(f"s3://{BUCKET}/shards/new.tar", "wb")


def test_gopen_s3_without_boto3_names_the_extra(monkeypatch):
    import sys

    from shardcache import s3 as s3mod
    from shardcache.gopen import gopen

    monkeypatch.setitem(sys.modules, "boto3", None)  # fault: the s3 extra is not installed
    monkeypatch.setattr(s3mod, "_clients", {})
    with pytest.raises(GopenError, match=r"pip install '\.\[s3\]'") as ei:
        gopen("s3://some-bucket/x.tar")
    assert "s3://some-bucket/x.tar" in str(ei.value)
