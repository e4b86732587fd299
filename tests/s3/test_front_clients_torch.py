"""The torch-based S3 readers through the S3 front: s3torchconnector, MosaicML Streaming
and LitData, against a real proxy with SeaweedFS behind it (the ``proxy`` fixture of
test_proxy_s3; for LitData the same proxy over HTTPS, ``tls_proxy``). Marked ``clients``:
``make test-clients`` installs the ``clients`` extra in a venv of its own and runs them;
without the packages they skip, naming the package.

Bytes are checked (sha256 against the fixture objects or the written samples) and
listings against the bucket as SeaweedFS lists it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from support.data import sha
from support.s3 import BUCKET, OBJECTS, bucket_listing, fixture_sha, start_s3_proxy

pytestmark = pytest.mark.clients


@pytest.fixture
def anonymous_env(monkeypatch, tmp_path):
    """No AWS settings of this machine: no CA bundle, no config or credential files."""
    for name in list(os.environ):
        if name.startswith("AWS_") or name == "S3_ENDPOINT_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return monkeypatch


# --- s3torchconnector (Amazon's PyTorch connector, on the CRT) -------------------------------


def s3torch():
    return pytest.importorskip(
        "s3torchconnector", reason="s3torchconnector is not installed: pip install s3torchconnector"
    )


def s3torch_kw(proxy) -> dict:
    """The CRT resolves names itself: path style on 127.0.0.1, unsigned (anonymous)."""
    from s3torchconnector import S3ClientConfig

    return dict(
        region="us-east-1",
        endpoint=f"http://127.0.0.1:{proxy.port}",
        s3client_config=S3ClientConfig(unsigned=True, force_path_style=True),
    )


def reader_constructors():
    from s3torchconnector import S3ReaderConstructor

    return {
        "sequential": S3ReaderConstructor.sequential(),
        "range_based": S3ReaderConstructor.range_based(),
    }


@pytest.mark.parametrize("reader", ["sequential", "range_based"])
def test_s3torchconnector_iterable_and_map_datasets(proxy, boto, anonymous_env, reader):
    s3torch()
    from s3torchconnector import S3IterableDataset, S3MapDataset

    kw = dict(s3torch_kw(proxy), reader_constructor=reader_constructors()[reader])
    want = {k: v for k, v in bucket_listing(boto, "many/").items()}
    # S3IterableDataset lists the prefix (ListObjectsV2) and reads every object
    ds = S3IterableDataset.from_prefix("s3://all/many/", **kw)
    got = {r.key: sha(r.read()) for r in ds}
    assert set(got) == set(want)
    assert got == {k: fixture_sha(k) for k in want}

    # S3MapDataset: the same listing, random access
    m = S3MapDataset.from_prefix("s3://all/many/", **kw)
    assert len(m) == len(want)
    assert sorted(m[i].key for i in range(len(m))) == sorted(want)
    third = m[3]
    assert sha(third.read()) == fixture_sha(third.key)

    # whole shards, and reads at offsets (range_based: a ranged GET per read)
    medium = OBJECTS["shards/medium.tar"]
    objs = S3MapDataset.from_objects(
        ["s3://shards/medium.tar", "s3://shards/dir/x one+two.tar", "s3://shards/small.tar"], **kw
    )
    assert sha(objs[0].read()) == fixture_sha("shards/medium.tar")
    assert sha(objs[1].read()) == fixture_sha("shards/dir/x one+two.tar")
    r = objs[0]
    r.seek(1048570)
    assert r.read(30) == medium[1048570:1048600]
    r.seek(len(medium) - 5)
    assert r.read() == medium[-5:]
    small = objs[2]
    small.seek(9990)
    assert small.read(100) == OBJECTS["shards/small.tar"][9990:]


@pytest.mark.parametrize("reader", ["sequential", "range_based"])
def test_s3torchconnector_reads_an_empty_object(proxy, anonymous_env, reader):
    """The CRT asks for its first part (``Range: bytes=0-8388607``, unsigned: no x-amz
    header); on an empty object S3 answers 416 InvalidRange with ``ActualObjectSize`` 0 in
    an XML body, and the CRT then asks ``?partNumber=1`` without a range."""
    s3torch()
    from s3torchconnector import S3MapDataset

    kw = dict(s3torch_kw(proxy), reader_constructor=reader_constructors()[reader])
    objs = S3MapDataset.from_objects(["s3://shards/empty.tar"], **kw)
    assert objs[0].read() == b""
    # and as part of a prefix, as a training job meets it
    keys = {}
    for r in S3MapDataset.from_prefix("s3://shards/", **kw):
        keys[r.key] = r.read()
    assert keys["empty.tar"] == b""
    assert sha(keys["medium.tar"]) == fixture_sha("shards/medium.tar")


# --- MosaicML Streaming (MDS shards, boto3 underneath) ---------------------------------------


def write_mds(boto, tmp_path: Path, name: str, n: int = 40) -> dict[str, str]:
    """Write ``n`` samples as MDS shards locally, upload them to BUCKET/mds/NAME; return
    the key -> sha256 of each sample's payload."""
    mds = pytest.importorskip(
        "streaming", reason="mosaicml-streaming is not installed: pip install mosaicml-streaming"
    )
    out = tmp_path / "mds-local"
    want = {}
    with mds.MDSWriter(
        out=str(out), columns={"key": "str", "data": "bytes"}, size_limit=4096
    ) as writer:
        for i in range(n):
            data = hashlib.sha256(f"{name}-{i}".encode()).digest() * (10 + i)
            writer.write({"key": f"sample-{i:04d}", "data": data})
            want[f"sample-{i:04d}"] = sha(data)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) > 3  # an index and several shards
    for p in files:
        boto.put_object(Bucket=BUCKET, Key=f"mds/{name}/{p.relative_to(out)}", Body=p.read_bytes())
    return want


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_mosaicml_streaming_dataset(
    proxy, boto, anonymous_env, localhost_subdomains, tmp_path, style
):
    want = write_mds(boto, tmp_path, f"ds-{style}")
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    env = anonymous_env
    if style == "path":
        env.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    else:
        config = tmp_path / "aws-config"
        config.write_text("[default]\ns3 =\n  addressing_style = virtual\n")
        env.setenv("AWS_CONFIG_FILE", str(config))
        env.setenv("S3_ENDPOINT_URL", f"http://localhost:{proxy.port}")
    # Streaming signs unless boto3 finds no credentials at client creation; any key pair
    # passes an anonymous front
    env.setenv("AWS_ACCESS_KEY_ID", "anything")
    env.setenv("AWS_SECRET_ACCESS_KEY", "anything")

    clean_stale_shared_memory()
    ds = StreamingDataset(
        remote=f"s3://all/mds/ds-{style}",
        local=str(tmp_path / "mds-cache"),
        shuffle=False,
        batch_size=1,
        download_retry=1,
    )
    try:
        got = {s["key"]: sha(s["data"]) for s in ds}
    finally:
        del ds
        clean_stale_shared_memory()
    assert got == want
    # what streaming downloaded is what the bucket holds
    local = {
        str(p.relative_to(tmp_path / "mds-cache")): p.stat().st_size
        for p in (tmp_path / "mds-cache").rglob("*")
        if p.is_file()
    }
    remote = bucket_listing(boto, f"mds/ds-{style}/", strip=f"mds/ds-{style}/")
    assert {k: v for k, v in local.items() if k in remote} == remote


# --- LitData ---------------------------------------------------------------------------------


def litdata_sample(i: int) -> dict:
    """One sample of the LitData dataset (module level: ``optimize`` pickles it for its
    worker processes)."""
    return {
        "key": f"sample-{i:04d}",
        "data": hashlib.sha256(f"lit-{i}".encode()).digest() * (8 + i),
    }


@pytest.fixture(scope="module")
def tls_proxy(seaweed, tmp_path_factory):
    """The S3 front over HTTPS: a throwaway trustme CA (support.tls.Certs) and a server
    certificate for ``localhost``/``127.0.0.1``; yields (proxy, certs)."""
    pytest.importorskip("litdata", reason="litdata is not installed: pip install litdata")
    pytest.importorskip("trustme", reason="trustme is not installed: pip install trustme")
    from support.tls import Certs

    certs = Certs(tmp_path_factory.mktemp("litdata-certs"))
    tmp = tmp_path_factory.mktemp("s3proxy-tls")
    p = start_s3_proxy(seaweed, tmp, seaweed.access_key, seaweed.secret_key, *certs.args())
    try:
        assert p.scheme == "https"
        yield p, certs
    finally:
        p.stop()


def record_obstore_reads(monkeypatch) -> list[str]:
    """The keys of obstore's successful reads, from now on (LitData imports obstore at each
    call, so patching the module's functions reaches it)."""
    import obstore

    reads: list[str] = []

    def recording(name):
        real = getattr(obstore, name)
        if name.endswith("_async"):

            async def spy(store, key, *args, **kwargs):
                result = await real(store, key, *args, **kwargs)
                reads.append(key)
                return result

        else:

            def spy(store, key, *args, **kwargs):
                result = real(store, key, *args, **kwargs)
                reads.append(key)
                return result

        monkeypatch.setattr(obstore, name, spy)

    for name in ("get", "get_range", "get_ranges"):
        recording(name)
        recording(name + "_async")
    return reads


def test_litdata_streaming_dataset(tls_proxy, boto, anonymous_env, tmp_path):
    """LitData fetches index.json with boto3 but its chunks with obstore, built from the
    boto3 client's endpoint and region with client options of its own (no ``allow_http``,
    no root certificate): obstore refuses a plain http endpoint ("builder error"), so
    LitData reads through the front over HTTPS. boto3 trusts the CA through ``verify`` in
    ``storage_options``; obstore (reqwest, rustls with the native roots) through
    ``SSL_CERT_FILE``. obstore signs with the boto3 client's credentials, so there must be
    some: any key pair passes an anonymous front."""
    import litdata
    from litdata import StreamingDataset

    proxy, certs = tls_proxy
    out = tmp_path / "lit-local"
    n = 60
    litdata.optimize(
        fn=litdata_sample,
        inputs=list(range(n)),
        output_dir=str(out),
        chunk_bytes=4096,
        num_workers=1,
        verbose=False,
    )
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) > 3, files  # index.json and several chunks
    for p in files:
        boto.put_object(Bucket=BUCKET, Key=f"litdata/ds/{p.relative_to(out)}", Body=p.read_bytes())
    want = {s["key"]: sha(s["data"]) for s in map(litdata_sample, range(n))}

    env = anonymous_env
    env.setenv("AWS_ACCESS_KEY_ID", "anything")
    env.setenv("AWS_SECRET_ACCESS_KEY", "anything")
    env.setenv("SSL_CERT_FILE", str(certs.ca))
    obstore_reads = record_obstore_reads(env)
    ds = StreamingDataset(
        input_dir="s3://all/litdata/ds",
        cache_dir=str(tmp_path / "lit-cache"),
        storage_options={
            "endpoint_url": f"https://localhost:{proxy.port}",
            "region_name": "us-east-1",
            "verify": str(certs.ca),
        },
    )
    assert len(ds) == n
    got = {s["key"]: sha(s["data"]) for s in ds}
    assert got == want
    # every chunk came through obstore, the index through boto3
    chunks = {f"litdata/ds/{p.name}" for p in files if p.name != "index.json"}
    assert set(obstore_reads) == chunks
    # random access too
    assert sha(ds[17]["data"]) == want["sample-0017"]
