"""The safe codec's decoders: a tagged record back into its value (:func:`safe_decode`),
database rows back into samples (:func:`safe_decode_rows`). They only ever build the
types the format names, never call pickle, and raise :class:`CodecError` (or
:class:`RowDecodeError`, naming the row) for anything else."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import itemgetter
from typing import Any

from dbcache._format import (
    _BYTES,
    _F64,
    _FROM_KEY,
    _FROM_URL,
    _I64,
    _IN_PAYLOAD,
    _KEYHEAD,
    _SCHEMA_CACHE_MAX,
    _STR,
    _U32,
    _U64,
    _VALUE,
    MAX_DEPTH,
    ROW_HEADER,
    SAFE_HEADER,
    CodecError,
    RowDecodeError,
    _describe,
)

__all__ = ["safe_decode", "safe_decode_rows"]

_SCHEMAS: dict[bytes, tuple[tuple[str, ...], tuple[int, ...], struct.Struct]] = {}


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


_NONE_TYPE = type(None)
_PLANS: dict[bytes, tuple] = {}


def _row_plan(fields: Any) -> tuple:
    """Parse a ``fields`` column into a decoding plan (cached per distinct value)."""
    if type(fields) is not bytes:
        raise CodecError(f"the fields column holds a {_describe(fields)}, not bytes")
    if not fields.startswith(ROW_HEADER):
        hint = " (it looks like a pickle)" if fields[:1] == b"\x80" else ""
        raise CodecError(f"not a safe-codec row: fields start with {fields[:8]!r}{hint}")
    keys: list[str] = []
    kinds: list[int] = []
    pos = len(ROW_HEADER)
    while pos < len(fields):
        if pos + _KEYHEAD.size > len(fields):
            raise CodecError("row truncated in the field table")
        klen, kind = _KEYHEAD.unpack_from(fields, pos)
        pos += _KEYHEAD.size
        if pos + klen > len(fields):
            raise CodecError("row truncated in the field table")
        try:
            name = fields[pos : pos + klen].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CodecError(f"bad UTF-8 field name: {exc}") from exc
        pos += klen
        if kind > _FROM_URL:
            raise CodecError(f"field {name!r}: unknown kind {kind}")
        if kind == _FROM_KEY and name != "__key__":
            raise CodecError(f"field {name!r}: only '__key__' comes from the key column")
        if kind == _FROM_URL and name != "__url__":
            raise CodecError(f"field {name!r}: only '__url__' comes from the url column")
        if name in keys:
            raise CodecError(f"field {name!r} appears twice in the field table")
        keys.append(name)
        kinds.append(kind)
    if kinds.count(_IN_PAYLOAD) > 1:
        raise CodecError("more than one field in the payload column")
    if not keys:
        raise CodecError("empty field table")
    # values are gathered as (url, key, payload, inline fields...); slot picks them in order
    slots = []
    inline = 0
    for kind in kinds:
        if kind == _FROM_URL:
            slots.append(0)
        elif kind == _FROM_KEY:
            slots.append(1)
        elif kind == _IN_PAYLOAD:
            slots.append(2)
        else:
            slots.append(3 + inline)
            inline += 1
    post = tuple((k, kind) for k, kind in zip(keys, kinds, strict=True) if kind in (_STR, _VALUE))
    payload_type = bytes if _IN_PAYLOAD in kinds else _NONE_TYPE
    lengths = struct.Struct(f"<{max(inline - 1, 0)}Q")
    plan = (_builder(tuple(keys), slots, inline), inline, lengths, payload_type, post)
    if len(_PLANS) >= _SCHEMA_CACHE_MAX:
        _PLANS.clear()
    _PLANS[fields] = plan
    return plan


_BUILDERS: dict[tuple[int, tuple[int, ...]], Callable[..., Callable[..., dict]]] = {}
_MAX_GENERATED_FIELDS = 256


def _builder(keys: tuple[str, ...], slots: list[int], inline: int) -> Callable[..., dict]:
    """A function building a sample dict from a row's values with one dict display.

    With at most one inline field it takes (url, key, payload, data); otherwise one
    sequence (url, key, payload, inline fields...). The generated source holds only
    fixed identifiers and integers: the field names are bound as values (closure cells),
    never written into the source, so no field name in a file can become code.
    """
    if len(slots) > _MAX_GENERATED_FIELDS:  # rare; keeps a crafted layout from compiling long
        # (all but at most three fields are inline here, so the values come as a sequence)
        pick = itemgetter(*slots)

        def build_seq(a: Any) -> dict:
            return dict(zip(keys, pick(a)))  # noqa: B905 - same length by construction

        return build_seq
    shape = (min(inline, 2), tuple(slots))
    make = _BUILDERS.get(shape)
    if make is None:
        names = ", ".join(f"k{i}" for i in range(len(slots)))
        if inline <= 1:
            args = "a0, a1, a2, a3=None"
            items = ", ".join(f"k{i}: a{slot}" for i, slot in enumerate(slots))
        else:
            args = "a"
            items = ", ".join(f"k{i}: a[{slot}]" for i, slot in enumerate(slots))
        source = f"def make({names}):\n    def build({args}):\n        return {{{items}}}\n    return build\n"
        scope: dict[str, Any] = {}
        exec(compile(source, "<dbcache row builder>", "exec"), {"__builtins__": {}}, scope)  # noqa: S102
        make = scope["make"]
        if len(_BUILDERS) >= _SCHEMA_CACHE_MAX:
            _BUILDERS.clear()
        _BUILDERS[shape] = make
    return make(*keys)


def _row_problem(row: tuple, plan: tuple) -> str:
    """Why ``row`` (url, key, data, payload) does not match its ``plan`` (for the message)."""
    url, key, data, payload = row
    if type(url) is not str or type(key) is not str:
        return f"the url/key columns hold {_describe(url)}/{_describe(key)}, not str"
    if type(payload) is not plan[3]:
        want = "bytes" if plan[3] is bytes else "NULL"
        return f"the payload column holds {_describe(payload)}, expected {want}"
    if type(data) is not bytes:
        return f"the data column holds a {_describe(data)}, not bytes"
    hint = " (it looks like a pickle)" if data[:1] == b"\x80" else ""
    inline, lengths = plan[1], plan[2]
    if inline == 0:
        return f"data column holds {len(data)} bytes, expected none{hint}"
    if len(data) < lengths.size:
        return f"record truncated in the length table{hint}"
    end = lengths.size + sum(lengths.unpack_from(data))
    return f"record truncated (its fields need {end} bytes, it has {len(data)}){hint}"


def safe_decode_rows(
    rows: Iterable[tuple], layouts: Mapping[Any, bytes] | None = None
) -> Iterator[dict]:
    """Decode (url, key, layout, data, payload) rows written by :func:`safe_encode_row`.

    ``layouts`` maps a row's layout column to its ``fields`` value; without it the
    layout column holds the ``fields`` value itself. Raises :class:`RowDecodeError`
    naming the problem for a damaged row; never pickle.
    """
    plans: dict[Any, tuple] = {}
    last: Any = plans  # no layout equals it
    for url, key, layout, data, payload in rows:
        if layout != last:  # rows of one data set mostly share one layout
            plan = plans.get(layout)
            if plan is None:
                try:
                    plan = plans[layout] = _layout_plan(layout, layouts)
                except CodecError as exc:
                    raise RowDecodeError(str(exc), url, key) from None
            build, inline, lengths, payload_type, post = plan
            last = layout
        if inline == 1:  # the common case: nothing to parse
            if (
                type(data) is bytes
                and type(payload) is payload_type
                and type(key) is str
                and type(url) is str
            ):
                sample = build(url, key, payload, data)
            else:
                raise RowDecodeError(_row_problem((url, key, data, payload), plan), url, key)
        elif inline == 0:
            if (
                data == b""
                and type(data) is bytes
                and type(payload) is payload_type
                and type(key) is str
                and type(url) is str
            ):
                sample = build(url, key, payload)
            else:
                raise RowDecodeError(_row_problem((url, key, data, payload), plan), url, key)
        else:
            ok = (
                type(data) is bytes
                and len(data) >= lengths.size
                and type(payload) is payload_type
                and type(key) is str
                and type(url) is str
            )
            if ok:
                values = [url, key, payload]
                pos = lengths.size
                for n in lengths.unpack_from(data):
                    values.append(data[pos : pos + n])
                    pos += n
                values.append(data[pos:])
                ok = pos <= len(data)  # slices past the end come back short
            if not ok:
                raise RowDecodeError(_row_problem((url, key, data, payload), plan), url, key)
            sample = build(values)
        if not post:
            yield sample
            continue
        for name, kind in post:
            if kind == _STR:
                try:
                    sample[name] = sample[name].decode("utf-8", "surrogatepass")
                except UnicodeDecodeError as exc:
                    raise RowDecodeError(f"field {name!r}: bad UTF-8: {exc}", url, key) from None
            else:
                try:
                    sample[name] = _decode_value(sample[name], 0)
                except CodecError as exc:
                    raise RowDecodeError(f"field {name!r}: {exc}", url, key) from None
        yield sample


def _layout_plan(layout: Any, layouts: Mapping[Any, bytes] | None) -> tuple:
    if layouts is None:
        fields = layout
    else:
        fields = layouts.get(layout)
        if fields is None:
            raise CodecError(f"layout {layout!r} is not in the layouts table")
    plan = _PLANS.get(fields) if type(fields) is bytes else None
    return _row_plan(fields) if plan is None else plan
