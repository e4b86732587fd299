"""Waiting on a condition instead of sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str | Callable[[], str] = "the condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``cond`` every ``interval`` seconds until it returns something truthy, and
    return that; after ``timeout`` seconds raise AssertionError naming ``what`` (a string,
    or a callable asked at that moment for the state worth showing) and the last value.

    Exceptions of the types in ``ignore`` count as "not yet" (a server still starting);
    any other exception propagates at once."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = cond()
        except ignore as exc:
            value, last = None, exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"waited {timeout:g} s for {said}; last: {last!r}")
        time.sleep(interval)
