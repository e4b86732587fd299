"""The span policy of clients following a growing download (pure, no I/O)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.inflight import READ_CHUNK, _next_span
from proxy.inflight.download import WHOLE_TAIL

pytestmark = pytest.mark.fast


def test_whole_prefix_goes_out_while_streaming():
    assert _next_span(0, 10 << 20, 100 << 20, 100 << 20, 10 << 20, True, False, None) == (
        10 << 20,
        False,
    )


def test_unverified_end_holds_back_one_byte_then_waits():
    size = 5 << 20
    assert _next_span(0, size, size, size, size, True, False, None) == (size - 1, False)
    assert _next_span(size - 1, size, size, size, size, True, False, None) == (1, True)


def test_a_small_unverified_end_waits_whole():
    """A small object (or a short last span) is not split around its last byte: it goes
    out in one send once verified, rather than two sends each a thread hop."""
    for size in (1, 1024, WHOLE_TAIL):
        assert _next_span(0, size, size, size, size, True, False, None) == (size, True)
    big = 5 << 20
    assert _next_span(big - WHOLE_TAIL, big, big, big, big, True, False, None) == (
        WHOLE_TAIL,
        True,
    )
    tail = WHOLE_TAIL + 1
    assert _next_span(big - tail, big, big, big, big, True, False, None) == (tail - 1, False)


def test_verified_end_goes_out_whole():
    size = 5 << 20
    assert _next_span(0, size, size, size, size, False, True, None) == (size, True)


def test_pread_path_keeps_chunks_and_waits_for_the_last():
    size = READ_CHUNK + 10
    assert _next_span(0, size, size, size, size, True, False, READ_CHUNK) == (READ_CHUNK, False)
    assert _next_span(READ_CHUNK, size, size, size, size, True, False, READ_CHUNK) == (10, True)


def test_middle_range_is_not_the_end():
    assert _next_span(100, 200, 200, 1000, 500, True, False, None) == (100, False)


def test_unknown_size_end_only_after_streaming():
    assert _next_span(0, 50, None, None, 50, True, False, None) == (50, False)
    assert _next_span(0, 50, None, None, 50, False, True, None) == (50, True)


@given(
    size=st.integers(1, 1 << 30),
    pos_frac=st.floats(0, 1, exclude_max=True),
    cap=st.one_of(st.none(), st.integers(1, 1 << 22)),
)
def test_final_byte_never_leaves_unverified_without_a_wait(size, pos_frac, cap):
    pos = min(int(size * pos_frac), size - 1)
    n, last = _next_span(pos, size, size, size, size, True, False, cap)
    assert 1 <= n <= size - pos
    if cap is not None:
        assert n <= cap
    # the span reaches the end only when flagged last (the caller then waits for verification)
    assert (pos + n == size) == last
