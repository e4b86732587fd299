"""Test data: digests to compare bytes by, shard builders, and the objects in the object
stores' bucket."""

from __future__ import annotations

import hashlib
import io
import os
import random
import tarfile

# the parts tests' object: 1000 KiB and a tail, so its last part is short
PARTS_OBJECT = random.Random(7).randbytes(1000 * 1024 + 123)


def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# the bucket (an S3 bucket, a GCS bucket, an Azure container) and the objects every S3,
# GCS and Azure test finds in its store: key -> bytes, uploaded once per session
BUCKET = "shardcache-test"
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


def sha(data: bytes | bytearray) -> str:
    """The SHA-256 of ``data`` in hex."""
    return hashlib.sha256(data).hexdigest()


def short_sha(data: bytes | bytearray) -> str:
    """The first 16 hex digits of the SHA-256: enough to tell bytes apart in a message."""
    return sha(data)[:16]


def make_shard(n_samples: int, seed: int = 0, size: int = 1000) -> bytes:
    """A small WebDataset tar shard with .txt and .bin members."""
    rnd = random.Random(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n_samples):
            key = f"sample{seed:03d}{i:05d}"
            for ext, payload in (
                ("txt", f"text {seed} {i}".encode()),
                ("bin", bytes(rnd.getrandbits(8) for _ in range(size))),
            ):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                info.mtime = 1700000000
                tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def blob(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic bytes, distinct per ``seed`` (the in-process proxy tests')."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}-{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


def pseudo_random_bytes(index: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes (distinct per index)."""
    out = bytearray()
    seed = hashlib.sha256(f"shard-{index}".encode()).digest()
    while len(out) < size:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return bytes(out[:size])


def write_shard(path, samples: list[dict]) -> None:
    """A tar at ``path`` holding ``samples`` (``__key__`` and one member per other key)."""
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            for name, value in sample.items():
                if name.startswith("__"):
                    continue
                member = tarfile.TarInfo(f"{sample['__key__']}.{name}")
                member.size = len(value)
                tar.addfile(member, io.BytesIO(value))


def shard_samples(nshards: int, per_shard: int) -> list[list[dict]]:
    """``nshards`` lists of ``per_shard`` samples (random .jpg bytes, a .cls index)."""
    return [
        [
            {"__key__": f"s{k}-{i:04d}", "jpg": os.urandom(100), "cls": str(i).encode()}
            for i in range(per_shard)
        ]
        for k in range(nshards)
    ]
