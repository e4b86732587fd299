"""Digests of whole objects: what an upstream declared in its answer's headers, computed
while the bytes are written, and compared before anything is committed.

Origins declare a digest of an object in several ways, all read by
:func:`declared_digests`:

- ``Content-MD5`` (RFC 1864) on a 200;
- Google Cloud Storage's ``x-goog-hash: crc32c=…,md5=…`` (base64), which GCS sends with
  the whole object's hashes on ranged answers too; not when GCS decompressed the stored
  bytes on the way (``x-goog-stored-content-encoding`` differs from what was sent);
- S3's ETag when it is the object's hex MD5: a single-part upload that is not encrypted
  with a key of KMS or the customer (``x-amz-server-side-encryption: aws:kms`` /
  ``aws:kms:dsse``, ``x-amz-server-side-encryption-customer-algorithm``); a multipart
  ETag (``…-N``) is an MD5 of MD5s and is not checked. Only for S3 answers (an
  ``s3://`` upstream, or an HTTP answer carrying S3's request id headers): any other
  origin's 32-hex ETag is an opaque token;
- S3's ``x-amz-checksum-crc32|crc32c|crc64nvme|sha1|sha256`` (asked for with
  ``x-amz-checksum-mode: ENABLED``) when it covers the full object: a composite value
  (``…-N``, or ``x-amz-checksum-type: COMPOSITE``) is a checksum of the parts' checksums;
- the Hugging Face Hub's ``X-Linked-Etag``, the sha256 of an LFS file (64 hex digits).

A digest on a 206 describes the part it came with, unless the header is an object-level
one (the S3 ETag, ``x-goog-hash``, ``X-Linked-Etag``): ``Content-MD5`` and
``x-amz-checksum-*`` on a 206 count only when the range is the whole object.

Digests are kept as ``(algorithm, lowercase hex)`` pairs. :class:`Digester` computes every
declared algorithm it can (``md5``, ``sha1``, ``sha256``: hashlib; ``crc32``: zlib;
``crc32c``: google-crc32c's C implementation) plus :data:`RECORDED`, so that every entry
has a digest that ``shardcache check --verify`` can recompute.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMPUTABLE",
    "RECORDED",
    "Digester",
    "Mismatch",
    "content_md5",
    "declared_digests",
    "file_digests",
    "is_s3_answer",
]

try:  # the C implementation (SSE4.2/ARMv8 CRC instructions): tens of GB/s
    import google_crc32c as _crc32c
except ImportError:  # pragma: no cover - a dependency; without it crc32c is not computed
    _crc32c = None  # type: ignore[assignment]

# what every download computes and records, declared or not: cheap enough to run on every
# byte (see BENCHMARKS.md), enough to find a changed file on disk
RECORDED: tuple[str, ...] = ("crc32c",) if _crc32c is not None else ("crc32",)

_HEX32 = re.compile(r'^"?([0-9a-fA-F]{32})"?$')
_HEX64 = re.compile(r'^(?:W/)?"?([0-9a-fA-F]{64})"?$')
_AMZ_CHECKSUMS = ("crc32", "crc32c", "crc64nvme", "sha1", "sha256")
_SIZES = {"md5": 16, "sha1": 20, "sha256": 32, "crc32": 4, "crc32c": 4, "crc64nvme": 8}
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+)\s*$", re.IGNORECASE)


def _values(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    get_all = getattr(headers, "get_all", None)  # http.client's HTTPMessage
    if get_all is not None:
        return list(get_all(name) or [])
    v = headers.get(name)
    return [] if v is None else [v]


def _b64hex(value: str, algorithm: str) -> str | None:
    """The hex of a base64 digest of ``algorithm``'s size, or None when it is not one."""
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == _SIZES[algorithm] else None


def _whole_range(headers: Mapping[str, str]) -> bool:
    """Whether a 206's Content-Range is the whole object (``bytes 0-(n-1)/n``)."""
    m = _CONTENT_RANGE.match(headers.get("Content-Range") or "")
    return bool(m) and int(m.group(1)) == 0 and int(m.group(2)) + 1 == int(m.group(3))


def is_s3_answer(headers: Mapping[str, str]) -> bool:
    """Whether an HTTP answer comes from S3 (or a store answering as S3 does)."""
    server = (headers.get("Server") or "").lower()
    return (
        bool(headers.get("x-amz-request-id") or headers.get("x-amz-id-2")) or server == "amazons3"
    )


def content_md5(headers: Mapping[str, str]) -> str | None:
    """The hex of a well-formed ``Content-MD5``, or None."""
    value = headers.get("Content-MD5")
    return _b64hex(value, "md5") if value else None


def declared_digests(
    headers: Mapping[str, str], status: int = 200, *, s3: bool = False
) -> tuple[tuple[str, str], ...]:
    """The digests of the whole object that an answer's ``headers`` declare, as
    ``(algorithm, lowercase hex)`` pairs in the order found (pure). ``status`` is the
    answer's (a 206 declares only what is about the whole object); ``s3``: the answer is
    S3's whatever its headers say (an ``s3://`` upstream)."""
    whole = status == 200 or (status == 206 and _whole_range(headers))
    out: list[tuple[str, str]] = []

    def add(algorithm: str, hexdigest: str | None) -> None:
        if hexdigest and (algorithm, hexdigest.lower()) not in out:
            out.append((algorithm, hexdigest.lower()))

    if whole:
        value = content_md5(headers)
        add("md5", value)
    stored_encoding = headers.get("x-goog-stored-content-encoding")
    sent_encoding = headers.get("Content-Encoding") or "identity"
    if stored_encoding is None or stored_encoding.lower() == sent_encoding.lower():
        for line in _values(headers, "x-goog-hash"):
            for item in line.split(","):
                key, _, value = item.strip().partition("=")
                if key.lower() in ("md5", "crc32c"):
                    add(key.lower(), _b64hex(value, key.lower()))
    if s3 or is_s3_answer(headers):
        encrypted = (headers.get("x-amz-server-side-encryption") or "").lower().startswith(
            "aws:kms"
        ) or headers.get("x-amz-server-side-encryption-customer-algorithm")
        m = _HEX32.match((headers.get("ETag") or "").strip())
        if m and not encrypted:
            add("md5", m.group(1))
        composite = (headers.get("x-amz-checksum-type") or "").upper() == "COMPOSITE"
        if whole and not composite:
            for algorithm in _AMZ_CHECKSUMS:
                value = headers.get(f"x-amz-checksum-{algorithm}")
                if value and "-" not in value:
                    add(algorithm, _b64hex(value, algorithm))
    m = _HEX64.match((headers.get("X-Linked-Etag") or "").strip())
    if m:
        add("sha256", m.group(1))
    return tuple(out)


class _Crc:
    """A running CRC with hashlib's face (``update``, ``copy``, ``hexdigest``)."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[Any, int], int], value: int = 0) -> None:
        self._fn = fn
        self._value = value

    def update(self, data: Any) -> None:
        self._value = self._fn(data, self._value)

    def copy(self) -> _Crc:
        return _Crc(self._fn, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _crc32c_update(data: Any, value: int) -> int:
    # google-crc32c takes read-only buffers only: a received batch is a view of a
    # reused bytearray, copied once here (a memcpy, far cheaper than the CRC's caller)
    if not isinstance(data, bytes):
        data = bytes(data)
    return _crc32c.extend(value, data)


def _crc32_update(data: Any, value: int) -> int:
    return zlib.crc32(data, value)


def _new(algorithm: str) -> Any:
    if algorithm == "crc32c":
        return _Crc(_crc32c_update)
    if algorithm == "crc32":
        return _Crc(_crc32_update)
    return hashlib.new(algorithm, usedforsecurity=False)


# algorithms this process can compute; a declared digest of another kind (crc64nvme: no
# implementation in the standard library) is reported and not checked
COMPUTABLE = frozenset({"md5", "sha1", "sha256", "crc32"} | ({"crc32c"} if _crc32c else set()))


@dataclass(frozen=True)
class Mismatch:
    """A declared digest the bytes did not have."""

    algorithm: str
    expected: str
    got: str

    def __str__(self) -> str:
        return f"{self.algorithm} declared {self.expected}, got {self.got}"


class Digester:
    """The digests of one object's bytes, fed in order (``update``), then compared with
    what was declared (:meth:`mismatches`) and recorded (:meth:`computed`).

    ``prefix_md5``: ``(length, hex)`` of a ``Content-MD5`` that came with a 206 for bytes
    ``0..length-1``. RFC 2616 makes it the MD5 of those bytes; some origins send the whole
    object's on every answer. It is checked as the first ``length`` bytes' MD5 when they
    have it, else as the whole object's — so either reading ends in the right bytes or an
    error, at the cost of no second hash."""

    def __init__(
        self,
        declared: Iterable[tuple[str, str]] = (),
        *,
        record: Iterable[str] = RECORDED,
        prefix_md5: tuple[int, str] | None = None,
    ) -> None:
        self.declared = tuple(declared)
        wanted = {a for a, _ in self.declared} | set(record)
        if prefix_md5 is not None:
            wanted.add("md5")
        self.unchecked = tuple(sorted(a for a, _ in self.declared if a not in COMPUTABLE))
        self._hashers = {a: _new(a) for a in sorted(wanted & COMPUTABLE)}
        self._prefix = prefix_md5
        self.size = 0

    def copy(self) -> Digester:
        """An independent digester in this one's state (to go on from here elsewhere)."""
        other = Digester.__new__(Digester)
        other.declared = self.declared
        other.unchecked = self.unchecked
        other._hashers = {a: h.copy() for a, h in self._hashers.items()}
        other._prefix = self._prefix
        other.size = self.size
        return other

    @property
    def checks(self) -> bool:
        """Whether anything declared is to be compared (not just recorded)."""
        return bool(self.declared) or self._prefix is not None

    def update(self, data: Any) -> None:
        """Feed the next bytes of the object (any buffer)."""
        n = len(data)
        if self._prefix is not None and self.size < self._prefix[0] <= self.size + n:
            cut = self._prefix[0] - self.size
            view = memoryview(data)
            self._update(view[:cut])
            self.size += cut
            self._settle_prefix()
            data, n = view[cut:], n - cut
        if n:
            self._update(data)
            self.size += n

    def _update(self, data: Any) -> None:
        for h in self._hashers.values():
            h.update(data)

    def _settle_prefix(self) -> None:
        length, expected = self._prefix  # type: ignore[misc]
        self._prefix = None
        if self._hashers["md5"].copy().hexdigest() != expected:
            # not the part's MD5: the origin means the whole object's
            self.declared += (("md5", expected),)

    def computed(self) -> tuple[tuple[str, str], ...]:
        """``(algorithm, hex)`` of every digest computed, sorted by algorithm."""
        return tuple((a, h.hexdigest()) for a, h in sorted(self._hashers.items()))

    def mismatches(self) -> list[Mismatch]:
        """Every declared digest the bytes fed so far do not have (call at the end)."""
        if self._prefix is not None:  # shorter than the range the 206 declared
            length, expected = self._prefix
            self._prefix = None
            self.declared += (("md5", expected),)
        got = dict(self.computed())
        return [
            Mismatch(a, want, got[a]) for a, want in self.declared if a in got and got[a] != want
        ]


def file_digests(path: str, algorithms: Iterable[str], *, chunk: int = 4 << 20) -> dict[str, str]:
    """The ``algorithms`` (those computable) of the bytes of file ``path``."""
    d = Digester(record=[a for a in algorithms if a in COMPUTABLE])
    with open(path, "rb", buffering=0) as f:
        while True:
            data = f.read(chunk)
            if not data:
                break
            d.update(data)
    return dict(d.computed())
