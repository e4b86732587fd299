"""An ``s3://`` upstream that misbehaves at the socket level: :mod:`badorigin` speaking
path-style S3 (``GET|HEAD /bucket/key``, ranged GETs with ``If-Match``, S3 XML errors),
read through the proxy daemon and through its S3 front. No SeaweedFS here.

The rule is the one of ``tests/test_upstream_faults.py``: a client never receives wrong
or missing bytes as a clean response, and a bad entry is never committed. ``stream``
fetches the 1 MiB object as one GET resumed with Range + If-Match (the default 8 MiB
part size); ``parts`` as 64 KiB ranged parts pinned with If-Match. The proxy has no AWS
credentials: its S3 requests go unsigned.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.badorigin import BadOrigin, Version  # noqa: E402
from support.faultclient import (  # noqa: E402
    COMMON,
    CUT40,
    ETAG_NEW,
    ETAG_OLD,
    LM_NEW,
    LM_OLD,
    SIZE,
    KiB,
    add_malformed_chunked,
    check_rule,
    fetch,
    pinned,
    second_read,
    settle,
    stats,
)
from support.proxy_helpers import ProxyProcess, aws_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

BUCKET = "bkt"
PREFIX = "pre"
FRONT = "shards"  # the proxy's upstream name: /shards/<key>, and the S3 front's bucket
KEY = "obj.tar"
ORIGIN_PATH = f"/{BUCKET}/{PREFIX}/{KEY}"
PROXY_PATH = f"/{FRONT}/{KEY}"

MODES: dict[str, tuple[str, ...]] = {
    "stream": (),
    "parts": ("--part-size", "64KiB", "--parallel", "4"),
}


def _env(tmp: Path) -> dict[str, str]:
    """No AWS credentials anywhere: unsigned requests."""
    return aws_env(None, None, tmp)


@pytest.fixture(params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture
def origin():
    with BadOrigin(s3=True) as o:
        yield o


@pytest.fixture
def proxy(origin, mode, tmp_path):
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        f"{FRONT}=s3://{BUCKET}/{PREFIX}",
        "--s3-endpoint-url",
        origin.url,
        "--s3-region",
        "us-east-1",
        *COMMON,
        *MODES[mode],
        env=_env(tmp_path),
    ).start()
    try:
        yield p
    finally:
        p.stop(timeout=10)


def tail_of(p: ProxyProcess) -> str:
    return p.log_text()[-3000:]


# --- the object replaced between the cut and the resume ------------------------------------

CHANGES = {
    # variant: (new ETag, origin honours If-Match)
    "new-etag": (ETAG_NEW, False),  # 206 with the new bytes and the new ETag
    "etag-dropped": (None, False),  # 206 with the new bytes and no ETag at all
    "honest": (ETAG_NEW, True),  # 412 PreconditionFailed
}


@pytest.mark.parametrize("variant", list(CHANGES))
def test_s3_replaced_object_is_never_spliced(origin, proxy, mode, variant):
    new_etag, honest = CHANGES[variant]
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    v0 = Version(old, etag=ETAG_OLD, last_modified=LM_OLD)
    sc = origin.add(
        ORIGIN_PATH,
        versions=[v0, Version(new, etag=new_etag, last_modified=LM_NEW)],
        advance_after=(1,),
        cut_at=CUT40,
        cut_on="first",
        cut_mode="rst",
    )
    if not honest:
        sc.honor_if_match = sc.honor_if_range = sc.honor_if_unmodified_since = False
    r = fetch(proxy.port, PROXY_PATH)
    check_rule(r, [old, new], tail_of(proxy))
    gets = origin.log(ORIGIN_PATH, "GET")
    assert gets and gets[0].version == 0, gets
    unpinned = [g for g in gets if (g.range_start or 0) > 0 and not pinned(g, v0)]
    assert not unpinned, "a resume / part without If-Match: " + ", ".join(
        f"{g.range} {g.headers}" for g in unpinned
    )
    settle(proxy)
    sc.heal()
    second_read(proxy, [old, new], PROXY_PATH)


# --- a malformed chunked body ---------------------------------------------------------------


@pytest.mark.parametrize("late", [False, True], ids=["together", "late"])
@pytest.mark.parametrize("where", ["first", "ranged"])
def test_s3_malformed_chunked_body_fails_fast(origin, proxy, mode, where, late):
    """``first``: every answer is chunked with a ``zz`` chunk-size line at 256 KiB.
    ``ranged``: the first GET is cut at 40 %, every 206 is chunked and starts with a
    ``zz`` line. ``together`` / ``late``: the bad line in one send() with what precedes
    it, or 50 ms after. Errors within a few seconds, no ``.part`` left, nothing
    committed."""
    data = os.urandom(SIZE)
    sc = add_malformed_chunked(origin, ORIGIN_PATH, data, where, late)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(fetch, proxy.port, PROXY_PATH, "GET", None, 10) for _ in range(2)]
        replies = [f.result(timeout=30) for f in futures]
    for r in replies:
        ok = check_rule(r, [data], tail_of(proxy))
        assert r.elapsed < 10, f"waited {r.elapsed:.1f}s: " + r.describe()
        if where == "first":
            assert not ok, r.describe()
    settle(proxy)
    assert stats(proxy.port)["entries"] == 0
    sc.heal()
    sc.framing, sc.ranged_framing = "length", None  # S3 answers carry a Content-Length
    second_read(proxy, [data], PROXY_PATH)


# --- access denied --------------------------------------------------------------------------


@pytest.mark.parametrize("status,code", [(403, "AccessDenied"), (401, "Unauthorized")])
def test_s3_denied_is_403_and_access_denied_at_the_front(origin, proxy, mode, status, code):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    data = os.urandom(64 * KiB)
    sc = origin.add(
        ORIGIN_PATH,
        versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)],
        status=status,
        error_code=code,
    )
    r = fetch(proxy.port, PROXY_PATH)
    assert r.status == 403, r.describe() + "\n" + tail_of(proxy)
    assert r.body.strip(), "a 403 without a message"
    client = boto3.client(
        "s3",
        endpoint_url=proxy.url,
        region_name="us-east-1",
        config=Config(
            signature_version=UNSIGNED,
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1},
        ),
    )
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=FRONT, Key=KEY)
    err = info.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 403, err
    assert err["Error"]["Code"] == "AccessDenied", err
    st = settle(proxy)
    assert st["entries"] == 0, st
    sc.heal()
    r2 = second_read(proxy, [data], PROXY_PATH)
    assert r2.headers.get("x-cache") != "HIT", r2.describe()
    got = client.get_object(Bucket=FRONT, Key=KEY)["Body"].read()
    assert got == data


# --- throttling: --retries counts the tries ------------------------------------------------

RETRIES = int(COMMON[COMMON.index("--retries") + 1])


def test_s3_slowdown_is_tried_retries_plus_one_times(origin, proxy, mode):
    """A bucket that answers every request 503 SlowDown: each request the proxy makes
    (a HEAD for a client's HEAD, a GET for a miss) is tried ``--retries`` + 1 times, in
    one loop, with the daemon's backoff, then the client gets a 5xx (a message, none of
    the object's bytes). The S3 client does not retry on its own inside that loop."""
    data = os.urandom(64 * KiB)
    sc = origin.add(
        ORIGIN_PATH,
        versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)],
        status=503,
    )

    def tries() -> dict[str, int]:
        return {m: len(origin.log(ORIGIN_PATH, m)) for m in ("HEAD", "GET")}

    r = fetch(proxy.port, PROXY_PATH, "HEAD")
    assert r.status is not None and r.status >= 500, r.describe()
    assert tries() == {"HEAD": RETRIES + 1, "GET": 0}, tail_of(proxy)
    r = fetch(proxy.port, PROXY_PATH)
    assert r.status is not None and r.status >= 500 and data not in r.body, r.describe()
    # the GETs of the miss, plus the one HEAD that asks for the object's checksums beside
    # its first request (tried once: it never fails a download)
    assert tries() == {"HEAD": RETRIES + 2, "GET": RETRIES + 1}, tail_of(proxy)
    st = settle(proxy)
    assert st["entries"] == 0, st
    sc.heal()
    second_read(proxy, [data], PROXY_PATH)


# --- framing that disagrees with itself (see tests/test_framing.py) --------------------------


def _framing(origin, mode: str, data: bytes, **faults):
    sc = origin.add(
        ORIGIN_PATH, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)], **faults
    )
    if mode == "stream":  # one GET: its resume meets the 206 faults
        sc.cut_at, sc.cut_on, sc.cut_mode = CUT40, "first", "rst"
    return sc


def _first_then_heal(origin, proxy, sc, data: bytes) -> bool:
    """The rule for the first read; with the origin healed, the exact object, and a
    MISS when the first failed (nothing was committed)."""
    r = fetch(proxy.port, PROXY_PATH)
    clean = check_rule(r, [data], tail_of(proxy))
    settle(proxy)
    sc.heal()
    r2 = fetch(proxy.port, PROXY_PATH)
    assert r2.status == 200 and r2.body == data, r2.describe() + "\n" + tail_of(proxy)
    if not clean:
        assert r2.headers.get("x-cache") == "MISS", "committed from a failed download"
    return clean


@pytest.mark.parametrize("skew", [-1000, 1000], ids=["shorter", "longer"])
def test_s3_content_length_other_than_the_range_is_an_error(origin, proxy, mode, skew):
    """Every later 206 declares a Content-Length ``skew`` bytes off its Content-Range
    span (and sends the span): never used, never committed."""
    data = os.urandom(SIZE)
    sc = _framing(origin, mode, data, length_skew=skew, length_skew_on="later-ranged")
    assert not _first_then_heal(origin, proxy, sc, data)


def test_s3_one_short_length_is_asked_again(origin, proxy, mode):
    """One 206 (the second GET) lies about its length: asked again, the exact object."""
    data = os.urandom(SIZE)
    sc = _framing(origin, mode, data, length_skew=-1000, length_skew_on="second-ranged")
    assert _first_then_heal(origin, proxy, sc, data)


def test_s3_total_that_changes_between_parts_is_an_error(origin, proxy, mode):
    """Later 206 answers name a total 4 KiB larger, with the same ETag: never spliced."""
    data = os.urandom(SIZE)
    sc = _framing(origin, mode, data, total_skew=4096, total_skew_on="later-ranged")
    assert not _first_then_heal(origin, proxy, sc, data)


# --- a cold range: once over the network (see tests/test_cold_range.py) ---------------------


def test_s3_cold_range_is_fetched_once(origin, proxy, mode):
    """``s3://`` is always fetched in parts: a cold range at 5 MiB of a 6 MiB object is
    answered from the object's one download, whose first GET is the part holding it;
    once cached, S3 sent the object's bytes once."""
    size, a = 6 * 1024 * KiB, 5 * 1024 * KiB + 321
    data = os.urandom(size)
    origin.add(ORIGIN_PATH, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)])
    r = fetch(proxy.port, PROXY_PATH, headers={"Range": f"bytes={a}-"})
    assert r.status == 206 and r.clean and r.body == data[a:], r.describe() + tail_of(proxy)
    settle(proxy, timeout=20)
    assert fetch(proxy.port, PROXY_PATH, "HEAD").headers.get("x-cache") == "HIT"
    gets = origin.log(ORIGIN_PATH, "GET")
    assert sum(g.sent for g in gets) == size, [(g.range, g.status, g.sent) for g in gets]
    part = 64 * KiB if mode == "parts" else 8 * 1024 * KiB
    assert gets[0].range_start == a - a % part, gets[0].range
