"""Sample codecs: how a sample dict becomes a database row and back.

The default ``safe`` codec is a small tagged binary format. Decoding it only ever builds
bytes, str, int, float, bool, None, lists, tuples, dicts and (when numpy is installed)
numpy arrays and scalars read with ``allow_pickle=False``: a tampered row can make decoding
fail, never run code.

The ``pickle`` codec stores anything picklable. Unpickling runs code chosen by whoever
wrote the file: use it only for files you created yourself and trust.

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

import io
import pickle
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CodecError",
    "Codec",
    "CODECS",
    "get_codec",
    "safe_encode",
    "safe_decode",
    "pickle_encode",
    "pickle_decode",
    "SAFE_HEADER",
]

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


@dataclass(frozen=True)
class Codec:
    """A named pair of functions turning a sample into bytes and back."""

    name: str
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    trusted_only: bool = False


def _field(path: str, key: Any) -> str:
    return f"{path}[{key!r}]" if path else repr(key)


def _describe(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _npy_bytes(value: Any, path: str) -> bytes:
    import numpy as np

    if value.dtype.hasobject:
        raise TypeError(
            f"field {path or '<sample>'}: numpy array of dtype {value.dtype} holds Python"
            " objects, which the safe codec does not store (it would need pickle)"
        )
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)
    return buf.getvalue()


def _encode(value: Any, out: list[bytes], path: str, depth: int) -> None:
    kind = type(value)
    if kind is bytes:
        out.append(b"b")
        out.append(_U64.pack(len(value)))
        out.append(value)
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s")
        out.append(_U64.pack(len(data)))
        out.append(data)
    elif value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"T" if value else b"F")
    elif kind is int:
        if _I64_MIN <= value <= _I64_MAX:
            out.append(b"i")
            out.append(_I64.pack(value))
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out.append(b"I")
            out.append(_U64.pack(len(data)))
            out.append(data)
    elif kind is float:
        out.append(b"f")
        out.append(_F64.pack(value))
    elif kind is dict:
        if depth >= MAX_DEPTH:
            raise TypeError(f"field {path or '<sample>'}: nested deeper than {MAX_DEPTH} levels")
        out.append(b"d")
        out.append(_U64.pack(len(value)))
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(
                    f"field {_field(path, key)}: dict key of type {_describe(key)}; the safe"
                    " codec stores dicts with str keys only"
                )
            data = key.encode("utf-8", "surrogatepass")
            out.append(_U64.pack(len(data)))
            out.append(data)
            _encode(item, out, _field(path, key), depth + 1)
    elif kind is list or kind is tuple:
        if depth >= MAX_DEPTH:
            raise TypeError(f"field {path or '<sample>'}: nested deeper than {MAX_DEPTH} levels")
        out.append(b"l" if kind is list else b"t")
        out.append(_U64.pack(len(value)))
        for index, item in enumerate(value):
            _encode(item, out, _field(path, index), depth + 1)
    elif kind.__module__ == "numpy" and "numpy" in sys.modules:
        import numpy as np

        if isinstance(value, np.ndarray) and kind is np.ndarray:
            data = _npy_bytes(value, path)
            out.append(b"a")
        elif isinstance(value, np.generic) and not isinstance(value, np.object_):
            data = _npy_bytes(np.asarray(value), path)
            out.append(b"g")
        else:
            raise TypeError(
                f"field {path or '<sample>'}: value of type {_describe(value)}; the safe codec"
                f" stores {_SAFE_TYPES}"
            )
        out.append(_U64.pack(len(data)))
        out.append(data)
    else:
        raise TypeError(
            f"field {path or '<sample>'}: value of type {_describe(value)}; the safe codec"
            f" stores {_SAFE_TYPES} (codec='pickle' stores anything, for trusted files only)"
        )


_U32 = struct.Struct("<I")
_KEYHEAD = struct.Struct("<IB")  # key length, kind
_BYTES, _STR, _VALUE = 0, 1, 2
_SCHEMAS: dict[bytes, tuple[tuple[str, ...], tuple[int, ...], struct.Struct]] = {}
_SCHEMA_CACHE_MAX = 1024


def _encode_sample(sample: dict, out: list[bytes]) -> None:
    schema: list[bytes] = []
    lengths: list[int] = []
    values: list[bytes] = []
    for key, value in sample.items():
        if type(key) is not str:
            raise TypeError(
                f"field {key!r}: dict key of type {_describe(key)}; the safe codec stores"
                " dicts with str keys only"
            )
        kdata = key.encode("utf-8", "surrogatepass")
        kind = type(value)
        if kind is bytes:
            vdata, code = value, _BYTES
        elif kind is str:
            vdata, code = value.encode("utf-8", "surrogatepass"), _STR
        else:
            parts: list[bytes] = []
            _encode(value, parts, repr(key), 1)
            vdata, code = b"".join(parts), _VALUE
        schema.append(_KEYHEAD.pack(len(kdata), code))
        schema.append(kdata)
        lengths.append(len(vdata))
        values.append(vdata)
    head = b"".join(schema)
    out.append(b"D")
    out.append(_U32.pack(len(head)))
    out.append(head)
    out.append(struct.pack(f"<{len(lengths)}Q", *lengths))
    out += values


def _parse_schema(head: bytes) -> tuple[tuple[str, ...], tuple[int, ...], struct.Struct]:
    keys: list[str] = []
    kinds: list[int] = []
    pos = 0
    while pos < len(head):
        if pos + _KEYHEAD.size > len(head):
            raise CodecError("record truncated in the field table")
        klen, kind = _KEYHEAD.unpack_from(head, pos)
        pos += _KEYHEAD.size
        if pos + klen > len(head):
            raise CodecError("record truncated in the field table")
        if kind not in (_BYTES, _STR, _VALUE):
            raise CodecError(f"unknown field kind {kind}")
        try:
            keys.append(head[pos : pos + klen].decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError as exc:
            raise CodecError(f"bad UTF-8 field name: {exc}") from exc
        kinds.append(kind)
        pos += klen
    parsed = (tuple(keys), tuple(kinds), struct.Struct(f"<{len(keys)}Q"))
    if len(_SCHEMAS) >= _SCHEMA_CACHE_MAX:
        _SCHEMAS.clear()
    _SCHEMAS[head] = parsed
    return parsed


def safe_encode(sample: Any) -> bytes:
    """Encode ``sample`` with the safe codec.

    Raises ``TypeError`` naming the field (e.g. ``'cls'`` or ``'meta'['tags'][2]``) and
    the type of the first value the codec does not store.
    """
    out = [SAFE_HEADER]
    if type(sample) is dict:
        _encode_sample(sample, out)
    else:
        _encode(sample, out, "", 0)
    return b"".join(out)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = len(SAFE_HEADER)

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise CodecError(f"record truncated: needs {n} bytes at offset {self.pos}")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def length(self) -> int:
        if self.pos + 8 > len(self.data):
            raise CodecError(f"record truncated at offset {self.pos}")
        (n,) = _U64.unpack_from(self.data, self.pos)
        self.pos += 8
        if n > len(self.data) - self.pos and n > 0:
            # a count of items can't exceed the bytes left either (each item takes >= 1)
            raise CodecError(f"record truncated: length {n} at offset {self.pos - 8}")
        return n


def _load_npy(data: bytes, scalar: bool) -> Any:
    try:
        import numpy as np
    except ImportError as exc:
        raise CodecError("record holds a numpy array but numpy is not installed") from exc
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError/OSError/... for bad .npy data
        raise CodecError(f"bad numpy array: {exc}") from exc
    return array[()] if scalar else array


def _decode(reader: _Reader, depth: int) -> Any:
    tag = reader.take(1)
    if tag == b"b":
        return reader.take(reader.length())
    if tag == b"s":
        try:
            return reader.take(reader.length()).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CodecError(f"bad UTF-8 string: {exc}") from exc
    if tag == b"N":
        return None
    if tag == b"T":
        return True
    if tag == b"F":
        return False
    if tag == b"i":
        return _I64.unpack(reader.take(8))[0]
    if tag == b"I":
        return int.from_bytes(reader.take(reader.length()), "little", signed=True)
    if tag == b"f":
        return _F64.unpack(reader.take(8))[0]
    if tag in (b"d", b"l", b"t"):
        if depth >= MAX_DEPTH:
            raise CodecError(f"record nested deeper than {MAX_DEPTH} levels")
        count = reader.length()
        if tag == b"d":
            result = {}
            for _ in range(count):
                try:
                    key = reader.take(reader.length()).decode("utf-8", "surrogatepass")
                except UnicodeDecodeError as exc:
                    raise CodecError(f"bad UTF-8 dict key: {exc}") from exc
                result[key] = _decode(reader, depth + 1)
            return result
        items = [_decode(reader, depth + 1) for _ in range(count)]
        return items if tag == b"l" else tuple(items)
    if tag == b"a" or tag == b"g":
        return _load_npy(reader.take(reader.length()), scalar=tag == b"g")
    raise CodecError(f"unknown tag {tag!r} at offset {reader.pos - 1}")


def safe_decode(data: bytes) -> Any:
    """Decode a record written by :func:`safe_encode`.

    Raises :class:`CodecError` for anything else (another codec's record, truncation,
    trailing bytes); it never calls pickle.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    if not data.startswith(SAFE_HEADER):
        head = data[:8]
        hint = " (it looks like a pickle)" if head[:1] == b"\x80" else ""
        raise CodecError(f"not a safe-codec record: starts with {head!r}{hint}")
    if data[3:4] == b"D":
        return _decode_sample(data)
    return _decode_value(data, len(SAFE_HEADER))


def _decode_value(data: bytes, start: int) -> Any:
    reader = _Reader(data)
    reader.pos = start
    value = _decode(reader, 1)
    if reader.pos != len(data):
        raise CodecError(f"{len(data) - reader.pos} trailing bytes after the record")
    return value


def _decode_sample(data: bytes) -> dict:
    start = len(SAFE_HEADER) + 5
    if len(data) < start:
        raise CodecError("record truncated in the sample header")
    end = start + _U32.unpack_from(data, start - 4)[0]
    head = data[start:end]
    parsed = _SCHEMAS.get(head)
    if parsed is None:
        if end > len(data):
            raise CodecError("record truncated in the field table")
        parsed = _parse_schema(head)
    keys, kinds, lengths = parsed
    pos = end + lengths.size
    if pos > len(data):
        raise CodecError("record truncated in the length table")
    values = []
    for n in lengths.unpack_from(data, end):
        values.append(data[pos : pos + n])
        pos += n
    if pos != len(data):  # slices past the end come back short, so check the total
        what = "truncated" if pos > len(data) else f"followed by {len(data) - pos} trailing bytes"
        raise CodecError(f"record {what} (its fields end at offset {pos} of {len(data)})")
    sample = dict(zip(keys, values, strict=True))
    if _STR in kinds or _VALUE in kinds:
        for key, kind in zip(keys, kinds, strict=True):
            if kind == _STR:
                try:
                    sample[key] = sample[key].decode("utf-8", "surrogatepass")
                except UnicodeDecodeError as exc:
                    raise CodecError(f"field {key!r}: bad UTF-8: {exc}") from exc
            elif kind == _VALUE:
                sample[key] = _decode_value(SAFE_HEADER + sample[key], len(SAFE_HEADER))
    return sample


def pickle_encode(sample: Any) -> bytes:
    """Encode anything picklable. Only for files that nobody else can write."""
    return pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)


def pickle_decode(data: bytes) -> Any:
    """Unpickle a record. DANGEROUS for untrusted files: unpickling can run any code."""
    try:
        return pickle.loads(data)  # noqa: S301 - explicit opt-in, documented as unsafe
    except Exception as exc:
        raise CodecError(f"bad pickle record: {exc}") from exc


CODECS: dict[str, Codec] = {
    "safe": Codec("safe", safe_encode, safe_decode),
    "pickle": Codec("pickle", pickle_encode, pickle_decode, trusted_only=True),
}


def get_codec(name: str) -> Codec:
    """The codec called ``name`` (``"safe"`` or ``"pickle"``); ValueError for others."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}") from None
