"""What the codecs share: their errors, and the safe format's layout (headers, tags,
field kinds) that its encoder (:mod:`dbcache._encode`) and decoder
(:mod:`dbcache._decode`) agree on.

Safe format, version 1: the header ``b"SC\\x01"`` then one value, where a value is a tag
byte and its payload (integers little-endian)::

    N None    T True    F False
    i int     8-byte signed          I big int   u64 length + signed bytes
    f float   8-byte IEEE double
    b bytes   u64 length + bytes     s str       u64 length + UTF-8 (surrogatepass)
    l list    u64 count + values     t tuple     u64 count + values
    d dict    u64 count + (u64 length + UTF-8 key, value) pairs
    a ndarray u64 length + .npy      g numpy scalar  u64 length + .npy of a 0-d array

A top-level dict (a sample) takes a flat layout that decodes with one struct call::

    D u32 table length, table: per field (u32 key length, u8 kind, UTF-8 key),
      u64 length of each value, then the values: kind 0 bytes as they are, 1 str as
      UTF-8, 2 any other value in the tagged form above. Samples of one data set share
      one table, which the decoder parses once and then looks up.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["CodecError", "RowDecodeError", "SAFE_HEADER", "ROW_HEADER"]

SAFE_HEADER = b"SC\x01"
MAX_DEPTH = 64  # nesting limit, so a crafted row cannot exhaust the stack

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1

_SAFE_TYPES = (
    "bytes, str, int, float, bool, None, lists, tuples, dicts with str keys"
    " and numpy arrays (non-object dtypes)"
)


class CodecError(ValueError):
    """A stored record cannot be decoded (truncated, corrupt or of another codec)."""


class RowDecodeError(CodecError):
    """A database row cannot be decoded; ``url`` and ``key`` are that row's columns."""

    def __init__(self, message: str, url: Any, key: Any) -> None:
        super().__init__(message)
        self.url = url
        self.key = key


Row = tuple[bytes, bytes, "bytes | None"]


def _field(path: str, key: Any) -> str:
    return f"{path}[{key!r}]" if path else repr(key)


def _describe(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


_U32 = struct.Struct("<I")
_KEYHEAD = struct.Struct("<IB")  # key length, kind
_BYTES, _STR, _VALUE = 0, 1, 2
_SCHEMA_CACHE_MAX = 1024


# -- database rows ----------------------------------------------------------------------
#
# A sample is stored as the columns (url, key, fields, data, payload), where a file keeps
# each distinct ``fields`` value once, in its layouts table, and a row its integer id:
#
#   fields   ROW_HEADER, then per field: u32 name length, u8 kind, UTF-8 name. Kinds:
#            0 bytes in data, 1 str in data (UTF-8), 2 other value in data (tagged form),
#            3 bytes in the payload column, 4 the key column (``__key__``), 5 the url
#            column (``__url__``). Samples of one data set share one ``fields`` value,
#            which the reader parses once into a plan: a function building the sample
#            dict with one dict display (the field names bound as values, never code).
#   data     u64 length of each field stored in data but the last, then those fields'
#            bytes (the last runs to the end: a sample with one such field, e.g. a class
#            label beside an image in the payload, needs no parsing at all).
#   payload  the largest bytes field, or NULL: SQLite hands it back as a bytes object
#            with no slicing copy in Python.

ROW_HEADER = b"SC\x02"
_IN_PAYLOAD, _FROM_KEY, _FROM_URL = 3, 4, 5
