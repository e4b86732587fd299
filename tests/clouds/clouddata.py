"""The bucket and objects every GCS and Azure test finds in its emulator."""

from __future__ import annotations

import random

BUCKET = "shardcache-test"  # the GCS bucket and the Azure container


def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# key -> bytes, uploaded once per session
OBJECTS: dict[str, bytes] = {
    "shards/small.tar": _payload(10_000, 1),
    "shards/medium.tar": _payload(3 * 1024 * 1024 + 17, 2),
    "shards/empty.tar": b"",
    "shards/dir/x one+two.tar": _payload(1234, 3),
    **{f"many/obj-{i:03d}.bin": _payload(100 + i, 100 + i) for i in range(23)},
    "many/sub/a.bin": b"a",
    "many/sub/b.bin": b"bb",
    "toplevel.bin": b"top",
}
