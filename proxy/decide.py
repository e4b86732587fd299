"""The request path as a table: what to do next with a data request, from what is known
about it. Pure (no I/O), tested alone, like :mod:`proxy.upstream.resume`.

:func:`decide` maps :class:`Facts` to a :class:`Step`. The handler
(:func:`proxy.shard._shard`) starts with nothing known, carries out each step — some
steps only learn a fact (``LOOKUP``, ``REVALIDATE``, ``COLD``, ``CLAIM``) and ask again,
the others answer the client — and stops at the first that answers.

=====================================================  ==================================
known                                                  next step
=====================================================  ==================================
a download of the object runs in this process           JOIN it (COALESCED; HIT once
                                                        every byte is verified)
not yet looked up                                       LOOKUP the entry
the index could not be read                             BYPASS (answer from the upstream)
an entry, revalidation due or stale by HTTP             REVALIDATE
(--revalidate http, past its stale-while-revalidate
window), and not yet asked
an entry (fresh, or confirmed)                          HIT (ENTRY_GONE when its file is
                                                        gone: forget it, look up again;
                                                        stale within its window: asked
                                                        about in the background)
credentials forwarded (--forward-credentials)           BYPASS (this client's answer)
the store takes no writes                               BYPASS
the cold shortcuts not yet tried (HEAD, a far Range)    COLD (answers, or declines)
several workers, no claim yet                           CLAIM the download across them
the claim: another worker holds it                      FORWARD to that worker
the claim: the object got cached meanwhile              LOOKUP again
otherwise                                               START the download (MISS)
=====================================================  ==================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace

__all__ = ["Claim", "Facts", "Step", "XCache", "decide"]


class XCache(str, enum.Enum):
    """What the ``X-Cache`` header says of an answer."""

    HIT = "HIT"  # from a committed entry (or a download whose every byte is verified)
    MISS = "MISS"  # the download this request started
    COALESCED = "COALESCED"  # a download another request started
    BYPASS = "BYPASS"  # from the upstream, not cached

    def __str__(self) -> str:
        return self.value


class Claim(enum.Enum):
    """What the store's cross-process claim on a download said (``--workers``)."""

    MINE = "mine"  # this process downloads it
    CACHED = "cached"  # it was committed meanwhile
    OWNER = "owner"  # another worker downloads it (and answers on its private port)


class Step(enum.Enum):
    JOIN = "join"
    LOOKUP = "lookup"
    REVALIDATE = "revalidate"
    HIT = "hit"
    ENTRY_GONE = "entry_gone"
    BYPASS = "bypass"
    COLD = "cold"
    CLAIM = "claim"
    FORWARD = "forward"
    START = "start"


@dataclass(frozen=True)
class Facts:
    """What is known about a data request so far."""

    downloading: bool = False  # a download of the object runs in this process
    looked_up: bool = False
    lookup_failed: bool = False  # the index could not be read
    entry: bool = False  # a committed entry was found
    entry_gone: bool = False  # ... but its file turned out missing or replaced
    revalidation_due: bool = False  # --revalidate says so, or the answer said no-cache
    fresh: bool = True  # the entry is fresh by RFC 9111 (only --revalidate http asks)
    stale_ok: bool = False  # ... or stale within its stale-while-revalidate window
    revalidated: bool = False  # the upstream was asked (fresh: the entry stands)
    writable: bool = True  # the store takes writes
    private: bool = False  # the client's credentials go to the upstream: its answer is its own
    cold_tried: bool = False  # the cold shortcuts were tried and declined
    shared: bool = False  # several workers share the port, and this request is not forwarded
    claim: Claim | None = None
    owner_gone: bool = False  # the worker holding the claim could not be reached

    def learn(self, **changes: object) -> Facts:
        """These facts and ``changes``: a copy made as ``dataclasses.replace`` would make
        it, without running ``__init__`` again (a hit learns three times)."""
        if not _FACT_NAMES.issuperset(changes):
            return replace(self, **changes)  # type: ignore[arg-type]  # its TypeError
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_FACT_NAMES = frozenset(f.name for f in fields(Facts))


def decide(f: Facts) -> Step:
    """The next step for a data request knowing ``f`` (see the table above)."""
    if f.downloading:
        return Step.JOIN
    if not f.looked_up:
        return Step.LOOKUP
    if f.lookup_failed:
        return Step.BYPASS
    if f.entry:
        if f.entry_gone:
            return Step.ENTRY_GONE
        if (f.revalidation_due or not (f.fresh or f.stale_ok)) and not f.revalidated:
            return Step.REVALIDATE
        return Step.HIT
    if f.private or not f.writable:
        return Step.BYPASS
    if not f.cold_tried:
        return Step.COLD
    if f.shared:
        if f.claim is None:
            return Step.CLAIM
        if f.claim is Claim.CACHED:
            return Step.LOOKUP
        if f.claim is Claim.OWNER and not f.owner_gone:
            return Step.FORWARD
    return Step.START
