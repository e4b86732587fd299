"""The shared test and benchmark scaffolding does what the tests rely on: ``wait_until``
(and ``until``, its form for a running event loop) returns as soon as its condition holds
and fails with a message when it never does; the benchmark harness stops every process it started however a run ends."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from support.wait import until, wait_until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.harness import INTERRUPTED, Procs, interruptible  # noqa: E402

pytestmark = pytest.mark.fast


def test_wait_until_returns_the_first_truthy_value():
    calls = []

    def cond():
        calls.append(1)
        return len(calls) >= 3 and "ready"

    assert wait_until(cond, 5, 0.001) == "ready"
    assert len(calls) == 3


def test_wait_until_names_what_it_waited_for_and_the_last_value():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"waited 0.2 s for the thing; last: \[\]"):
        wait_until(lambda: [], 0.2, 0.01, what="the thing")
    assert 0.2 <= time.monotonic() - t0 < 5


def test_wait_until_asks_a_callable_for_its_message_at_the_timeout():
    state = {"n": 0}

    def cond():
        state["n"] += 1
        return False

    with pytest.raises(AssertionError, match=r"for n=\d+"):
        wait_until(cond, 0.05, 0.01, what=lambda: f"n={state['n']}")


def test_wait_until_treats_only_the_ignored_errors_as_not_yet():
    tries = iter([OSError("refused"), OSError("refused"), 7])

    def cond():
        v = next(tries)
        if isinstance(v, Exception):
            raise v
        return v

    assert wait_until(cond, 5, 0.001, ignore=(OSError,)) == 7
    with pytest.raises(ValueError):
        wait_until(lambda: int("x"), 5, 0.001, ignore=(OSError,))


async def test_until_lets_the_loop_run_and_awaits_a_coroutine_condition():
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, done.set)  # needs the loop to run meanwhile
    assert await until(done.is_set, 5, 0.001) is True
    asked = []

    async def cond():
        asked.append(1)
        await asyncio.sleep(0)
        return len(asked) >= 3 and {"entries": 3}

    assert await until(cond, 5, 0.001) == {"entries": 3}
    assert len(asked) == 3


async def test_until_names_what_it_waited_for_and_the_last_value():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"waited 0.2 s for the thing; last: \[\]"):
        await until(lambda: [], 0.2, 0.01, what="the thing")
    assert 0.2 <= time.monotonic() - t0 < 5
    n = 0

    async def cond():
        nonlocal n
        n += 1
        return None

    with pytest.raises(AssertionError, match=r"for n=\d+; last: None"):
        await until(cond, 0.05, 0.01, what=lambda: f"n={n}")


def test_the_bench_harness_stops_its_processes_on_an_interrupt(tmp_path):
    procs = Procs()
    with interruptible() as interrupted, procs:
        p = procs.start(["sleep", "60"], tmp_path / "log")
        raise KeyboardInterrupt
    assert interrupted == [True]
    assert p.poll() is not None and procs.live == []
    assert INTERRUPTED == 130


def test_the_bench_harness_stops_its_processes_after_a_clean_run(tmp_path):
    procs = Procs()
    with interruptible() as interrupted, procs:
        p = procs.start(["sleep", "60"], tmp_path / "log")
        assert p.poll() is None
    assert interrupted == []
    assert p.poll() is not None
