"""RFC 9111 freshness (:mod:`proxy.policy.freshness`, ``--revalidate http``), without I/O:
lifetimes, current age, HTTP-date parsing and the ``--revalidate`` values."""

from __future__ import annotations

import calendar
import email.utils

import pytest

from proxy.policy import (
    REVALIDATE_HTTP,
    current_age,
    describe_revalidate,
    freshness_lifetime,
    is_fresh,
    needs_revalidation,
    parse_revalidate,
    stale_needs_upstream,
    stale_while_revalidate,
)
from proxy.policy.freshness import (
    HEURISTIC_CAP,
    directives,
    http_date,
    parse_age,
)

T = float(calendar.timegm((2026, 11, 26, 12, 0, 0, 0, 0, 0)))  # the response time


def date(t: float) -> str:
    return email.utils.formatdate(t, usegmt=True)


def life(*fields: tuple[str, str], lm: str | None = None, at: float = T) -> float:
    return freshness_lifetime(fields, lm, at)


# -- --revalidate values -------------------------------------------------------------------


def test_revalidate_http_is_a_mode_of_its_own():
    assert parse_revalidate("http") == REVALIDATE_HTTP
    assert parse_revalidate(" HTTP ") == REVALIDATE_HTTP
    assert parse_revalidate("always") == 0.0 and parse_revalidate("never") is None
    assert parse_revalidate("10m") == 600.0
    with pytest.raises(ValueError, match="never, always, http"):
        parse_revalidate("sometimes")
    # the operator's age never applies in http mode (freshness decides there)...
    assert not needs_revalidation(REVALIDATE_HTTP, 0.0, T)
    # ...and always still asks on every use
    assert needs_revalidation(0.0, T, T)
    assert describe_revalidate(REVALIDATE_HTTP).startswith("http")
    assert describe_revalidate(None) == "never" and describe_revalidate(0.0) == "always"
    assert describe_revalidate(90.0) == "after 90s"


# -- lifetimes -----------------------------------------------------------------------------


def test_s_maxage_wins_over_max_age_wins_over_expires():
    exp = ("Expires", date(T + 1000))
    dt = ("Date", date(T))
    assert life(("Cache-Control", "max-age=60, s-maxage=5"), exp, dt) == 5
    assert life(("Cache-Control", "s-maxage=5, max-age=60"), exp, dt) == 5
    # on separate field lines too
    assert life(("Cache-Control", "max-age=60"), ("Cache-Control", "s-maxage=5"), dt) == 5
    assert life(("Cache-Control", "max-age=60"), exp, dt) == 60
    assert life(("Cache-Control", "max-age=0"), exp, dt) == 0
    assert life(exp, dt) == 1000


@pytest.mark.parametrize(
    "value, lifetime",
    [
        ("max-age=3600", 3600),
        ("MAX-AGE=3600", 3600),
        ("max-age=0003600", 3600),  # leading zeros are digits
        ('max-age="3600"', 3600),  # the quoted form, which senders should not use
        ("max-age=-1", 0),  # invalid: stale
        ("max-age='3600'", 0),
        ("max-age=1.5", 0),
        ("max-age=99999999999999999999", 2**31),  # capped (RFC 9111 1.2.2)
        ('foo="max-age=8", max-age=1', 1),  # a directive inside a quoted string is not one
        ('max-age=1, foo="max-age=8"', 1),
        ("max-age=10, max-age=10", 10),
        ("max-age=1200, max-age=1", 0),  # conflicting: stale (RFC 9111 4.2.1)
    ],
)
def test_max_age_parsing(value, lifetime):
    assert life(("Cache-Control", value), ("Date", date(T))) == lifetime


def test_expires():
    dt = ("Date", date(T))
    assert life(("Expires", date(T - 10)), dt) == 0  # past
    assert life(("Expires", date(T)), dt) == 0  # present
    assert life(("Expires", "0"), dt) == 0  # invalid: already expired
    assert life(("Expires", date(T + 50)), ("Expires", date(T + 60)), dt) == 0  # two lines
    # no Date: the response time stands for it
    assert life(("Expires", date(T + 30))) == 30
    # relative to the origin's Date, not to this cache's clock
    assert life(("Expires", date(T + 30)), ("Date", date(T - 100))) == 130


def test_heuristic_freshness_only_without_an_explicit_lifetime():
    lm = date(T - 1000)
    assert life(("Date", date(T)), lm=lm) == pytest.approx(100.0)  # 10 % of Date - LM
    assert life(("Date", date(T)), lm=date(T - 10 * 365 * 86400)) == HEURISTIC_CAP
    assert life(("Date", date(T)), ("Cache-Control", "max-age=7"), lm=lm) == 7
    assert life(("Date", date(T)), ("Expires", date(T - 1)), lm=lm) == 0
    assert life(("Date", date(T))) == 0  # nothing to go by: asked each time
    assert life(("Date", date(T)), lm="yesterday") == 0


def test_cdn_cache_control_governs_when_present():
    cc = ("Cache-Control", "max-age=10000")
    assert life(("CDN-Cache-Control", "max-age=5"), cc) == 5
    assert life(("CDN-Cache-Control", "max-age=0"), ("Expires", date(T + 999))) == 0
    # one that does not parse is ignored as a whole
    assert life(("CDN-Cache-Control", "max-age=5 garbage"), cc) == 10000


# -- current age ---------------------------------------------------------------------------


def test_current_age_adds_the_upstream_age_and_the_resident_time():
    dt = ("Date", date(T))
    assert current_age([dt], T, T) == 0
    assert current_age([dt], T, T + 7) == 7  # resident
    assert current_age([dt, ("Age", "30")], T, T + 7) == 37  # upstream Age + resident
    # apparent age (response time - Date) when it is larger than the Age
    assert current_age([("Date", date(T - 50)), ("Age", "30")], T, T + 7) == 57
    # a Date in the future is no negative age
    assert current_age([("Date", date(T + 500))], T, T + 1) == 1
    assert current_age([], T, T + 3) == 3


@pytest.mark.parametrize(
    "lines, age",
    [
        (["30"], 30),
        (["abc"], None),
        (["-7200"], None),
        (["7200.0"], None),
        (["2147483647"], 2147483647),
        (["2147483649"], 2**31),
        (["7200, 0"], 7200),  # the first member of a list
        (["0, 7200"], 0),
        (["7200", "0"], 7200),  # the first line
        (["0", "7200"], 0),
        ([], None),
    ],
)
def test_age_parsing(lines, age):
    assert parse_age(lines) == age


def test_is_fresh():
    f = [("Date", date(T)), ("Cache-Control", "max-age=10")]
    assert is_fresh(f, None, T, T + 9)
    assert not is_fresh(f, None, T, T + 10)
    # an upstream Age past the lifetime: stale at once
    assert not is_fresh([*f, ("Age", "11")], None, T, T)
    assert is_fresh([*f, ("Age", "abc")], None, T, T)  # an invalid Age is ignored
    assert not is_fresh([("Date", date(T))], None, T, T)  # no lifetime at all


def test_stale_needs_upstream():
    assert stale_needs_upstream([("Cache-Control", "max-age=1, must-revalidate")])
    assert stale_needs_upstream([("Cache-Control", "proxy-revalidate")])
    assert stale_needs_upstream([("Cache-Control", "s-maxage=2")])
    assert not stale_needs_upstream([("Cache-Control", "max-age=1")])
    assert not stale_needs_upstream([])


def test_stale_while_revalidate_window():
    f = [("Date", date(T)), ("Cache-Control", "max-age=1, stale-while-revalidate=4")]
    assert is_fresh(f, None, T, T + 0.5)
    assert not is_fresh(f, None, T, T + 3) and stale_while_revalidate(f, None, T, T + 3)
    assert not stale_while_revalidate(f, None, T, T + 5)  # past the window
    for extra in ("must-revalidate", "proxy-revalidate", "no-cache"):
        g = [("Date", date(T)), ("Cache-Control", f"max-age=1, stale-while-revalidate=4, {extra}")]
        assert not stale_while_revalidate(g, None, T, T + 3), extra
    assert not stale_while_revalidate([("Cache-Control", "max-age=1")], None, T, T + 3)


# -- parsing -------------------------------------------------------------------------------


def test_directives_keep_quoted_commas_and_refuse_garbage():
    assert directives(['a="x, y", b, c=1']) == {"a": "x, y", "b": None, "c": "1"}
    assert directives(["no-cache"]) == {"no-cache": None}
    assert directives(["max-age=5 garbage"]) is None
    assert directives([]) == {}


@pytest.mark.parametrize(
    "text, ok",
    [
        ("Thu, 18 Aug 2050 02:01:18 GMT", True),
        ("THU, 18 AUG 2050 02:01:18 gmt", True),  # names in any case
        ("Thursday, 18-Aug-50 02:01:18 GMT", True),  # RFC 850
        ("Thu Aug 18 02:01:18 2050", True),  # asctime
        ("Thu Aug  8 02:01:18 2050", True),
        ("Thu, 18 Aug 2050 02:01:18 UTC", False),
        ("Thu, 18 Aug 2050 02:01:18 AEST", False),
        ("Thu, 18 Aug 50 02:01:18 GMT", False),
        ("Thu 18 Aug 2050 02:01:18 GMT", False),
        ("Thu, 18  Aug  2050 02:01:18 GMT", False),
        ("Thu, 18-Aug-2050 02:01:18 GMT", False),
        ("Thu, 18 Aug 2050 02.01.18 GMT", False),
        ("Thu, 18 Aug 2050 2:01:18 GMT", False),
        ("Thu, 32 Aug 2050 02:01:18 GMT", False),
        ("0", False),
        ("", False),
    ],
)
def test_http_dates(text, ok):
    got = http_date(text, T)
    assert (got is not None) is ok, text
    if ok and "Aug 18" not in text and "Aug  8" not in text:
        assert got == calendar.timegm((2050, 8, 18, 2, 1, 18, 0, 0, 0))


def test_two_digit_years_are_read_as_the_nearest_century():
    assert http_date("Sunday, 06-Nov-94 08:49:37 GMT", T) == calendar.timegm(
        (1994, 11, 6, 8, 49, 37, 0, 0, 0)
    )
