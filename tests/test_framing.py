"""Framing that disagrees with itself, from a misbehaving origin (:mod:`badorigin`), read
through the proxy daemon on each http transport.

An answer's framing says which bytes it carries twice over: a 206's ``Content-Range``
names them and its ``Content-Length`` counts them; every part of one object names the
same total. When these disagree, or more bytes arrive than were declared, the bytes
cannot be trusted: the answer is an error, never committed, and the client gets the
right bytes from a retry or a visible error (an aborted connection, a 5xx before the
body), never a clean short or wrong body. Afterwards, with the origin healthy, the
object is fetched again (``MISS``: nothing was committed) and served exactly.

Transports: those of ``tests/test_upstream_faults.py`` (``threads``, ``aiohttp``,
``parts`` on threads) and ``parts-aiohttp`` (parts on the aiohttp transport, whose
connections are pooled: bytes left over from an answer are read as the next one's).
The whole-object transports meet a 206 only when they resume, so their cases cut the
first GET at 40 %.
"""

from __future__ import annotations

import os

import pytest
from support.faultclient import (
    COMMON,
    CUT40,
    ETAG_OLD,
    LM_OLD,
    NAME,
    SIZE,
    TRANSPORTS,
    check_rule,
    fetch,
    second_read,
    settle,
    tail_of,
)
from support.origins import BadOrigin, Version
from support.proxy import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

FRAMINGS = {
    **TRANSPORTS,
    "parts-aiohttp": (*TRANSPORTS["parts"], "--http-transport", "aiohttp"),
}
PARTS = ("parts", "parts-aiohttp")


@pytest.fixture(params=list(FRAMINGS))
def transport(request) -> str:
    return request.param


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


@pytest.fixture
def proxy_args(transport: str) -> tuple[str, ...]:
    return (*COMMON, *FRAMINGS[transport])


def add(origin: BadOrigin, transport: str, data: bytes, **faults):
    """``data`` at NAME with ``faults``; on a whole-object transport the first GET is cut
    at 40 % so that the resume meets the 206 faults."""
    sc = origin.add(NAME, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)], **faults)
    if transport not in PARTS and not faults.get("length_skew_on") == "full":
        sc.cut_at, sc.cut_on, sc.cut_mode = CUT40, "first", "rst"
    return sc


def check_then_heal(origin: BadOrigin, proxy: ProxyProcess, sc, data: bytes) -> bool:
    """The first read obeys the rule; nothing was committed (the next read, with the
    origin healed, is a MISS with the exact bytes). True when the first read was clean."""
    r = fetch(proxy.port, f"/{NAME}")
    clean = check_rule(r, [data], tail_of(proxy))
    settle(proxy)
    sc.heal()
    r2 = second_read(proxy, [data])
    if not clean:
        assert r2.headers.get("x-cache") == "MISS", (
            "an entry was committed from a failed download: " + r2.describe()
        )
    return clean


@pytest.mark.parametrize("keep", [False, True], ids=["close", "keep-alive"])
@pytest.mark.parametrize("skew", [-1000, 1000], ids=["shorter", "longer"])
def test_content_length_other_than_the_range_is_an_error(origin, proxy, transport, skew, keep):
    """Every 206 declares a Content-Length ``skew`` bytes off its Content-Range span and
    sends the span: shorter, the origin sends more bytes than it declared (left on a
    kept-alive connection, they would be read as the next answer); longer, it declares
    bytes it never sends. Never a clean wrong body; nothing committed."""
    if skew > 0 and keep:
        pytest.skip("a longer length on a kept connection only waits for the read timeout")
    data = os.urandom(SIZE)
    sc = add(origin, transport, data, length_skew=skew, length_skew_on="ranged")
    sc.length_skew_close = not keep
    clean = check_then_heal(origin, proxy, sc, data)
    assert not clean, "a 206 whose framing disagrees was used"
    bad = [q for q in origin.log(NAME, "GET") if q.status == 206]
    assert bad, "no 206 was asked for: the case did not happen"


def test_content_length_off_on_every_later_part(origin, proxy, transport):
    """Only resumes and later parts lie (the first ranged answer is right): each is
    refused as it arrives, the retries run out, the error is visible."""
    data = os.urandom(SIZE)
    sc = add(origin, transport, data, length_skew=-1000, length_skew_on="later-ranged")
    assert not check_then_heal(origin, proxy, sc, data)


def test_one_answer_with_a_short_length_is_asked_again_from_where_it_began(
    origin, proxy, transport
):
    """The second GET (a resume, or a part) declares 1000 bytes fewer than its range and
    sends the whole range; every other answer is right. None of its bytes is used: the
    request is asked again from the same first byte (not resumed after the bytes the
    lying length framed), and the client gets the exact object."""
    data = os.urandom(SIZE)
    sc = add(origin, transport, data, length_skew=-1000, length_skew_on="second-ranged")
    assert check_then_heal(origin, proxy, sc, data)
    gets = origin.log(NAME, "GET")
    lied = [q for q in gets if q.ordinal == 2]
    assert lied and lied[0].status == 206, [(q.range, q.status) for q in gets]
    later = [q.range_start for q in gets if q.ordinal > 2]
    assert lied[0].range_start in later, (
        f"the range of the refused answer ({lied[0].range}) was not asked again: "
        + ", ".join(f"{q.range} -> {q.status}" for q in gets)
    )
    first, last = (int(x) for x in lied[0].content_range.split()[1].split("/")[0].split("-"))
    after_the_lie = first + (last - first + 1) - 1000  # where its declared length ended
    assert after_the_lie not in later, "resumed after bytes the lying length framed"


@pytest.mark.parametrize("keep", [False, True], ids=["close", "keep-alive"])
def test_more_bytes_than_a_whole_answer_declared_is_an_error(origin, proxy, transport, keep):
    """A 200 declares 1000 bytes fewer than it sends (then keeps the connection, or
    closes it): the declared length is no size of the object. The threads transport
    finds the extra bytes in its buffer or socket at the declared end, aiohttp's parser
    fails on them; never a clean short body, nothing committed. Parts ask ranges only:
    their answers are right and so is the object."""
    data = os.urandom(SIZE)
    sc = add(origin, transport, data, length_skew=-1000, length_skew_on="full")
    sc.length_skew_close = not keep
    clean = check_then_heal(origin, proxy, sc, data)
    assert clean == (transport in PARTS)


def test_content_range_total_that_changes_between_parts_is_an_error(origin, proxy, transport):
    """Later 206 answers (the other parts, a resume) name a total 4 KiB larger than the
    first answer did, with the same ETag: not the same object, never spliced."""
    data = os.urandom(SIZE)
    sc = add(origin, transport, data, total_skew=4096, total_skew_on="later-ranged")
    assert not check_then_heal(origin, proxy, sc, data)
