"""The request path's decision table (:mod:`proxy.decide`), without I/O."""

from __future__ import annotations

import pytest

from proxy.decide import Claim, Facts, Step, XCache, decide

pytestmark = pytest.mark.fast

LOOKED = Facts(looked_up=True)


@pytest.mark.parametrize(
    "facts, step",
    [
        (Facts(downloading=True), Step.JOIN),
        (Facts(), Step.LOOKUP),
        (Facts(looked_up=True, lookup_failed=True), Step.BYPASS),
        (Facts(looked_up=True, entry=True), Step.HIT),
        (Facts(looked_up=True, entry=True, revalidation_due=True), Step.REVALIDATE),
        (Facts(looked_up=True, entry=True, revalidation_due=True, revalidated=True), Step.HIT),
        # --revalidate http: a stale entry is asked about once, a fresh one served as it is
        (Facts(looked_up=True, entry=True, fresh=False), Step.REVALIDATE),
        (Facts(looked_up=True, entry=True, fresh=False, revalidated=True), Step.HIT),
        (Facts(looked_up=True, entry=True, fresh=True), Step.HIT),
        # stale within its stale-while-revalidate window: served (and asked about behind)
        (Facts(looked_up=True, entry=True, fresh=False, stale_ok=True), Step.HIT),
        (
            Facts(looked_up=True, entry=True, fresh=False, stale_ok=True, revalidation_due=True),
            Step.REVALIDATE,
        ),
        (Facts(looked_up=True, entry=True, fresh=True, revalidation_due=True), Step.REVALIDATE),
        (Facts(looked_up=True, entry=True, entry_gone=True), Step.ENTRY_GONE),
        (Facts(looked_up=True, writable=False), Step.BYPASS),
        (LOOKED, Step.COLD),
        (Facts(looked_up=True, cold_tried=True), Step.START),
        (Facts(looked_up=True, cold_tried=True, shared=True), Step.CLAIM),
        (Facts(looked_up=True, cold_tried=True, shared=True, claim=Claim.MINE), Step.START),
        (Facts(looked_up=True, cold_tried=True, shared=True, claim=Claim.OWNER), Step.FORWARD),
        (Facts(looked_up=True, cold_tried=True, shared=True, claim=Claim.CACHED), Step.LOOKUP),
        # a download that runs wins over anything the index says
        (Facts(downloading=True, looked_up=True, entry=True), Step.JOIN),
        # an entry is served even while the store takes no writes
        (Facts(looked_up=True, entry=True, writable=False), Step.HIT),
    ],
)
def test_table(facts, step):
    assert decide(facts) is step


def test_every_path_ends_in_an_answer():
    """Walking the table with each fact learnt in turn reaches an answering step."""
    answering = {Step.JOIN, Step.HIT, Step.BYPASS, Step.START, Step.FORWARD, Step.ENTRY_GONE}
    for writable in (True, False):
        for shared in (True, False):
            for claim in (Claim.MINE, Claim.OWNER):
                f = Facts(shared=shared, writable=writable)
                for _ in range(10):
                    step = decide(f)
                    if step in answering:
                        break
                    f = {
                        Step.LOOKUP: lambda f: f.learn(looked_up=True),
                        Step.COLD: lambda f: f.learn(cold_tried=True),
                        Step.CLAIM: lambda f, c=claim: f.learn(claim=c),
                        Step.REVALIDATE: lambda f: f.learn(revalidated=True),
                    }[step](f)
                else:
                    raise AssertionError(f"no answer for {f}")


def test_x_cache_values_are_the_header_text():
    assert [str(x) for x in XCache] == ["HIT", "MISS", "COALESCED", "BYPASS"]
    assert XCache.HIT == "HIT"
