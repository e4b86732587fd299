"""The safe codec's encoders: a value into a tagged record (:func:`safe_encode`), a
sample into the columns of a database row (:func:`safe_encode_row`). They store only the
types the decoder builds, and name the field of the first value they cannot store."""

from __future__ import annotations

import io
import struct
import sys
from typing import Any

from dbcache._format import (
    _BYTES,
    _F64,
    _FROM_KEY,
    _FROM_URL,
    _I64,
    _I64_MAX,
    _I64_MIN,
    _IN_PAYLOAD,
    _KEYHEAD,
    _SAFE_TYPES,
    _STR,
    _U32,
    _U64,
    _VALUE,
    MAX_DEPTH,
    ROW_HEADER,
    SAFE_HEADER,
    Row,
    _describe,
    _field,
)

__all__ = ["safe_encode", "safe_encode_row"]


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


def _encode_field(name: str, value: Any) -> tuple[bytes, int]:
    """A sample field's stored bytes and kind: bytes and str as they are, else a record."""
    kind = type(value)
    if kind is bytes:
        return value, _BYTES
    if kind is str:
        return value.encode("utf-8", "surrogatepass"), _STR
    parts: list[bytes] = []
    _encode(value, parts, repr(name), 1)
    return b"".join(parts), _VALUE


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
        vdata, code = _encode_field(key, value)
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


def safe_encode_row(sample: Any) -> Row:
    """The (``fields``, ``data``, ``payload``) columns of ``sample`` (a dict with str keys).

    Raises ``TypeError`` naming the field and type of a value the safe codec does not store.
    """
    if type(sample) is not dict:
        raise TypeError(f"a sample is a dict, got {_describe(sample)}")
    big, bigsize = None, -1
    for name, value in sample.items():
        if type(value) is bytes and len(value) > bigsize:
            big, bigsize = name, len(value)
    table = [ROW_HEADER]
    lengths: list[int] = []
    values: list[bytes] = []
    for name, value in sample.items():
        if type(name) is not str:
            raise TypeError(
                f"field {name!r}: dict key of type {_describe(name)}; the safe codec stores"
                " dicts with str keys only"
            )
        kind = type(value)
        if name == big:
            code = _IN_PAYLOAD
        elif kind is str and name == "__key__":
            code = _FROM_KEY
        elif kind is str and name == "__url__":
            code = _FROM_URL
        else:
            vdata, code = _encode_field(name, value)
            lengths.append(len(vdata))
            values.append(vdata)
        kdata = name.encode("utf-8", "surrogatepass")
        table.append(_KEYHEAD.pack(len(kdata), code))
        table.append(kdata)
    data = struct.pack(f"<{len(lengths) - 1}Q", *lengths[:-1]) if len(lengths) > 1 else b""
    data += b"".join(values)
    return b"".join(table), data, None if big is None else sample[big]
