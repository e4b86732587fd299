"""The upstream layer's pure rules, without I/O: the resume rule (what to ask, how to
check the answer, when to give up), object metadata, and the error tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errormap import error_answer
from proxy.upstream.errors import s3_error, status_error
from proxy.upstream.parts import PartsOrder, plan_parts
from proxy.upstream.resume import (
    backoff_delay,
    can_resume,
    check_framing,
    next_try,
    range_headers,
    verify,
)
from shardcache.errors import (
    BadRequest,
    DownloadFailed,
    Forbidden,
    NotFound,
    ObjectChanged,
    ProxyError,
    RangeNotSatisfiable,
    UpstreamCut,
    UpstreamError,
    UpstreamThrottled,
    UpstreamTimeout,
)
from shardcache.meta import ObjectMeta

pytestmark = pytest.mark.fast

URL = "http://origin/a.tar"
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
LM2 = "Tue, 02 Jan 2024 00:00:00 GMT"
TAGGED = ObjectMeta(size=1000, etag='"v1"', last_modified=LM)
DATED = ObjectMeta(size=1000, last_modified=LM)
WEAK = ObjectMeta(size=1000, etag='W/"v1"', last_modified=LM)
BARE = ObjectMeta(size=1000)


def partial(first: int, last: int, total: int | str, **h: str) -> dict[str, str]:
    return {"Content-Range": f"bytes {first}-{last}/{total}", **h}


# -- what to ask ---------------------------------------------------------------------------


def test_range_headers_pin_the_version():
    h = range_headers(TAGGED, 300, None)
    assert h == {"Range": "bytes=300-", "If-Match": '"v1"', "If-Range": '"v1"'}
    h = range_headers(DATED, 300, 500)
    assert h == {"Range": "bytes=300-499", "If-Unmodified-Since": LM, "If-Range": LM}
    # a weak ETag pins nothing: Last-Modified does
    assert range_headers(WEAK, 10, None)["If-Range"] == LM
    assert "If-Match" not in range_headers(WEAK, 10, None)
    # a range to the object's end is asked open-ended
    assert range_headers(TAGGED, 10, 1000)["Range"] == "bytes=10-"
    assert range_headers(None, 0, None) == {}
    assert range_headers(BARE, 0, 100) == {"Range": "bytes=0-99"}


def test_can_resume_needs_a_validator():
    assert can_resume(TAGGED) and can_resume(DATED) and can_resume(WEAK)
    assert not can_resume(BARE)
    assert not can_resume(ObjectMeta(size=5, etag='W/"x"'))


# -- checking the answer -------------------------------------------------------------------


def test_verify_accepts_exactly_what_was_asked():
    got = verify(URL, TAGGED, 300, None, 206, partial(300, 999, 1000, ETag='"v1"'))
    assert got.size == 1000 and got.etag == '"v1"'
    verify(URL, TAGGED, 300, 500, 206, partial(300, 499, 1000, ETag='"v1"'))
    verify(URL, DATED, 300, None, 206, partial(300, 999, 1000, **{"Last-Modified": LM}))
    verify(URL, TAGGED, 0, None, 200, {"Content-Length": "1000", "ETag": '"v1"'})


@pytest.mark.parametrize(
    "meta,status,headers",
    [
        # another ETag, or none at all, on the continuation of a tagged version
        (TAGGED, 206, partial(300, 999, 1000, ETag='"v2"')),
        (TAGGED, 206, partial(300, 999, 1000)),
        # no ETag: Last-Modified decides
        (DATED, 206, partial(300, 999, 1000, **{"Last-Modified": LM2})),
        (DATED, 206, partial(300, 999, 1000)),
        # another total size
        (TAGGED, 206, partial(300, 1199, 1200, ETag='"v1"')),
        # an honest origin answering If-Range with the whole new version
        (TAGGED, 200, {"Content-Length": "1000", "ETag": '"v2"'}),
        (DATED, 200, {"Content-Length": "1000", "Last-Modified": LM2}),
        # If-Match refused
        (TAGGED, 412, {}),
        # nothing proves a version without validators
        (BARE, 206, partial(300, 999, 1000)),
    ],
)
def test_verify_refuses_another_version(meta, status, headers):
    with pytest.raises(ObjectChanged):
        verify(URL, meta, 300, None, status, headers)


@pytest.mark.parametrize(
    "start,end,status,headers",
    [
        (300, None, 206, partial(200, 999, 1000, ETag='"v1"')),  # another start
        (300, 500, 206, partial(300, 999, 1000, ETag='"v1"')),  # another end
        (300, None, 206, {"ETag": '"v1"'}),  # no Content-Range
        (300, None, 206, {"Content-Range": "bytes 300-200/1000", "ETag": '"v1"'}),
        (300, None, 200, {"Content-Length": "1000", "ETag": '"v1"'}),  # Range ignored
        (300, None, 302, {}),
    ],
)
def test_verify_refuses_other_bytes(start, end, status, headers):
    with pytest.raises(UpstreamError) as ei:
        verify(URL, TAGGED, start, end, status, headers)
    assert not isinstance(ei.value, ObjectChanged)
    assert URL in str(ei.value)


@pytest.mark.parametrize("length", ["699", "701", "0", "7e2", "-700", "700, 700"])
def test_verify_refuses_a_length_that_is_not_the_range(length):
    """A 206 whose Content-Length is not its Content-Range span frames other bytes than
    it names: shorter leaves the rest of the range on the wire, longer waits for bytes
    the range does not hold. Refused before a byte is used, whatever else is right."""
    headers = partial(300, 999, 1000, ETag='"v1"', **{"Content-Length": length})
    with pytest.raises(UpstreamError) as ei:
        verify(URL, TAGGED, 300, None, 206, headers)
    assert not isinstance(ei.value, ObjectChanged)
    assert "Content-Length" in str(ei.value) and URL in str(ei.value)
    with pytest.raises(UpstreamError):
        check_framing(URL, 206, headers)


def test_a_length_equal_to_the_range_or_no_length_is_framing_that_agrees():
    verify(
        URL,
        TAGGED,
        300,
        None,
        206,
        partial(300, 999, 1000, ETag='"v1"', **{"Content-Length": "700"}),
    )
    verify(URL, TAGGED, 300, None, 206, partial(300, 999, 1000, ETag='"v1"'))  # close-delimited
    chunked = {"Transfer-Encoding": "chunked", "Content-Length": "5"}  # chunking frames it
    verify(URL, TAGGED, 300, None, 206, partial(300, 999, 1000, ETag='"v1"', **chunked))
    check_framing(URL, 200, {"Content-Length": "5"})  # a 200 has no range to disagree with


@given(st.integers(0, 5_000), st.integers(0, 5_000), st.integers(0, 12_000))
def test_an_accepted_206_is_framed_by_its_range(first, span, length):
    headers = {"Content-Range": f"bytes {first}-{first + span}/15000", "ETag": '"v1"'}
    headers["Content-Length"] = str(length)
    meta = ObjectMeta(size=15_000, etag='"v1"')
    try:
        verify(URL, meta, first, first + span + 1, 206, headers)
    except UpstreamError:
        return
    assert length == span + 1


def test_from_byte_zero_any_answer_of_the_announced_size_will_do():
    verify(URL, BARE, 0, None, 200, {"Content-Length": "1000"})
    verify(URL, ObjectMeta(size=None), 0, None, 200, {"Transfer-Encoding": "chunked"})
    with pytest.raises(ObjectChanged):
        verify(URL, BARE, 0, None, 200, {"Content-Length": "999"})


@given(
    st.integers(0, 10_000),
    st.integers(1, 10_000),
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    st.integers(10_000, 20_000),
    st.sampled_from(['"v1"', '"v2"', None]),
)
def test_verify_never_accepts_bytes_other_than_asked(start, length, first, last, total, etag):
    """Whatever an origin answers, an accepted 206 is exactly the range asked, of the
    same size and ETag."""
    end = start + length
    meta = ObjectMeta(size=15_000, etag='"v1"')
    headers = {"Content-Range": f"bytes {first}-{last}/{total}"}
    if etag:
        headers["ETag"] = etag
    try:
        verify(URL, meta, start, end, 206, headers)
    except (UpstreamError, ObjectChanged):
        return
    assert (first, last, total, etag) == (start, end - 1, 15_000, '"v1"')


# -- giving up -----------------------------------------------------------------------------


def test_next_try_gives_up_after_the_retries_or_without_a_validator():
    assert next_try(TAGGED, 500, 1, 3, 0.5) == pytest.approx(0.5)
    assert next_try(TAGGED, 500, 3, 3, 0.5) == pytest.approx(2.0)
    assert next_try(TAGGED, 500, 4, 3, 0.5) is None
    assert next_try(BARE, 500, 1, 3, 0.5) is None  # bytes received, no way to pin them
    assert next_try(BARE, 0, 1, 3, 0.5) is not None  # nothing received: ask again
    assert next_try(None, 0, 1, 0, 0.5) is None


@given(st.integers(1, 30), st.floats(0, 1))
def test_backoff_is_bounded_and_grows(attempt, rand):
    d = backoff_delay(attempt, 0.1, cap=2.0, rand=rand)
    assert 0.05 <= d <= 2.0
    assert backoff_delay(attempt + 1, 0.1, cap=100.0) >= backoff_delay(attempt, 0.1, cap=100.0)


# -- metadata ------------------------------------------------------------------------------


def test_meta_from_headers():
    m = ObjectMeta.from_headers(
        {
            "Content-Length": "10",
            "ETag": '"e"',
            "Accept-Ranges": "bytes",
            "Content-MD5": "XUFAKrxLKna5cZ2REBfFkg==",
        }
    )
    assert (m.size, m.strong_etag, m.accept_ranges) == (10, '"e"', True)
    assert m.md5 is not None and len(m.md5) == 16
    assert ObjectMeta.from_headers({"Transfer-Encoding": "chunked"}).size is None
    assert ObjectMeta.from_headers({"Content-Range": "bytes 5-9/77"}, 206).size == 77
    assert ObjectMeta.from_headers({"Content-Range": "bytes 5-9/*"}, 206).size is None


def test_same_version():
    assert TAGGED.same_version(ObjectMeta(size=1000, etag='"v1"'))
    assert not TAGGED.same_version(ObjectMeta(size=1000, etag='"v2"'))
    assert not TAGGED.same_version(ObjectMeta(size=999, etag='"v1"'))
    assert DATED.same_version(ObjectMeta(size=None, last_modified=LM))
    assert not DATED.same_version(ObjectMeta(size=None, last_modified=LM2))
    assert not WEAK.same_version(ObjectMeta(size=1000, etag='W/"v2"', last_modified=LM))
    assert not BARE.same_version(BARE)


# -- error tables --------------------------------------------------------------------------


def told(exc: ProxyError) -> tuple[int, str]:
    answer = error_answer(exc)
    return answer.status, answer.code


@pytest.mark.parametrize(
    "status,cls,answer",
    [
        (401, Forbidden, (403, "AccessDenied")),  # the proxy's credentials were refused
        (403, Forbidden, (403, "AccessDenied")),
        (404, NotFound, (404, "NoSuchKey")),
        (410, NotFound, (404, "NoSuchKey")),
        (412, ObjectChanged, (502, "InternalError")),
        (416, RangeNotSatisfiable, (416, "InvalidRange")),
        (429, UpstreamThrottled, (503, "SlowDown")),
        (503, UpstreamThrottled, (503, "SlowDown")),
        (504, UpstreamTimeout, (504, "RequestTimeout")),
        (500, UpstreamError, (502, "InternalError")),
        (400, ProxyError, (400, "InvalidRequest")),
        (418, ProxyError, (418, "InternalError")),
    ],
)
def test_http_status_table_and_answers(status, cls, answer):
    err = status_error(URL, status, "Reason")
    assert type(err) is cls
    assert URL in str(err)
    assert told(err) == answer


@pytest.mark.parametrize(
    "code,status,cls",
    [
        ("NoSuchKey", 404, NotFound),
        ("AccessDenied", 403, Forbidden),
        ("", 401, Forbidden),
        ("SlowDown", 503, UpstreamThrottled),
        ("PreconditionFailed", 412, ObjectChanged),
        ("InvalidRange", 416, RangeNotSatisfiable),
        ("Weird", 400, UpstreamError),
    ],
)
def test_s3_table_uses_the_same_tree(code, status, cls):
    err = s3_error("s3://b/k", code, status, "m")
    assert type(err) is cls and "s3://b/k" in str(err)


def test_answers_for_the_rest_of_the_tree():
    assert told(BadRequest("x")) == (400, "InvalidRequest")
    assert told(UpstreamCut("x")) == (502, "InternalError")
    assert told(DownloadFailed(URL, None)) == (502, "InternalError")
    assert told(ProxyError("token", status_hint=401)) == (401, "AccessDenied")
    assert told(ProxyError("no", status_hint=501)) == (501, "NotImplemented")


# -- the order of parts ----------------------------------------------------------------------


def test_parts_order_takes_the_preferred_parts_and_tells_what_is_ready():
    """A reader's position picks the part holding it and the next; ``ready`` counts the
    bytes on disk from a position across complete parts, never past a gap."""
    order = PartsOrder()
    order.prefer(2500)  # said before the pump knew its parts
    assert not order.active and order.ready(2500) == 0
    parts = plan_parts(10_000, 1000)
    got = [0] * len(parts)
    order._parts, order._got = parts, got
    started = [True] + [False] * 9
    assert order._next(started) == 2
    started[2] = True
    assert order._next(started) == 3
    started[3] = True
    assert order._next(started) is None  # the rest is the pump's order
    order.prefer(7999)
    order.prefer(7001)  # the same part: one entry
    assert order.wanted == [2500, 7000]
    assert order._next(started) == 7
    got[2], got[3] = 1000, 400
    assert order.ready(2500) == 500 + 400
    assert order.ready(3400) == 0 and order.ready(1999) == 0
    got[3] = 1000
    assert order.ready(2000) == 2000  # part 4 not started: stops there
