"""The proxy demo runs end to end and reports what it promises."""

from __future__ import annotations

import io

import pytest

from shardcache.cli.proxydemo import proxy_demo


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_proxy_demo_small():
    out = io.StringIO()
    assert proxy_demo(shards=3, samples=20, sample_size=1000, out=out) == 0
    text = out.getvalue()
    assert "cold: 60 samples" in text and "warm: 60 samples" in text
    # each phase reports its own origin traffic, not a running total
    assert "cold: 60 samples" in text and "this pass took 3 requests" in text
    warm = next(line for line in text.splitlines() if line.startswith("warm:"))
    assert "this pass took 0 requests and 0.0 MiB from the origin" in warm
    assert "hit ratio 0.50 (3 hits, 3 misses)" in text
    assert "the hit ratio counts shard requests" in text
    assert " MB" not in text  # one unit system: MiB
    assert "every shard crossed the network once" in text
    # a shard's progress line comes after it is read, with all its samples counted
    progress = [line.split() for line in text.splitlines() if line.startswith("  cold: shard")]
    assert [(p[2], p[4]) for p in progress] == [("1/3", "20"), ("2/3", "40"), ("3/3", "60")]
    assert "a 512-byte header" in text
