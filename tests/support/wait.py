"""Waiting on a condition instead of sleeping a fixed time: :func:`wait_until` in a
thread, :func:`until` inside a running event loop."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
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


async def until(
    cond: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str | Callable[[], str] = "the condition",
) -> T:
    """:func:`wait_until` for a test running in an event loop: ``cond`` (a function, or a
    coroutine function, e.g. one that asks the proxy's ``/-/stats``) is asked every
    ``interval`` seconds, the loop running meanwhile, until it returns something truthy,
    which is returned; after ``timeout`` seconds AssertionError names ``what`` and the
    last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"waited {timeout:g} s for {said}; last: {value!r}")
        await asyncio.sleep(interval)
