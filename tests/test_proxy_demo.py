"""The proxy demo runs end to end and reports what it promises."""

from __future__ import annotations

import io

import pytest

from proxy.demo import proxy_demo


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_proxy_demo_small():
    out = io.StringIO()
    assert proxy_demo(shards=3, samples=20, sample_size=1000, out=out) == 0
    text = out.getvalue()
    assert "cold: 60 samples" in text and "warm: 60 samples" in text
    assert "origin so far: 3 requests" in text
    assert "hit ratio: 0.50 (3 hits, 3 misses)" in text
    assert "every shard crossed the network once" in text
